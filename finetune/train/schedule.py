"""When things happen in a run: how many optimizer steps it takes, the learning rate at each, and the steps
after which it evaluates."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from finetune.recipe.schema import EvalConfig, LoadedRecipe, TrainConfig
from finetune.train.data import BatchStream
from finetune.train.data.stream import StreamingBatches


def total_steps(loaded: LoadedRecipe, stream: BatchStream | StreamingBatches) -> int:
    """Optimizer steps of the run: train.max_steps, or epochs x steps per epoch."""
    t = loaded.recipe.train
    if t.max_steps:
        return t.max_steps
    return max(1, math.ceil(t.epochs * stream.steps_per_epoch))


def lr_lambda(schedule: str, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak lr for optimizer step ``s`` (0-based): linear warmup, then the decay."""

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def lr_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The scheduler of ``train.lr_schedule`` over ``total`` optimizer steps (``train.warmup_steps``,
    ``train.min_lr_ratio``)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(t.lr_schedule, t.warmup_steps, total, t.min_lr_ratio)
    )


@dataclass(frozen=True)
class EvalSchedule:
    """The steps after which a run evaluates (``eval.at_start``, ``eval.every``); the end of the run always
    evaluates."""

    at_start: bool
    every: int
    total: int

    @classmethod
    def of(cls, e: EvalConfig, total: int) -> EvalSchedule:
        """The schedule of the recipe's ``eval`` section for a run of ``total`` steps."""
        return cls(bool(e.at_start), int(e.every or 0), total)

    def before_training(self, step: int) -> bool:
        """Whether to evaluate before the first step (a fresh run only, not a resumed one)."""
        return self.at_start and step == 0

    def due(self, step: int) -> bool:
        """Whether to evaluate after optimizer step ``step`` (the last step's evaluation is the final one)."""
        return bool(self.every) and step % self.every == 0 and step < self.total
