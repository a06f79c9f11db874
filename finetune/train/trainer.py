"""One rank's run, in named phases: setup -> train (train_step ..., evaluate) -> save.

Read top to bottom, this is everything ``finetune run`` does on a rank once the Plan exists:

    setup       tokenizer and data; the model as the execution spec says (built, checked against the plan's
                inventory, activation checkpointing and the strategy's wrapping); optimizer, scheduler, loss
                scaler; the checkpointer, which resumes when asked
    train       evaluate before the first step, then ``train_step`` until the last step, logging, evaluating
                and checkpointing as the recipe says
    train_step  one optimizer step over the global batch (micro-batches, gradient accumulation, clipping,
                non-finite policy), with the memory probe around the first two steps
                (:mod:`~finetune.train.metrics.step_memory`); the metrics row, tokens/s and MFU of every step come from
                :class:`~finetune.train.metrics.log.MetricsProcessor`, the evaluations from the
                :class:`~finetune.train.schedule.EvalSchedule`
    evaluate    eval loss and exact match (collective-safe: every rank runs the same forwards)
    save        the final model or adapter, and the tokenizer (rank 0 writes; every rank gathers)

The process group is the worker's (finetune.train.runtime.worker): it joins it before the trainer starts and leaves it after.

A global batch is split into ``grad_accum_steps`` micro-batches on each of ``world_size`` ranks. Every
micro-batch's summed token loss is divided by the number of target tokens in the *whole global batch*
(counted before the forward passes, and summed over ranks), then multiplied by the world size because data
parallelism averages gradients over ranks: the update is exactly the single-process update on the same
global batch, whatever the micro-batch size, accumulation or number of processes.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any

import torch

from finetune.model import router
from finetune.model.kernels import experts_kernel_of
from finetune.objectives.loss import causal_lm_loss, count_target_tokens, document_ids, target_rows
from finetune.plan.types import Plan
from finetune.recipe.schema import LoadedRecipe
from finetune.train.checkpoint.checkpointer import ModelState, OptimizerState, RNGState
from finetune.train.checkpoint.early_stopping import early_stopping_for
from finetune.train.checkpoint.resume import RunCheckpoints, build_checkpointer, resume_command
from finetune.train.checkpoint.save import save_final
from finetune.train.data import BatchStream, TaskData
from finetune.train.data.batches import to_device
from finetune.train.data.preference import PreferenceStream
from finetune.train.data.retain import RetainData, load_retain
from finetune.train.data.stream import StreamingBatches
from finetune.train.data.task import load_task_data
from finetune.train.determinism import seed_everything
from finetune.train.evaluate import EvalResult, evaluate
from finetune.train.gradients import MicroBatchLoss, accumulate, clip_grad_norm, pipeline_step
from finetune.train.hooks import TrainerHooks, load_hooks
from finetune.train.metrics.console import Reporter
from finetune.train.metrics.log import MetricsProcessor, MetricsWriter, first_retain
from finetune.train.metrics.step_memory import StepMemory
from finetune.train.metrics.throughput import MfuMeter, row_widths
from finetune.train.model.build import (
    broadcast_decomposed,
    build_model,
    check_model_storage,
    count_parameters,
    load_tokenizer,
)
from finetune.train.model.load import build_on_meta, loads_sharded, materialize
from finetune.train.model.reference import preference_figures, setup_objective
from finetune.train.nonfinite import nonfinite_limit, nonfinite_policy, nonfinite_stop
from finetune.train.optimizer import build_optimizer
from finetune.train.parallel.distributed import DistContext
from finetune.train.parallel.parallelize import parallelize, unwrap
from finetune.train.parallel.pipeline import Pipeline, StagedForward, build_pipeline
from finetune.train.precision import autocast_factory, grad_scaler
from finetune.train.rollout import GrpoRun, setup_grpo
from finetune.train.runtime import allocator
from finetune.train.runtime.preflight import RunPhase
from finetune.train.runtime.signals import StopRequest
from finetune.train.schedule import EvalSchedule, lr_scheduler, total_steps
from finetune.train.state import DataPosition, RunResult, StepResult, TrainState, position
from finetune.units import parse_bytes


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
        # this process on the plan's parallel layout: its coordinates and the run's one device mesh
        self.ctx = (ctx or DistContext.from_env()).laid_out(self.spec)
        self.pipeline: Pipeline | None = None  # distributed.pp: this rank's stage model and its schedule
        self.stages: StagedForward | None = None  # ... and its stages' forward, for evaluation
        self.measure_memory, self.resume = measure_memory, resume
        self.hooks = hooks or load_hooks()
        self.out_dir = Path(loaded.recipe.output.dir)
        self.reporter = Reporter(self.ctx.is_main)
        self.state = TrainState()
        self.phase = RunPhase()  # where the run is, for the out-of-memory message
        self.started = time.perf_counter()
        self.saved_files: list[str] = []  # what the final save wrote (rank 0)

    # -- setup ------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Data, model, optimizer and checkpointer; resumes when asked."""
        r, ctx, chosen = self.loaded.recipe, self.ctx, self.plan.chosen
        seed_everything(r.train.seed)
        self.tokenizer = load_tokenizer(self.loaded)
        self.data: TaskData = load_task_data(self.loaded, self.tokenizer, self.hooks.before_tokenizing)
        self.retain: RetainData | None = load_retain(self.loaded, self.tokenizer)  # eval.retain
        if self.retain is not None:
            self.data.notes.append(self.retain.describe())
        self.early_stopping = early_stopping_for(r, self.data, self.retain)  # before the model: a wrong metric fails fast
        self.scaler = grad_scaler(self.spec, ctx.device)
        self.micro_loss = MicroBatchLoss(self.scaler)  # how each micro-batch's loss enters backward (a pipeline's loss_fn)
        self.model = self._setup_model()
        # a mixture of experts: its load-balancing loss in the loss, its routing counted (finetune/model/router.py)
        self.router = router.enable(self.model, self.spec.aux_loss_coef)
        self.optimizer = build_optimizer(
            self.model, r.train, self.spec.strategy, tensor_parallel=self.spec.tensor_parallel or self.spec.expert_parallel,
            name=self.spec.optimizer,
        )
        self.autocast = autocast_factory(self.spec, ctx.device)
        self.grpo: GrpoRun | None = None  # grpo: its prompts, rollouts, rewards and reference (finetune/train/rollout.py)
        self.stream: BatchStream | StreamingBatches
        if self.spec.grpo:
            self.grpo = setup_grpo(self.loaded, self.spec, self.model, self.data, self.tokenizer, ctx, self.autocast)
            self.stream = self.grpo.stream
            self.objective: Any = self.grpo.objective
            self.reference = self.grpo.reference
        else:
            stream = PreferenceStream if self.spec.preference else BatchStream  # pairs: chosen and rejected rows
            if self.data.stream is not None:  # data.streaming: read while training (train.max_steps is required)
                assert r.train.max_steps is not None, "the capability table requires train.max_steps with data.streaming"
                self.stream = StreamingBatches(
                    self.data.stream, r.train.global_batch_size, r.train.seed, self.tokenizer.pad_token_id,
                    r.train.max_steps,
                )
            else:
                self.stream = stream(self.data.train, r.train.global_batch_size, r.train.seed, self.tokenizer.pad_token_id)
            # dpo, simpo, orpo (None: sft); dpo's reference (finetune/train/model/reference.py), before any resume
            self.objective, self.reference = setup_objective(
                self.loaded, self.spec, self.model, self.data, ctx, self.autocast, self.tokenizer.pad_token_id,
                eval_batch_size(r, chosen),
            )
        self.total = total_steps(self.loaded, self.stream)
        self.scheduler = lr_scheduler(self.optimizer, r.train, self.total)
        self.step_figures: dict[str, float] = {}
        self.params: list[torch.Tensor] = [p for p in self.model.parameters() if p.requires_grad]
        self.reporter.start(
            self.plan, self.trainable, self.total_params, self.total, self.data.stats, ctx.world_size,
            getattr(self.data, "notes", []), experts_kernel_of(unwrap(self.model)),
        )
        if ctx.device.type == "cuda":
            self.reporter.print(allocator.describe())
        states = {
            "model": ModelState(self.model, adapters_only=self.spec.method.adapters),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "rng": RNGState(ctx.rank, ctx.world_size),
            "train": self.state,
            "data": DataPosition(self.stream, self.state),
            "early_stopping": self.early_stopping,
        }
        self.checkpointer = build_checkpointer(
            self.loaded, self.plan, ctx, states, self.total, self.hooks.checkpoint_half_written
        )
        self.checkpoints = RunCheckpoints(
            self.loaded, self.plan, ctx, self.checkpointer, unwrap(self.model), self.total, self.reporter.plain,
            early=self.early_stopping,
        )
        self.checkpoints.start(self.state, self.resume)
        self._setup_step_reporting()
        self.on_nonfinite = nonfinite_policy(self.loaded, chosen.precision)

    def _setup_step_reporting(self) -> None:
        """What each step reports from the step the run (re)starts at: the metrics (rows, tokens/s, MFU, the
        trackers), the first steps' memory and the evaluation schedule."""
        r, ctx, start = self.loaded.recipe, self.ctx, self.state.step
        resumed_at = start if self.checkpoints.last_saved is not None else None
        writer = MetricsWriter(
            self.out_dir / "metrics.jsonl", ctx.is_main, open_trackers(self.loaded, self.plan, ctx, resumed_at)
        )
        inner = unwrap(self.model)
        mfu = MfuMeter(
            inner, r.hardware.gpu_type or self.plan.hardware.get("gpu_type"), self.spec.compute_dtype,
            ctx.world_size, ctx.device.type,
            whole=(inner.config, self.spec.adapter) if self.spec.pipeline else None,
        )
        self.metrics = MetricsProcessor(writer, mfu, log_every=r.output.log_every, total_steps=self.total, start_step=start)
        self.step_memory = StepMemory(
            self.measure_memory, self.loaded, self.plan, ctx, self.out_dir, start_step=start, total_steps=self.total,
            say=self.reporter.print, track=self.metrics.track,
        )
        self.step_memory.modules = (self.reference,) if self.reference is not None else ()
        self.step_memory.model, self.step_memory.optimizer = self.model, self.optimizer
        self.checkpoints.measure = self.step_memory.phase  # the first checkpoint's save
        self.eval_schedule = EvalSchedule.of(r.eval, self.total)

    def _setup_model(self) -> torch.nn.Module:
        """Build the model the execution spec describes, check it against the plan, then wrap it."""
        r, spec, ctx = self.loaded.recipe, self.spec, self.ctx
        keep_base = ctx.is_main and spec.method.adapters and r.model.init == "random"
        base_dir = self.out_dir / "base" if keep_base else None
        text = spec.adapter.prefix_init_text if spec.adapter is not None else None
        prompt_text = spec.adapter.prompt_init_text if spec.adapter is not None else None
        if spec.pipeline:  # built on meta, cut into this rank's stages, wrapped, then its tensors loaded
            self.pipeline, self.stages, (self.trainable, self.total_params) = build_pipeline(
                self.loaded, spec, ctx, n_microbatches=self.plan.chosen.grad_accum_steps,
                autocast=lambda: self.autocast(), loss_fn=self.micro_loss, pad_id=self.tokenizer.pad_token_id,
                base_dir=base_dir,
            )
            check_model_storage(self.pipeline.model, spec, None)  # a stage's bytes are not the plan's inventory
            return self.pipeline.model
        if not loads_sharded(spec, ctx.world_size, experts=bool(self.plan.model.get("experts"))):
            model = build_model(self.loaded, spec, ctx.device, base_dir=base_dir)
            broadcast_decomposed(model)
            # prefix.init: text: the base's own keys/values of the text, before any wrapper (every rank alike)
            if text is not None:
                from finetune.model.adapters import init_prefix_from_text, prefix_text_ids

                assert spec.adapter is not None  # the text is the adapter's
                ids = prefix_text_ids(text, self.tokenizer, spec.adapter.num_virtual_tokens)
                init_prefix_from_text(model, ids)
            if prompt_text is not None:  # prompt.init: text: the base's own embeddings of the text's tokens
                from finetune.model.adapters import init_prompt_from_text, prefix_text_ids

                assert spec.adapter is not None
                ids = prefix_text_ids(prompt_text, self.tokenizer, spec.adapter.num_virtual_tokens, "prompt")
                init_prompt_from_text(model, ids)
            check_model_storage(model, spec, self.plan.model.get("param_bytes_by_dtype"))
            self.trainable, self.total_params = count_parameters(model)
            return parallelize(model, spec, ctx)
        # Sharded: built on meta, wrapped, then each rank materialises only its shards (finetune/train/model/load.py).
        # (prefix.init: text is refused there by the capability table when the plan is made.)
        assert text is None and prompt_text is None, "init: text on a sharded load is refused by the capability table"
        model = build_on_meta(self.loaded, spec, ctx.device)
        check_model_storage(model, spec, self.plan.model.get("param_bytes_by_dtype"))
        self.trainable, self.total_params = count_parameters(model)
        model = parallelize(model, spec, ctx)
        materialize(model, self.loaded, spec, ctx.device, base_dir)
        return model

    def _count(self, mb: dict[str, Any]) -> int:
        """What the loss of a micro-batch is normalised by over the global batch: its target tokens (sft), its
        pairs (dpo, simpo, orpo) or its completions or completion tokens (grpo), counted on the host copy."""
        if self.grpo is not None:
            return int(mb["count"])
        return int(mb["pairs"]) if self.objective is not None else count_target_tokens(mb)

    # -- one optimizer step -----------------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        """Forward and backward every micro-batch of this rank's share of the global batch, then update."""
        ctx, state, chosen = self.ctx, self.state, self.plan.chosen
        step = state.step + 1
        self.phase.at("forward", step)
        self.hooks.before_step(step, ctx.rank)
        epoch, in_epoch = position(state.step, self.stream)
        layout = ctx.layout  # the ranks of a TP group and of a pipeline read the same batch slice
        rollout, rollout_seconds = None, 0.0
        if self.grpo is not None:  # this rank's sampled completions, scored (a new batch every num_iterations steps)
            self.phase.at("rollout", step)
            started = time.perf_counter()
            with self.step_memory.phase("rollout"):
                rollout = self.grpo.rollouts.for_step(self.model, epoch, in_epoch, chosen.micro_batch_size)
            rollout_seconds = time.perf_counter() - started  # 0 on the steps that reuse the batch's completions
            micro = rollout.micro
            self.phase.at("forward", step)
        else:
            micro = self.stream.micro_batches(
                epoch, in_epoch, rank=layout.dp_rank, world_size=layout.dp, micro_batch_size=chosen.micro_batch_size
            )
        widths = row_widths(micro)  # for MFU
        # Counted on the host copies (no padding; the loss's normaliser), summed over replicas on the device:
        # the step reads its figures once, after the backward passes (host_figures below).
        counts = ctx.data_sum(
            torch.tensor([sum(int(mb["num_tokens"]) for mb in micro), sum(self._count(mb) for mb in micro)]),
            on_device=True,
        )
        if self.pipeline is not None:  # one width for the stages' static shapes (the schedule moves them)
            micro = self.pipeline.pad(micro)
        else:  # sequence parallelism: the fused head sees this TP rank's positions, so its target rows are theirs
            shard = (layout.tp_rank, layout.tp) if self.spec.sequence_parallel else None
            micro = [_to_device(mb, ctx.device, shard) for mb in micro]
        max_norm = self.loaded.recipe.train.max_grad_norm
        with self.step_memory.measuring(state.step, micro, self.model, self.optimizer):
            if self.pipeline is not None:  # the schedule runs the micro-batches through the stages
                loss_sum = pipeline_step(self.pipeline, micro, counts[1], ctx, self.micro_loss)
            else:
                loss_sum = accumulate(
                    self.model, micro, counts[1], ctx, self.autocast, self.scaler, self.phase,
                    self.objective or causal_lm_loss, sync_every_micro_batch=self.spec.sync_every_micro_batch,
                )
            loss_sum = self.hooks.after_backward(step, self.params, loss_sum)
            self.phase.at("optimizer")
            norm = clip_grad_norm(self.params, self.optimizer, self.scaler, max_norm, layout)  # every stage's
            loss_total, grad_norm, tokens, global_tokens = host_figures(
                ctx.data_sum(loss_sum, on_device=True), norm, counts[0], counts[1]
            )
            input_tokens = int(tokens)
            figures: dict[str, float] = {}  # the step's columns beside the loss, from each part that has some
            if self.router is not None:  # the load-balancing loss apart from the cross-entropy, and the load
                figures.update(router_figures(self.router, ctx, global_tokens))
                loss_total -= self.router.coef * figures.get("aux_loss", 0.0) * global_tokens
            loss = loss_total / max(global_tokens, 1.0)
            if self.grpo is not None and rollout is not None:  # rewards, kl, clip ratio, completion length
                figures.update(self.grpo.figures(rollout))
                figures["rollout_seconds"] = rollout_seconds
            elif self.objective is not None:  # dpo, simpo, orpo: rewards and log-probs, means over the pairs
                figures.update(preference_figures(self.objective, ctx, global_tokens))
            if self.data.mixture:  # a mixture's samples in this global batch, by source
                figures.update(self.stream.source_counts(epoch, in_epoch, self.data.mixture))
            self.step_figures = figures
            self._update(step, loss, grad_norm)
        self.step_memory.after(state.step)
        self.scheduler.step()
        state.step = step
        state.tokens += input_tokens
        state.history.append(loss)
        return StepResult(loss, grad_norm, input_tokens, epoch, widths)

    def _update(self, step: int, loss: float, grad_norm: float) -> None:
        """The optimizer step, or none when the loss or gradients are not finite (``train.on_nonfinite``)."""
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite and self.on_nonfinite == "stop":
            raise nonfinite_stop(step, loss, grad_norm, self.checkpoints.last_saved, resume_command(self.loaded))
        self.state.skipped_in_a_row = 0 if finite else self.state.skipped_in_a_row + 1
        limit = self.loaded.recipe.train.max_consecutive_skips
        if self.state.skipped_in_a_row >= limit:  # every rank saw the same figures: every rank stops here
            raise nonfinite_limit(step, self.state.skipped_in_a_row, loss, grad_norm, self.checkpoints.last_saved)
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
    def evaluate(self, task: bool = True) -> EvalResult | None:
        """Eval loss and exact match on the held-out data and on the retain set (``eval.retain``); None when the
        recipe has neither. ``task=False``: the retain set only."""
        r = self.loaded.recipe
        task = task and bool(self.data.eval or self.data.eval_prompts)
        if not task and self.retain is None:
            return None
        self.phase.at("evaluation")
        return evaluate(
            self.model, self.data.eval, self.data.eval_prompts, self.tokenizer, self.ctx,
            batch_size=eval_batch_size(r, self.plan.chosen), max_new_tokens=r.eval.max_new_tokens, autocast=self.autocast,
            retain=self.retain, task=task, objective=None if self.grpo is not None else self.objective,
            stages=self.stages, measure=self.step_memory.phase,
            rewards=self.grpo.rewards if self.grpo is not None else None,
        )

    def _evaluate_at_start(self) -> EvalResult | None:
        """The evaluation before the first step (``eval.at_start``); the retain set is measured there whatever
        ``eval.at_start`` says, since forgetting is its change from the start. A resumed run reads the figures
        measured before training from metrics.jsonl."""
        state = self.state
        if self.eval_schedule.before_training(state.step) or (self.retain is not None and state.step == 0):
            ev = self._evaluate_and_show(0, task=self.eval_schedule.before_training(state.step))
            self.metrics.log_eval(0, ev)
            return ev
        return first_retain(self.out_dir / "metrics.jsonl") if self.retain is not None else None

    # -- the whole run ----------------------------------------------------------------------------------------
    def train(self) -> RunResult:
        """Every step of the run; returns early (after a checkpoint) when SIGTERM or Ctrl-C asks to stop."""
        state, stop = self.state, StopRequest(self.reporter.plain)
        self.model.train()
        at_start = self._evaluate_at_start()
        self.metrics.start()
        self.checkpoints.restore_rng()  # last thing before the first step: the resumed run draws what the first would
        with stop, self.reporter.progress(self.total, start=state.step) as advance:
            while state.step < self.total and not self.checkpoints.stopped_early:
                started = time.perf_counter()
                self.step_memory.pop_report_seconds()  # reports of the phases between steps are not this step's
                result = self.train_step()
                seconds = time.perf_counter() - started - self.step_memory.pop_report_seconds()  # training time only
                ev = self._evaluate_and_show(state.step) if self.eval_schedule.due(state.step) else None
                lr = float(self.scheduler.get_last_lr()[0])  # a float: the recipe's LR is one
                tokens_per_s = self.metrics.log_step(
                    state.step, result, seconds, lr=lr, tokens=state.tokens, ev=ev, extra=self.step_figures
                )
                advance(loss=result.loss, lr=lr, tokens_per_s=tokens_per_s)
                self.hooks.after_step(state.step)
                self.phase.at("save")
                # saves when due, and early stopping's best; True after SIGTERM/Ctrl-C/SIGUSR1
                if self.checkpoints.after_step(state, stop, ev):
                    self.metrics.close()
                    return self._result(None, exit_code=stop.exit_code)
        if self.checkpoints.stopped_early:  # the evaluation that stopped the run is its last
            last_eval = self.checkpoints.stop_eval
        else:
            last_eval = self.evaluate()
            self.metrics.log_eval(state.step, last_eval)
            self.checkpoints.after_final_eval(state, last_eval)
        self.metrics.close()
        if self.checkpoints.restore_final_model(state):  # train.early_stopping.final_model: best
            last_eval = self.evaluate()  # the saved model's figures
        self.save()
        run = self._result(last_eval)
        run.tokens_per_s, run.utilisation = self.metrics.steady()
        self.reporter.summary(
            run, self.plan.chosen, state.skipped_steps, gpu=self.ctx.device.type == "cuda", retain_before=at_start
        )
        if self.loaded.recipe.output.push_to_hub and self.ctx.is_main:
            self.push(self.loaded.recipe.output.push_to_hub)
        return run

    def _evaluate_and_show(self, step: int, task: bool = True) -> EvalResult | None:
        """:meth:`evaluate`, with its line on the console (step 0: before training)."""
        ev = self.evaluate(task)
        self.reporter.eval_line(step, ev)
        return ev

    def push(self, repo_id: str) -> None:
        """Upload the files this run wrote (the final model or adapter, the tokenizer, the run files) with a model
        card (rank 0, after the final save); nothing else in output.dir."""
        from finetune.storage.publish import RUN_RECORDS, model_card, push_folder

        files = [*self.saved_files, *(f for f in RUN_RECORDS if (self.out_dir / f).is_file())]
        url = push_folder(
            self.out_dir, repo_id, key="output.push_to_hub", card=model_card(self.out_dir), files=files,
            message=f"finetune: {self.plan.chosen.method} run, {self.state.step} steps",
            private=self.loaded.recipe.output.push_private,
        )
        self.reporter.plain(f"uploaded to the Hub: {repo_id} ({url})")

    def save(self) -> None:
        """The final model or adapter and the tokenizer (every rank calls; rank 0 writes and records the names
        in ``saved_files``, which an upload sends)."""
        self.phase.at("save")
        self.saved_files = save_final(
            self.model, unwrap(self.model), self.tokenizer, self.out_dir, self.ctx,
            adapters=self.spec.method.adapters, max_shard_bytes=parse_bytes(self.loaded.recipe.output.max_shard_size),
        )

    def _result(self, last_eval: EvalResult | None, exit_code: int = 0) -> RunResult:
        history = self.state.history
        return RunResult(
            steps=self.state.step, final_loss=history[-1] if history else None, eval=last_eval,
            output_dir=self.out_dir, seconds=time.perf_counter() - self.started,
            measured_peak=self.step_memory.measured_peak,
            model=unwrap(self.model), losses=list(history), exit_code=exit_code,
            checkpoint_seconds=self.checkpoints.save_seconds,
        )


