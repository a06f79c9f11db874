"""Measuring peak memory during training, per rank, as the planner models it, to compare with its prediction.

The planner predicts a rank's tensors (parameters, gradients, optimizer state, activations, buffers) plus a
runtime overhead of two terms (``finetune.plan.memory.overhead_parts``): the caching allocator's slack and what the
device holds outside the allocator (CUDA context, cuBLAS/cuDNN workspaces, NCCL's buffers). On CUDA a rank
measures each: ``torch.cuda.max_memory_allocated`` (the tensors), ``max_memory_reserved`` (the allocator's hold at
its peak) and the device's used memory at that peak (``torch.cuda.mem_get_info``'s total - free, taken after the
block, less what the allocator reserves then, plus its peak: the allocator never returns memory by itself, so
what lies outside it is the same then as at the peak; other processes on the device count there too). On CPU (with
``--measure-memory``) a rank measures the peak of tensor memory seen by ``MemTracker``, the planner's figure
without its runtime overhead, which a CPU run does not have.

Every rank measures; :func:`memory_report` takes all ranks' :meth:`PeakMemory.figures` (gathered to rank 0) and
compares the plan with the worst rank, the one whose tensors peaked highest.

Usage (the trainer wraps its first optimizer steps; entering several times keeps the maximum)::

    peak = PeakMemory(device, modules=(model,), optimizer=opt)
    for step in ...:
        with peak if step < 2 else contextlib.nullcontext():
            ...  # forward + backward of every micro-batch, optimizer.step(), zero_grad()
    report = memory_report(device, plan.chosen.memory, [peak.figures(rank)], peak.steps)
    print(summary_line(report))   # memory: predicted X, measured Y (Z% off)
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from finetune.plan.types import MemoryBreakdown
from finetune.units import fmt_bytes

# MemTracker's categories, renamed to the planner's vocabulary.
_CATEGORY_NAMES = {
    "Parameter": "params",
    "Buffer": "buffers",
    "Gradient": "grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "Optstate": "optimizer",
    "Other": "other",
}


class PeakMemory:
    """Context manager that records the peak memory of the code it wraps (on this rank).

    ``measured_peak_bytes`` is the maximum of tensor memory over every ``with`` block; ``by_category`` is the
    breakdown at that peak (CPU: MemTracker categories; CUDA: only ``allocated_before`` and ``peak``). On CUDA,
    ``reserved_peak_bytes`` and ``device_used_peak_bytes`` are the allocator's and the device's peaks (see the
    module docstring), ``device_total_bytes`` the device's memory; None on CPU.
    """

    def __init__(
        self,
        device: str,
        modules: tuple[Any, ...] = (),
        optimizer: Any = None,
        tensors: tuple[Any, ...] = (),
    ) -> None:
        """``device``: "cuda" or "cpu"; ``modules``/``optimizer``/``tensors``: objects created before the
        block whose tensors count (needed on CPU, where MemTracker only sees what it is told about)."""
        self.device = str(device).split(":")[0]
        self.modules = tuple(m for m in modules if m is not None)
        self.optimizer = optimizer
        self.tensors = tuple(tensors)
        self.measured_peak_bytes = 0
        self.reserved_peak_bytes: int | None = None
        self.device_used_peak_bytes: int | None = None
        self.device_total_bytes: int | None = None
        self.by_category: dict[str, int] = {}
        self.steps = 0  # how many blocks were measured (1: the first step only, no optimizer state before it)
        self._tracker: Any = None
        self._hook: Any = None
        self._quiet = contextlib.ExitStack()  # torch's module tracking kept off stderr while entered

    # -- context manager ------------------------------------------------------------------------------
    def __enter__(self) -> PeakMemory:
        import torch

        self.steps += 1
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_before = torch.cuda.memory_allocated()
            return self
        tracker = mem_tracker_class()()
        tracker.track_external(*self.modules, *self.tensors)
        if self.optimizer is not None:
            tracker.track_external(self.optimizer)
        roots = {id(m) for m in self.modules}

        # MemTracker refuses a second forward of a root module inside one block (gradient accumulation):
        # forget the per-module statistics before each new micro-batch (the global peak is kept). This
        # global hook is registered before the tracker's own, so it runs first.
        def _reset_between_micro_batches(module: Any, args: Any) -> None:
            if id(module) in roots and module in tracker.memory_tracking:
                tracker.reset_mod_stats()

        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(_reset_between_micro_batches)
        self._tracker = tracker
        from finetune.plan.tracker import quiet_module_tracking

        self._quiet.enter_context(quiet_module_tracking())
        tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            peak = int(torch.cuda.max_memory_allocated())
            reserved = int(torch.cuda.max_memory_reserved())
            free, total = torch.cuda.mem_get_info()
            # outside the allocator now (context, libraries' workspaces, NCCL) + the allocator at its peak
            used = int(total - free) - int(torch.cuda.memory_reserved()) + reserved
            if peak > self.measured_peak_bytes:
                self.measured_peak_bytes = peak
                self.by_category = {"allocated_before": int(self._cuda_before), "peak": peak}
            self.reserved_peak_bytes = max(self.reserved_peak_bytes or 0, reserved)
            self.device_used_peak_bytes = max(self.device_used_peak_bytes or 0, used)
            self.device_total_bytes = int(total)
            return
        tracker = self._tracker
        tracker.__exit__(*exc)
        self._hook.remove()
        self._quiet.close()
        self._tracker = self._hook = None
        snap = tracker.get_tracker_snapshot("peak")
        for dev, cats in snap.items():
            if torch.device(dev).type != "cpu":
                continue
            total = int(cats.get("Total", 0))
            if total > self.measured_peak_bytes:
                self.measured_peak_bytes = total
                self.by_category = {
                    _CATEGORY_NAMES.get(str(getattr(k, "value", k)), str(k)): int(v)
                    for k, v in cats.items()
                    if str(getattr(k, "value", k)) != "Total"
                }

    def figures(self, rank: int = 0) -> dict[str, Any]:
        """This rank's measurement as memory.json lists it under ``ranks``: ``measured_peak`` (tensors) and its
        ``by_category``; on CUDA also ``reserved_peak``, ``device_used_peak`` and ``device_total``."""
        out: dict[str, Any] = {"rank": rank, "measured_peak": self.measured_peak_bytes,
                               "by_category": dict(self.by_category)}
        if self.device == "cuda":
            out.update(reserved_peak=self.reserved_peak_bytes, device_used_peak=self.device_used_peak_bytes,
                       device_total=self.device_total_bytes)
        return out


# -- reporting ----------------------------------------------------------------------------------------
def worst_rank(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank whose tensors peaked highest (the lowest-numbered of equals): the one the plan must hold."""
    return max(ranks, key=lambda r: (r["measured_peak"], -r["rank"]))


