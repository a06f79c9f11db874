"""The training loop of one rank: executes the Plan, logs, evaluates, saves.

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from finetune.plan.types import Plan
from finetune.recipe import LoadedRecipe
from finetune.train.data import BatchStream, TaskData, load_data
from finetune.train.distributed import DistContext, maybe_inject_failure
from finetune.train.evaluate import EvalResult, evaluate
from finetune.train.loss import causal_lm_loss, count_target_tokens
from finetune.train.memory import PeakMemory
from finetune.train.model import (
    build_model,
    compute_dtype,
    count_parameters,
    load_tokenizer,
)
from finetune.train.outputs import MetricsWriter, Reporter, save_final
from finetune.train.parallel import no_sync, parallelize, unwrap
from finetune.train.resume import (
    RunCheckpoints,
    StopRequest,
    inject_test_faults,
    nonfinite_policy,
    step_sleep,
)


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


def build_optimizer(model: torch.nn.Module, loaded: LoadedRecipe, strategy: str) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; ZeRO-1 shards its state over ranks."""
    t = loaded.recipe.train
    groups = param_groups(model, t.weight_decay)
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            groups[0]["params"], optimizer_class=torch.optim.AdamW, lr=t.lr, betas=t.betas,
            weight_decay=groups[0]["weight_decay"],
        )
        for g in groups[1:]:
            opt.add_param_group(g)
        return opt
    return torch.optim.AdamW(groups, lr=t.lr, betas=t.betas)


@dataclass
class TrainState:
    """Counters that a checkpoint must restore."""

    step: int = 0  # optimizer steps done
    tokens: int = 0  # input tokens (not padding) processed, all ranks
    skipped_steps: int = 0
    history: list[float] = field(default_factory=list)  # per-step loss (the parity tests read metrics.jsonl)


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


def _autocast_factory(precision: str, device: torch.device, strategy: str) -> Callable[[], Any]:
    """Mixed precision context for DDP/single (FSDP2 casts parameters itself through its policy)."""
    if precision in ("bf16", "fp16") and strategy not in ("zero2", "fsdp"):
        dtype = compute_dtype(precision)
        return lambda: torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext


def total_steps(loaded: LoadedRecipe, stream: BatchStream) -> int:
    """Optimizer steps of the run: train.max_steps, or epochs x steps per epoch."""
    t = loaded.recipe.train
    if t.max_steps:
        return t.max_steps
    return max(1, math.ceil(t.epochs * stream.steps_per_epoch))


def _position(step: int, stream: BatchStream) -> tuple[int, int]:
    return divmod(step, stream.steps_per_epoch)


