"""Activations measured, not guessed: the training micro-step traced on fake tensors.

The model is built with 1 and 2 decoder layers inside ``FakeTensorMode`` (shapes and dtypes, no storage,
no FLOPs), set up exactly as the trainer sets it up (dtype, LoRA adapters, autocast, activation checkpointing,
the attention implementation), and ``finetune.train.loss.causal_lm_loss`` plus ``backward()`` run under
``MemTracker``, which files every tensor as parameter, gradient, activation or temporary.

A full model's backward runs head -> layer L-1 -> ... -> layer 0, with activations shrinking and gradients
growing linearly, so its peak is in one of three windows, each of which is linear in the number of layers
and in the micro-batch size:

  head     forward, loss and the head's backward (every layer's activations are alive)
  first    the backward of the last decoder layer (its recomputation with checkpointing)
  last     the backward of layer 0 and of the embeddings (nearly every gradient exists)

Each window's peak is traced at layers x micro-batch in {1, 2} x {1, 2} and extrapolated bilinearly, which
is exact for a stack of identical layers; four small traces stand for any depth and batch.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

from finetune.plan.shapes import decoder_layer_names, lora_kwargs, reduced_config

WINDOWS = ("head", "first", "last")
# Traced depth: layer 0 is special (under LoRA nothing flows back into its input), so the per-layer
# increment is measured on layer 1 of a two-layer model.
TRACE_LAYERS = 2


@dataclass(frozen=True)
class TraceSpec:
    """What to trace: everything that changes activation memory."""

    method: str  # full | lora | qlora
    precision: str  # fp32 | bf16 | fp16 | bf16-pure
    checkpointing: bool
    seq_len: int
    packed: bool
    attn_implementation: str = "sdpa"
    lora: tuple | None = None  # (r, alpha, dropout, target_modules)
    fsdp_compute: bool = False  # FSDP2 mixed precision: every parameter computed in 16-bit, no autocast


@dataclass
class WindowPeaks:
    """Peaks of one window, in bytes: with gradients, without them, and without autocast weight copies."""

    grads_and_acts: int = 0
    grads_at_peak: int = 0
    acts: int = 0
    acts_no_copies: int = 0


@dataclass
class TraceResult:
    """One trace: window peaks, and what one decoder layer adds (retained activations, their autocast
    weight copies, its gradients), in bytes."""

    windows: dict[str, WindowPeaks]
    layer_acts: int = 0
    layer_copies: int = 0
    layer_grads: int = 0


@dataclass
class ActivationProfile:
    """Window peaks of a model at any depth and micro-batch, from two-layer traces at micro-batch 1 and 2.

    Depth: every extra layer adds its retained activations to the ``head`` and ``first`` windows and its
    gradients to the ``last`` window. Micro-batch: linear between the two traces.
    """

    points: dict[int, TraceResult]

    def at(self, layers: int, batch: int) -> dict[str, WindowPeaks]:
        """The window peaks extrapolated to ``layers`` decoder layers and micro-batch ``batch``."""
        deep = {b: self._deepen(r, layers - TRACE_LAYERS) for b, r in self.points.items()}
        out: dict[str, WindowPeaks] = {}
        for w in WINDOWS:
            vals = {}
            for f in ("grads_and_acts", "grads_at_peak", "acts", "acts_no_copies"):
                v1, v2 = getattr(deep[1][w], f), getattr(deep[2][w], f)
                vals[f] = max(0, int(v1 + (batch - 1) * (v2 - v1)))
            out[w] = WindowPeaks(**vals)
        return out

    @staticmethod
    def _deepen(r: TraceResult, extra: int) -> dict[str, WindowPeaks]:
        out = {}
        for w, p in r.windows.items():
            if w == "last":
                g = extra * r.layer_grads
                out[w] = WindowPeaks(p.grads_and_acts + g, p.grads_at_peak + g, p.acts, p.acts_no_copies)
            else:
                a = extra * r.layer_acts
                out[w] = WindowPeaks(p.grads_and_acts + a, p.grads_at_peak, p.acts + a,
                                     p.acts_no_copies + extra * (r.layer_acts - r.layer_copies))
        return out


class _WindowTracker:
    """A MemTracker that also keeps, per window, the peaks the planner needs (cheaply, no snapshots)."""

    def __new__(cls, root: str, layer_names: list[str]) -> Any:
        import torch
        from torch.distributed._tools.mem_tracker import _MemRefType

        from finetune.train.memory import mem_tracker_class

        class Tracker(mem_tracker_class()):
            def __init__(self) -> None:
                super().__init__()
                # ModTracker names modules "<RootClass>.<qualified name>"
                self.first_layer = f"{root}.{layer_names[-1]}"
                self.last_layer = f"{root}.{layer_names[0]}"
                self.windows = {w: WindowPeaks() for w in WINDOWS}
                self.seen_first = False
                self.seen_last = False
                self.copies = 0
                self.layer_in: tuple[int, int] | None = None
                self.layer_out: tuple[int, int] | None = None
                self.pending_out = False

            def _acts_now(self) -> int:
                return sum(
                    d.get(_MemRefType.ACT, 0) + d.get(_MemRefType.TEMP, 0) for d in self._curr_mem_snap.values()
                )

            def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
                # The layer's increment is measured from its start to the start of the next module, when
                # the caller has dropped the layer's input (kept only if the layer saved it for backward).
                if self.pending_out and not self._mod_tracker.is_bw:
                    self.layer_out = (self._acts_now(), self.copies)
                    self.pending_out = False
                super()._pre_fw_hook(module, inputs)
                fqn = self._mod_tracker.get_known_fqn(module)
                if fqn == self.first_layer and not self._mod_tracker.is_bw and self.layer_in is None:
                    self.layer_in = (self._acts_now(), self.copies)

            def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
                super()._post_fw_hook(module, inputs, outputs)
                fqn = self._mod_tracker.get_known_fqn(module)
                if fqn == self.first_layer and not self._mod_tracker.is_bw and self.layer_out is None:
                    self.layer_out = (self._acts_now(), self.copies)  # fallback if no module follows
                    self.pending_out = True

            def _update_peak_stats(self, peak_state: Any) -> None:  # replaces the per-module snapshots
                snap = self._curr_mem_snap
                grads = acts = 0
                for dev_snap in snap.values():
                    grads += dev_snap.get(_MemRefType.GRAD, 0)
                    acts += dev_snap.get(_MemRefType.ACT, 0) + dev_snap.get(_MemRefType.TEMP, 0)
                mt = self._mod_tracker
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
                    wp.acts = max(wp.acts, acts)
                    wp.acts_no_copies = max(wp.acts_no_copies, acts - self.copies)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                res = super().__torch_dispatch__(func, types, args, kwargs)
                # autocast's low-precision copies of parameters: FSDP2 has all-gathered params instead
                if func is torch.ops.aten._to_copy.default and args and isinstance(args[0], torch.nn.Parameter):
                    nbytes = res.untyped_storage().nbytes()
                    self.copies += nbytes
                    weakref.finalize(res.untyped_storage(), self._drop_copy, nbytes)
                return res

            def _drop_copy(self, nbytes: int) -> None:
                self.copies -= nbytes

        return Tracker()


_CACHE: dict[Any, ActivationProfile] = {}


TRACE_VERSION = 3  # bump when what a trace records changes: invalidates the disk cache


def activation_profile(config: Any, spec: TraceSpec) -> ActivationProfile:
    """Trace ``spec`` with two decoder layers at micro-batch 1 and 2.

    Cached in memory and on disk (``$FINETUNE_CACHE`` or ~/.cache/finetune/traces, keyed by the config,
    the spec and the versions of torch, transformers and peft): planning the same model again is instant.
    """
    key = (config.to_json_string(use_diff=False), spec)
    if key not in _CACHE:
        path = _disk_path(key)
        profile = _load(path) if path else None
        if profile is None:
            profile = ActivationProfile({b: trace_windows(config, spec, TRACE_LAYERS, b) for b in (1, 2)})
            _save(path, profile)
        _CACHE[key] = profile
    return _CACHE[key]


def _disk_path(key: Any) -> Any:
    import hashlib
    import os
    from pathlib import Path

    try:
        import peft
        import torch
        import transformers

        versions = (torch.__version__, transformers.__version__, peft.__version__, TRACE_VERSION)
        digest = hashlib.sha256(repr((key, versions)).encode()).hexdigest()[:32]
        root = Path(os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune") / "traces"
        return root / f"{digest}.json"
    except Exception:  # no home, odd environment: no disk cache
        return None


def _load(path: Any) -> ActivationProfile | None:
    import json

    try:
        raw = json.loads(path.read_text())
        points = {}
        for b, r in raw.items():
            windows = {w: WindowPeaks(**v) for w, v in r["windows"].items()}
            points[int(b)] = TraceResult(windows, r["layer_acts"], r["layer_copies"], r["layer_grads"])
        return ActivationProfile(points)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save(path: Any, profile: ActivationProfile) -> None:
    import json
    import os
    from dataclasses import asdict

    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({b: asdict(r) for b, r in profile.points.items()}))
        os.replace(tmp, path)  # atomic: concurrent planners never read half a file
    except OSError:
        pass


def trace_windows(config: Any, spec: TraceSpec, num_layers: int, batch: int) -> TraceResult:
    """One fake-tensor trace of a training micro-step; the peak of each window, in bytes."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from finetune.train.loss import causal_lm_loss

    cfg = reduced_config(config, num_layers)
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16-pure": torch.bfloat16}.get(spec.precision)
    if spec.method == "full":
        dtype = torch.bfloat16 if spec.precision == "bf16-pure" else torch.float32
    else:
        dtype = compute or torch.float32
    autocast = spec.precision in ("bf16", "fp16") and not spec.fsdp_compute
    if spec.fsdp_compute and compute is not None:
        dtype = compute
    # Built on the meta device (peft's dtype moves do not work on fake parameters), then every parameter
    # and buffer is replaced by a fake CPU tensor of the same shape, dtype and sharing.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=spec.attn_implementation)
    model.train()
    if spec.method == "qlora":
        _emulate_kbit_preparation(model)
    if spec.method != "full":
        from peft import LoraConfig, get_peft_model

        r, alpha, dropout, targets = spec.lora
        lora = _LoraArgs(r, alpha, dropout, list(targets) if isinstance(targets, tuple) else targets)
        model = get_peft_model(model, LoraConfig(**lora_kwargs(lora, cfg.model_type)))
    if spec.fsdp_compute and compute is not None:  # MixedPrecisionPolicy casts adapters and norms too
        for prm in model.parameters():
            if prm.is_floating_point():
                prm.data = prm.data.to(compute)
    if spec.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with FakeTensorMode(allow_non_fake_inputs=True):
        _fakeify(model)
        ids = torch.zeros(batch, spec.seq_len, dtype=torch.long)
        batch_dict: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
        if spec.packed:
            batch_dict["position_ids"] = torch.arange(spec.seq_len).repeat(batch, 1)
        else:
            batch_dict["attention_mask"] = torch.ones_like(ids)
        layers = decoder_layer_names(model)
        tracker = _WindowTracker(type(model).__name__, layers)
        tracker.track_external(model)
        with tracker, _attention_kernels(spec.attn_implementation):
            if autocast:
                with torch.autocast("cpu", dtype=compute):
                    loss, _ = causal_lm_loss(model, batch_dict)
            else:
                loss, _ = causal_lm_loss(model, batch_dict)
            loss.backward()
        layer = model.get_submodule(layers[-1])
        grads = sum(p.grad.untyped_storage().nbytes() for p in layer.parameters() if p.grad is not None)
        (a_in, c_in), (a_out, c_out) = tracker.layer_in, tracker.layer_out
        return TraceResult(tracker.windows, a_out - a_in, c_out - c_in, grads)


