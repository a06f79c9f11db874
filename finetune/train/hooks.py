"""Points where code outside the trainer may act on a run: fault injection in the tests, profilers.

The trainer calls a :class:`TrainerHooks` at fixed points of every step, and before it tokenizes a data source;
the defaults do nothing. A run installs other hooks only when ``$FINETUNE_HOOKS`` names them as
``/path/to/file.py:Factory`` (or ``package.module:Factory``): the test suite sets it to its own
``tests/fault_hooks.py``, so that failure, NaN, kill and slow-step injection live with the tests, not in the
training step, and reach the worker processes that ``torch.distributed.run`` starts (they inherit the
environment).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HOOKS_ENV = "FINETUNE_HOOKS"


class TrainerHooks:
    """No-op hooks; subclass and override what you need."""

    def before_step(self, step: int, rank: int) -> None:
        """Optimizer step ``step`` (1-based) is about to start on ``rank``."""

    def after_backward(self, step: int, params: list[torch.Tensor], loss_sum: torch.Tensor) -> torch.Tensor:
        """Gradients of step ``step`` exist; return the loss sum the step goes on with."""
        return loss_sum

    def after_step(self, step: int) -> None:
        """Optimizer step ``step`` is done (logged and evaluated; not yet checkpointed)."""

    def checkpoint_half_written(self, step: int) -> None:
        """Rank 0 has written the checkpoint of ``step``'s tensors, not yet its meta.json nor the rename."""

    def before_tokenizing(self, source: str) -> None:
        """This process (local rank 0) is about to tokenize ``source``, which the tokenization cache does not hold."""


def load_hooks() -> TrainerHooks:
    """The hooks ``$FINETUNE_HOOKS`` names, or the no-op ones."""
    spec = os.environ.get(HOOKS_ENV)
    if not spec:
        return TrainerHooks()
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location("finetune_user_hooks", where)
        assert module_spec is not None and module_spec.loader is not None, f"{HOOKS_ENV}: cannot load {where}"
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    hooks = getattr(module, name)()
    assert isinstance(hooks, TrainerHooks), f"{HOOKS_ENV}: {spec} is not a TrainerHooks"
    return hooks
