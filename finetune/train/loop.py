"""The pieces of one optimizer step and of the run around it, which finetune.train.trainer puts in order.

A global batch is split into ``grad_accum_steps`` micro-batches on each of ``world_size`` ranks. Every
micro-batch's summed token loss is divided by the number of target tokens in the *whole global batch*
(counted before the forward passes, and summed over ranks), then multiplied by the world size because
data parallelism averages gradients over ranks. The update is therefore exactly the single-process update
on the same global batch, whatever the micro-batch size, accumulation or number of processes.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from finetune.errors import UserError
from finetune.loss import causal_lm_loss
from finetune.plan.types import Plan
from finetune.recipe import LoadedRecipe, TrainConfig
from finetune.spec import ExecSpec, Strategy
from finetune.train.data import BatchStream
from finetune.train.distributed import DistContext
from finetune.train.evaluate import EvalResult
from finetune.train.memory import PeakMemory
from finetune.train.optim import LocalShardOptimizer, is_sharded
from finetune.train.outputs import Reporter
from finetune.train.parallel import no_sync
from finetune.units import torch_dtype


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def lr_lambda(schedule: str, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak lr for optimizer step ``s`` (0-based): linear warmup, then the decay."""

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters, with weight decay on matrices only (not norms, biases)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def optimizer_class(name: str) -> tuple[type, dict[str, Any]]:
    """The optimizer class of ``train.optimizer`` and its implementation options.

    torch's AdamW: its fused kernel on CUDA and on CPU. It updates each tensor in place, so the step needs no
    temporaries (foreach holds a state-sized ``sqrt(exp_avg_sq)`` of every tensor at once, the per-parameter
    loop two of the largest tensor), and on CPU it is several times faster than either
    (``scripts/bench_optimizer.py``). bitsandbytes' 8-bit AdamW keeps both moments in 8 bits.
    """
    if name == "adamw":
        return torch.optim.AdamW, {"fused": True}
    import bitsandbytes as bnb

    if name == "adamw8bit":
        return bnb.optim.AdamW8bit, {}
    if name == "paged_adamw8bit":
        return bnb.optim.PagedAdamW8bit, {}
    raise UserError(f"train.optimizer: unknown optimizer `{name}`; use adamw, adamw8bit or paged_adamw8bit")


