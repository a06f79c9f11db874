"""The GPU check: what a first contact with a CUDA machine must show, in timed sections.

``bash scripts/gpu_check.sh [--dry-run] [--part 1|2|all]`` runs the sections of a part one after the other,
each in its own process under its own time limit (coreutils ``timeout``), and carries on after a section fails
or times out. Every section writes ``$OUT/<section>.json`` (its status, figures and checks); the script ends
with a summary table on stdout and ``$OUT/summary.json``. The sections (:mod:`scripts.gpu_check.registry`):

    part 1  preconditions  versions, the wheels carried, bitsandbytes' CUDA binary, device -> gpu_type -> peak
            harness        FSDP2, DCP and the checkpointer over NCCL at world size 1 (the tool's own functions)
            memory         plan vs measured memory through `finetune run`: full, LoRA, QLoRA 4-bit and 8-bit in
                           bf16 and fp16, with evaluation and a resume
    part 2  optimizer8bit  8-bit AdamW against AdamW
            compile        train.compile with LoRA and activation checkpointing on more than 8 blocks
            attention      flex attention's loss against sdpa's (and eager) on one batch
            vocab          a 128k vocabulary through the fused head
            smollm2        SmolLM2-135M tokens/s and MFU, against TRL's SFTTrainer on the same job

``--dry-run`` runs what a CPU can: the harness on gloo with CPU tensors, the CLI runs for two steps of the
tiny model; a section that needs CUDA writes status ``skipped`` with the reason and what it would measure.
"""
