"""The memory of a run's first optimizer steps and of the phases around them: measured on every rank,
gathered to rank 0, written to memory.json and printed beside the plan's prediction.

On CUDA always, on CPU with ``--measure-memory``: a :class:`~finetune.train.metrics.memory.PeakMemory` probe wraps the
first two steps a run (or a resumed run) takes on every rank. After two steps the measurement includes AdamW's
state, so it compares with the plan's steady state; a one-step run compares with the planner's first-step figure
(no optimizer state yet). Each rank's figures (tensors; on CUDA also the allocator's reserve and the device's used
memory) go to rank 0, which compares the plan with the worst rank's.

The first of each phase in :data:`~finetune.train.metrics.memory.PHASES` is measured the same way (:meth:`StepMemory.phase`):
the evaluation's loss pass and its generation beside the plan's evaluation at its batch, the first checkpoint's
save beside the states the plan counts and, sampled per process, the plan's host memory per node for a save.
memory.json keeps them under ``phases`` (written with the steps' report, and again after each later phase).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from finetune.plan.types import Plan
from finetune.recipe.schema import LoadedRecipe
from finetune.train.metrics.memory import (
    HostPeak,
    PeakMemory,
    memory_report,
    phase_line,
    phase_report,
    summary_line,
    worst_rank,
    write_report,
)
from finetune.train.parallel.distributed import DistContext

#: The steps measured: the 2nd is the steady state (AdamW's state exists by then).
MEASURED_STEPS = 2


class StepMemory:
    """The peak-memory probe around a run's first steps and its report.

    ``start_step`` is the step the run (re)starts from, ``total_steps`` its last; ``say`` prints the summary
    line (rank 0), ``track`` sends the prediction and the measurement to the trackers.
    """

    def __init__(
        self, enabled: bool, loaded: LoadedRecipe, plan: Plan, ctx: DistContext, out_dir: Path, *,
        start_step: int, total_steps: int, say: Callable[[str], None], track: Callable[[dict[str, Any]], None],
    ) -> None:
        self.enabled = enabled or ctx.device.type == "cuda"
        self.loaded, self.plan, self.ctx, self.out_dir = loaded, plan, ctx, out_dir
        self.start_step, self.total_steps = start_step, total_steps
        self.say, self.track = say, track
        self.probe: PeakMemory | None = None
        self.longest = 0  # the widest micro-batch measured (tokens)
        self.measured_peak: int | None = None
        self.modules: tuple[torch.nn.Module, ...] = ()  # measured beside the model: dpo's frozen reference copy
        self.model: torch.nn.Module | None = None  # what the phases' probes track (the trainer sets them)
        self.optimizer: Any = None
        self.phases: dict[str, dict[str, Any]] = {}  # memory.json's ``phases``: each measured phase's report
        self._steps_report: dict[str, Any] | None = None  # memory.json's steps part, once written
        self._predicted_phases: dict[str, int] | None = None
        self._report_seconds = 0.0  # spent in after() gathering and reporting: not training time

    def measuring(
        self, done: int, micro: list[dict[str, torch.Tensor]], model: torch.nn.Module, optimizer: Any
    ) -> contextlib.AbstractContextManager[Any]:
        """The probe around the optimizer step after ``done`` steps when it is one of the run's first two
        (``micro``: its micro-batches), else a no-op."""
        if done - self.start_step >= MEASURED_STEPS:
            return contextlib.nullcontext()
        self.longest = max(self.longest, max(mb["input_ids"].shape[1] for mb in micro))
        if not self.enabled:
            return contextlib.nullcontext()
        if self.probe is None:
            self.probe = PeakMemory(self.ctx.device.type, modules=(model, *self.modules), optimizer=optimizer)
        return self.probe

    def after(self, done: int) -> None:
        """After the optimizer step that followed ``done`` steps: when it is the last one measured (or the run's
        last), gather every rank's figures and keep the worst rank's peak; rank 0 writes memory.json, prints the
        summary line and sends the prediction and the worst rank's figures to the trackers."""
        step = done + 1
        if self.probe is None or done - self.start_step >= MEASURED_STEPS:
            return
        if done - self.start_step != MEASURED_STEPS - 1 and step != self.total_steps:
            return
        started = time.perf_counter()
        ranks = self.gather(self.probe.figures(self.ctx.rank))
        self.measured_peak = int(worst_rank(ranks)["measured_peak"])
        report = self.report(self.probe, ranks)
        if report is not None:  # the trackers get the plan's prediction and the worst rank's measurement once
            row = {"step": step, "memory/predicted_bytes": report["predicted"],
                   "memory/measured_bytes": report["measured_peak"]}
            if "device_used_peak" in report:
                row.update({"memory/reserved_bytes": report["reserved_peak"],
                            "memory/device_used_bytes": report["device_used_peak"]})
            self.track(row)
        self._report_seconds += time.perf_counter() - started

    def pop_report_seconds(self) -> float:
        """Seconds :meth:`after` and :meth:`phase` spent since the last call gathering, planning at the measured
        width and writing (no training): the trainer pops them before a step (those of the evaluation or save
        between steps are no step's) and after it, and takes the second out of the step's time, so that tokens/s
        and MFU cover training alone."""
        seconds, self._report_seconds = self._report_seconds, 0.0
        return seconds

    def gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's figures, on every rank (a collective when the run is distributed; they travel as JSON,
        never unpickled)."""
        if not self.ctx.distributed:
            return [mine]
        from finetune.train.parallel.distributed import all_gather_json

        return [r for r in all_gather_json(mine) if r is not None]

    def report(self, probe: PeakMemory, ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Write memory.json and print the plan's prediction beside the worst rank's measurement (rank 0);
        return its content (None on other ranks)."""
        if not self.ctx.is_main:
            return None
        from finetune.plan.flowchart import chosen_memory

        loaded, plan, device = self.loaded, self.plan, self.ctx.device.type
        first_step = probe.steps < 2
        predicted = plan.chosen.memory
        if first_step:
            predicted = chosen_memory(loaded, plan, device=device, first_step=True)
        planned = loaded.recipe.data.max_seq_len
        at_rows, rows = None, None
        if 0 < self.longest < planned:
            # the plan is for full rows; these batches were narrower: predict them too, like for like
            at_rows = chosen_memory(loaded, plan, device=device, first_step=first_step, seq_len=self.longest)
            rows = (planned, self.longest)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        report = memory_report(probe.device, predicted, ranks, probe.steps, at_rows, rows)
        self._steps_report = report
        self._write()
        self.say(summary_line(report))
        return report

    # -- the phases around the steps ----------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Any:
        """Measure the code inside when it is the run's first ``name`` phase (evaluation, generation, checkpoint)
        and the probe is on; every rank enters (the figures are gathered after it). Rank 0 reports it beside the
        plan's figure: a line on the console, an entry of memory.json's ``phases``."""
        if not self.enabled or name in self.phases:
            yield
            return
        self.phases[name] = {}  # measured once, even when the block fails
        probe = PeakMemory(self.ctx.device.type, modules=(self.model, *self.modules), optimizer=self.optimizer)
        host = HostPeak() if name == "checkpoint" else contextlib.nullcontext()
        with probe, host:
            yield
        started = time.perf_counter()
        mine = probe.figures(self.ctx.rank)
        if isinstance(host, HostPeak):
            mine["host_peak"] = host.peak
        ranks = self.gather(mine)
        if self.ctx.is_main:
            self.phases[name] = self.phase_report(name, ranks)
            self._write()
            self.say(phase_line(name, self.phases[name]))
        self._report_seconds += time.perf_counter() - started

    def phase_report(self, name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        """memory.json's entry for phase ``name`` (rank 0): the plan's figures for it beside ``ranks``'."""
        import os

        from finetune.plan.flowchart import chosen_phase_memory

        if self._predicted_phases is None:
            self._predicted_phases = chosen_phase_memory(self.loaded, self.plan, device=self.ctx.device.type)
        job = self.plan.job or {}
        host = job.get("host_checkpoint_per_node") if name == "checkpoint" else None
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.ctx.world_size))
        return phase_report(self._predicted_phases.get(name, 0), ranks, host_predicted_per_node=host,
                            processes_per_node=per_node)

    def _write(self) -> None:
        """memory.json: the steps' report with the phases measured so far (nothing before the steps' report)."""
        if self._steps_report is None:
            return
        report = dict(self._steps_report)
        done = {k: v for k, v in self.phases.items() if v}
        if done:
            report["phases"] = done
        write_report(self.out_dir / "memory.json", report)
