"""What a run logs: one row per logged step in metrics.jsonl (and the trackers), made by
:class:`MetricsProcessor` from each optimizer step's numbers, with tokens/s over the log window and the MFU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.train.evaluate import EvalResult
from finetune.train.metrics.throughput import MfuMeter, Throughput
from finetune.train.state import StepResult

if TYPE_CHECKING:
    from finetune.plan.flops import Utilisation


def eval_fields(ev: EvalResult | None) -> dict[str, Any]:
    """An evaluation's columns of a metrics row (none when there was no evaluation)."""
    if ev is None:
        return {}
    row = {"eval_loss": ev.loss, "eval_exact_match": ev.exact_match} if ev.n_prompts or ev.loss is not None else {}
    row.update({f"eval_{k}": v for k, v in (ev.preference or {}).items()})  # dpo, simpo, orpo
    if ev.reward is not None:  # grpo
        row["eval_reward"] = ev.reward
    if ev.retain_loss is not None:  # eval.retain
        row["retain_loss"] = ev.retain_loss
        if ev.retain_exact_match is not None:
            row["retain_exact_match"] = ev.retain_exact_match
    return row


def first_retain(path: Path) -> EvalResult | None:
    """The retain figures measured before training, from a run's metrics.jsonl (a resumed run's summary
    compares with them); None when there are none."""
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step") == 0 and row.get("retain_loss") is not None:
            return EvalResult(None, None, 0, [], row["retain_loss"], row.get("retain_exact_match"))
    return None


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl (rank 0 only)."""

    def __init__(self, path: Path, enabled: bool, trackers: Any = None) -> None:
        self.path = path
        self.enabled = enabled
        self.trackers = trackers  # finetune.train.metrics.trackers.Trackers: the same rows, to TensorBoard/wandb/MLflow
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row`` and flush, so a killed run keeps every line written so far."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.track(row)

    def track(self, row: dict[str, Any]) -> None:
        """Send ``row`` to the trackers only (what metrics.jsonl keeps elsewhere, e.g. memory.json)."""
        if self.enabled and self.trackers is not None:
            self.trackers.log(row)

    def close(self) -> None:
        """Finish the trackers' runs."""
        if self.trackers is not None:
            self.trackers.close()


class MetricsProcessor:
    """Turns each optimizer step's numbers into what the run logs.

    After every step, :meth:`log_step` counts the step into the log window and into the run's steady state
    (the steps after the first, which warms up; a one-step run's only step), and every ``log_every`` steps (at
    the last step, and with an evaluation) writes the row: loss, lr, the evaluation's columns, tokens so far,
    tokens/s over the window's training seconds (``train_seconds``: the window's steps, without the
    evaluations, checkpoints and logging between them), gradient norm, epoch and, on a GPU whose peak is known,
    the MFU of those seconds. It returns the window's tokens/s for the progress bar. :meth:`steady` gives the
    run's tokens/s and MFU for its summary.
    """

    def __init__(
        self, writer: MetricsWriter, meter: MfuMeter, *, log_every: int, total_steps: int, start_step: int
    ) -> None:
        self.writer, self.meter = writer, meter
        self.log_every, self.total_steps, self.start_step = log_every, total_steps, start_step
        self.window, self.steady_steps = Throughput(), Throughput()

    def start(self) -> None:
        """The first log window starts now (just before the first step)."""
        self.window = Throughput()

    def log_step(
        self, step: int, result: StepResult, seconds: float, *, lr: float, tokens: int, ev: EvalResult | None = None,
        extra: dict[str, float] | None = None,
    ) -> float:
        """Count optimizer step ``step`` (``seconds`` long, evaluation excluded) and write its row when due;
        ``tokens``: the run's input tokens so far, ``ev``: the evaluation after this step, if any. Returns
        tokens/s over the log window up to now. ``extra``: the objective's figures of the step (dpo's rewards)."""
        if step - self.start_step > 1 or self.total_steps - self.start_step == 1:  # the first step warms up
            self.steady_steps.add(result, seconds)
        self.window.add(result, seconds)
        row: dict[str, Any] = {"step": step, "loss": result.loss, "lr": lr, **(extra or {}), **eval_fields(ev)}
        tokens_per_s = self.window.tokens / max(self.window.seconds, 1e-9)  # training time only
        if step % self.log_every == 0 or step == self.total_steps or "eval_loss" in row or "retain_loss" in row:
            row.update(
                tokens=tokens, tokens_per_s=tokens_per_s, train_seconds=self.window.seconds,
                grad_norm=result.grad_norm, epoch=result.epoch,
            )
            utilisation = self.meter(tokens_per_s, self.window.mean_width)
            if utilisation is not None:
                row["mfu"] = utilisation.mfu
            self.window = Throughput()
            self.writer.write(row)
        return tokens_per_s

    def log_eval(self, step: int, ev: EvalResult | None) -> None:
        """A row of an evaluation outside a step's row (before the first step, after the last)."""
        if ev is not None:
            self.writer.write({"step": step, **eval_fields(ev)})

    def track(self, row: dict[str, Any]) -> None:
        """Send ``row`` to the trackers only (see :meth:`MetricsWriter.track`)."""
        self.writer.track(row)

    def steady(self) -> tuple[float | None, Utilisation | None]:
        """The run's tokens/s over its steady steps, and their MFU (None, None before any)."""
        if self.steady_steps.seconds <= 0:
            return None, None
        tokens_per_s = self.steady_steps.tokens / self.steady_steps.seconds
        return tokens_per_s, self.meter(tokens_per_s, self.steady_steps.mean_width)

    def close(self) -> None:
        """Finish the trackers' runs."""
        self.writer.close()
