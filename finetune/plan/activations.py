"""Activations measured, not guessed: the training micro-step traced on fake tensors.

The model is built with 1 and 2 decoder layers inside ``FakeTensorMode`` (shapes and dtypes, no storage,
no FLOPs), set up exactly as the trainer sets it up (dtype, LoRA adapters, autocast, activation checkpointing,
the attention implementation), and ``finetune.objectives.loss.causal_lm_loss`` plus ``backward()`` run under
a tracker that files every tensor storage as torch's ``MemTracker`` does (parameter, gradient, activation).

A full model's backward runs head -> layer L-1 -> ... -> layer 0, with activations shrinking and gradients
growing linearly, so its peak is in one of three windows, each of which is linear in the number of layers
and in the micro-batch size:

  head     forward, loss and the head's backward (every layer's activations are alive)
  first    the backward of the last decoder layer (its recomputation with checkpointing)
  last     the backward of layer 0 and of the embeddings (nearly every gradient exists)

Each window's peak is traced at two layers and extrapolated linearly in depth, which is exact for a stack of
identical layers. In the micro-batch it is linear from 2 on, but micro-batch 1 is off that line for some
models (torch's math SDPA path keeps one more (1, heads, T, T) tensor per layer at micro-batch 1), so
micro-batch 1 and 2 are traced as such and larger ones are extrapolated from 2 and 4. Attention with dropout
(GPT-2's) is traced as the trainer runs it on CPU, through :mod:`finetune.model.attention` (``causal_lm_loss``
enables it on the traced model): q, k and v are kept, no (B, H, T, T) tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from finetune.model.kernels import experts_implementation, set_experts_kernel
from finetune.objectives.loss_chunks import LossChunks
from finetune.plan.config import concrete
from finetune.plan.shapes import decoder_layer_names, reduced_config
from finetune.spec import AdapterSpec, ExecSpec, Method
from finetune.units import torch_dtype

WINDOWS = ("head", "first", "last")
# Traced depth: layer 0 is special (under LoRA nothing flows back into its input), so the per-layer
# increment is measured on layer 1 of a two-layer model.
TRACE_LAYERS = 2
FLEX = "flex_attention"


@dataclass(frozen=True)
class TraceSpec:
    """What to trace: everything that changes activation memory (dtypes from the execution spec)."""

    method: str  # full | lora | qlora | prefix | adapter
    checkpointing: bool
    seq_len: int
    packed: bool
    attn_implementation: str = "sdpa"
    adapter: AdapterSpec | None = None  # what is trained on the frozen base (the execution spec's)
    base_dtype: str = "fp32"  # dtype the model is built in: full's masters, or the frozen base's
    autocast_dtype: str | None = None  # torch.autocast around the forward (single, DDP, ZeRO-1)
    fsdp_compute_dtype: str | None = None  # FSDP2 mixed precision: every parameter computed in it, no autocast
    # flex attention on CPU: finetune.model.flex's fallback (a dense mask per layer, sdpa). Out of the repr, which keys
    # the disk cache: every other trace keeps its cached file (activation_profile adds it to a CPU flex key).
    dense_flex: bool = field(default=False, repr=False)
    # train.objective (dpo, simpo, orpo: 2 rows a sample, the logits materialised, finetune/objectives/preference.py) and
    # the dpo reference's kind (base and model run a forward without gradients first). Out of the repr, as
    # dense_flex: the disk key names them for the preference objectives only (preference_key).
    objective: str = field(default="sft", repr=False)
    reference: str = field(default="none", repr=False)
    # TP's sequence parallelism: the tp degree whose rank 0 is traced with the residual stream split over the
    # sequence (finetune.plan.tensor_parallel.sequence_parallel_trace); 1: none. Out of the repr, as above.
    sequence_parallel: int = field(default=1, repr=False)
    # a mixture of experts' kernel (finetune.model.kernels): grouped_mm wherever one is traced (its memory does not
    # depend on the routing; eager's per-expert loop reads values fake tensors do not have). Out of the repr.
    experts: str = field(default="grouped_mm", repr=False)
    # the traced depth: TRACE_LAYERS, or more for a model whose layers differ (up to two layers of its last kind,
    # the one the rest of the model repeats: finetune.plan.shapes.Inventory.trace_depth). Out of the repr, as
    # above: the disk key names it when it is not TRACE_LAYERS (depth_key).
    depth: int = field(default=TRACE_LAYERS, repr=False)
    # a mixture of experts' load-balancing loss in the traced loss (finetune/model/router.py): the router logits kept
    # for it, its few small tensors. Out of the repr; the disk key names it when on (depth_key).
    aux_loss: bool = field(default=False, repr=False)
    # how the traced loss is chunked and whether its head is fused (the trainer's defaults unless given). Out of
    # the repr: the disk cache is keyed by it apart (disk_path).
    loss: LossChunks = field(default_factory=LossChunks, repr=False)

    @property
    def depth_key(self) -> tuple[Any, ...]:
        """What a deeper trace, or one with a load-balancing loss, adds to its disk cache key (nothing for a
        two-layer trace without)."""
        return (() if self.depth == TRACE_LAYERS else ("depth", self.depth)) + (("aux_loss",) if self.aux_loss else ())
    # the device the plan is for: a cuda trace runs finetune.plan.cuda_trace's rules (what CUDA keeps where the
    # CPU's kernels keep something else: dropout's 1-byte mask, autocast's fp32 ops)
    device: str = "cuda"

    @property
    def preference_key(self) -> tuple[str, ...]:
        """What a preference trace adds to its disk cache key (nothing for sft; the trailing number is bumped
        when what a preference trace records changes)."""
        return () if self.objective == "sft" else ("objective", self.objective, self.reference, "2")

    @property
    def sequence_parallel_key(self) -> tuple[Any, ...]:
        """What a sequence-parallel trace adds to its disk cache key (nothing without it)."""
        return () if self.sequence_parallel == 1 else ("sequence_parallel", self.sequence_parallel, "1")

    @classmethod
    def of(
        cls, spec: ExecSpec, *, seq_len: int, packed: bool, attn_implementation: str, lora: tuple | None = None,
        device: str = "cuda", depth: int = 2,
    ) -> TraceSpec:
        """The trace of one execution spec at ``seq_len`` tokens per row on ``device`` (the plan's hardware:
        a cuda trace keeps what CUDA's kernels keep, finetune/plan/cuda_trace.py; on CPU flex attention's path
        materialises a mask) (``lora``: (r, alpha, dropout, targets) replacing the spec's LoRA shape)."""
        adapter = spec.adapter if spec.method.adapters else None
        if lora is not None and adapter is not None and adapter.r:  # a LoRA shape (only LoRA has a rank)
            r, alpha, dropout, targets = lora
            adapter = replace(adapter, r=r, alpha=alpha, dropout=dropout, target_modules=targets)
        return cls(
            method=str(spec.method),
            checkpointing=spec.checkpointing,
            seq_len=seq_len,
            packed=packed,
            attn_implementation=attn_implementation,
            adapter=adapter,
            base_dtype=spec.base_dtype(False),
            autocast_dtype=spec.compute_dtype if spec.autocast else None,
            fsdp_compute_dtype=spec.fsdp_param_dtype,
            dense_flex=attn_implementation == FLEX and device == "cpu",
            objective=spec.objective,
            reference=spec.reference,
            sequence_parallel=spec.tp if spec.sequence_parallel else 1,
            experts=experts_implementation(device, spec.compute_dtype),
            depth=depth,
            aux_loss=spec.aux_loss_coef > 0,
            device=device,
        )


@dataclass
class WindowPeaks:
    """Peaks of one window, in bytes: with gradients, without them, and without autocast weight copies."""

    grads_and_acts: int = 0
    grads_at_peak: int = 0
    acts: int = 0
    acts_no_copies: int = 0


@dataclass
class TraceResult:
    """One trace: window peaks, what one decoder layer adds (retained activations, their autocast weight
    copies, its gradients), and the activations kept around the decoder layers (``position_acts``: alive as
    the first layer starts beside the embeddings' output: the position embeddings, a mask; ``head_acts``: what
    the final norm, the head and the loss add to the last layer's output and keep until the backward), in
    bytes."""

    windows: dict[str, WindowPeaks]
    layer_acts: int = 0
    layer_copies: int = 0
    layer_grads: int = 0
    position_acts: int = 0
    head_acts: int = 0


class ActivationProfile:
    """Window peaks of a model at any depth and micro-batch, from two-layer traces at micro-batch 1, 2 and 4.

    Depth: every extra layer adds its retained activations to the ``head`` and ``first`` windows and its
    gradients to the ``last`` window. Micro-batch: micro-batch 1 and 2 are their own traces; larger ones lie
    on the line through the traces at 2 and 4 (not through 1: see the module docstring). Traces are taken
    only when asked for: at micro-batch 1 the first trace is the answer.
    """

    def __init__(
        self, points: dict[int, TraceResult], trace: Callable[[int], TraceResult] | None = None,
        depth: int = TRACE_LAYERS,
    ) -> None:
        self.points = points
        self._trace = trace
        self.depth = depth  # the traced decoder layers

    def point(self, batch: int) -> TraceResult:
        """The trace at micro-batch ``batch`` (1, 2 or 4), traced now if it was not yet."""
        if batch not in self.points:
            if self._trace is None:
                raise KeyError(f"no trace at micro-batch {batch}")
            self.points[batch] = self._trace(batch)
        return self.points[batch]

    def at(self, layers: int, batch: int) -> dict[str, WindowPeaks]:
        """The window peaks extrapolated to ``layers`` decoder layers and micro-batch ``batch``."""
        if batch <= 2:
            return self._deepen(self.point(batch), layers - self.depth)
        two = self._deepen(self.point(2), layers - self.depth)
        four = self._deepen(self.point(4), layers - self.depth)
        out: dict[str, WindowPeaks] = {}
        for w in WINDOWS:
            vals = {}
            for f in ("grads_and_acts", "grads_at_peak", "acts", "acts_no_copies"):
                v2, v4 = getattr(two[w], f), getattr(four[w], f)
                vals[f] = max(0, int(v2 + (batch - 2) * (v4 - v2) / 2))
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


_CACHE: dict[Any, ActivationProfile] = {}


TRACE_VERSION = 13  # bump when what a trace records changes (or the traced loss): invalidates the disk cache


def activation_profile(config: Any, spec: TraceSpec) -> ActivationProfile:
    """The activation profile of ``spec``: two decoder layers traced at micro-batch 1 (2 and 4 when needed).

    Each trace is cached in memory and on disk (``$FINETUNE_CACHE`` or ~/.cache/finetune/traces, keyed by
    the config, the spec, the micro-batch and the versions of torch, transformers and peft): planning the
    same model again is instant.
    """
    key = (config.to_json_string(use_diff=False), spec)
    if key not in _CACHE:

        def trace(batch: int) -> TraceResult:
            path = disk_path(
                ((*key, batch, "dense_flex") if spec.dense_flex else (*key, batch))
                + spec.preference_key
                + spec.sequence_parallel_key
                + spec.depth_key,
                spec.loss,
            )
            result = _load(path) if path else None
            if result is None:
                result = trace_windows(config, spec, spec.depth, batch)
                _save(path, result)
            return result

        _CACHE[key] = ActivationProfile({}, trace, spec.depth)
    return _CACHE[key]


def disk_path(key: Any, chunks: LossChunks) -> Any:
    """``$FINETUNE_CACHE/traces/<digest>.json`` for a trace (keyed also by the loss's settings ``chunks``, which
    change what a trace records), or None when there is no cache directory."""
    from finetune.plan.cache import cache_file

    return cache_file("traces", key, TRACE_VERSION, *chunks.key)


def _load(path: Any) -> TraceResult | None:
    from finetune.plan.cache import read_json

    r = read_json(path)
    try:
        windows = {w: WindowPeaks(**v) for w, v in r["windows"].items()}
        return TraceResult(
            windows, r["layer_acts"], r["layer_copies"], r["layer_grads"], r["position_acts"], r["head_acts"]
        )
    except (AttributeError, KeyError, TypeError):
        return None


def _save(path: Any, result: TraceResult) -> None:
    from dataclasses import asdict

    from finetune.plan.cache import write_json

    write_json(path, asdict(result))


def build_meta_model(config: Any, spec: TraceSpec, num_layers: int) -> tuple[Any, Any, bool]:
    """The model of ``spec`` with ``num_layers`` decoder layers on the meta device, set up as the trainer sets
    it up (dtype, QLoRA's frozen base, LoRA adapters, FSDP2's compute dtype, checkpointing); returns
    (model, the autocast dtype or None, whether the trainer runs it under autocast)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = reduced_config(config, num_layers)
    compute = torch_dtype(spec.fsdp_compute_dtype) if spec.fsdp_compute_dtype else None
    dtype = compute or torch_dtype(spec.base_dtype)
    autocast = spec.autocast_dtype is not None
    # Built on the meta device (peft's dtype moves do not work on fake parameters), then every parameter
    # and buffer is replaced by a fake CPU tensor of the same shape, dtype and sharing.
    cfg = concrete(cfg)
    kernel = _traced_kernel(spec)
    mapping = AutoModelForCausalLM._model_mapping
    sdpa = type(cfg) not in mapping or getattr(mapping[type(cfg)], "_supports_sdpa", True)
    built = "eager" if kernel == "sdpa" and not sdpa else kernel  # sdpa: flex on a GPU (see _traced_kernel)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=built)
    if built != kernel:
        # An architecture without sdpa in transformers (gpt-oss) keeps flex's fused-kernel footprint in the trace:
        # its attention layers are pointed at sdpa, which ignores what the kernel adds (gpt-oss's sinks: a
        # (B, H, T) rescale of the output), instead of eager's (B, H, T, T) probabilities that flex never holds.
        model.config._attn_implementation_internal = "sdpa"
    set_experts_kernel(model, spec.experts)
    model.train()
    if Method(spec.method).quantized:
        _emulate_kbit_preparation(model)
    if spec.adapter is not None:
        from finetune.model.methods import inject

        # prefix tuning: the prefix of every layer of the real model is computed up front (one embedding
        # lookup), so it is traced at full depth, outside the per-layer increment
        model = inject(model, spec.adapter, num_layers=config.num_hidden_layers, stand_in=True)
    if compute is not None:  # FSDP2's MixedPrecisionPolicy casts adapters and norms too
        for prm in model.parameters():
            if prm.is_floating_point():
                prm.data = prm.data.to(compute)
    if spec.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.aux_loss:  # the trainer's router (the coefficient does not change the memory)
        from finetune.model import router

        router.enable(model, 1.0)
    return model, torch_dtype(spec.autocast_dtype) if autocast and spec.autocast_dtype else None, autocast


def trace_windows(config: Any, spec: TraceSpec, num_layers: int, batch: int) -> TraceResult:
    """One fake-tensor trace of a training micro-step; the peak of each window, in bytes."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_leaves

    from finetune.objectives.loss import causal_lm_loss

    model, _compute, autocast = build_meta_model(config, spec, num_layers)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakeify(model)
        ids = torch.zeros(batch, spec.seq_len, dtype=torch.long)
        batch_dict: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
        if spec.packed and spec.attn_implementation == FLEX and not spec.dense_flex:
            pass  # flex: a block-sparse document mask, no (B, 1, T, T) tensor (see _traced_kernel)
        elif spec.packed:
            batch_dict["position_ids"] = torch.arange(spec.seq_len).repeat(batch, 1)
        # unpacked rows: no attention mask, as the trainer sends them (right-padded rows need none; see
        # finetune.train.trainer._to_device), so neither builds a (B, 1, T, T) mask
        layers = decoder_layer_names(model)
        from finetune.plan.tracker import WindowTracker

        tracker = WindowTracker(type(model).__name__, layers, model, {w: WindowPeaks() for w in WINDOWS})
        kernels = attention_kernels("sdpa" if spec.dense_flex else _traced_kernel(spec))  # the fallback calls sdpa
        step: Callable[[Any, dict[str, Any]], Any]
        if spec.objective == "sft":
            step = functools.partial(causal_lm_loss, chunks=spec.loss)
        else:
            step = _grpo_step(spec) if spec.objective == "grpo" else _preference_step(spec, batch_dict)
        # activations alive as the first decoder layer starts and as the last one returns, and the embeddings'
        # output (the first call of each: checkpointing's recomputation calls the layers again in the backward)
        marks: dict[str, int] = {}

        def mark(name: str) -> Callable[..., None]:
            def hook(*_: Any) -> None:  # returns None: the module's inputs and output stay as they are
                marks.setdefault(name, tracker.acts)

            return hook

        def embedded(_m: Any, _a: Any, out: Any) -> None:
            first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
            marks.setdefault("embedded", first.untyped_storage().nbytes() if first is not None else 0)

        hooks = [
            model.get_submodule(layers[0]).register_forward_pre_hook(mark("embed")),
            model.get_submodule(layers[-1]).register_forward_hook(mark("layers")),
            model.get_input_embeddings().register_forward_hook(embedded),
        ]
        with tracker, kernels, mask_checks(spec), _sequence_parallel(model, spec), grouped_mm_any_dtype(), \
                _device_rules(spec):
            if autocast:
                with torch.autocast("cpu", dtype=torch_dtype(spec.autocast_dtype or "fp32")):
                    loss, _ = step(model, batch_dict)
            else:
                loss, _ = step(model, batch_dict)
            retained = tracker.acts  # what the forward and the loss keep for the backward
            loss.backward()
        for h in hooks:
            h.remove()
        layer = model.get_submodule(layers[-1])
        grads = sum(p.grad.untyped_storage().nbytes() for p in layer.parameters() if p.grad is not None)
        assert tracker.layer_in is not None and tracker.layer_out is not None, "the first layer ran"
        (a_in, c_in), (a_out, c_out) = tracker.layer_in, tracker.layer_out
        return TraceResult(
            tracker.windows, a_out - a_in, c_out - c_in, grads,
            max(0, marks.get("embed", 0) - marks.get("embedded", 0)), max(0, retained - marks.get("layers", retained)),
        )


def _device_rules(spec: TraceSpec) -> Any:
    """What CUDA keeps where the CPU trace differs (finetune.plan.cuda_trace) for a cuda trace, else nothing."""
    import contextlib

    if spec.device != "cuda":
        return contextlib.nullcontext()
    from finetune.plan.cuda_trace import cuda_kernels

    return cuda_kernels()


def _sequence_parallel(model: Any, spec: TraceSpec) -> Any:
    """TP's sequence parallelism on the traced rank (finetune.plan.tensor_parallel), or nothing."""
    import contextlib

    if spec.sequence_parallel == 1:
        return contextlib.nullcontext()
    from finetune.plan.tensor_parallel import sequence_parallel_trace

    return sequence_parallel_trace(model, spec.sequence_parallel, spec.seq_len)


def _preference_step(spec: TraceSpec, batch: dict[str, Any]) -> Callable[[Any, dict[str, Any]], Any]:
    """The preference objective's micro-step on ``batch``'s rows as chosen and rejected (2 rows a sample): the
    policy's log-probs and backward, on rows without an attention mask as the trainer sends them (the causal
    kernel: :func:`~finetune.objectives.preference.sequence_logps` tells transformers there is one document per row).
    dpo's reference forward (base or model) runs before it without gradients: it keeps nothing, and its
    transients (one layer's, and the logits') are smaller than what the policy's forward holds at its end, so
    it is not traced (its weights, for a frozen copy, are memory.py's)."""
    import torch

    from finetune.objectives.preference import sequence_logps

    for k in list(batch):
        batch[k] = torch.cat([batch[k], batch[k]])

    def step(model: Any, rows: dict[str, Any]) -> Any:
        logps, counts = sequence_logps(model, rows)
        return logps.sum(), counts

    return step


def _grpo_step(spec: TraceSpec) -> Callable[[Any, dict[str, Any]], Any]:
    """grpo's micro-step: each completion row's per-token log-probs (the logits materialised in fp32, as
    :func:`~finetune.objectives.grpo.token_logps` takes them) into the clipped loss and backward. The old policy's and the
    reference's log-probabilities come with the rollout (the planner's ``rollout`` memory), not from this step."""
    from finetune.objectives.grpo import GrpoSettings, summed_loss, token_logps, token_losses

    settings = GrpoSettings()

    def step(model: Any, rows: dict[str, Any]) -> Any:
        import torch

        logps, mask = token_logps(model, rows)
        adv = torch.ones(logps.shape[0], dtype=logps.dtype, device=logps.device)
        per_token, _ = token_losses(settings, logps, mask, adv, None, None)
        return summed_loss(settings, per_token, mask), mask.sum()

    return step


def _traced_kernel(spec: TraceSpec) -> str:
    """The attention implementation the trace runs. On a GPU, flex attention is traced as sdpa's fused kernel on
    an unmasked causal row: both keep q, k, v, the output and a per-row log-sum-exp for backward, and flex's
    document mask is a ``BlockMask`` of per-block indices (int32, (B, 1, T/128, T/128) a few times: 64 KiB per
    row at 8192 tokens), not the (B, 1, T, T) tensor sdpa gets for a packed row. (Fake tensors cannot run flex
    itself: it is compiled, and torch 2.13 has no CPU backward for it.) On CPU the trainer runs
    :mod:`finetune.model.flex`'s fallback, which is plain eager code, so the trace runs that very code: the BlockMask
    built eagerly, then in every layer the mask evaluated densely ((B, 1, T, T) bool) and handed to sdpa."""
    if spec.attn_implementation == FLEX and spec.dense_flex:
        from finetune.model import flex

        flex.install()  # what the trainer registers; it dispatches on the tensors' device (fake tensors: cpu)
        return FLEX
    return "sdpa" if spec.attn_implementation == FLEX else spec.attn_implementation


def mask_checks(spec: TraceSpec) -> Any:
    """For flex: transformers' mask code reads tensor values (is this row packed? is this padding mask all
    ones?), which fake tensors do not have. On a GPU it would then build the packed (B, 1, T, T) mask for any
    row without a padding mask, so the flex trace runs sdpa's plain causal path instead. On CPU the answers
    are given from what the trace feeds: a packed row is packed (its document ids computed as transformers
    does, without the value check) and the padding mask of an unpacked row is all ones (a full row, the
    planned worst case), so the fallback builds the mask it builds for such a real row."""
    import contextlib
    from unittest import mock

    if spec.attn_implementation != FLEX:
        return contextlib.nullcontext()
    from transformers import masking_utils

    if not spec.dense_flex:
        return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)

    def document_ids(position_ids: Any) -> Any:
        import torch

        restarts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
        return restarts.cumsum(-1)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(masking_utils, "find_packed_sequence_indices", document_ids))
    stack.enter_context(mock.patch.object(masking_utils, "fast_all", lambda tensor: True))
    return stack


