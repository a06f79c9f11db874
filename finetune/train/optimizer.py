"""The optimizer of a run: which class ``train.optimizer`` names, its parameter groups, and how it is laid
out over ranks (ZeRO-1's sharded state; bitsandbytes' 8-bit AdamW over FSDP2 and tensor-parallel shards).

Under FSDP2 every parameter and gradient is a DTensor, which bitsandbytes' kernels do not accept. AdamW is
elementwise, so each rank can update its own shard alone: :class:`LocalShardOptimizer` hands bitsandbytes
the local shards (``to_local()``: tensors aliasing the DTensors' local storage, updated in place) and their
local gradients. The quantization blocks (256 values, one absmax each) then start at each shard's first
value, so a sharded run's moments round a little differently from one process's: the same algorithm on a
different blocking, not the same bits.

Checkpoints hold AdamW's moments dequantized to fp32 DTensors laid out as the parameters
(``exp_avg``, ``exp_avg_sq``, ``step``, as torch's AdamW names them): torch.distributed.checkpoint reshards
them like any other state, and loading quantizes them back into this rank's blocks, recovering each block's
absmax (:func:`_requantize`), so a save and load on the same layout gives back the same codes.

The fp32 moments are 8 bytes per local parameter, four times the 8-bit state, and exist only for the
checkpoint: the checkpointer streams them (:meth:`LocalShardOptimizer.streamed`). Its state dict then holds a
placeholder per moment (a :class:`MomentStream`: the layout, no values), and torch.distributed.checkpoint's
planners (finetune/train/checkpoint/checkpointer.py) ask it for one moment when the writer reaches it (dequantized a slice
of blocks at a time on the device, copied into host memory) and hand it each moment once the reader has filled
it (quantized back a slice at a time on the device). On the device a save or a resume adds one slice
(:data:`CHUNK` values), not 8 bytes per parameter; in host memory a resume adds one moment of one parameter,
and a save what DCP's file writer keeps of everything it wrote to a rank's file until that file is closed.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from finetune.errors import UserError
from finetune.recipe.schema import TrainConfig
from finetune.spec import Strategy

#: bitsandbytes' block of values sharing one absmax (its optimizers' blockwise quantization).
BLOCK = 256
#: Values (a multiple of :data:`BLOCK`) dequantized or quantized at a time on the device by a checkpoint:
#: 4 MiB of fp32, and the requantization's temporaries (about 30 bytes a value) stay near 30 MiB.
CHUNK = 1 << 20


def is_sharded(params: list[torch.Tensor]) -> bool:
    """True when any of ``params`` is a DTensor (FSDP2 or tensor parallelism laid it out over ranks)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters, with weight decay on matrices only (not norms, biases)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
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
    (``scripts/bench_optimizer.py``). bitsandbytes' 8-bit AdamW keeps both moments in 8 bits; its step
    synchronises the device once (:func:`synchronising_once`).
    """
    if name == "adamw":
        return torch.optim.AdamW, {"fused": True}
    import bitsandbytes as bnb

    if name == "adamw8bit":
        return synchronising_once(bnb.optim.AdamW8bit), {}
    if name == "paged_adamw8bit":
        return synchronising_once(bnb.optim.PagedAdamW8bit), {}
    raise UserError(f"train.optimizer: unknown optimizer `{name}`; use adamw, adamw8bit or paged_adamw8bit")


_ONCE: dict[type, type] = {}


def synchronising_once(inner_class: type[Any]) -> type[Any]:
    """bitsandbytes' optimizer ``inner_class`` whose step synchronises the device once, after the last
    parameter's update, instead of after every parameter.

    bitsandbytes (0.50, ``Optimizer8bit.step``) calls ``torch.cuda.synchronize()`` after each parameter's
    update, so the host waits for every kernel in turn: a model of hundreds of tensors pays hundreds of
    round trips per step and the host can never run ahead of the device. Its update kernels take no stream:
    they run on the default stream, where torch's step also runs, in order. What needs the device done is a
    paged state (its prefetches and page-ins are asynchronous), and bitsandbytes' own step synchronises once
    more for it after the loop: the one synchronisation kept here, for every optimizer. The updates are
    bitsandbytes' own (``init_state``, ``prefetch_state``, ``update_step``), in its order.
    """
    if inner_class in _ONCE:
        return _ONCE[inner_class]
    from bitsandbytes.optim import optimizer as bnb_optimizer

    @torch.no_grad()
    def step(self: Any, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.initialized:
            self.check_overrides()
            self.to_gpu()
            self.initialized = True
        last = None
        for gindex, group in enumerate(self.param_groups):
            for pindex, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if len(self.state[p]) == 0:
                    self.init_state(group, p, gindex, pindex)
                self.prefetch_state(p)
                self.update_step(group, p, gindex, pindex)
                last = p
        if last is not None:  # the function bitsandbytes' own step synchronises with (a no-op on the CPU)
            bnb_optimizer.sync_gpu(last)
        return loss

    cls = type(inner_class.__name__, (inner_class,), {"step": step, "__doc__": inner_class.__doc__})
    cls.__module__ = __name__
    _ONCE[inner_class] = cls
    return cls


def build_optimizer(
    model: torch.nn.Module, t: TrainConfig, strategy: Strategy, *, tensor_parallel: bool = False,
    name: str | None = None,
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (the plan's; None: ``train.optimizer``, adamw for auto) over the trainable parameters (``train``
    section settings); ZeRO-1 shards its state over ranks.

    Under ZeRO-2, FSDP and tensor parallelism (DTensor parameters) the 8-bit optimizers update each rank's
    local shards (:class:`LocalShardOptimizer`); unsharded runs use bitsandbytes' class as is.
    Under tensor parallelism the parameters are DTensors on different meshes (TP-split linears, FSDP-only
    norms) or plain tensors (what TP replicates), and under expert parallelism the experts' are on the
    (expert_shard, ep) mesh beside the dense weights' dp_shard (``tensor_parallel`` is then set too): the
    foreach and fused kernels need one kind in a list, so AdamW runs its per-parameter loop there.
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


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (``t`` itself when it is a plain tensor), aliasing its storage."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


class LocalShardOptimizer(torch.optim.Optimizer):
    """A bitsandbytes optimizer (``inner_class``, e.g. ``bnb.optim.AdamW8bit``) run over the local shards of
    DTensor parameters.

    ``param_groups`` hold the parameters themselves (DTensors or plain tensors), so the LR scheduler, the
    gradient scaler, gradient clipping and ``torch.distributed.checkpoint``'s name mapping see an ordinary
    optimizer; ``state`` maps each parameter to bitsandbytes' state of its shard (8-bit codes and absmax per
    block; fp32 moments for shards under bitsandbytes' ``min_8bit_size``). A rank whose shard of a parameter
    is empty keeps no state for it.
    """

    def __init__(self, param_groups: list[dict[str, Any]], inner_class: type, **options: Any) -> None:
        outer = [{**g, "params": list(g["params"])} for g in param_groups]
        self._locals: list[torch.Tensor | None] = []
        inner_groups = []
        for g in outer:
            mine = []
            for p in g["params"]:
                local = _local(p)
                self._locals.append(local if local.numel() else None)
                if local.numel():
                    mine.append(local)
            inner_groups.append({**g, "params": mine})
        self._inner_groups = inner_groups
        # a subclass of bitsandbytes' optimizer (init_state, and whole_numel from _by_whole_size)
        self.inner: Any = _by_whole_size(inner_class)(
            [g for g in inner_groups if g["params"]] or [{"params": [torch.zeros(1)]}], **options
        )
        super().__init__(outer, self.inner.defaults)
        self._streaming = False  # state_dict gives MomentStream placeholders (streamed)
        self._record_sizes()
        self._alias_state()

    # -- the step ---------------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _refresh_locals(self) -> None:
        """Follow FSDP2 when it replaced a parameter's local tensor (lazy init, a state-dict load): the
        shard's state moves to the new tensor."""
        inner_state = self.inner.state
        for i, p in enumerate(self._params()):
            old, new = self._locals[i], _local(p)
            if old is None or new is old:
                continue
            if old in inner_state:
                inner_state[new] = inner_state.pop(old)
            for g in self.inner.param_groups:
                g["params"] = [new if q is old else q for q in g["params"]]
            self._locals[i] = new
        self._record_sizes()

    def _record_sizes(self) -> None:
        self.inner.whole_numel = {
            id(q): p.numel() for p, q in zip(self._params(), self._locals, strict=True) if q is not None
        }

    def _alias_state(self) -> None:
        """``state[param]`` is bitsandbytes' state of its shard (the same dict), for memory tracking and for
        ``torch.distributed.checkpoint``'s test whether the state exists yet."""
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for p, local in zip(self._params(), self._locals, strict=True):
            if local is not None and local in self.inner.state:
                state[p] = self.inner.state[local]
        self.state = state

    def _sync_groups(self) -> None:
        """The hyperparameters of each group (the scheduler's lr among them) onto bitsandbytes' groups."""
        inner = iter(self.inner.param_groups)
        for g, mine in zip(self.param_groups, self._inner_groups, strict=True):
            if mine["params"]:
                next(inner).update({k: v for k, v in g.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step of every local shard that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refresh_locals()
        self._sync_groups()
        pairs = [(p, q) for p, q in zip(self._params(), self._locals, strict=True) if q is not None]
        for p, local in pairs:
            local.grad = None if p.grad is None else _local(p.grad)
        try:
            self.inner.step()
        finally:
            for _, local in pairs:
                local.grad = None
        self._alias_state()
        return loss

    # -- checkpoints: fp32 moments laid out as the parameters -------------------------------------------
    @contextlib.contextmanager
    def streamed(self) -> Iterator[None]:
        """For the duration, :meth:`state_dict` holds a :class:`MomentStream` placeholder for each moment
        instead of its values, which torch.distributed.checkpoint's planners of finetune/train/checkpoint/checkpointer.py
        write and read one moment at a time (module docstring)."""
        self._streaming = True
        try:
            yield
        finally:
            self._streaming = False

    def state_dict(self) -> dict[str, Any]:
        """torch's AdamW layout: ``exp_avg`` and ``exp_avg_sq`` (fp32, DTensors where the parameter is
        one) and ``step`` for every parameter with state, and the param groups. Streamed
        (:meth:`streamed`): placeholders of the moments; otherwise their values, on the device."""
        self._refresh_locals()
        moments: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        streaming = self._streaming
        for p, local in zip(self._params(), self._locals, strict=True):
            if local is not None and local in self.inner.state:
                state = self.inner.state[local]
                moments[p] = _streamed(p, state, local) if streaming else _export(p, state)
        aliases, self.state = self.state, moments
        try:
            return super().state_dict()
        finally:
            self.state = aliases

    @contextlib.contextmanager
    def keys_as_saved(self) -> Iterator[None]:
        """``state[param]`` with :meth:`state_dict`'s names for the duration: torch.distributed.checkpoint
        rebuilds a flattened state dict by the names it finds there."""
        aliases = self.state
        self.state = defaultdict(dict, {p: dict.fromkeys(("step", "exp_avg", "exp_avg_sq")) for p in aliases})
        try:
            yield
        finally:
            self._alias_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyperparameters, steps and moments (quantized into this rank's blocks, one parameter at a
        time) from :meth:`state_dict`'s layout; a streamed moment was quantized as it was read, and only its
        step is taken here."""
        saved = state_dict["state"]
        # torch's loading would cast every state tensor to its parameter's dtype and device at once: it gets
        # the steps, and the moments go through _import_moment, one at a time
        super().load_state_dict({**state_dict, "state": {k: {"step": e["step"]} for k, e in saved.items()}})
        self._refresh_locals()
        self._sync_groups()
        # the saved groups list the keys of ``saved`` in the order of this optimizer's parameters
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        for key, local in zip(keys, self._locals, strict=True):
            if local is None or key not in saved:
                continue
            state = self._state_of(local)
            state["step"] = int(saved[key]["step"])
            for k, name in ((1, "exp_avg"), (2, "exp_avg_sq")):
                value = saved[key].get(name)
                if value is not None and moment_stream(value) is None:
                    _import_moment(state, k, _local(value))
        self._alias_state()

    def _state_of(self, local: torch.Tensor) -> dict[str, Any]:
        """bitsandbytes' state of a local shard, created (as its first step would) when it has none yet."""
        if local not in self.inner.state:
            for gi, g in enumerate(self.inner.param_groups):
                for pi, q in enumerate(g["params"]):
                    if q is local:
                        self.inner.init_state(g, local, gi, pi)
        return self.inner.state[local]


def _by_whole_size(inner_class: type[Any]) -> type[Any]:
    """``inner_class`` choosing 8-bit or fp32 moments by the whole parameter's size, not its shard's: a
    tensor keeps the moments it has on one process (and that the planner counts), however it is sharded."""

    def get_config(self: Any, gindex: int, pindex: int, group: dict[str, Any]) -> dict[str, Any]:
        config = inner_class.get_config(self, gindex, pindex, group)
        whole = self.whole_numel.get(id(self.param_groups[gindex]["params"][pindex]))
        if whole is not None and whole >= config["min_8bit_size"]:
            config["min_8bit_size"] = 0
        return config

    return type(f"Local{inner_class.__name__}", (inner_class,), {"get_config": get_config, "whole_numel": {}})


def _export(p: torch.Tensor, s: dict[str, Any]) -> dict[str, Any]:
    """One shard's bitsandbytes state as fp32 moments laid out as ``p``."""
    from torch.distributed.tensor import DTensor

    m1, m2 = _dequantized(s, 1), _dequantized(s, 2)
    if isinstance(p, DTensor):
        m1, m2 = (
            DTensor.from_local(m, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()) for m in (m1, m2)
        )
    return {"step": torch.tensor(float(s["step"])), "exp_avg": m1, "exp_avg_sq": m2}


def _dequantized(s: dict[str, Any], k: int) -> torch.Tensor:
    codes = s[f"state{k}"]
    if codes.dtype != torch.uint8:
        return codes.detach().clone()
    import bitsandbytes.functional as F

    return F.dequantize_blockwise(codes, absmax=s[f"absmax{k}"], code=s[f"qmap{k}"], blocksize=BLOCK)


def _import_moment(s: dict[str, Any], k: int, value: torch.Tensor) -> None:
    """Saved fp32 moment ``k`` (1: exp_avg, 2: exp_avg_sq) of one shard, on the host or the device, into its
    bitsandbytes state in place: quantized :data:`CHUNK` values at a time on the state's device."""
    target = s[f"state{k}"]
    if target.dtype != torch.uint8:
        target.copy_(value.reshape(target.shape))
        return
    codes, absmax, flat = target.view(-1), s[f"absmax{k}"], value.reshape(-1)
    for start in range(0, codes.numel(), CHUNK):
        end = min(codes.numel(), start + CHUNK)
        part = flat[start:end].to(device=codes.device, dtype=torch.float32)
        _requantize(part, s[f"qmap{k}"], absmax[start // BLOCK : -(-end // BLOCK)], codes[start:end])


def _moment_on_host(s: dict[str, Any], k: int) -> torch.Tensor:
    """Moment ``k`` of one shard in fp32 in host memory, dequantized :data:`CHUNK` values at a time on its
    device and copied over."""
    state = s[f"state{k}"]
    host = torch.empty(state.shape, dtype=torch.float32, device="cpu")
    if state.dtype != torch.uint8:
        host.copy_(state)
        return host
    import bitsandbytes.functional as F

    codes, absmax, out = state.view(-1), s[f"absmax{k}"], host.view(-1)
    for start in range(0, codes.numel(), CHUNK):
        end = min(codes.numel(), start + CHUNK)
        out[start:end].copy_(F.dequantize_blockwise(
            codes[start:end], absmax=absmax[start // BLOCK : -(-end // BLOCK)], code=s[f"qmap{k}"], blocksize=BLOCK,
        ))
    return host


class MomentStream:
    """A moment of one parameter's shard that a checkpoint writes or reads by itself
    (:meth:`LocalShardOptimizer.streamed`): its placeholder stands in the optimizer's state dict with the
    moment's layout and no values.

    Saving, :meth:`values` gives the fp32 values in host memory when the writer reaches it. Loading,
    :meth:`buffer` is the host tensor the reader fills, in one piece or several (each announced to
    :meth:`commit`), and the last piece quantizes it into the 8-bit state and lets it go.
    """

    def __init__(self, state: dict[str, Any], k: int, shape: torch.Size) -> None:
        self.state, self.k, self.shape = state, k, shape  # bitsandbytes' state of the shard, moment 1 or 2
        self._buffer: torch.Tensor | None = None
        self._filled = 0

    def values(self) -> torch.Tensor:
        """This shard's fp32 moment in host memory, shaped as the shard."""
        return _moment_on_host(self.state, self.k)

    def buffer(self) -> torch.Tensor:
        """The host tensor a checkpoint's reader fills with this shard's moment."""
        if self._buffer is None:
            self._buffer = torch.empty(self.shape, dtype=torch.float32, device="cpu")
        return self._buffer

    def commit(self, count: int) -> None:
        """``count`` more values of :meth:`buffer` were read; once all are, quantize them into the state."""
        self._filled += count
        if self._buffer is not None and self._filled >= self._buffer.numel():
            _import_moment(self.state, self.k, self._buffer)
            self._buffer, self._filled = None, 0


def moment_stream(value: Any) -> MomentStream | None:
    """The :class:`MomentStream` whose placeholder ``value`` is (None for any other value)."""
    return getattr(value, "_moment_stream", None)


def _streamed(p: torch.Tensor, s: dict[str, Any], local: torch.Tensor) -> dict[str, Any]:
    """One shard's state as :meth:`LocalShardOptimizer.state_dict` streams it: the step, and a placeholder
    per moment laid out as ``p`` whose values are one fp32 number broadcast over the shape (4 bytes, on the
    mesh's device: a DTensor's local tensor must be there, and torch.distributed.checkpoint reads only the
    layout of what it will not write or read itself)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {"step": torch.tensor(float(s["step"]))}
    for k, name in ((1, "exp_avg"), (2, "exp_avg_sq")):
        device = p.device_mesh.device_type if isinstance(p, DTensor) else local.device
        stub = torch.zeros((), dtype=torch.float32, device=device).expand(local.shape)
        if isinstance(p, DTensor):
            stub = DTensor.from_local(stub, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        stub._moment_stream = MomentStream(s, k, local.shape)  # type: ignore[attr-defined]
        out[name] = stub
    return out


def _requantize(value: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor) -> None:
    """Blockwise codes (into ``out``) and absmax (into ``absmax``) of dequantized moments ``value``, which give
    back the codes they were dequantized from.

    Quantizing them again would not: a block's absmax was its largest magnitude, and when that value was
    negative the signed code book's extreme (-0.99297, not -1) shrank it, so the block's largest dequantized
    magnitude undershoots the absmax. It is recovered as the larger of the largest value (code 1.0) and the
    most negative one over the code book's extreme; each value then takes its nearest code.
    """
    n = value.numel()
    blocks = value.new_zeros(absmax.numel() * BLOCK)
    blocks[:n] = value
    blocks = blocks.view(-1, BLOCK)
    scale = blocks.amax(dim=1).clamp(min=0)
    lowest = float(code.min())
    if lowest < 0:
        scale = torch.maximum(scale, blocks.amin(dim=1).clamp(max=0) / lowest)
    scaled = blocks / torch.where(scale > 0, scale, 1.0)[:, None]
    right = torch.bucketize(scaled, code).clamp(1, code.numel() - 1)
    nearer_left = (scaled - code[right - 1]).abs() <= (code[right] - scaled).abs()
    codes = torch.where(nearer_left, right - 1, right).view(-1)[:n]
    out.copy_(codes.view(out.shape).to(torch.uint8))
    absmax.copy_(scale)
