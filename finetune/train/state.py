"""What a run counts and reports: the counters a checkpoint restores, the data position, one optimizer step's
numbers and the finished run's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from finetune.errors import UserError
from finetune.train.data import BatchStream
from finetune.train.data.stream import StreamingBatches
from finetune.train.evaluate import EvalResult

if TYPE_CHECKING:
    from finetune.plan.flops import Utilisation


@dataclass
class TrainState:
    """Counters that a checkpoint must restore."""

    step: int = 0  # optimizer steps done
    tokens: int = 0  # input tokens (not padding) processed, all ranks
    skipped_steps: int = 0
    skipped_in_a_row: int = 0  # non-finite steps since the last finite one (train.max_consecutive_skips)
    history: list[float] = field(default_factory=list)  # per-step loss (the parity tests read metrics.jsonl)

    def state_dict(self) -> dict[str, Any]:
        """The counters as JSON values (a checkpoint's meta.json)."""
        return {"step": self.step, "tokens": self.tokens, "skipped_steps": self.skipped_steps,
                "skipped_in_a_row": self.skipped_in_a_row, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.skipped_steps = int(state["skipped_steps"])
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self.history = [float(x) for x in state["history"]]


def position(step: int, stream: BatchStream | StreamingBatches) -> tuple[int, int]:
    """(epoch, global batch within the epoch) of the batch that optimizer step ``step`` + 1 runs."""
    return divmod(step, stream.steps_per_epoch)


class DataPosition:
    """Where the batch stream is: a pure function of the step, saved with a fingerprint of the data so that a
    resume on other data (or another seed or global batch) is refused."""

    def __init__(self, stream: BatchStream | StreamingBatches, state: TrainState) -> None:
        self.stream, self.state = stream, state

    def state_dict(self) -> dict[str, Any]:
        """The next global batch to run: epoch, step in the epoch, data fingerprint."""
        return self.stream.position_state(*position(self.state.step, self.stream))

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Check the saved position against the data and the (already restored) step."""
        if self.stream.restore_position(saved) != position(self.state.step, self.stream):
            raise UserError("--resume: the checkpoint holds an inconsistent data position; choose another checkpoint")


@dataclass
class StepResult:
    """What one optimizer step reports."""

    loss: float
    grad_norm: float
    input_tokens: int  # real tokens (no padding) over all ranks
    epoch: int
    row_widths: tuple[int, int] = (0, 0)  # this rank's sum of (padded row width x real tokens), and its tokens


@dataclass
class RunResult:
    """What a finished run reports."""

    steps: int
    final_loss: float | None
    eval: EvalResult | None
    output_dir: Path
    seconds: float
    measured_peak: int | None = None
    model: torch.nn.Module | None = None  # the trained model (unwrapped), for in-process callers
    exit_code: int = 0  # 130/143: stopped by Ctrl-C/SIGTERM after saving a checkpoint
    checkpoint_seconds: list[float] = field(default_factory=list)  # time of each checkpoint save
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None  # real tokens/s over the training steps after the first (all ranks)
    utilisation: Utilisation | None = None  # MFU on a GPU whose peak is known; None on CPU
