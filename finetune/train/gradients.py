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
    model: torch.nn.Module, micro: list[dict[str, torch.Tensor]], global_tokens: float | torch.Tensor,
    ctx: DistContext, autocast: Callable[[], Any], scaler: Any, phase: RunPhase,
    loss_fn: Callable[[torch.nn.Module, dict[str, Any]], tuple[torch.Tensor, Any]] = causal_lm_loss,
    *, sync_every_micro_batch: bool = False,
) -> torch.Tensor:
    """Forward and backward every micro-batch (``phase`` follows: forward, backward); gradients are synchronised
    on the last one only, or, with ``sync_every_micro_batch`` (the execution spec's: FSDP2's strategies),
    reduce-scattered after every one (:func:`~finetune.train.parallel.no_sync`). Returns this rank's summed
    token loss, a float64 tensor on the device.

    Nothing here reads a device value on the host: ``global_tokens`` may be a device tensor (the all-reduced
    count), and the summed loss stays on the device, so the host runs ahead of the kernels through every
    micro-batch (FSDP's prefetch included); the trainer reads the step's figures once, after the last one.
    """
    device = micro[0]["input_ids"].device if micro else ctx.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    # data parallelism averages over replicas, TP does not
    scale = ctx.dp_size / torch.as_tensor(global_tokens, dtype=torch.float64, device=device).clamp(min=1.0)
    for i, mb in enumerate(micro):
        last = i == len(micro) - 1
        phase.at("forward")
        with no_sync(model, enabled=not last, every_micro_batch=sync_every_micro_batch), autocast():
            s, _ = loss_fn(model, mb)  # the objective's summed loss (sft: tokens; dpo, simpo, orpo: pairs)
        phase.at("backward")
        loss = s * scale.to(s.dtype)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += s.detach().double()
    return loss_sum


def clip_gradients(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float | None
) -> float:
    """Unscale (fp16) and clip the global gradient norm; return the norm before clipping."""
    return float(clip_grad_norm(params, optimizer, scaler, max_norm))


def clip_grad_norm(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float | None
) -> torch.Tensor:
    """:func:`clip_gradients`, returning the norm as a 0-d tensor where the gradients are (no host sync when
    every gradient has one layout; gradients on several meshes, as under tensor parallelism, read it once)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    groups = _grads_by_layout(params)
    if len(groups) > 1:
        return torch.tensor(_clip_mixed_layouts(groups, max_norm), dtype=torch.float64)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


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

    squares: torch.Tensor | None = None
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq = n.double() ** 2
        squares = sq if squares is None else squares + sq.to(squares.device)
    norm = math.sqrt(float(squares)) if squares is not None else 0.0  # the one host sync of the clipping
    if max_norm and math.isfinite(norm):
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for grads in groups.values():
                for g in grads:
                    g.mul_(coef)
    return norm
