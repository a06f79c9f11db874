"""A run's checkpoint lifecycle, as the training loop uses it: preflight, resume, periodic and final saves,
and the resume command a user is shown.

The loop calls :meth:`RunCheckpoints.start` once the model, optimizer, scheduler and scaler exist (it loads
the checkpoint into them, or prepares a fresh start), :meth:`RunCheckpoints.restore_rng` just before the
first step, and :meth:`RunCheckpoints.after_step` after every optimizer step, which also turns SIGTERM and
Ctrl-C (recorded by :class:`finetune.train.runtime.signals.StopRequest`) into a checkpoint and a clean exit. The files
themselves are :mod:`finetune.train.checkpoint.checkpointer`'s business.

Resume sources: ``--resume`` (``latest``, ``auto`` or a path) and, under ``--max-restarts``, torchrun's restart
counter: a restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from the newest checkpoint by itself,
as does a requeued SLURM job (``SLURM_RESTART_COUNT`` > 0, :mod:`finetune.train.runtime.slurm`). ``auto`` resumes from
the newest checkpoint when there is one and starts the run otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from finetune.errors import UserError
from finetune.model.methods import training_of
from finetune.plan.types import Plan
from finetune.recipe.schema import LoadedRecipe, recipe_to_yaml
from finetune.train.checkpoint import checkpointer as ck
from finetune.train.checkpoint.early_stopping import EarlyStopping
from finetune.train.evaluate import EvalResult
from finetune.train.parallel.distributed import DistContext
from finetune.train.runtime.signals import StopRequest
from finetune.train.runtime.slurm import requeued
from finetune.train.state import TrainState, position
from finetune.units import checkpoint_bytes


def identity_for(loaded: LoadedRecipe, plan: Plan) -> dict[str, Any]:
    """What this run's checkpoints record and a resume must match."""
    c = plan.chosen
    return ck.run_identity(
        c.method, loaded.recipe.model.path, c.world_size, c.strategy, c.precision, loaded.recipe, c.tp, c.pp
    )


def build_checkpointer(
    loaded: LoadedRecipe, plan: Plan, ctx: DistContext, states: dict[str, Any], total_steps: int,
    half_written: Callable[[int], None] | None = None,
) -> ck.Checkpointer:
    """The run's checkpointer over ``states`` (see :class:`finetune.train.checkpoint.checkpointer.Checkpointer`)."""
    r = loaded.recipe
    files = ck.RunFiles(
        identity=identity_for(loaded, plan), recipe_yaml=recipe_to_yaml(r), plan=plan.to_dict(), keep=r.output.keep,
        total_steps=total_steps,
    )
    return ck.Checkpointer(Path(r.output.dir), ctx.rank, ctx.world_size, states, files, half_written)


def preflight_resume(loaded: LoadedRecipe, plan: Plan, resume: str | None, overwrite: bool = False) -> str | None:
    """Before launching: resolve ``--resume`` to a checkpoint directory and check that it fits the recipe.

    Without ``--resume``, refuse to start over an earlier run in output.dir unless ``overwrite``, which
    removes it. Returns the path (or None).
    """
    out_dir = Path(loaded.recipe.output.dir)
    if resume is not None and overwrite:
        raise UserError("--overwrite starts over and --resume continues; pass one of them")
    if overwrite:
        ck.clear_run(out_dir)
    if resume is None:
        ck.check_fresh_start(out_dir)
        return None
    if resume == AUTO:
        if ck.latest_checkpoint(out_dir) is None:
            if not requeued():  # a requeued job's first attempt may have left metrics before its first checkpoint
                ck.check_fresh_start(out_dir)
            return None
        resume = "latest"
    path = ck.resolve_resume(resume, out_dir)
    ck.check_resume_matches(path, identity_for(loaded, plan))
    ck.check_safe_to_load(path)  # a planted .metadata or trainer.pt is refused here, before anything is written
    return str(path)


#: ``--resume auto``: the newest complete checkpoint when there is one, else a fresh start.
AUTO = "auto"


