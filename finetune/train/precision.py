"""Mixed precision as the execution spec says: torch.autocast around the forward passes, and the loss scaler
of fp16 runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from finetune.spec import ExecSpec
from finetune.units import torch_dtype


def autocast_factory(spec: ExecSpec, device: torch.device) -> Callable[[], Any]:
    """torch.autocast when the execution spec says so (single/DDP/ZeRO-1 mixed precision), else a no-op
    (FSDP2 casts parameters itself through its policy)."""
    if spec.autocast:
        dtype = torch_dtype(spec.compute_dtype)
        return lambda: torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext


def grad_scaler(spec: ExecSpec, device: torch.device) -> torch.amp.GradScaler | None:
    """The dynamic loss scaler of fp16 mixed precision (``spec.loss_scaling``), else None."""
    return torch.amp.GradScaler(device.type) if spec.loss_scaling else None