def grouped_mm_any_dtype() -> Any:
    """A mode under which ``aten._grouped_mm`` runs on fake tensors of any dtype, as its CPU kernel and CUDA's
    per-group fallback run: torch's meta registration (what fake tensors execute) checks for the bf16 that
    only CUDA's fused kernel needs, so an fp32 or fp16 mixture of experts could not be traced. The output has
    the shape the meta registration gives, in the inputs' dtype, contiguous as the real kernels return it;
    what autograd keeps for the backward (the input and the weights) is decided above this mode, so the trace
    counts what the real kernel keeps. bf16 calls run torch's own registration unchanged.

    Under the same mode ``aten.bincount`` with a ``minlength`` gives ``minlength`` counts: its length depends
    on the values (their maximum + 1 when larger), which fake tensors do not have. The one caller in a traced
    step counts the experts each token was routed to (transformers' load-balancing loss of a mixture of experts
    before 5.24: ``bincount(selected_experts, minlength=num_experts)``), whose values are below ``minlength``.
    Without a ``minlength`` torch's own registration runs (and refuses)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    grouped = torch.ops.aten._grouped_mm.default
    bincount = torch.ops.aten.bincount.default

    class GroupedMM(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is bincount:
                values = args[0]
                weights = args[1] if len(args) > 1 else kwargs.get("weights")
                minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
                if not minlength:
                    return func(*args, **kwargs)
                dtype = torch.long if weights is None else weights.dtype
                return torch.zeros(minlength, dtype=dtype, device=values.device)
            if func is not grouped or (args[0].dtype == torch.bfloat16 and args[1].dtype == torch.bfloat16):
                return func(*args, **kwargs)
            a, b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 and args[4] is not None else a.dtype)
            shape: tuple[int, ...]
            if a.dim() == 2 and b.dim() == 2:  # the weights' gradient: one (M, N) block per group
                shape = (offs.shape[0], a.shape[0], b.shape[1])
            elif a.dim() == 2:  # tokens grouped along a's rows, one weight per group
                shape = (a.shape[0], b.shape[-1])
            elif b.dim() == 2:
                shape = (a.shape[1], b.shape[1])
            else:
                shape = (a.shape[0], a.shape[1], b.shape[-1])
            return torch.empty(shape, dtype=dtype, device=a.device)

    return GroupedMM()


def attention_kernels(attn_implementation: str) -> Any:
    """The fused SDPA kernel the trainer gets on real tensors (fake tensors would otherwise take the math
    path, which materialises the (B, H, T, T) attention matrix)."""
    import contextlib

    if attn_implementation != "sdpa":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)


def fakeify(model: Any) -> None:
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
    """QLoRA as the trainer runs it: frozen base, non-quantized parameters in the compute dtype.

    The 4-bit linear weights are stood in for by compute-dtype weights: bitsandbytes dequantizes one weight at
    a time into a transient of that size, which :mod:`finetune.plan.memory` adds. A mixture's fused expert
    weights run finetune.model.experts' NF4 forward, whose dequantized copy of the routed experts (on fake tensors:
    every expert) is a traced tensor of its own.
    """
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    from finetune.model.experts import stand_in_nf4

    out_emb = model.get_output_embeddings()
    for p in model.parameters():
        p.requires_grad_(False)
    for m in model.modules():
        if (type(m) is nn.Linear or isinstance(m, Conv1D)) and m is not out_emb:
            m.forward = functools.partial(_four_bit_forward, m)  # type: ignore[method-assign]
    stand_in_nf4(model)  # a mixture's fused experts: NF4 per expert, the routed ones dequantized in the trace


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
