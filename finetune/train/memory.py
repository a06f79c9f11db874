"""Measuring peak memory during training, to compare with the planner's prediction.

On CUDA the peak is ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. On CPU (with
``--measure-memory``) it is the peak of tensor memory seen by ``MemTracker`` (parameters, buffers, gradients,
optimizer state, activations, temporaries), which is what the planner predicts without its runtime overhead.

Usage (the trainer wraps its first optimizer steps; entering several times keeps the maximum)::

    peak = PeakMemory(device, modules=(model,), optimizer=opt)
    for step in ...:
        with peak if step < 2 else contextlib.nullcontext():
            ...  # forward + backward of every micro-batch, optimizer.step(), zero_grad()
    report = peak.report(plan.chosen.memory)   # {"predicted", "measured_peak", "by_category", ...}
"""

from __future__ import annotations

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
    """Context manager that records the peak tensor memory of the code it wraps (on this rank).

    ``measured_peak_bytes`` is the maximum over every ``with`` block; ``by_category`` is the breakdown
    at that peak (CPU: MemTracker categories; CUDA: only ``allocated_before`` and ``peak``).
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
        self.by_category: dict[str, int] = {}
        self.steps = 0  # how many blocks were measured (1: the first step only, no optimizer state before it)
        self._tracker: Any = None
        self._hook: Any = None

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
        tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            peak = int(torch.cuda.max_memory_allocated())
            if peak > self.measured_peak_bytes:
                self.measured_peak_bytes = peak
                self.by_category = {"allocated_before": int(self._cuda_before), "peak": peak}
            return
        tracker = self._tracker
        tracker.__exit__(*exc)
        self._hook.remove()
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

    # -- reporting ------------------------------------------------------------------------------------
    def report(
        self, predicted: MemoryBreakdown, at_rows: MemoryBreakdown | None = None, rows: tuple[int, int] | None = None
    ) -> dict[str, Any]:
        """The memory.json content: prediction (tensor memory, i.e. without the runtime overhead, which no
        allocator counter sees), measured peak, error, breakdowns.

        ``predicted`` is the plan's (rows of ``data.max_seq_len`` tokens, the worst case); ``at_rows`` the
        same plan predicted at the width the measured batches had (``rows``: (planned, measured) tokens), since
        the trainer pads a micro-batch only to its longest row: ``error_at_measured_rows`` is the planner's
        accuracy, ``error`` how far the plan's bound was from this run.
        """
        pred = predicted.total - predicted.overhead
        meas = self.measured_peak_bytes
        at = pred if at_rows is None else at_rows.total - at_rows.overhead
        rep: dict[str, Any] = {
            "device": self.device,
            "predicted": pred,
            "predicted_with_overhead": predicted.total,
            "measured_peak": meas,
            "steps_measured": self.steps,
            "error": (pred - meas) / meas if meas else None,
            "predicted_at_measured_rows": at,
            "error_at_measured_rows": (at - meas) / meas if meas else None,
            "predicted_by_category": predicted.to_dict(),
            "by_category": dict(self.by_category),
        }
        if rows is not None:
            rep["rows"] = {"planned": rows[0], "measured": rows[1]}
        if at_rows is not None:
            rep["predicted_at_measured_rows_by_category"] = at_rows.to_dict()
        return rep

    def summary_line(
        self, predicted: MemoryBreakdown, at_rows: MemoryBreakdown | None = None, rows: tuple[int, int] | None = None
    ) -> str:
        """``memory: predicted X, measured Y (Z% off)``, and the prediction at the measured rows' width when
        the batches were narrower than planned."""
        rep = self.report(predicted, at_rows, rows)
        err = rep["error"]
        off = f"{100 * err:+.1f}% off" if err is not None else "not measured"
        line = f"memory: predicted {fmt_bytes(rep['predicted'])}, measured {fmt_bytes(rep['measured_peak'])} ({off})"
        if rows is not None and at_rows is not None:
            err = rep["error_at_measured_rows"]
            off = f"{100 * err:+.1f}% off" if err is not None else "not measured"
            line += (
                f"; planned for {rows[0]}-token rows, these batches were at most {rows[1]} (padding to the longest):"
                f" predicted {fmt_bytes(rep['predicted_at_measured_rows'])} at {rows[1]} tokens ({off})"
            )
        return line

    def write(
        self, path: str | Path, predicted: MemoryBreakdown, at_rows: MemoryBreakdown | None = None,
        rows: tuple[int, int] | None = None,
    ) -> dict[str, Any]:
        """Write :meth:`report` as JSON to ``path`` and return it."""
        rep = self.report(predicted, at_rows, rows)
        Path(path).write_text(json.dumps(rep, indent=2) + "\n")
        return rep


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
