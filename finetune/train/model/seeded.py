"""``model.init: random`` one tensor at a time: the seeded weights of ``from_config``, bit for bit, without
ever holding the whole model.

``torch.manual_seed(seed); AutoModelForCausalLM.from_config(config)`` draws from the one global CPU
generator in one sequence, in construction order:

- every ``nn.Linear`` / ``nn.Embedding`` runs torch's ``reset_parameters`` as it is built (kaiming-uniform,
  normal...): values that the init below overwrites, but that advance the generator;
- at the end of each ``PreTrainedModel``'s ``__init__`` (the inner ``LlamaModel``'s, then the outer
  ``LlamaForCausalLM``'s, whose head is built in between), ``post_init`` -> ``init_weights`` runs
  ``_initialize_weights`` on every module of its subtree not initialised yet, children before parents
  (transformers' ``smart_apply``), then ties the weights.

:func:`replay_seeded_init` first builds the model on the meta device recording that sequence (no draw),
then replays it from the seed: a construction draw is redone on a CPU scratch tensor of the same shape and
dtype and thrown away; an ``init_weights`` runs the model's own ``_initialize_weights`` module by module with
only the parameters that module writes materialised on CPU (a dry run on meta tells which), and hands each
parameter to ``keep`` once the last module that writes it has run, then frees it. Tying is left out (it
comes after the draws, and the tied head's own draw is discarded as tying discards it), so the caller keeps
a tied parameter under its first name. At most one module's parameters exist at once (a Linear: one tensor).

The replay relies on what transformers' init does: a parameter's first write in ``_initialize_weights`` is a
whole overwrite (``normal_``, ``uniform_``, ``fill_``, ``zero_``, ``copy_``), so construction values never
reach the result, and no module rewrites a parameter handed over before. Where the dry run sees otherwise,
:class:`NotReplayable` is raised and the caller builds the seeded model whole, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: In-place random draws of a tensor: what construction-time init calls on a parameter.
RANDOM_INPLACE = {
    "normal_",
    "uniform_",
    "bernoulli_",
    "random_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
}
#: In-place ops that overwrite the whole tensor regardless of its previous values.
WHOLE_WRITES = RANDOM_INPLACE | {"fill_", "zero_", "copy_"}


def release_free_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    glibc raises its mmap threshold to the size of the largest block freed so far (up to 32 MiB), so after
    the first few tensors every tensor of a few MiB comes from the heap, and the small objects allocated
    between them keep the heap from shrinking: replaying the init of the 67M-parameter test model one tensor
    at a time peaked 172 MiB above its start, 3.6 times its largest tensor; trimming after each tensor, 48 MiB.
    """
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - raises AttributeError where libc has none (musl, macOS)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def _name(func: Any) -> str:
    return getattr(func, "__name__", "")


def _target(func: Any, args: Any, kwargs: dict) -> torch.Tensor | None:
    """The tensor an in-place op or ``torch.nn.init`` function writes (init functions dispatch their
    override with the tensor as a keyword), or None for anything else."""
    name = _name(func)
    if not name.endswith("_") or name.startswith("__"):
        return None
    t = args[0] if args else kwargs.get("tensor")
    return t if isinstance(t, torch.Tensor) else None


def _is_draw(func: Any) -> bool:
    return _name(func) in RANDOM_INPLACE or getattr(func, "__module__", "") == "torch.nn.init"


class NotReplayable(Exception):
    """The model's init does something the replay cannot reproduce one tensor at a time."""


class _Construction(TorchFunctionMode):
    """Records, on the meta device, every random draw of construction and every ``init_weights`` call, in
    order: ``("draw", func, shape, dtype, args, kwargs)`` or ``("init", model)``."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[Any, ...]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        t = _target(func, args, kwargs)
        if t is not None and t.is_meta and _is_draw(func):
            rest = {k: v for k, v in kwargs.items() if k != "tensor"}
            self.events.append(("draw", func, tuple(t.shape), t.dtype, tuple(args[1:]), rest))
            return t
        return func(*args, **kwargs)


def _redraw(func: Any, shape: tuple[int, ...], dtype: torch.dtype, args: tuple, kwargs: dict) -> None:
    """A construction draw again, on a CPU scratch tensor: the generator advances as it did; values dropped."""
    func(torch.empty(shape, dtype=dtype, device="cpu"), *args, **kwargs)
    release_free_heap()


class _Writes(TorchFunctionMode):
    """Which of ``params`` (by id) an init function writes in place, directly or through a view, and whether
    each one's first write was a whole overwrite."""

    def __init__(self, params: dict[int, str]) -> None:
        super().__init__()
        self.params = params
        self.written: list[str] = []
        self.first_whole: dict[str, bool] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        t = _target(func, args, kwargs)
        if t is not None:
            name = _name(func)
            base = t._base if t._base is not None else t
            pname = self.params.get(id(base))
            if pname is not None:
                if pname not in self.written:
                    self.written.append(pname)
                whole = name in WHOLE_WRITES or getattr(func, "__module__", "") == "torch.nn.init"
                self.first_whole.setdefault(pname, whole and base is t)
        return func(*args, **kwargs)