def memory_report(
    device: str, predicted: MemoryBreakdown, ranks: list[dict[str, Any]], steps: int,
    at_rows: MemoryBreakdown | None = None, rows: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The memory.json content: the plan's prediction beside every rank's measurement (``ranks``:
    :meth:`PeakMemory.figures` of each) and the worst rank's (:func:`worst_rank`), which the errors compare.

    ``predicted`` (tensor memory: the breakdown without its runtime overhead, which no tensor counter sees) is
    the plan's, for rows of ``data.max_seq_len`` tokens, the worst case; ``at_rows`` the same plan predicted at
    the width the measured batches had (``rows``: (planned, measured) tokens), since the trainer pads a
    micro-batch only to its longest row: ``error_at_measured_rows`` is the planner's accuracy, ``error`` how far
    the plan's bound was from this run. On CUDA, ``overhead`` compares the plan's overhead terms with the worst
    rank's reserved beyond allocated and device used beyond reserved, and ``error_with_overhead`` the plan's
    total with the device's used memory.
    """
    from finetune.plan.memory import overhead_parts

    worst = worst_rank(ranks)
    pred = predicted.total - predicted.overhead
    meas = int(worst["measured_peak"])
    at = pred if at_rows is None else at_rows.total - at_rows.overhead
    rep: dict[str, Any] = {
        "device": device,
        "predicted": pred,
        "predicted_with_overhead": predicted.total,
        "measured_peak": meas,
        "worst_rank": worst["rank"],
        "steps_measured": steps,
        "error": (pred - meas) / meas if meas else None,
        "predicted_at_measured_rows": at,
        "error_at_measured_rows": (at - meas) / meas if meas else None,
        "predicted_by_category": predicted.to_dict(),
        "by_category": dict(worst.get("by_category", {})),
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
    }
    if rows is not None:
        rep["rows"] = {"planned": rows[0], "measured": rows[1]}
    if at_rows is not None:
        rep["predicted_at_measured_rows_by_category"] = at_rows.to_dict()
    reserved, used = worst.get("reserved_peak"), worst.get("device_used_peak")
    if reserved is not None and used is not None:
        slack, outside = overhead_parts(predicted.overhead, pred)
        rep["reserved_peak"], rep["device_used_peak"] = reserved, used
        rep["error_with_overhead"] = (predicted.total - used) / used if used else None
        rep["overhead"] = {
            "predicted": predicted.overhead, "predicted_allocator_slack": slack, "predicted_outside_allocator": outside,
            "measured": used - meas, "measured_allocator_slack": reserved - meas,
            "measured_outside_allocator": used - reserved,
        }
    return rep


def _off(err: float | None) -> str:
    return f"{100 * err:+.1f}% off" if err is not None else "not measured"


def summary_line(rep: dict[str, Any]) -> str:
    """The run's plan-versus-measured line of a :func:`memory_report`: ``memory: predicted X, measured Y (Z%
    off)``, naming the worst rank when there are several; the prediction at the measured rows' width when the
    batches were narrower than planned; on CUDA the plan's overhead terms beside the measured ones."""
    n = len(rep["ranks"])
    on = f" on rank {rep['worst_rank']}, the most of {n} ranks" if n > 1 else ""
    line = (
        f"memory: predicted {fmt_bytes(rep['predicted'])}, measured {fmt_bytes(rep['measured_peak'])}{on} "
        f"({_off(rep['error'])})"
    )
    rows = rep.get("rows")
    if rows is not None and "predicted_at_measured_rows_by_category" in rep:
        line += (
            f"; planned for {rows['planned']}-token rows, these batches were at most {rows['measured']} (padding to "
            f"the longest): predicted {fmt_bytes(rep['predicted_at_measured_rows'])} at {rows['measured']} tokens "
            f"({_off(rep['error_at_measured_rows'])})"
        )
    o = rep.get("overhead")
    if o is not None:
        line += (
            f"; overhead predicted {fmt_bytes(o['predicted'])} (allocator slack "
            f"{fmt_bytes(o['predicted_allocator_slack'])} + outside the allocator "
            f"{fmt_bytes(o['predicted_outside_allocator'])}), measured {fmt_bytes(o['measured'])} (reserved beyond "
            f"allocated {fmt_bytes(o['measured_allocator_slack'])} + device beyond reserved "
            f"{fmt_bytes(o['measured_outside_allocator'])})"
        )
    return line