def build_optimizer(
    model: torch.nn.Module, t: TrainConfig, strategy: Strategy, *, tensor_parallel: bool = False,
    name: str | None = None,
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (the plan's; None: ``train.optimizer``, adamw for auto) over the trainable parameters (``train``
    section settings); ZeRO-1 shards its state over ranks.

    Under ZeRO-2, FSDP and tensor parallelism (DTensor parameters) the 8-bit optimizers update each rank's
    local shards (:class:`finetune.train.optim.LocalShardOptimizer`); unsharded runs use bitsandbytes' class as is.
    Under tensor parallelism the parameters are DTensors on different meshes (TP-split linears, FSDP-only
    norms) or plain tensors (what TP replicates): the foreach and fused kernels need one kind in a list, so
    AdamW runs its per-parameter loop there.
    """
    groups = param_groups(model, t.weight_decay)
    name = name or (t.optimizer if t.optimizer != "auto" else "adamw")
    cls, options = optimizer_class(name)
    if cls is not torch.optim.AdamW and is_sharded([p for g in groups for p in g["params"]]):
        # bitsandbytes' kernels take no DTensors: its 8-bit AdamW runs over each rank's local shards
        return LocalShardOptimizer(groups, cls, lr=t.lr, betas=t.betas, **options)
    if strategy is Strategy.ZERO1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            groups[0]["params"], optimizer_class=cls, lr=t.lr, betas=t.betas,
            weight_decay=groups[0]["weight_decay"], **options,
        )
        for g in groups[1:]:
            opt.add_param_group(g)
        return opt
    if tensor_parallel and cls is torch.optim.AdamW:
        options = {"foreach": False}
    return cls(groups, lr=t.lr, betas=t.betas, **options)


@dataclass
class TrainState:
    """Counters that a checkpoint must restore."""

    step: int = 0  # optimizer steps done
    tokens: int = 0  # input tokens (not padding) processed, all ranks
    skipped_steps: int = 0
    history: list[float] = field(default_factory=list)  # per-step loss (the parity tests read metrics.jsonl)

    def state_dict(self) -> dict[str, Any]:
        """The counters as JSON values (a checkpoint's meta.json)."""
        return {"step": self.step, "tokens": self.tokens, "skipped_steps": self.skipped_steps,
                "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.skipped_steps = int(state["skipped_steps"])
        self.history = [float(x) for x in state["history"]]


class DataPosition:
    """Where the batch stream is: a pure function of the step, saved with a fingerprint of the data so that a
    resume on other data (or another seed or global batch) is refused."""

    def __init__(self, stream: BatchStream, state: TrainState) -> None:
        self.stream, self.state = stream, state

    def state_dict(self) -> dict[str, Any]:
        """The next global batch to run: epoch, step in the epoch, data fingerprint."""
        return self.stream.position_state(*position(self.state.step, self.stream))

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Check the saved position against the data and the (already restored) step."""
        if self.stream.restore_position(saved) != position(self.state.step, self.stream):
            raise UserError("--resume: the checkpoint holds an inconsistent data position; choose another checkpoint")


@dataclass
class RunResult:
    """What a finished run reports."""

    steps: int
    final_loss: float | None
    eval: EvalResult | None
    output_dir: Path
    seconds: float
    measured_peak: int | None = None
    model: torch.nn.Module | None = None  # the trained model (unwrapped), for in-process callers
    exit_code: int = 0  # 130/143: stopped by Ctrl-C/SIGTERM after saving a checkpoint
    checkpoint_seconds: list[float] = field(default_factory=list)  # time of each checkpoint save
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None  # real tokens/s over the training steps after the first (all ranks)
    utilisation: Any = None  # finetune.plan.flops.Utilisation: MFU on a GPU whose peak is known; None on CPU


def autocast_factory(spec: ExecSpec, device: torch.device) -> Callable[[], Any]:
    """torch.autocast when the execution spec says so (single/DDP/ZeRO-1 mixed precision), else a no-op
    (FSDP2 casts parameters itself through its policy)."""
    if spec.autocast:
        dtype = torch_dtype(spec.compute_dtype)
        return lambda: torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext


def total_steps(loaded: LoadedRecipe, stream: BatchStream) -> int:
    """Optimizer steps of the run: train.max_steps, or epochs x steps per epoch."""
    t = loaded.recipe.train
    if t.max_steps:
        return t.max_steps
    return max(1, math.ceil(t.epochs * stream.steps_per_epoch))


def position(step: int, stream: BatchStream) -> tuple[int, int]:
    return divmod(step, stream.steps_per_epoch)


def accumulate(
    model: torch.nn.Module, micro: list[dict[str, torch.Tensor]], global_tokens: float, ctx: DistContext,
    autocast: Callable[[], Any], scaler: Any,
) -> torch.Tensor:
    """Forward and backward every micro-batch; gradients are synchronised on the last one only."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    scale = ctx.dp_size / max(global_tokens, 1.0)  # data parallelism averages over replicas, TP does not
    from finetune.train.preflight import at

    for i, mb in enumerate(micro):
        last = i == len(micro) - 1
        at("forward")
        with no_sync(model, enabled=not last), autocast():
            s, _ = causal_lm_loss(model, mb)
        at("backward")
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


def eval_fields(ev: EvalResult | None) -> dict[str, Any]:
    if ev is None:
        return {}
    return {"eval_loss": ev.loss, "eval_exact_match": ev.exact_match}


def memory_probe(enabled: bool, ctx: DistContext, model: torch.nn.Module, optimizer: Any) -> Any:
    """A probe of the first two optimizer steps' peak memory (CUDA always; CPU with --measure-memory)."""
    if not (enabled or ctx.device.type == "cuda"):
        return contextlib.nullcontext()
    return PeakMemory(ctx.device.type, modules=(model,), optimizer=optimizer)


def report_memory(
    probe: PeakMemory, loaded: LoadedRecipe, plan: Plan, out_dir: Path, ctx: DistContext, reporter: Reporter,
    longest: int,
) -> dict[str, Any] | None:
    """Write memory.json and print the plan's prediction beside the measured peak (rank 0); return its content.

    After two steps the measurement includes AdamW's state, so it compares with the plan's steady state;
    a one-step run compares with the planner's first-step figure (no optimizer state yet).
    """
    if not ctx.is_main:
        return None
    from finetune.plan.flowchart import chosen_memory

    first_step = probe.steps < 2
    predicted = plan.chosen.memory
    if first_step:
        predicted = chosen_memory(loaded, plan, device=ctx.device.type, first_step=True)
    planned = loaded.recipe.data.max_seq_len
    at_rows, rows = None, None
    if 0 < longest < planned:
        # the plan is for full rows; these batches were narrower: predict them too, like for like
        at_rows = chosen_memory(loaded, plan, device=ctx.device.type, first_step=first_step, seq_len=longest)
        rows = (planned, longest)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = probe.write(out_dir / "memory.json", predicted, at_rows, rows)
    line = probe.summary_line(predicted, at_rows, rows)
    reporter.print(line)
    return report
