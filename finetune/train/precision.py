"""Mixed precision as the execution spec says: torch.autocast around the forward passes, the loss scaler
of fp16 runs, and the tensors an architecture keeps in fp32."""

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


def keep_fp32(model: torch.nn.Module, spec: ExecSpec) -> torch.nn.Module:
    """``model`` with the tensors its architecture keeps in fp32 (``spec.fp32_tensors``) in fp32, on every
    load path (transformers applies them when it loads a checkpoint in a 16-bit dtype, not when it builds a
    model from its config, and the fp16-only ones not in bf16). Returns ``model``."""
    if not spec.fp32_tensors:
        return model
    for name, p in model.named_parameters():
        if p.dtype != torch.float32 and p.is_floating_point() and spec.keeps_fp32(name):
            p.data = p.data.to(torch.float32)
    for name, b in model.named_buffers():
        if b.dtype != torch.float32 and b.is_floating_point() and spec.keeps_fp32(name):
            parent, _, leaf = name.rpartition(".")
            owner = model.get_submodule(parent)
            owner.register_buffer(leaf, b.to(torch.float32), persistent=leaf not in owner._non_persistent_buffers_set)
    return model
