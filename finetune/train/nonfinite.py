"""What a run does when a step's loss or gradient norm is not finite (``train.on_nonfinite``): skip the
update (the step and its batch still count) or stop with one line naming the step and the last good checkpoint.
Skipping has a limit (``train.max_consecutive_skips``): that many non-finite steps in a row stop the run too,
before anything is saved or uploaded.
"""

from __future__ import annotations

from pathlib import Path

from finetune.errors import UserError
from finetune.recipe.schema import LoadedRecipe


class NonFiniteError(UserError):
    """The loss or gradient norm became NaN/inf under ``train.on_nonfinite: stop`` (exit status 3)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=3)


def nonfinite_policy(loaded: LoadedRecipe, precision: str) -> str:
    """``train.on_nonfinite`` resolved: auto is skip under fp16 loss scaling, stop otherwise."""
    p = loaded.recipe.train.on_nonfinite
    if p == "auto":
        return "skip" if precision == "fp16" else "stop"
    return p


def nonfinite_stop(
    step: int, loss: float, grad_norm: float, last_saved: Path | None, resume_command: str
) -> NonFiniteError:
    """The one-line error of ``train.on_nonfinite: stop``, naming the step and the last good checkpoint
    (``last_saved``, which ``resume_command`` continues from)."""
    if last_saved is not None:
        last = f"last good checkpoint: {last_saved} (resume with `{resume_command}`)"
    else:
        last = "no checkpoint was saved yet (set output.save_every)"
    return NonFiniteError(
        f"step {step}: the loss is {loss} and the gradient norm {grad_norm}, training stopped "
        f"(train.on_nonfinite: stop); {last}; lower train.lr, or set train.on_nonfinite: skip"
    )


def nonfinite_limit(step: int, in_a_row: int, loss: float, grad_norm: float, last_saved: Path | None) -> NonFiniteError:
    """The one-line error when ``train.max_consecutive_skips`` non-finite steps came in a row (exit status 3):
    the run learns nothing any more, so it stops without saving or uploading."""
    last = f"the last checkpoint, {last_saved}, is kept" if last_saved is not None else "no checkpoint was saved"
    return NonFiniteError(
        f"step {step}: {in_a_row} steps in a row had a non-finite loss or gradient norm (now {loss} and {grad_norm}), "
        f"train.max_consecutive_skips; training stopped without saving the model ({last}); lower train.lr, check "
        "the data, or raise train.max_consecutive_skips"
    )