def train_rank(
    loaded: LoadedRecipe, plan: Plan, *, measure_memory: bool = False, ctx: DistContext | None = None,
    resume: str | None = None,
) -> RunResult:
    """Run the whole training of this rank as ``plan`` says; rank 0 writes the outputs.

    ``resume``: ``latest`` or a checkpoint directory to continue from (see finetune.train.resume).
    """
    ctx = ctx or DistContext.from_env()
    r = loaded.recipe
    chosen = plan.chosen
    out_dir = Path(r.output.dir)
    started = time.perf_counter()
    reporter = Reporter(ctx.is_main)

    seed_everything(r.train.seed)
    tokenizer = load_tokenizer(loaded)
    data: TaskData = load_data(loaded, tokenizer)
    keep_base = ctx.is_main and chosen.method != "full" and r.model.init == "random"
    model = build_model(loaded, chosen, ctx.device, base_dir=out_dir / "base" if keep_base else None)
    trainable, total = count_parameters(model)
    model = parallelize(model, chosen, ctx)
    optimizer = build_optimizer(model, loaded, chosen.strategy)
    stream = BatchStream(data.train, r.train.global_batch_size, r.train.seed, tokenizer.pad_token_id)
    steps = total_steps(loaded, stream)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(r.train.lr_schedule, r.train.warmup_steps, steps, r.train.min_lr_ratio)
    )
    scaler = torch.amp.GradScaler(ctx.device.type) if chosen.precision == "fp16" else None
    autocast = _autocast_factory(chosen.precision, ctx.device, chosen.strategy)
    params = [p for p in model.parameters() if p.requires_grad]
    metrics = MetricsWriter(out_dir / "metrics.jsonl", enabled=ctx.is_main)
    state = TrainState()
    reporter.start(plan, trainable, total, steps, data.stats, ctx.world_size, getattr(data, "notes", []))
    checkpoints = RunCheckpoints(
        loaded, plan, ctx, stream, model, unwrap(model), optimizer, scheduler, scaler, steps, reporter.plain
    )
    checkpoints.start(state, resume)
    on_nonfinite = nonfinite_policy(loaded, chosen.precision)
    stop = StopRequest(reporter.plain)

    def do_eval() -> EvalResult | None:
        if not data.eval and not data.eval_prompts:
            return None
        return evaluate(
            model, data.eval, data.eval_prompts, tokenizer, ctx,
            batch_size=r.eval.batch_size, max_new_tokens=r.eval.max_new_tokens, autocast=autocast,
        )

    model.train()
    window_tokens, window_start = 0, time.perf_counter()
    measured_peak = None
    last_eval: EvalResult | None = None
    if r.eval.at_start and state.step == 0:
        first = do_eval()
        if first is not None:
            metrics.write({"step": 0, **_eval_fields(first)})
            reporter.eval_line(0, first)
    start_step, longest, probe = state.step, 0, None
    checkpoints.restore_rng()  # last thing before the first step: the resumed run draws what the first would
    with stop, reporter.progress(steps, start=state.step) as advance:
        while state.step < steps:
            maybe_inject_failure(ctx, state.step + 1)  # test hook (FINETUNE_FAIL_RANK / _AT_STEP), else no-op
            epoch, in_epoch = _position(state.step, stream)
            micro = stream.micro_batches(
                epoch, in_epoch, rank=ctx.rank, world_size=ctx.world_size, micro_batch_size=chosen.micro_batch_size
            )
            input_tokens = int(ctx.all_reduce_sum(sum(int(mb["num_tokens"]) for mb in micro)))  # no padding
            micro = [{k: v.to(ctx.device) for k, v in mb.items()} for mb in micro]
            global_tokens = float(ctx.all_reduce_sum(sum(count_target_tokens(mb) for mb in micro)))
            if state.step == start_step:
                probe = _memory_probe(measure_memory, ctx, model, optimizer)
            if state.step - start_step < 2:  # the 2nd step is the steady state: AdamW's state exists by then
                longest = max(longest, max(mb["input_ids"].shape[1] for mb in micro))
                measuring = probe
            else:
                measuring = contextlib.nullcontext()
            with measuring:
                loss_sum = _accumulate(model, micro, global_tokens, ctx, autocast, scaler)
                loss_sum = inject_test_faults(state.step + 1, params, loss_sum)  # test hook, else no-op
                grad_norm = _clip(model, params, optimizer, scaler, r.train.max_grad_norm)
                loss = float(ctx.all_reduce_sum(loss_sum)) / max(global_tokens, 1.0)
                finite = math.isfinite(loss) and math.isfinite(grad_norm)
                if not finite and on_nonfinite == "stop":
                    raise checkpoints.nonfinite_error(state.step + 1, loss, grad_norm)
                if scaler is not None:
                    scaler.step(optimizer)  # skips the update itself when the scaled grads overflowed
                    scaler.update()
                    state.skipped_steps += int(not finite)
                elif finite:
                    optimizer.step()
                else:  # on_nonfinite: skip. No update; the step (and its batch) still counts.
                    state.skipped_steps += 1
                optimizer.zero_grad(set_to_none=True)
            if isinstance(measuring, PeakMemory) and (state.step - start_step == 1 or state.step + 1 == steps):
                measured_peak = probe.measured_peak_bytes
                _report_memory(probe, loaded, plan, out_dir, ctx, reporter, longest)
            scheduler.step()
            state.step += 1
            state.tokens += input_tokens
            state.history.append(loss)
            window_tokens += input_tokens
            row: dict[str, Any] = {"step": state.step, "loss": loss, "lr": scheduler.get_last_lr()[0]}
            if r.eval.every and state.step % r.eval.every == 0 and state.step < steps:
                last_eval = do_eval()
                row.update(_eval_fields(last_eval))
                reporter.eval_line(state.step, last_eval)
            if state.step % r.output.log_every == 0 or state.step == steps or "eval_loss" in row:
                now = time.perf_counter()
                row.update(
                    tokens=state.tokens,
                    tokens_per_s=window_tokens / max(now - window_start, 1e-9),
                    grad_norm=grad_norm,
                    epoch=epoch,
                )
                window_tokens, window_start = 0, now
                metrics.write(row)
            advance(loss=loss, lr=row["lr"], tokens_per_s=row.get("tokens_per_s") or window_tokens / max(time.perf_counter() - window_start, 1e-9))
            step_sleep()  # test hook, else no-op
            if checkpoints.after_step(state, stop):  # saves when due; True after SIGTERM/Ctrl-C
                return RunResult(
                    steps=state.step, final_loss=loss, eval=None, output_dir=out_dir,
                    seconds=time.perf_counter() - started, measured_peak=measured_peak, model=unwrap(model),
                    losses=list(state.history), exit_code=stop.exit_code,
                    checkpoint_seconds=checkpoints.save_seconds,
                )

    last_eval = do_eval()
    if last_eval is not None:
        metrics.write({"step": state.step, **_eval_fields(last_eval)})
    save_final(model, unwrap(model), tokenizer, out_dir, chosen, ctx)
    result = RunResult(
        steps=state.step, final_loss=state.history[-1] if state.history else None, eval=last_eval,
        output_dir=out_dir, seconds=time.perf_counter() - started, measured_peak=measured_peak,
        model=unwrap(model), losses=list(state.history), checkpoint_seconds=checkpoints.save_seconds,
    )
    reporter.summary(result, chosen, state.skipped_steps)
    return result


