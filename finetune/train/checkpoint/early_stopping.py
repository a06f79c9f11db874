"""Early stopping (``train.early_stopping``): watch one figure of every evaluation, keep the best one's checkpoint,
stop once it has not improved for ``patience`` evaluations in a row.

The run's checkpoint lifecycle (finetune/train/checkpoint/resume.py) asks :meth:`EarlyStopping.observe` after each
evaluation during training (and after the final one): an improvement (beyond the best value so far by more
than ``min_delta``, in the metric's better direction) resets the count and makes that step's checkpoint the
best one, which is saved then whatever ``output.save_every`` says, named by ``checkpoints/best.json`` and never
pruned by ``output.keep``; an evaluation without one counts, and the ``patience``-th in a row stops the run
after that step. The evaluation before training is not counted: there is no checkpoint of the starting weights
to keep. The state (best value and step, the count, where it stopped) is part of every checkpoint, so a resumed
run stops at the step and keeps the checkpoint an uninterrupted one would. Every rank takes rank 0's value of
the figure, so all of them decide alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune.errors import UserError
from finetune.recipe.schema import EarlyStoppingConfig
from finetune.train.evaluate import EvalResult
from finetune.train.metrics.log import eval_fields


@dataclass(frozen=True)
class Verdict:
    """What one evaluation means for the run."""

    improved: bool  # the best so far: its checkpoint is saved and becomes checkpoints/best.json
    stop: bool  # patience is spent: the run stops after this step


def reported_metrics(*, eval_rows: bool, eval_prompts: bool, preference: bool, retain: Any) -> list[str]:
    """The figures this run's evaluations report (metrics.jsonl's names): held-out rows give eval_loss, their
    prompts with answers eval_exact_match, a preference objective its eval_rewards/* and eval_logps/*, and
    eval.retain its retain_loss (and retain_exact_match where its rows have answers)."""
    from finetune.objectives.preference import METRICS

    names = []
    if eval_rows:
        names.append("eval_loss")
    if eval_prompts:
        names.append("eval_exact_match")
    if preference:
        names += [f"eval_{m}" for m in METRICS]
    if retain is not None:
        names.append("retain_loss")
        if retain.prompts:
            names.append("retain_exact_match")
    return names


def early_stopping_for(recipe: Any, data: Any, retain: Any) -> EarlyStopping | None:
    """``train.early_stopping``'s state for a run whose evaluations run on ``data`` (a ``TaskData``) and
    ``retain`` (eval.retain's rows, or None); None when it is off. A metric they do not report is one sentence."""
    config = recipe.train.early_stopping
    if config is None:
        return None
    reported = reported_metrics(
        eval_rows=bool(data.eval), eval_prompts=bool(data.eval_prompts), preference=recipe.train.objective != "sft",
        retain=retain,
    )
    return EarlyStopping(config, reported)


class EarlyStopping:
    """The early-stopping state of one run (a checkpoint part: :meth:`state_dict` / :meth:`load_state_dict`)."""

    def __init__(self, config: EarlyStoppingConfig, reported: list[str]) -> None:
        if config.metric not in reported:
            shown = ", ".join(reported) or "none (no held-out data)"
            raise UserError(
                f"train.early_stopping.metric: this run's evaluations do not report {config.metric}; they report "
                f"{shown}: choose one of them"
            )
        self.config = config
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.bad_evaluations = 0  # evaluations in a row without an improvement
        self.stopped_at: int | None = None

    @property
    def metric(self) -> str:
        """The watched figure's name."""
        return self.config.metric

    @property
    def stopped(self) -> bool:
        """Whether patience ran out (the run trains no further step)."""
        return self.stopped_at is not None

    def describe(self) -> str:
        """The header's line: what is watched and what the run saves as its model."""
        c = self.config
        better = "lower" if c.better == "min" else "higher"
        final = "the best evaluation's checkpoint" if c.final_model == "best" else "the last step's weights"
        return (
            f"early stopping: {c.metric} ({better} is better), patience {c.patience} evaluation(s), min_delta "
            f"{c.min_delta:g}; the final model is {final} (train.early_stopping.final_model: {c.final_model})"
        )

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if self.best_value is None:
            return True
        delta = self.config.min_delta
        if self.config.better == "min":
            return value < self.best_value - delta
        return value > self.best_value + delta

    def observe(self, step: int, ev: EvalResult | None, from_rank0: Callable[[float | None], float | None]) -> Verdict:
        """Count the evaluation after optimizer step ``step`` (``from_rank0``: rank 0's value on every rank)."""
        value = eval_fields(ev).get(self.metric)
        value = from_rank0(None if value is None else float(value))
        if value is None:
            raise UserError(f"train.early_stopping.metric: the evaluation after step {step} reported no {self.metric}")
        if self.improves(value):
            self.best_value, self.best_step, self.bad_evaluations = value, step, 0
            return Verdict(improved=True, stop=False)
        self.bad_evaluations += 1
        if self.bad_evaluations >= self.config.patience:
            self.stopped_at = step
        return Verdict(improved=False, stop=self.stopped)

    def pointer(self, path: str) -> dict[str, Any]:
        """``checkpoints/best.json``: the best checkpoint (``path``, relative to output.dir) and its figure."""
        return {
            "step": self.best_step, "checkpoint": path, "metric": self.metric, "value": self.best_value,
            "mode": self.config.better,
        }

    def summary(self, total_steps: int) -> str:
        """The summary's line: where the run stopped and which checkpoint is the best."""
        if self.best_step is None:
            return f"early stopping: no evaluation of {self.metric} during training"
        best = f"best {self.metric} {self.best_value:.4f} at step {self.best_step} (checkpoints/step-{self.best_step})"
        if self.stopped_at is None:
            return f"early stopping: not triggered in {total_steps} steps; {best}"
        return (
            f"early stopping: stopped after step {self.stopped_at} of {total_steps} ({self.bad_evaluations} "
            f"evaluation(s) without an improvement); {best}"
        )

    def state_dict(self) -> dict[str, Any]:
        """The state as JSON values (a checkpoint's meta.json)."""
        return {
            "metric": self.metric, "best_value": self.best_value, "best_step": self.best_step,
            "bad_evaluations": self.bad_evaluations, "stopped_at": self.stopped_at,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore what :meth:`state_dict` returned; a checkpoint that watched another metric (or none) starts the
        count afresh, and a larger patience than the checkpoint's lets a stopped run go on."""
        if not state or state.get("metric") != self.metric:
            return
        best = state.get("best_value")
        self.best_value = None if best is None else float(best)
        self.best_step = None if state.get("best_step") is None else int(state["best_step"])
        self.bad_evaluations = int(state.get("bad_evaluations", 0))
        stopped = state.get("stopped_at")
        self.stopped_at = int(stopped) if stopped is not None and self.bad_evaluations >= self.config.patience else None