def write_report(path: str | Path, rep: dict[str, Any]) -> None:
    """Write a :func:`memory_report` as JSON to ``path``."""
    Path(path).write_text(json.dumps(rep, indent=2) + "\n")


#: The phases around the training steps a run measures once each (the first of each), beside the plan's
#: figures for them: the evaluation's loss pass, its generation, the first checkpoint's save, and grpo's first
#: rollout (sampling and scoring the first step's completions).
PHASES = ("evaluation", "generation", "checkpoint", "rollout")


class HostPeak:
    """Context manager sampling this process's anonymous resident memory (``RssAnon``) every 2 ms: ``peak`` is
    the highest seen inside it (None where /proc/self/status has no RssAnon, i.e. not Linux)."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._stop: Any = None

    def __enter__(self) -> HostPeak:
        import threading

        if rss_anon() is None:
            return self
        self.peak = rss_anon()
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.002):
                self.peak = max(self.peak or 0, rss_anon() or 0)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak or 0, rss_anon() or 0)


def rss_anon() -> int | None:
    """This process's anonymous resident memory in bytes (None without /proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def phase_report(
    predicted: int, ranks: list[dict[str, Any]], *, host_predicted_per_node: int | None = None,
    processes_per_node: int = 1,
) -> dict[str, Any]:
    """memory.json's entry for one phase: the plan's tensors beside the worst rank's measured peak (``ranks``:
    :meth:`PeakMemory.figures`, each with ``host_peak`` when the process's host memory was sampled); with
    ``host_predicted_per_node`` (the plan's job figure) also each node's host memory, the sum of its ranks'
    peaks (ranks numbered node by node, ``processes_per_node`` to a node), the highest node against the plan."""
    worst = worst_rank(ranks)
    meas = int(worst["measured_peak"])
    rep: dict[str, Any] = {
        "predicted": predicted, "measured_peak": meas, "worst_rank": worst["rank"],
        "error": (predicted - meas) / meas if meas else None,
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
    }
    if worst.get("device_used_peak") is not None:
        rep["device_used_peak"] = worst["device_used_peak"]
    hosts = [r.get("host_peak") for r in ranks]
    if host_predicted_per_node is not None and all(h is not None for h in hosts):
        nodes: dict[int, int] = {}
        for r in ranks:
            node = int(r["rank"]) // max(1, processes_per_node)
            nodes[node] = nodes.get(node, 0) + int(r["host_peak"])
        node, measured = max(nodes.items(), key=lambda kv: (kv[1], -kv[0]))
        rep["host"] = {
            "predicted_per_node": host_predicted_per_node, "measured_per_node": measured, "node": node,
            "error": (host_predicted_per_node - measured) / measured if measured else None,
        }
    return rep


