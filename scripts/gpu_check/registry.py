"""The sections of the GPU check, in the order they run (what a first contact with CUDA teaches first), each with
its expected seconds on one H200, its time limit there, and what it measures.

The check plans for one call of the lent machine: :data:`BUDGET_S` seconds at most (``GPU_CHECK_BUDGET`` may
lower it), counted from the script's start (the carried wheels' installation included), which leaves a rerun of
the failed sections inside the machine's 15 minutes. A section starts only while what is left of the budget
covers its estimate, and runs under the smaller of its limit and what is left; the others are reported as
skipped with the seconds that were left. The estimates add up to :func:`planned_s`, under the budget.

``--dry-run`` takes each section's CPU path (tiny models, at most 2 training steps), every section in one
process, under its own limits and budget (:data:`DRY_BUDGET_S`: a shared 2-core CPU, not the GPU's plan).

No heavy import here: the supervisor reads this table before any section runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: The most a GPU call plans for. The lent machine's 15 minutes count from asking for it until it goes back (30 s
#: after a call, or at once when handed back); a start takes one to two minutes, and no machine starts with less
#: than 4 left. A start (120 s), a first call stopped at its timeout (BUDGET_S + 30 s) and the machine's idle
#: window (30 s) leave 300 s: a fresh machine for the rerun of what failed (150 s planned) starts inside them.
BUDGET_S = 420
#: The dry run's budget on a CPU shared with other work (what gates its sections; its summary still records
#: the GPU plan's BUDGET_S).
DRY_BUDGET_S = 1200
#: Kept free at the end of the budget: the last summary and the logs' packing.
RESERVE_S = 5


@dataclass(frozen=True)
class Section:
    """One section of the check: ``target`` is ``module:function`` in scripts.gpu_check, called with its Check."""

    name: str
    estimate_s: int  # expected seconds on one H200 (16 cores), the section's Python work included
    limit_s: int  # the most it may run on the GPU (less when the budget has less left)
    dry_limit_s: int  # the most its CPU path may run under --dry-run
    target: str
    measures: str  # one sentence: what the section measures


SECTIONS: tuple[Section, ...] = (
    Section(
        "preconditions", 8, 40, 120, "preconditions:run",
        "Python against the carried wheels; torch, transformers, peft, bitsandbytes, datasets, pydantic against "
        "pyproject's floors and what finetune.versions detects (reported, never failed); bitsandbytes' CUDA "
        "binary and an NF4 round trip; the device name -> gpu_type -> peak FLOP/s the tool maps it to.",
    ),
    Section(
        "harness", 40, 110, 240, "harness:harness",
        "the process group of the trainer's initialisation at world size 1 (its backend, a CPU collective), then "
        "the tool's sharded path on it: FSDP2 with CPUOffloadPolicy (train.offload) for two steps, FSDP2 bf16 "
        "with fused AdamW against the unsharded run, the Checkpointer and DCP restoring weights and moments "
        "exactly, QLoRA's sharded 4-bit codes, fp16 with the GradScaler.",
    ),
    Section(
        "optimizer8bit", 15, 60, 120, "harness:optimizer8bit",
        "8-bit AdamW over FSDP2's local shards (LocalShardOptimizer): the extra device memory of a checkpoint's "
        "save (bytes per trainable parameter) and the state restored exactly by a load.",
    ),
    Section(
        "hsdp", 10, 45, 120, "harness:hsdp",
        "HSDP on a (1, 1) (dp_replicate, dp_shard) mesh: its losses against the unsharded run.",
    ),
    Section(
        "qlora8", 10, 45, 120, "harness:qlora8",
        "8-bit QLoRA (bitsandbytes' LLM.int8 layers): the bytes its forward saves for backward against the "
        "activations the plan counts for the same micro-batch (10%).",
    ),
    Section(
        "pipeline", 15, 60, 120, "harness:pipeline",
        "every pipeline stage of a 2-stage split in one process (the stages' own runner, masks and fused head): "
        "the loss and gradients through the stages against the whole model's.",
    ),
    Section(
        "memory", 70, 150, 300, "memory:run",
        "finetune run --measure-memory for bf16 full, LoRA and QLoRA: the plan against the allocated peak (10%), "
        "with the reserved and device-used figures memory.json records.",
    ),
    Section(
        "attention", 25, 80, 120, "attention:run",
        "forward + backward at 4096 tokens under sdpa (one document), sdpa packed (documents by position_ids: a "
        "dense mask) and flex attention packed (a block mask): milliseconds, and the packed losses agreeing.",
    ),
    Section(
        "moe_experts", 20, 60, 120, "moe:experts",
        "a mixture of experts' forward + backward under each experts implementation transformers offers "
        "(eager, grouped_mm, batched_mm): tokens/s, the same loss.",
    ),
    Section(
        "moe_lora", 15, 60, 120, "moe:lora",
        "LoRA on the experts' fused weights (where this build adapts them): adapters on every layer's experts, "
        "two steps that train them.",
    ),
    Section(
        "compile", 60, 120, 120, "compiled:run",
        "train.compile with LoRA and activation checkpointing on 12 blocks: compile time, tokens/s against "
        "eager, the same losses (the dry run: the plan of the compiled recipe).",
    ),
    Section(
        "dpo", 20, 60, 180, "flows:dpo",
        "train.objective: dpo with LoRA through finetune run: finite losses, reward accuracy and margin logged, "
        "an evaluation.",
    ),
    Section(
        "chat_eval", 25, 75, 180, "flows:chat_eval",
        "a LoRA run's adapter through finetune chat (a reply) and finetune eval --tasks run (its exact match; "
        "lm-evaluation-harness where installed).",
    ),
    Section(
        "throughput", 35, 90, 180, "flows:throughput",
        "full fine-tuning of SmolLM2-135M's architecture in bf16 on packed 2048-token rows: tokens/s and MFU "
        "(against the detected GPU's peak) from metrics.jsonl.",
    ),
)

BY_NAME = {s.name: s for s in SECTIONS}


def limit_of(section: Section, dry_run: bool) -> int:
    """The section's time limit; ``GPU_CHECK_LIMITS=name=seconds,...`` overrides it (to test a timeout)."""
    for item in os.environ.get("GPU_CHECK_LIMITS", "").split(","):
        name, _, seconds = item.partition("=")
        if name.strip() == section.name and seconds.strip().isdigit():
            return int(seconds)
    return section.dry_limit_s if dry_run else section.limit_s


def budget_s() -> int:
    """The GPU plan's budget: :data:`BUDGET_S`, or less with ``GPU_CHECK_BUDGET``."""
    asked = os.environ.get("GPU_CHECK_BUDGET", "").strip()
    return min(BUDGET_S, int(asked)) if asked.isdigit() else BUDGET_S


def planned_s(sections: list[Section] | tuple[Section, ...] = SECTIONS) -> int:
    """The GPU estimates of ``sections``, added up."""
    return sum(s.estimate_s for s in sections)


def selected(only: str | None) -> list[Section]:
    """Every section in order, or those ``only`` names (comma-separated); ValueError names an unknown one."""
    if not only:
        return list(SECTIONS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    return [s for s in SECTIONS if s.name in names]
