"""Apply the Plan's strategy to a model: single process, DDP, ZeRO-1, ZeRO-2 or FSDP (torch.distributed)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from finetune.plan.types import Candidate
from finetune.train.distributed import DistContext


def parallelize(model: torch.nn.Module, chosen: Candidate, ctx: DistContext) -> torch.nn.Module:
    """Wrap ``model`` for ``chosen.strategy``; a single process is returned unchanged."""
    if chosen.strategy == "single" or not ctx.distributed:
        return model
    raise NotImplementedError(f"strategy {chosen.strategy}")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a DDP wrapper (FSDP2 shards in place, so there is nothing to unwrap)."""
    return getattr(model, "module", model)


def no_sync(model: torch.nn.Module, enabled: bool) -> Any:
    """Skip gradient synchronisation for a non-final micro-batch (DDP's no_sync)."""
    if enabled and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def full_state_dict(model: torch.nn.Module, inner: torch.nn.Module, ctx: DistContext) -> dict[str, Any] | None:
    """The full (unsharded) state dict on rank 0 for sharded strategies; None means "the module's own"."""
    return None
