"""One rank's run, in named phases: setup -> train (train_step ..., evaluate) -> save -> cleanup.

Read top to bottom, this is everything ``finetune run`` does on a rank once the Plan exists:

    setup       tokenizer and data; the model as the execution spec says (built, checked against the plan's
                inventory, activation checkpointing and the strategy's wrapping); optimizer, scheduler, loss
                scaler; the checkpointer, which resumes when asked
    train       evaluate before the first step, then ``train_step`` until the last step, logging, evaluating
                and checkpointing as the recipe says
    train_step  one optimizer step over the global batch (micro-batches, gradient accumulation, clipping,
                non-finite policy), with the memory probe around the first two steps
    evaluate    eval loss and exact match (collective-safe: every rank runs the same forwards)
    save        the final model or adapter, and the tokenizer (rank 0 writes; every rank gathers)
    cleanup     nothing to release today but the process group, which the worker owns

A global batch is split into ``grad_accum_steps`` micro-batches on each of ``world_size`` ranks. Every
micro-batch's summed token loss is divided by the number of target tokens in the *whole global batch*
(counted before the forward passes, and summed over ranks), then multiplied by the world size because data
parallelism averages gradients over ranks: the update is exactly the single-process update on the same
global batch, whatever the micro-batch size, accumulation or number of processes.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.loss import count_target_tokens
from finetune.plan.hardware import parse_bytes
from finetune.plan.types import Plan
from finetune.recipe import LoadedRecipe
from finetune.train.checkpoint import ModelState, OptimizerState, RNGState
from finetune.train.data import BatchStream, TaskData, load_data
from finetune.train.distributed import DistContext
from finetune.train.evaluate import EvalResult, evaluate
from finetune.train.hooks import TrainerHooks, load_hooks
from finetune.train.load import build_on_meta, loads_sharded, materialize
from finetune.train.loop import (
    DataPosition,
    RunResult,
    TrainState,
    accumulate,
    autocast_factory,
    build_optimizer,
    clip_gradients,
    eval_fields,
    lr_lambda,
    memory_probe,
    position,
    report_memory,
    seed_everything,
    total_steps,
)
from finetune.train.memory import PeakMemory
from finetune.train.model import (
    broadcast_decomposed,
    build_model,
    check_model_storage,
    count_parameters,
    load_tokenizer,
)
from finetune.train.outputs import MetricsWriter, Reporter, save_final
from finetune.train.parallel import parallelize, unwrap
from finetune.train.preflight import at
from finetune.train.resume import RunCheckpoints, StopRequest, build_checkpointer, nonfinite_policy


@dataclass
class StepResult:
    """What one optimizer step reports."""

    loss: float
    grad_norm: float
    input_tokens: int  # real tokens (no padding) over all ranks
    epoch: int
    row_widths: tuple[int, int] = (0, 0)  # this rank's sum of (padded row width x real tokens), and its tokens


class Trainer:
    """Trains one rank exactly as ``plan`` says; rank 0 prints and writes the outputs."""

    def __init__(
        self,
        loaded: LoadedRecipe,
        plan: Plan,
        ctx: DistContext | None = None,
        *,
        measure_memory: bool = False,
        resume: str | None = None,
        hooks: TrainerHooks | None = None,
    ) -> None:
        assert plan.execution is not None, "a plan for a run carries its execution spec"
        self.loaded, self.plan, self.spec = loaded, plan, plan.execution
        self.ctx = ctx or DistContext.from_env()
        self.ctx.tp = self.spec.tp  # the ranks of a TP group share one data slice
        self.measure_memory, self.resume = measure_memory, resume
        self.hooks = hooks or load_hooks()
        self.out_dir = Path(loaded.recipe.output.dir)
        self.reporter = Reporter(self.ctx.is_main)
        self.state = TrainState()
        self.started = time.perf_counter()
        self.measured_peak: int | None = None
        self._flops: tuple[float, float] | None = None  # model FLOPs per token: at width 0, per token of width

    # -- setup ------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Data, model, optimizer and checkpointer; resumes when asked."""
        r, ctx, chosen = self.loaded.recipe, self.ctx, self.plan.chosen
        seed_everything(r.train.seed)
        self.tokenizer = load_tokenizer(self.loaded)
        self.data: TaskData = load_data(self.loaded, self.tokenizer)
        self.model = self._setup_model()
        self.optimizer = build_optimizer(
            self.model, r.train, self.spec.strategy, tensor_parallel=self.spec.tensor_parallel,
            name=self.spec.optimizer,
        )
        self.stream = BatchStream(self.data.train, r.train.global_batch_size, r.train.seed, self.tokenizer.pad_token_id)
        self.total = total_steps(self.loaded, self.stream)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(r.train.lr_schedule, r.train.warmup_steps, self.total, r.train.min_lr_ratio)
        )
        self.scaler = torch.amp.GradScaler(ctx.device.type) if self.spec.loss_scaling else None
        self.autocast = autocast_factory(self.spec, ctx.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.metrics = MetricsWriter(self.out_dir / "metrics.jsonl", enabled=ctx.is_main)
        self.reporter.start(
            self.plan, self.trainable, self.total_params, self.total, self.data.stats, ctx.world_size,
            getattr(self.data, "notes", []),
        )
        states = {
            "model": ModelState(self.model, adapters_only=self.spec.method.adapters),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "rng": RNGState(ctx.rank, ctx.world_size),
            "train": self.state,
            "data": DataPosition(self.stream, self.state),
        }
        self.checkpointer = build_checkpointer(
            self.loaded, self.plan, ctx, states, self.total, self.hooks.checkpoint_half_written
        )
        self.checkpoints = RunCheckpoints(
            self.loaded, self.plan, ctx, self.checkpointer, unwrap(self.model), self.total, self.reporter.plain
        )
        self.checkpoints.start(self.state, self.resume)
        resumed_at = self.state.step if self.checkpoints.last_saved is not None else None
        self.metrics.trackers = open_trackers(self.loaded, self.plan, ctx, resumed_at)
        self.on_nonfinite = nonfinite_policy(self.loaded, chosen.precision)

    def _setup_model(self) -> torch.nn.Module:
        """Build the model the execution spec describes, check it against the plan, then wrap it."""
        r, spec, ctx = self.loaded.recipe, self.spec, self.ctx
        keep_base = ctx.is_main and spec.method.adapters and r.model.init == "random"
        base_dir = self.out_dir / "base" if keep_base else None
        text = spec.adapter.prefix_init_text if spec.adapter is not None else None
        if not loads_sharded(spec, ctx.world_size):
            model = build_model(self.loaded, spec, ctx.device, base_dir=base_dir)
            broadcast_decomposed(model)
            # prefix.init: text: the base's own keys/values of the text, before any wrapper (every rank alike)
            if text is not None:
                from finetune.adapters import init_prefix_from_text, prefix_text_ids

                ids = prefix_text_ids(text, self.tokenizer, spec.adapter.num_virtual_tokens)
                init_prefix_from_text(model, ids)
            check_model_storage(model, spec, self.plan.model.get("param_bytes_by_dtype"))
            self.trainable, self.total_params = count_parameters(model)
            return parallelize(model, spec, ctx)
        # Sharded: built on meta, wrapped, then each rank materialises only its shards (finetune/train/load.py).
        # (prefix.init: text is refused there by the capability table when the plan is made.)
        assert text is None, "prefix.init: text on a sharded load is refused by the capability table"
        model = build_on_meta(self.loaded, spec)
        check_model_storage(model, spec, self.plan.model.get("param_bytes_by_dtype"))
        self.trainable, self.total_params = count_parameters(model)
        model = parallelize(model, spec, ctx)
        materialize(model, self.loaded, spec, ctx.device, base_dir)
        return model

    # -- one optimizer step -----------------------------------------------------------------------------------
    def train_step(self, start_step: int) -> StepResult:
        """Forward and backward every micro-batch of this rank's share of the global batch, then update."""
        ctx, state, chosen = self.ctx, self.state, self.plan.chosen
        step = state.step + 1
        at("forward", step)
        self.hooks.before_step(step, ctx.rank)
        epoch, in_epoch = position(state.step, self.stream)
        micro = self.stream.micro_batches(
            epoch, in_epoch, rank=ctx.dp_rank, world_size=ctx.dp_size, micro_batch_size=chosen.micro_batch_size
        )
        input_tokens = int(ctx.data_sum(sum(int(mb["num_tokens"]) for mb in micro)))  # no padding
        # attention FLOPs per token grow with the row it sits in (for MFU): token-weighted row width
        widths = (sum(mb["input_ids"].shape[1] * int(mb["num_tokens"]) for mb in micro),
                  sum(int(mb["num_tokens"]) for mb in micro))
        micro = [{k: v.to(ctx.device) for k, v in mb.items()} for mb in micro]
        global_tokens = float(ctx.data_sum(sum(count_target_tokens(mb) for mb in micro)))
        if state.step == start_step:
            self.probe = memory_probe(self.measure_memory, ctx, self.model, self.optimizer)
        measuring: Any = contextlib.nullcontext()
        if state.step - start_step < 2:  # the 2nd step is the steady state: AdamW's state exists by then
            self.longest = max(self.longest, max(mb["input_ids"].shape[1] for mb in micro))
            measuring = self.probe
        with measuring:
            loss_sum = accumulate(self.model, micro, global_tokens, ctx, self.autocast, self.scaler)
            loss_sum = self.hooks.after_backward(step, self.params, loss_sum)
            at("optimizer")
            grad_norm = clip_gradients(self.params, self.optimizer, self.scaler, self.loaded.recipe.train.max_grad_norm)
            loss = float(ctx.data_sum(loss_sum)) / max(global_tokens, 1.0)
            self._update(step, loss, grad_norm)
        if isinstance(measuring, PeakMemory) and (state.step - start_step == 1 or step == self.total):
            self.measured_peak = measuring.measured_peak_bytes
            report = report_memory(measuring, self.loaded, self.plan, self.out_dir, ctx, self.reporter, self.longest)
            if report is not None:  # the trackers get the plan's prediction and the measured peak once
                self.metrics.track(
                    {"step": step, "memory/predicted_bytes": report["predicted"],
                     "memory/measured_bytes": report["measured_peak"]}
                )
        self.scheduler.step()
        state.step = step
        state.tokens += input_tokens
        state.history.append(loss)
        return StepResult(loss, grad_norm, input_tokens, epoch, widths)

    def _update(self, step: int, loss: float, grad_norm: float) -> None:
        """The optimizer step, or none when the loss or gradients are not finite (``train.on_nonfinite``)."""
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite and self.on_nonfinite == "stop":
            raise self.checkpoints.nonfinite_error(step, loss, grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the update itself when the scaled grads overflowed
            self.scaler.update()
            self.state.skipped_steps += int(not finite)
        elif finite:
            self.optimizer.step()
        else:  # on_nonfinite: skip. No update; the step (and its batch) still counts.
            self.state.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)

    # -- evaluation -------------------------------------------------------------------------------------------
    def evaluate(self) -> EvalResult | None:
        """Eval loss and exact match on the held-out data (None when the recipe has none)."""
        r = self.loaded.recipe
        if not self.data.eval and not self.data.eval_prompts:
            return None
        at("evaluation")
        return evaluate(
            self.model, self.data.eval, self.data.eval_prompts, self.tokenizer, self.ctx,
            batch_size=eval_batch_size(r, self.plan.chosen), max_new_tokens=r.eval.max_new_tokens, autocast=self.autocast,
        )

    # -- the whole run ----------------------------------------------------------------------------------------
    def train(self) -> RunResult:
        """Every step of the run; returns early (after a checkpoint) when SIGTERM or Ctrl-C asks to stop."""
        r, state = self.loaded.recipe, self.state
        stop = StopRequest(self.reporter.plain)
        self.model.train()
        if r.eval.at_start and state.step == 0:
            first = self.evaluate()
            if first is not None:
                self.metrics.write({"step": 0, **eval_fields(first)})
                self.reporter.eval_line(0, first)
        start_step, self.longest, self.probe = state.step, 0, None
        window_tokens, window_start = 0, time.perf_counter()
        window_widths, steady = Throughput(), Throughput()  # this log window's; steps 2.. of the run
        self.checkpoints.restore_rng()  # last thing before the first step: the resumed run draws what the first would
        with stop, self.reporter.progress(self.total, start=state.step) as advance:
            while state.step < self.total:
                step_start = time.perf_counter()
                result = self.train_step(start_step)
                if state.step - start_step > 1 or self.total - start_step == 1:  # the first step warms up
                    steady.add(result, time.perf_counter() - step_start)
                window_tokens += result.input_tokens
                window_widths.add(result, 0.0)
                row: dict[str, Any] = {"step": state.step, "loss": result.loss, "lr": self.scheduler.get_last_lr()[0]}
                if r.eval.every and state.step % r.eval.every == 0 and state.step < self.total:
                    ev = self.evaluate()
                    row.update(eval_fields(ev))
                    self.reporter.eval_line(state.step, ev)
                now = time.perf_counter()
                tokens_per_s = window_tokens / max(now - window_start, 1e-9)
                if state.step % r.output.log_every == 0 or state.step == self.total or "eval_loss" in row:
                    row.update(tokens=state.tokens, tokens_per_s=tokens_per_s, grad_norm=result.grad_norm, epoch=result.epoch)
                    utilisation = self.utilisation(tokens_per_s, window_widths.mean_width)
                    if utilisation is not None:
                        row["mfu"] = utilisation.mfu
                    window_tokens, window_start, window_widths = 0, now, Throughput()
                    self.metrics.write(row)
                advance(loss=result.loss, lr=row["lr"], tokens_per_s=tokens_per_s)
                self.hooks.after_step(state.step)
                at("save")
                if self.checkpoints.after_step(state, stop):  # saves when due; True after SIGTERM/Ctrl-C
                    self.metrics.close()
                    return self._result(None, exit_code=stop.exit_code)
        last_eval = self.evaluate()
        if last_eval is not None:
            self.metrics.write({"step": state.step, **eval_fields(last_eval)})
        self.metrics.close()
        self.save()
        result = self._result(last_eval)
        if steady.seconds > 0:
            result.tokens_per_s = steady.tokens / steady.seconds
            result.utilisation = self.utilisation(result.tokens_per_s, steady.mean_width)
        self.reporter.summary(result, self.plan.chosen, state.skipped_steps, gpu=self.ctx.device.type == "cuda")
        if r.output.push_to_hub and self.ctx.is_main:
            self.push(r.output.push_to_hub)
        return result

    def utilisation(self, tokens_per_s: float, row_width: float) -> Any:
        """The model FLOPs utilisation of ``tokens_per_s`` (all ranks) in rows ``row_width`` tokens wide, against
        the peak of this run's GPUs (``hardware.gpu_type``, else the detected one) in its matmul dtype; None on
        CPU, and on a GPU whose peak is not known."""
        if self.ctx.device.type != "cuda":
            return None
        return self._utilisation(tokens_per_s, row_width)

    def _utilisation(self, tokens_per_s: float, row_width: float) -> Any:
        from finetune.plan.flops import mfu, training_flops_per_token

        if tokens_per_s <= 0 or row_width <= 0:
            return None
        if self._flops is None:  # from the model as built; linear in the row width
            model = unwrap(self.model)
            zero = training_flops_per_token(model, seq_len=0).per_token
            self._flops = (zero, training_flops_per_token(model, seq_len=1).per_token - zero)
        zero, per_width = self._flops
        gpu_type = self.loaded.recipe.hardware.gpu_type or self.plan.hardware.get("gpu_type")
        # finetune leaves TF32 off (torch's default), so fp32 matmuls run at the fp32 peak
        return mfu(tokens_per_s, zero + per_width * row_width, gpu_type, self.spec.compute_dtype, self.ctx.world_size)

    def push(self, repo_id: str) -> None:
        """Upload output.dir's model or adapter with its model card (rank 0, after the final save)."""
        from finetune.publish import model_card, push_folder

        url = push_folder(
            self.out_dir, repo_id, key="output.push_to_hub", card=model_card(self.out_dir),
            message=f"finetune: {self.plan.chosen.method} run, {self.state.step} steps",
        )
        self.reporter.plain(f"uploaded to the Hub: {repo_id} ({url})")

    def save(self) -> None:
        """The final model or adapter and the tokenizer (every rank calls; rank 0 writes)."""
        at("save")
        save_final(
            self.model, unwrap(self.model), self.tokenizer, self.out_dir, self.ctx,
            adapters=self.spec.method.adapters, max_shard_bytes=parse_bytes(self.loaded.recipe.output.max_shard_size),
        )

    def cleanup(self) -> None:
        """Release what setup acquired beyond memory (nothing today: the worker owns the process group)."""

    def _result(self, last_eval: EvalResult | None, exit_code: int = 0) -> RunResult:
        history = self.state.history
        return RunResult(
            steps=self.state.step, final_loss=history[-1] if history else None, eval=last_eval,
            output_dir=self.out_dir, seconds=time.perf_counter() - self.started, measured_peak=self.measured_peak,
            model=unwrap(self.model), losses=list(history), exit_code=exit_code,
            checkpoint_seconds=self.checkpoints.save_seconds,
        )


@dataclass
class Throughput:
    """Tokens, seconds and row widths summed over steps (what tokens/s and MFU are computed from)."""

    tokens: int = 0
    seconds: float = 0.0
    width_tokens: int = 0  # this rank's sum of (padded row width x real tokens)
    local_tokens: int = 0

    def add(self, step: StepResult, seconds: float) -> None:
        """Count one step."""
        self.tokens += step.input_tokens
        self.seconds += seconds
        self.width_tokens += step.row_widths[0]
        self.local_tokens += step.row_widths[1]

    @property
    def mean_width(self) -> float:
        """The token-weighted mean row width (0 before any token)."""
        return self.width_tokens / self.local_tokens if self.local_tokens else 0.0


def open_trackers(loaded: LoadedRecipe, plan: Plan, ctx: DistContext, resume_step: int | None) -> Any:
    """output.trackers on rank 0 (none elsewhere), started fresh or continued at ``resume_step``."""
    import json

    from finetune.train.trackers import Trackers

    # Through JSON: the plan's enums become their plain names, as in plan.json (wandb would write their names).
    config = json.loads(json.dumps({"recipe": loaded.recipe.model_dump(mode="json"), "plan": plan.to_dict()}))
    out_dir = Path(loaded.recipe.output.dir)
    return Trackers.open(
        list(loaded.recipe.output.trackers), out_dir, config, resume_step=resume_step, enabled=ctx.is_main
    )


def train_rank(
    loaded: LoadedRecipe, plan: Plan, *, measure_memory: bool = False, ctx: DistContext | None = None,
    resume: str | None = None, debug_memory: bool = False,
) -> RunResult:
    """Run the whole training of this rank as ``plan`` says (setup, train, cleanup).

    Before anything is loaded, the preflight checks that this rank can hold the plan; running out of memory
    later raises :class:`~finetune.train.preflight.OutOfMemory` naming the phase, the step and what to run
    instead (``debug_memory``: with a CUDA allocator snapshot), never torch's traceback.
    """
    from finetune.train import preflight as pf

    ctx = ctx or DistContext.from_env()
    pf.at("load", 0)
    pf.preflight(loaded, plan, ctx)
    pf.start_debug_memory(debug_memory, ctx.device)
    trainer = Trainer(loaded, plan, ctx, measure_memory=measure_memory, resume=resume)
    try:
        trainer.setup()
        return trainer.train()
    except BaseException as err:
        if not pf.is_oom(err):
            raise
        snapshot = pf.dump_debug_memory(debug_memory, ctx.device, trainer.out_dir, ctx.rank)
        where, allocated, text = dict(pf.WHERE), pf.allocated_now(ctx.device), str(err)
        err.__traceback__ = None  # let go of the frames (and their tensors) before planning an alternative
    finally:
        trainer.cleanup()
    del trainer  # the model, optimizer and activations: the planner below needs the room
    import gc

    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    raise pf.OutOfMemory(pf.oom_message(text, loaded, plan, ctx.device, ctx.rank, snapshot, where, allocated))


def eval_batch_size(recipe: Any, chosen: Any) -> int:
    """eval.batch_size, or for auto the plan's largest batch that fits (32 for a plan made before evaluation
    was planned)."""
    b = recipe.eval.batch_size
    return int(b) if b != "auto" else (chosen.eval_batch_size or 32)