def _accumulate(
    model: torch.nn.Module, micro: list[dict[str, torch.Tensor]], global_tokens: float, ctx: DistContext,
    autocast: Callable[[], Any], scaler: Any,
) -> torch.Tensor:
    """Forward and backward every micro-batch; gradients are synchronised on the last one only."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    scale = ctx.world_size / max(global_tokens, 1.0)
    for i, mb in enumerate(micro):
        last = i == len(micro) - 1
        with no_sync(model, enabled=not last), autocast():
            s, _ = causal_lm_loss(model, mb)
        loss = s * scale
        (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += s.detach().double().cpu()
    return loss_sum


def _clip(
    model: torch.nn.Module, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scaler: Any,
    max_norm: float | None,
) -> float:
    """Unscale (fp16) and clip the global gradient norm; return the norm before clipping."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _eval_fields(ev: EvalResult | None) -> dict[str, Any]:
    if ev is None:
        return {}
    return {"eval_loss": ev.loss, "eval_exact_match": ev.exact_match}


def _memory_probe(enabled: bool, ctx: DistContext, model: torch.nn.Module, optimizer: Any) -> Any:
    """A probe of the first two optimizer steps' peak memory (CUDA always; CPU with --measure-memory)."""
    if not (enabled or ctx.device.type == "cuda"):
        return contextlib.nullcontext()
    return PeakMemory(ctx.device.type, enabled=True, modules=(model,), optimizer=optimizer)


def _report_memory(
    probe: PeakMemory, loaded: LoadedRecipe, plan: Plan, out_dir: Path, ctx: DistContext, reporter: Reporter,
    longest: int,
) -> None:
    """Write memory.json and print the plan's prediction beside the measured peak (rank 0).

    After two steps the measurement includes AdamW's state, so it compares with the plan's steady state;
    a one-step run compares with the planner's first-step figure (no optimizer state yet).
    """
    if not ctx.is_main:
        return
    predicted = plan.chosen.memory
    if probe.steps < 2:
        from finetune.plan.flowchart import first_step_memory

        predicted = first_step_memory(loaded, plan, device=ctx.device.type)
    out_dir.mkdir(parents=True, exist_ok=True)
    probe.write(out_dir / "memory.json", predicted)
    line = probe.summary_line(predicted)
    planned = loaded.recipe.data.max_seq_len
    if longest < planned:
        line += f"; planned for {planned}-token rows, these batches were at most {longest} (padding to the longest)"
    reporter.print(line)