@dataclass
class _LoraArgs:
    r: int
    alpha: float
    dropout: float
    target_modules: Any


def _attention_kernels(attn_implementation: str) -> Any:
    """The fused SDPA kernel the trainer gets on real tensors (fake tensors would otherwise take the math
    path, which materialises the (B, H, T, T) attention matrix)."""
    import contextlib

    if attn_implementation != "sdpa":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)


def _fakeify(model: Any) -> None:
    """Replace every meta parameter and buffer of ``model`` by an empty (fake) CPU tensor, keeping ties."""
    import torch

    memo: dict[int, Any] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                mod._parameters[name] = memo[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in memo:
                    memo[id(b)] = torch.zeros(b.shape, dtype=b.dtype)
                mod._buffers[name] = memo[id(b)]


def _emulate_kbit_preparation(model: Any) -> None:
    """QLoRA as the trainer runs it: frozen base; non-quantized parameters upcast to fp32 by peft.

    The 4-bit linear weights are stood in for by compute-dtype weights: bitsandbytes dequantizes one weight at
    a time into a transient of that size, which :mod:`finetune.plan.memory` adds.
    """
    import torch
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    out_emb = model.get_output_embeddings()
    linear_weights = {
        id(m.weight) for m in model.modules() if (type(m) is nn.Linear or isinstance(m, Conv1D)) and m is not out_emb
    }
    for p in model.parameters():
        p.requires_grad_(False)
        if id(p) not in linear_weights and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.to(torch.float32)
    for m in model.modules():
        if (type(m) is nn.Linear or isinstance(m, Conv1D)) and m is not out_emb:
            m.forward = functools.partial(_four_bit_forward, m)


def _four_bit_forward(module: Any, x: Any) -> Any:
    """bitsandbytes' Linear4bit.forward: input cast to the compute dtype, a matmul that saves only the packed
    weight (never the input), output cast back to the input's dtype (fp32 next to peft's fp32 norms)."""

    weight = module.weight if not hasattr(module, "nf") else module.weight.t()  # Conv1D stores W transposed
    out = _FrozenMatmul.apply(x.to(weight.dtype), weight)
    if getattr(module, "bias", None) is not None:
        out = out + module.bias.to(out.dtype)
    return out.to(x.dtype) if x.dtype != out.dtype else out


class _FrozenMatmulMeta(type):
    """Defers building the autograd.Function until torch is imported (this module stays import-light)."""

    _fn: Any = None

    def apply(cls, x: Any, w: Any) -> Any:
        if cls._fn is None:
            import torch

            class Fn(torch.autograd.Function):
                @staticmethod
                def forward(ctx: Any, x: Any, w: Any) -> Any:
                    ctx.save_for_backward(w)
                    return torch.nn.functional.linear(x, w)

                @staticmethod
                def backward(ctx: Any, grad: Any) -> Any:
                    (w,) = ctx.saved_tensors
                    return grad @ w.to(grad.dtype), None

            cls._fn = Fn
        return cls._fn.apply(x, w)


class _FrozenMatmul(metaclass=_FrozenMatmulMeta):
    pass
