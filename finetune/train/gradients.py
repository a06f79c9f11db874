"""The gradients of one optimizer step: accumulated over the micro-batches (or run through a pipeline's
schedule), then clipped.

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

from finetune.objectives.loss import causal_lm_loss
from finetune.train.data.batches import to_device
from finetune.train.parallel.distributed import DistContext
from finetune.train.parallel.parallelize import no_sync

if TYPE_CHECKING:
    from finetune.train.parallel.layout import ParallelLayout
    from finetune.train.parallel.pipeline import Pipeline
    from finetune.train.runtime.preflight import RunPhase


class MicroBatchLoss:
    """How a micro-batch's summed loss enters backward: times the step's scale (the data-parallel replicas over
    the global batch's target tokens, counted before the step), through the fp16 loss scaler; each summed loss
    is kept for the step's figure. :func:`accumulate` calls it on every micro-batch; under a pipeline it is the
    schedule's ``loss_fn``, which the schedule calls on the last stage (:func:`pipeline_step`)."""

    def __init__(self, scaler: Any = None) -> None:
        self.scaler = scaler
        self.scale: torch.Tensor | None = None
        self.sums: list[torch.Tensor] = []

    def start(self, global_tokens: float | torch.Tensor, replicas: int, device: torch.device) -> None:
        """A new step over ``global_tokens`` target tokens (a device tensor or a number), averaged over
        ``replicas`` data-parallel replicas (data parallelism averages gradients, TP and pipeline stages do not)."""
        self.scale = replicas / torch.as_tensor(global_tokens, dtype=torch.float64, device=device).clamp(min=1.0)
        self.sums = []

    def __call__(self, summed: torch.Tensor, target: Any = None) -> torch.Tensor:
        """The loss to backward for a micro-batch whose summed loss is ``summed`` (``target``: the schedule's
        micro-batch of labels, which the stage's forward already used)."""
        assert self.scale is not None, "start() sets the step's scale"
        self.sums.append(summed.detach().double())
        loss = summed * self.scale.to(summed.dtype)
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def total(self, device: torch.device) -> torch.Tensor:
        """The step's summed loss on this rank so far (float64, on ``device``; 0 where no loss was computed)."""
        out = torch.zeros((), dtype=torch.float64, device=device)
        for s in self.sums:
            out += s
        return out


def accumulate(
    model: torch.nn.Module, micro: list[dict[str, torch.Tensor]], global_tokens: float | torch.Tensor,
    ctx: DistContext, autocast: Callable[[], Any], scaler: Any, phase: RunPhase,
    loss_fn: Callable[[torch.nn.Module, dict[str, Any]], tuple[torch.Tensor, Any]] = causal_lm_loss,
    *, sync_every_micro_batch: bool = False,
) -> torch.Tensor:
    """Forward and backward every micro-batch (``phase`` follows: forward, backward); gradients are synchronised
    on the last one only, or, with ``sync_every_micro_batch`` (the execution spec's: FSDP2's strategies),
    reduce-scattered after every one (:func:`~finetune.train.parallel.parallelize.no_sync`). Returns this rank's summed
    token loss, a float64 tensor on the device.

    Nothing here reads a device value on the host: ``global_tokens`` may be a device tensor (the all-reduced
    count), and the summed loss stays on the device, so the host runs ahead of the kernels through every
    micro-batch (FSDP's prefetch included); the trainer reads the step's figures once, after the last one.
    """
    device = micro[0]["input_ids"].device if micro else ctx.device
    loss = MicroBatchLoss(scaler)
    loss.start(global_tokens, ctx.layout.dp, device)
    for i, mb in enumerate(micro):
        last = i == len(micro) - 1
        phase.at("forward")
        with no_sync(model, enabled=not last, every_micro_batch=sync_every_micro_batch), autocast():
            s, _ = loss_fn(model, mb)  # the objective's summed loss (sft: tokens; dpo, simpo, orpo: pairs)
        phase.at("backward")
        loss(s).backward()
    return loss.total(device)


def pipeline_step(
    pipe: Pipeline, micro: list[dict[str, torch.Tensor]], global_tokens: float | torch.Tensor, ctx: DistContext,
    loss: MicroBatchLoss,
) -> torch.Tensor:
    """Forward and backward the step's micro-batches (host copies, as :meth:`Pipeline.pad` gives them: one width)
    through the stages: one step of the pipeline's schedule, whose ``loss_fn`` is ``loss`` (scaled as
    :func:`accumulate` scales each micro-batch). Returns this replica's summed token loss (float64, on the
    device) on every rank of the pp group."""
    from finetune.objectives.loss import shifted_labels

    ids = to_device(torch.cat([mb["input_ids"] for mb in micro]), ctx.device)
    labels = to_device(torch.cat([shifted_labels(mb) for mb in micro]), ctx.device)
    loss.start(global_tokens, ctx.layout.dp, ids.device)
    schedule = pipe.schedule.for_shape(ids.shape[0] // len(micro), ids.shape[1])
    assert len(micro) == pipe.schedule.n_microbatches, f"{len(micro)} micro-batches, the schedule runs {pipe.schedule.n_microbatches}"
    # the last stage's forward takes the labels (its fused head), the schedule's loss_fn its output
    schedule.step(*((ids,) if pipe.first else ()), target=labels, return_outputs=False, labels=labels)
    return ctx.from_last_stage(loss.total(ids.device))


def clip_gradients(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float | None
) -> float:
    """Unscale (fp16) and clip the global gradient norm; return the norm before clipping."""
    return float(clip_grad_norm(params, optimizer, scaler, max_norm))


def clip_grad_norm(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float | None,
    layout: ParallelLayout | None = None,
) -> torch.Tensor:
    """:func:`clip_gradients`, returning the norm as a 0-d tensor where the gradients are (no host sync when
    every gradient has one layout; gradients on several meshes, as under tensor parallelism, read it once).

    Under a pipeline (``layout`` with pp above 1) ``params`` are this rank's stages' and the norm is the whole
    model's: each rank's squared norms (reduced over dp and tp by DTensor) are summed over the pp group, with
    no host sync; under fp16 an overflow on any stage skips the update on every stage (GradScaler checks its own
    rank's gradients only), so the stages never fall out of step."""
    if layout is not None and layout.pp_enabled:
        return _clip_over_stages(params, optimizer, scaler, max_norm, layout)
    if scaler is not None:
        scaler.unscale_(optimizer)
    groups = _grads_by_layout(params)
    if len(groups) > 1:
        return torch.tensor(_clip_mixed_layouts(groups, max_norm), dtype=torch.float64)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


def _clip_over_stages(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float | None,
    layout: ParallelLayout,
) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if scaler is not None:
        scaler.unscale_(optimizer)
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        for flag in found.values():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    groups = _grads_by_layout(params)
    device = next((g.device for grads in groups.values() for g in grads), torch.device(layout.device_type))
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        squares = squares + n.double().to(squares.device) ** 2
    dist.all_reduce(squares, group=layout.pp_group)
    norm = squares.sqrt()
    if max_norm:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grads in groups.values():
            for g in grads:
                local = g.to_local() if isinstance(g, DTensor) else g
                local.mul_(coef.to(device=local.device, dtype=local.dtype))
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
