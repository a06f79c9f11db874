"""The sections of the GPU check: their part, time limit, estimated time and what each measures.

The limits of a part add up to at most :data:`PART_BUDGET_S` with the wheels' installation
(:data:`SETUP_S`), so that a part ends inside one 7-minute call of the lent machine even when every section
runs to its limit. The estimates are expected times on one H200 with 16 cores (Python's start and the imports
included), from the sizes of the jobs; summary.json sets them beside the measured seconds. ``--dry-run`` takes
its own, much shorter, path through each section, under its own generous limits.

No heavy import here: the shell script reads this table before any section runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: A part must end inside one call of at most 7 minutes.
PART_BUDGET_S = 420
#: Installing the carried wheels and listing the sections, before the first section starts.
SETUP_S = 20


@dataclass(frozen=True)
class Section:
    """One timed section of the check."""

    name: str
    part: int
    limit_s: int  # the `timeout` it runs under on a GPU
    estimate_s: int  # expected seconds on one H200 (16 cores)
    dry_limit_s: int  # the `timeout` under --dry-run: generous, for 2 CPU cores shared with other work
    module: str  # scripts.gpu_check.<module>, whose run(check) is the section
    measures: str  # one sentence: what the section measures


SECTIONS: tuple[Section, ...] = (
    Section(
        "preconditions", 1, 45, 15, 120, "preconditions",
        "Python against the carried wheels, torch/transformers/peft/bitsandbytes against pyproject's minimums, "
        "bitsandbytes' CUDA binary, and the device name -> gpu_type -> peak FLOP/s the tool maps it to.",
    ),
    Section(
        "harness", 1, 110, 55, 300, "harness",
        "parallelize, materialize and the checkpointer at world size 1 over NCCL: FSDP2 full fine-tuning with "
        "fused AdamW on DTensors, DCP save/load (the tool's checkpointer and the default process group), QLoRA's "
        "sharded 4-bit codes through the all-gather into bitsandbytes' dequantize, fp16 with the GradScaler.",
    ),
    Section(
        "memory", 1, 245, 170, 600, "memory",
        "finetune run --measure-memory for full, LoRA, QLoRA 4-bit and 8-bit (LLM.int8) in bf16 and fp16 with "
        "evaluation: the plan's prediction against the allocated peak (and reserved, device used where "
        "memory.json has them), plus a resume from a checkpoint that must repeat the uninterrupted losses.",
    ),
    Section(
        "optimizer8bit", 2, 70, 40, 240, "optimizer8bit",
        "train.optimizer adamw8bit against adamw on the same full fine-tuning run: losses, the plan's "
        "optimizer-state bytes and the measured peak.",
    ),
    Section(
        "compile", 2, 110, 75, 180, "compiled",
        "train.compile with LoRA and activation checkpointing on a 12-block model: compile time, tokens/s "
        "against the eager run, and the same losses.",
    ),
    Section(
        "attention", 2, 60, 35, 180, "attention",
        "flex attention's loss and gradient norm against sdpa's and eager's on the same packed batch and "
        "weights.",
    ),
    Section(
        "vocab", 2, 45, 25, 240, "vocab",
        "a micro Llama with Llama 3's 128256-token vocabulary through the fused head and loss: the plan "
        "against the measured peak, against the unfused logits, and the same first loss unfused.",
    ),
    Section(
        "smollm2", 2, 115, 80, 60, "peers",
        "SmolLM2-135M (its architecture, seeded weights) LoRA in bf16: finetune's tokens/s and MFU against TRL's "
        "SFTTrainer on the same samples, batches and steps.",
    ),
)

BY_NAME = {s.name: s for s in SECTIONS}


def sections_of(part: str) -> list[Section]:
    """The sections of ``part`` (1, 2 or all), in order."""
    if part == "all":
        return list(SECTIONS)
    return [s for s in SECTIONS if str(s.part) == part]


def limit_of(section: Section, dry_run: bool) -> int:
    """The section's time limit; ``GPU_CHECK_LIMITS=name=seconds,...`` overrides it (to test a timeout)."""
    for item in os.environ.get("GPU_CHECK_LIMITS", "").split(","):
        name, _, seconds = item.partition("=")
        if name.strip() == section.name and seconds.strip().isdigit():
            return int(seconds)
    return section.dry_limit_s if dry_run else section.limit_s


def part_limit(part: str) -> int:
    """The worst case of ``part`` on a GPU: every section at its limit, plus the setup."""
    return SETUP_S + sum(s.limit_s for s in sections_of(part))
