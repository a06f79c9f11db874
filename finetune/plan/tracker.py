"""The storage counter that traces activations: every new tensor storage filed as a gradient or an activation,
with the peaks the planner needs kept per window of the backward (see finetune/plan/activations.py).

It counts as torch's ``MemTracker`` does (same categories, same storages: parameters and buffers of the model
are known up front and not counted; a storage becomes a gradient when autograd hands it to a parameter), but
keeps only running totals instead of per-module snapshots: a trace costs about half. Module positions
(forward/backward, which decoder layer) come from torch's ``ModTracker``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Kind = Literal["fixed", "grad", "act"]  # a parameter or buffer, a gradient, an activation or temporary


@contextlib.contextmanager
def quiet_module_tracking() -> Iterator[None]:
    """Inside: torch's ``ModTracker`` (under the planner's tracer and ``MemTracker``) says nothing on stderr.

    When a module starts a forward while a module of the same name is still open, ModTracker warns "The module
    hierarchy tracking maybe be messed up" and, to print it, replaces ``warnings.formatwarning`` for the whole
    process: a torch diagnostic a user can do nothing about, printed before a run's own one-sentence errors.
    Here that warning is ignored and the format put back."""
    fmt = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The module hierarchy tracking", category=UserWarning)
        try:
            yield
        finally:
            warnings.formatwarning = fmt


@dataclass
class _Storage:
    """One live storage the tracker counts."""

    nbytes: int
    kind: Kind
    ref: weakref.ref[Any] | None = None


class WindowTracker(TorchDispatchMode):
    """Counts gradients and activations while one forward and backward of ``model`` run under it.

    ``root`` is the model's class name and ``layer_names`` its decoder layers' qualified names (the first
    layer's backward opens the "first" window, the last layer's the "last"; before either, "head").
    ``windows`` maps those three names to empty peaks records (``activations.WindowPeaks``), which the pass
    raises; ``layer_in`` / ``layer_out`` are then the (activations, autocast copies) at the first layer's
    start and end of forward.
    """

    def __init__(self, root: str, layer_names: list[str], model: torch.nn.Module, windows: dict[str, Any]) -> None:
        super().__init__()
        self.mt = ModTracker()
        # ModTracker names modules "<RootClass>.<qualified name>"
        self.first_layer = f"{root}.{layer_names[-1]}"
        self.last_layer = f"{root}.{layer_names[0]}"
        self.windows = windows
        self.seen_first = False
        self.seen_last = False
        self.grads = 0
        self.acts = 0  # activations and backward temporaries: every tracked storage that is not a gradient
        self.copies = 0  # autocast's low-precision copies of parameters
        self.layer_in: tuple[int, int] | None = None
        self.layer_out: tuple[int, int] | None = None
        self.pending_out = False
        self.storages: dict[int, _Storage] = {}  # by id(storage)
        self.hooks: list[Any] = []
        self.quiet = contextlib.ExitStack()  # torch's module tracking kept off stderr while entered
        for t in [*model.parameters(), *model.buffers()]:
            self._add(t.untyped_storage(), "fixed")
        for prm in model.parameters():
            if prm.requires_grad:
                self.hooks.append(prm.register_hook(self._mark_grad))
                self.hooks.append(prm.register_post_accumulate_grad_hook(lambda q: self._mark_grad(q.grad)))

    # -- storages ------------------------------------------------------------------------------------------
    def _add(self, st: Any, kind: Kind) -> _Storage:
        key = id(st)
        entry = _Storage(st.nbytes(), kind)
        entry.ref = weakref.ref(st, functools.partial(self._dead, key))
        self.storages[key] = entry
        if kind == "grad":
            self.grads += entry.nbytes
        elif kind == "act":
            self.acts += entry.nbytes
        return entry

    def _dead(self, key: int, _ref: Any = None) -> None:
        entry = self.storages.pop(key, None)
        if entry is not None:
            if entry.kind == "grad":
                self.grads -= entry.nbytes
            elif entry.kind == "act":
                self.acts -= entry.nbytes

    def _mark_grad(self, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        st = grad.untyped_storage()
        entry = self.storages.get(id(st))
        if entry is None:
            self._add(st, "grad")
        elif entry.kind == "act":
            entry.kind = "grad"
            self.acts -= entry.nbytes
            self.grads += entry.nbytes

    # -- module positions ----------------------------------------------------------------------------------
    def _pre_fw(self, module: torch.nn.Module, inputs: Any) -> None:
        # The layer's increment is measured from its start to the start of the next module, when the caller
        # has dropped the layer's input (kept only if the layer saved it for backward).
        if self.mt.is_bw:
            return
        if self.pending_out:
            self.layer_out = (self.acts, self.copies)
            self.pending_out = False
        if self.layer_in is None and self.mt.get_known_fqn(module) == self.first_layer:
            self.layer_in = (self.acts, self.copies)

    def _post_fw(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        if self.mt.is_bw or self.layer_out is not None:
            return
        if self.mt.get_known_fqn(module) == self.first_layer:
            self.layer_out = (self.acts, self.copies)  # fallback if no module follows
            self.pending_out = True

    def _update_peaks(self) -> None:
        grads, acts, mt = self.grads, self.acts, self.mt
        active = []
        if mt.is_bw and self.first_layer in mt.parents:
            self.seen_first = True
            active.append("first")
        if mt.is_bw and self.last_layer in mt.parents:
            self.seen_last = True
        if self.seen_last:
            active.append("last")
        if not self.seen_first and not self.seen_last:
            active.append("head")
        for w in active:
            wp = self.windows[w]
            if grads + acts > wp.grads_and_acts:
                wp.grads_and_acts = grads + acts
                wp.grads_at_peak = grads
            if acts > wp.acts:
                wp.acts = acts
            if acts - self.copies > wp.acts_no_copies:
                wp.acts_no_copies = acts - self.copies

    # -- every op ------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        res = func(*args, **(kwargs or {}))
        storages = self.storages
        for t in tree_leaves(res):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if id(st) not in storages:
                    self._add(st, "act")
        # autocast's low-precision copies of parameters: FSDP2 has all-gathered params instead
        if func is torch.ops.aten._to_copy.default and args and isinstance(args[0], torch.nn.Parameter):
            nbytes = res.untyped_storage().nbytes()
            self.copies += nbytes
            weakref.finalize(res.untyped_storage(), self._drop_copy, nbytes)
        self._update_peaks()
        return res

    def _drop_copy(self, nbytes: int) -> None:
        self.copies -= nbytes

    def __enter__(self) -> WindowTracker:
        self.quiet.enter_context(quiet_module_tracking())
        self.mt.register_user_hooks(self._pre_fw, self._post_fw)
        self.mt.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.mt.clear_user_hooks()
        self.mt.__exit__(*exc)
        for h in self.hooks:
            h.remove()
        self.quiet.close()