def restarted_attempt() -> bool:
    """Whether this run is a later attempt of the same job: torchrun restarted its workers
    (``--max-restarts``) or SLURM requeued it."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 or requeued()


def _layout(tp: int, pp: int) -> str:
    """`` tp N`` and `` pp N`` for a tensor- or pipeline-parallel layout, nothing otherwise (the resume note)."""
    return (f" tp {tp}" if tp > 1 else "") + (f" pp {pp}" if pp > 1 else "")


def resume_command(loaded: LoadedRecipe) -> str:
    """The command that continues this run from its newest checkpoint."""
    recipe = loaded.path
    if recipe is None or not Path(recipe).is_file():
        recipe = Path(loaded.recipe.output.dir) / "recipe.yaml"  # the resolved copy every run saves
    try:
        shown = str(Path(recipe).resolve().relative_to(Path.cwd()))
    except ValueError:
        shown = str(recipe)
    sets = "".join(f" --set {shlex.quote(o)}" for o in loaded.overrides)
    return f"finetune run {shlex.quote(shown)}{sets} --resume"


@dataclass
class RunCheckpoints:
    """Saving and resuming for one rank of one run: when to save, what to resume from, what to say."""

    loaded: LoadedRecipe
    plan: Plan
    ctx: DistContext
    checkpointer: ck.Checkpointer
    inner: torch.nn.Module  # the unwrapped model (its parameter sizes make the disk check)
    total_steps: int
    say: Callable[[str], None]  # Reporter.plain
    early: EarlyStopping | None = None  # train.early_stopping (finetune/train/checkpoint/early_stopping.py)
    last_saved: Path | None = None
    last_saved_step: int = -1
    save_seconds: list[float] = field(default_factory=list)
    # a context around a save, given the phase's name (the memory probe's: finetune/train/metrics/step_memory.py)
    measure: Callable[[str], contextlib.AbstractContextManager[Any]] = lambda _: contextlib.nullcontext()
    stop_eval: EvalResult | None = None  # the evaluation that stopped the run early

    @property
    def out_dir(self) -> Path:
        """output.dir"""
        return Path(self.loaded.recipe.output.dir)

    def start(self, state: TrainState, resume: str | None) -> None:
        """Resume into ``state`` and the built objects (the checkpointer's parts), or prepare a fresh start.

        Also checks, on rank 0, that output.dir has room for the checkpoints the run will keep.
        """
        out = self.out_dir
        metrics = out / "metrics.jsonl"
        restarted = restarted_attempt()
        if (resume == AUTO or (resume is None and restarted)) and ck.latest_checkpoint(out) is not None:
            resume = "latest"
        elif resume == AUTO:
            resume = None
        if self.ctx.is_main:
            self._check_disk()
        if self.early is not None:
            self.say(self.early.describe())
        if resume is None:
            if not restarted:
                ck.check_fresh_start(out)
            if self.ctx.is_main:
                # An earlier run here was refused or removed (--overwrite) before launch; what is left is a
                # failed first attempt of this run (torchrun restarted it before any checkpoint).
                ck.clear_checkpoints(out)
                metrics.unlink(missing_ok=True)
            self.ctx.wait_barrier()  # rank 0 may be removing a large earlier run's checkpoints
            return
        path = ck.resolve_resume(resume, out)
        ck.check_resume_matches(path, identity_for(self.loaded, self.plan))
        meta = self.checkpointer.load(path)
        epoch, in_epoch = position(state.step, self.checkpointer.states["data"].stream)
        self.last_saved, self.last_saved_step = path, state.step
        if self.ctx.is_main:
            aside = ck.set_aside_newer(out, state.step, metrics)
            ck.truncate_metrics(metrics, state.step)
            note = ""
            if aside is not None:
                moved = [p.name for _, p in ck.list_checkpoints_in(aside)]
                what = f"checkpoints {', '.join(moved)} were" if len(moved) > 1 else f"checkpoint {moved[0]} was"
                note = (
                    f"; the newer {what} moved aside to {aside}, with the metrics.jsonl of that run (delete the "
                    "folder when it is no longer needed)"
                )
            saved_by = meta.get("saved_by", {}).get("world_size", self.ctx.world_size)
            saved_tp, tp = int(meta["identity"].get("tp", 1)), self.plan.chosen.tp
            saved_pp, pp = int(meta["identity"].get("pp", 1)), self.plan.chosen.pp
            was = (saved_by, meta["identity"].get("strategy"), saved_tp, saved_pp)
            if was != (self.ctx.world_size, self.plan.chosen.strategy, tp, pp):
                note += (
                    f"; resharded from {meta['identity'].get('strategy')} x{saved_by}{_layout(saved_tp, saved_pp)} "
                    f"to {self.plan.chosen.strategy} x{self.ctx.world_size}{_layout(tp, pp)}"
                )
            self.say(
                f"resumed from {path} at step {state.step} of {self.total_steps} "
                f"(epoch {epoch}, batch {in_epoch}){note}"
            )
            if self.early is not None:  # the pointer as the checkpoint's state has it (a newer best was set aside)
                self._write_best()
        self.ctx.wait_barrier()  # rank 0 may be moving newer checkpoints aside

    def _check_disk(self) -> None:
        assert self.plan.execution is not None, "a plan for a run carries its execution spec"
        full = training_of(self.plan.execution).saves_frozen()  # every weight is saved, not only the trained
        weights = trainable = 0
        moment_bytes = 4
        for p in self.inner.parameters():
            if full or p.requires_grad:
                weights += p.numel() * p.element_size()
            if p.requires_grad:
                trainable += p.numel()
                moment_bytes = p.element_size()  # AdamW's moments as the trained values are stored
        if self.plan.execution.optimizer != "adamw":  # the 8-bit optimizers' checkpoints hold fp32 moments
            moment_bytes = 4
        self.out_dir.mkdir(parents=True, exist_ok=True)
        one = checkpoint_bytes(weights, trainable, moment_bytes)
        existing = len(ck.list_checkpoints(self.out_dir))
        ck.check_free_disk(self.out_dir, one, self.loaded.recipe.output.keep, existing)

    def restore_rng(self) -> None:
        """Restore the checkpoint's RNG state of this rank (call just before the first step)."""
        self.checkpointer.states["rng"].restore()

    def save(self, state: TrainState) -> Path:
        """Checkpoint ``state`` now (every rank calls)."""
        started = time.perf_counter()
        with self.measure("checkpoint"):
            path = self.checkpointer.save(state.step)
        self.last_saved, self.last_saved_step = path, state.step
        self.save_seconds.append(time.perf_counter() - started)
        return path

    def after_step(self, state: TrainState, stop: StopRequest, ev: EvalResult | None = None) -> bool:
        """Save when due (every output.save_every steps and at the end), when a signal asks to stop, and, under
        early stopping, at an evaluation ``ev`` that improved (the best checkpoint) or that stopped the run;
        return True when a signal stops the run now (the checkpoint is saved and the resume command printed).
        :attr:`stopped_early` says when early stopping ends it after this step."""
        every = self.loaded.recipe.output.save_every
        due = (every and state.step % every == 0) or state.step >= self.total_steps
        verdict = self.early.observe(state.step, ev, self._from_rank0) if self.early and ev is not None else None
        if verdict is not None and verdict.stop:
            self.stop_eval = ev
        stopping = stop.agreed(lambda flags: self.ctx.all_reduce_sum(torch.tensor(flags)))
        keep = verdict is not None and (verdict.improved or verdict.stop)
        if (due or stopping or keep) and self.last_saved_step != state.step:
            self.save(state)
        if verdict is not None and verdict.improved and self.ctx.is_main:
            self._write_best()  # after its checkpoint is complete: the pointer never names a missing one
        if stopping:
            self.say(f"checkpoint saved: {self.last_saved} (step {state.step} of {self.total_steps})")
            requeue = " (a requeued SLURM job resumes from it by itself)" if "SLURM_JOB_ID" in os.environ else ""
            self.say(f"resume with: {resume_command(self.loaded)}{requeue}")
        return stopping

    @property
    def stopped_early(self) -> bool:
        """Whether early stopping ended the run (patience spent), now or in the checkpoint it resumed."""
        return self.early is not None and self.early.stopped

    def after_final_eval(self, state: TrainState, ev: EvalResult | None) -> None:
        """Count the run's final evaluation for early stopping (its checkpoint, the last step's, exists)."""
        if self.early is None or ev is None or self.early.stopped:
            return
        if self.early.observe(state.step, ev, self._from_rank0).improved and self.ctx.is_main:
            self._write_best()

    def restore_final_model(self, state: TrainState) -> bool:
        """Under ``final_model: best``, put the best checkpoint's weights into the model before the final save
        (every rank); then say where the run stopped and which checkpoint is the best. True when the model now
        holds another step's weights than the last (its final evaluation is then to be measured again)."""
        early = self.early
        if early is None:
            return False
        best = early.best_step
        restored = early.config.final_model == "best" and best is not None and best != state.step
        if restored:
            self.checkpointer.load_weights(ck.checkpoints_dir(self.out_dir) / f"step-{best}")
        self.say(early.summary(self.total_steps))
        if early.config.final_model == "best" and best is not None:
            self.say(f"final model: the weights of step {best}, the best evaluation's (checkpoints/{ck.BEST})")
        return restored

    def _write_best(self) -> None:
        assert self.early is not None
        step = self.early.best_step
        kept = step is not None and (ck.checkpoints_dir(self.out_dir) / f"step-{step}" / ck.META).is_file()
        ck.write_best(self.out_dir, self.early.pointer(f"{ck.CHECKPOINTS}/step-{step}") if kept else None)

    def _from_rank0(self, value: float | None) -> float | None:
        """Rank 0's ``value`` on every rank (a collective), so that every rank decides alike."""
        if not self.ctx.distributed:
            return value
        mine = [value or 0.0, 1.0 if value is not None else 0.0] if self.ctx.is_main else [0.0, 0.0]
        total, present = (float(x) for x in self.ctx.all_reduce_sum(torch.tensor(mine, dtype=torch.float64)))
        return total if present > 0 else None