def open_trackers(loaded: LoadedRecipe, plan: Plan, ctx: DistContext, resume_step: int | None) -> Any:
    """output.trackers on rank 0 (none elsewhere), started fresh or continued at ``resume_step``."""
    import json

    from finetune.train.metrics.trackers import Trackers

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
    """Run the whole training of this rank as ``plan`` says (setup, then train, which saves).

    Before anything is loaded, the preflight checks that this rank can hold the plan; running out of memory
    later raises :class:`~finetune.train.runtime.preflight.OutOfMemory` naming the phase, the step and what to run
    instead (``debug_memory``: with a CUDA allocator snapshot), never torch's traceback.
    """
    from finetune.train.runtime import preflight as pf

    ctx = ctx or DistContext.from_env()
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
        where, allocated, text = copy.copy(trainer.phase), pf.allocated_now(ctx.device), str(err)
        err.__traceback__ = None  # let go of the frames (and their tensors) before planning an alternative
    del trainer  # the model, optimizer and activations: the planner below needs the room
    import gc

    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    raise pf.OutOfMemory(pf.oom_message(text, loaded, plan, ctx.device, ctx.rank, snapshot, where, allocated))


def _to_device(
    mb: dict[str, torch.Tensor], device: torch.device, shard: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """A micro-batch on the device, with the fused head's target rows (:func:`~finetune.objectives.loss.target_rows`, of
    this rank's positions under sequence parallelism: ``shard``) found on its host copy first, and without its
    attention mask.

    Training rows are right-padded (:func:`~finetune.train.data.batches.collate`): under causal attention a
    real position attends only to the real positions before it whether or not the padding is masked, and the
    padded positions carry no target, so the loss and every gradient are the same without the mask. Given a
    mask, transformers reads its values on the host to decide whether it may skip it (a device sync in every
    forward) and otherwise builds a (B, 1, T, T) mask; without one it takes the causal kernel directly.
    """
    moved = {k: to_device(v, device) for k, v in mb.items() if k != "attention_mask"}
    rows = target_rows(mb, shard)
    if rows is not None:
        moved["target_rows"] = to_device(rows, device)
    if mb.get("position_ids") is not None:  # packed rows: their documents, for transformers' mask code
        docs = document_ids(mb["position_ids"])  # (an empty tensor: one document per row)
        moved["document_ids"] = to_device(docs if docs is not None else torch.empty(0, dtype=torch.long), device)
    return moved


def router_figures(state: router.RouterState, ctx: DistContext, global_tokens: float) -> dict[str, float]:
    """A mixture of experts' step figures over every data-parallel rank: ``aux_loss`` (the load-balancing loss,
    the target-token-weighted mean of the micro-batches', without its coefficient; when the model adds it) and
    ``expert_load`` (the busiest expert's routed tokens over the mean expert's, at the most uneven layer)."""
    aux_sum, counts = state.take()
    out: dict[str, float] = {}
    if counts is not None:
        summed = ctx.data_sum(counts, on_device=True)
        out["expert_load"] = router.load_imbalance(summed.float())
    if aux_sum is not None:
        out["aux_loss"] = float(ctx.data_sum(aux_sum.reshape(1), on_device=True).reshape(())) / max(global_tokens, 1.0)
    return out


def host_figures(*values: torch.Tensor) -> list[float]:
    """The step's device figures (summed loss, gradient norm, token counts) read on the host together: the
    step's one device-to-host sync."""
    return torch.stack([v.detach().reshape(()).to(device=values[0].device, dtype=torch.float64) for v in values]).tolist()


def eval_batch_size(recipe: Any, chosen: Any) -> int:
    """eval.batch_size, or for auto the plan's largest batch that fits (32 for a plan made before evaluation
    was planned)."""
    b = recipe.eval.batch_size
    return int(b) if b != "auto" else (chosen.eval_batch_size or 32)