def phase_line(name: str, rep: dict[str, Any]) -> str:
    """The console's line of a :func:`phase_report`: ``memory, evaluation: predicted X, measured Y (Z% off)``."""
    n = len(rep["ranks"])
    on = f" on rank {rep['worst_rank']}" if n > 1 else ""
    line = (
        f"memory, {name}: predicted {fmt_bytes(rep['predicted'])}, measured {fmt_bytes(rep['measured_peak'])}{on} "
        f"({_off(rep['error'])})"
    )
    host = rep.get("host")
    if host is not None:
        line += (
            f"; host memory per node predicted {fmt_bytes(host['predicted_per_node'])}, measured "
            f"{fmt_bytes(host['measured_per_node'])} ({_off(host['error'])})"
        )
    return line


_TRACKER_CLASS: Any = None


def mem_tracker_class() -> Any:
    """``MemTracker`` that also works with frozen parameters (LoRA, QLoRA).

    torch's MemTracker registers a gradient hook on every parameter it sees, which raises for parameters
    that do not require grad; this subclass tracks those as parameters without a hook.
    """
    global _TRACKER_CLASS
    if _TRACKER_CLASS is not None:
        return _TRACKER_CLASS
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> tuple[int, int]:
            def _grad_hook(grad: Any) -> None:
                self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

            param_memory = 0
            for param in module.parameters():
                winfos = self._update_and_maybe_create_winfos(param, _MemRefType.PARAM)
                param_memory += sum(w.mem_consumed for w in winfos)
                if param.grad is not None:
                    self._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD)
                if install_grad_hooks and param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(_grad_hook),
                        param.register_post_accumulate_grad_hook(lambda p: _grad_hook(p.grad)),
                    )
            buffer_memory = 0
            for buffer in module.buffers():
                winfos = self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER)
                buffer_memory += sum(w.mem_consumed for w in winfos)
            return param_memory, buffer_memory

    _TRACKER_CLASS = FrozenAwareMemTracker
    return _TRACKER_CLASS
