"""The gradients of one optimizer step: accumulated over the micro-batches, then clipped.

A global batch is split into ``grad_accum_steps`` micro-batches on each of ``world_size`` ranks. Every
micro-batch's summed token loss is divided by the number of target tokens in the *whole global batch*
(counted before the forward passes, and summed over ranks), then multiplied by the world size because
data parallelism averages gradients over ranks. The update is therefore exactly the single-process update
on the same global batch, whatever the micro-batch size, accumulation or number of processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from finetune.loss import causal_lm_loss
from finetune.train.distributed import DistContext
from finetune.train.parallel import no_sync

if TYPE_CHECKING:
    from finetune.train.preflight import RunPhase


def accumulate(
    model: torch.nn.Module, micro: list[dict[str, torch.Tensor]], global_tokens: float, ctx: DistContext,
    autocast: Callable[[], Any], scaler: Any, phase: RunPhase,
) -> torch.Tensor:
    """Forward and backward every micro-batch (``phase`` follows: forward, backward); gradients are synchronised
    on the last one only. Returns this rank's summed token loss."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    scale = ctx.dp_size / max(global_tokens, 1.0)  # data parallelism averages over replicas, TP does not
    for i, mb in enumerate(micro):
        last = i == len(micro) - 1
        phase.at("forward")
        with no_sync(model, enabled=not last), autocast():
            s, _ = causal_lm_loss(model, mb)
        phase.at("backward")
        loss = s * scale
        (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += s.detach().double().cpu()
    return loss_sum


def clip_gradients(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float | None
) -> float:
    """Unscale (fp16) and clip the global gradient norm; return the norm before clipping."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    groups = _grads_by_layout(params)
    if len(groups) > 1:
        return _clip_mixed_layouts(groups, max_norm)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _grads_by_layout(params: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """Gradients grouped by how they are laid out over ranks: (mesh, placements) of a DTensor, None if plain."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(g)
    return groups


def _clip_mixed_layouts(groups: dict[Any, list[torch.Tensor]], max_norm: float | None) -> float:
    """``clip_grad_norm_`` for gradients on several meshes (tensor parallelism: TP-split, FSDP-sharded and
    replicated ones), which torch's cannot stack together: one norm per layout, each made global by DTensor
    (a TP or FSDP shard's norm is reduced over its mesh), then combined and applied as one coefficient."""
    from torch.distributed.tensor import DTensor

    squares = 0.0
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        squares += float(n) ** 2
    norm = math.sqrt(squares)
    if max_norm and math.isfinite(norm):
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for grads in groups.values():
                for g in grads:
                    g.mul_(coef)
    return norm