def _post_order(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """transformers' ``smart_apply``: children first, each sub-model's modules with its own ``_init_weights``."""
    from transformers import PreTrainedModel

    out: list[tuple[torch.nn.Module, Any]] = []

    def visit(module: torch.nn.Module, owner: Any) -> None:
        for child in module.children():
            visit(child, child if isinstance(child, PreTrainedModel) else owner)
        out.append((module, owner))

    visit(model, model)
    return out


def build_recorded(config: Any, dtype: torch.dtype, **kwargs: Any) -> tuple[torch.nn.Module, list[tuple]]:
    """The model on meta, untied, and the sequence of its construction's draws and ``init_weights`` calls."""
    from transformers import AutoModelForCausalLM, PreTrainedModel
    from transformers.initialization import no_tie_weights

    recorder = _Construction()
    original = PreTrainedModel.init_weights

    def record(model: Any) -> None:
        recorder.events.append(("init", model))

    PreTrainedModel.init_weights = record  # type: ignore[method-assign]
    try:
        with recorder, torch.device("meta"), no_tie_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    finally:
        PreTrainedModel.init_weights = original  # type: ignore[method-assign]
    return model, recorder.events


def replay_seeded_init(
    config: Any,
    dtype: torch.dtype,
    seed: int,
    keep: Callable[[str, torch.Tensor], None],
    on_built: Callable[[torch.nn.Module], None] | None = None,
    **kwargs: Any,
) -> None:
    """``torch.manual_seed(seed)`` then the draws of ``from_config(config, dtype=dtype, **kwargs)``, one module at
    a time; ``keep(name, tensor)`` gets every parameter's final value once (names as in the untied model's
    ``named_parameters``), after which it is freed. ``on_built`` sees the (meta, untied) model before any
    value is drawn. Raises :class:`NotReplayable` (see the module doc)."""
    from transformers.initialization import guard_torch_init_functions

    model, events = build_recorded(config, dtype, **kwargs)
    if on_built is not None:
        on_built(model)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    where = {}
    for name in names.values():
        owner_name, _, attr = name.rpartition(".")
        where[name] = (model.get_submodule(owner_name), attr)
    kept: set[str] = set()
    torch.manual_seed(seed)
    with torch.no_grad():
        for event in events:
            if event[0] == "draw":
                _redraw(*event[1:])
                continue
            sub = event[1]
            custom = bool(sub.is_custom_code())
            steps = []
            last: dict[str, int] = {}
            for i, (module, owner) in enumerate(_post_order(sub)):
                if getattr(module, "_is_hf_initialized", False):
                    continue
                ids = {id(o._parameters[a]): n for n, (o, a) in where.items()}  # replaced as they are freed
                with _Writes(ids) as seen:
                    owner._init_weights(module)  # on meta: no draw, no value, only which tensors it writes
                for n in seen.written:
                    if n in kept or (not seen.first_whole.get(n, True) and n not in last):
                        raise NotReplayable(f"{n} is not overwritten whole by its init")
                    last[n] = i
                steps.append((i, module, owner, seen.written))
            with guard_torch_init_functions():
                for i, module, owner, writes in steps:
                    for n in writes:
                        _materialize(where[n])
                    owner._initialize_weights(module, custom)
                    for n in [n for n, j in last.items() if j == i]:
                        _hand_over(where[n], n, keep)
                        kept.add(n)
    if kept != set(names.values()):
        raise NotReplayable(f"no init writes {sorted(set(names.values()) - kept)[:3]}")


def _materialize(slot: tuple[torch.nn.Module, str]) -> None:
    owner, attr = slot
    p = owner._parameters[attr]
    assert p is not None, "slots name parameters from named_parameters()"
    if p.is_meta:
        owner._parameters[attr] = torch.nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad
        )


def _hand_over(
    slot: tuple[torch.nn.Module, str], name: str, keep: Callable[[str, torch.Tensor], None]
) -> None:
    owner, attr = slot
    p = owner._parameters[attr]
    assert p is not None, "slots name parameters from named_parameters()"
    keep(name, p.detach())
    owner._parameters[attr] = torch.nn.Parameter(
        torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
    )
    del p
    release_free_heap()
