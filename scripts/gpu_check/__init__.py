"""The GPU check: what a first contact with a CUDA machine must show, in one call of at most 420 seconds.

``bash scripts/gpu_check.sh [--dry-run] [--only a,b]`` runs the sections of :mod:`scripts.gpu_check.registry`
in order, in one worker process that a supervisor (:mod:`scripts.gpu_check.__main__`) watches: a section past
its limit is killed and reported ``timed out``, one whose process dies is ``failed``, and a new worker goes on
with the next. A section starts only while the budget covers its estimate. After every section ``$OUT`` gets
``summary.json`` (every section's record) and ``logs.tar.gz`` (the logs), and nothing else
(:mod:`scripts.gpu_check.report`). The sections, in the order they run:

    preconditions  versions against pyproject's floors (reported), bitsandbytes' CUDA binary, device -> peak
    harness        the trainer's process group at world size 1; FSDP2 with CPU offload, bf16 + fused AdamW, the
                   checkpointer and DCP, QLoRA's sharded codes, fp16 (harness.py, as the four after it)
    optimizer8bit  the sharded 8-bit optimizer's save: its device memory, the state restored exactly
    hsdp           a (1, 1) (dp_replicate, dp_shard) mesh against the unsharded run
    qlora8         8-bit QLoRA's bytes saved for backward against the plan's
    pipeline       every stage of a 2-stage split in one process against the whole model
    memory         plan vs measured (finetune run --measure-memory): bf16 full, LoRA, QLoRA
    attention      4096 tokens: sdpa, sdpa packed, flex attention packed
    moe_experts    eager, grouped_mm and batched_mm experts (moe.py)
    moe_lora       LoRA on the experts, where this build adapts them
    compile        train.compile + LoRA + activation checkpointing against eager
    dpo            train.objective: dpo through finetune run (flows.py, as the two after it)
    chat_eval      finetune chat and finetune eval on a LoRA run
    throughput     tokens/s and MFU of SmolLM2-135M's architecture

``--dry-run`` runs what a CPU can: the harness on gloo with CPU tensors, CLI runs of micro models for at most
2 steps; a section that needs CUDA for a part says so in its record.
"""
