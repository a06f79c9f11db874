"""Evaluation memory, traced like the training step: the eval loss forward and greedy generation.

An evaluation runs between optimizer steps, with the parameters, the optimizer state and the strategy's
buffers alive but no gradients, under ``torch.no_grad``: its activations are the forward's transients, the
(B, T, V) logits of the loss, and for exact match the prompt's logits and the KV cache that grows by one
token per generated token. Both are traced on fake tensors by running the trainer's own functions
(``causal_lm_loss`` and ``finetune.model.generation.greedy_tokens``) on the model built as
:mod:`finetune.plan.activations` builds it, at 1 and 2 decoder layers x eval batch 1 and 2, and extrapolated
bilinearly (the cache grows linearly in both). Generation is traced for 2 and 3 new tokens: each decode step
adds the same cache, so the peak of step N follows; the prompt's forward (prefill) is its own peak.

The eval batch ``auto`` is the largest (up to :data:`MAX_AUTO_EVAL_BATCH`) whose peak fits beside the states.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, replace
from typing import Any

from finetune.plan.activations import (
    WINDOWS,
    TraceSpec,
    WindowPeaks,
    attention_kernels,
    disk_path,
    fakeify,
    grouped_mm_any_dtype,
)
from finetune.plan.shapes import decoder_layer_names

#: The largest eval batch ``eval.batch_size: auto`` picks (more rarely speeds up a small eval set).
MAX_AUTO_EVAL_BATCH = 64
EVAL_TRACE_VERSION = 1


@dataclass(frozen=True)
class EvalTrace:
    """Peak bytes of non-parameter tensors during one evaluation, at one depth and batch."""

    loss: int  # the eval-loss forward (logits of the whole batch and the loss's chunks)
    prefill: int  # generation's first forward over the prompt
    decode2: int  # the second generated token's step
    decode3: int  # the third's: the difference is one token of KV cache


@dataclass(frozen=True)
class EvalPeak:
    """The evaluation's activation peak at a batch size, split as the plan shows it."""

    batch_size: int
    loss: int
    generation: int

    @property
    def activations(self) -> int:
        """The larger of the two passes."""
        return max(self.loss, self.generation)


def trace_eval(config: Any, spec: TraceSpec, num_layers: int, batch: int) -> EvalTrace:
    """One fake-tensor trace of an evaluation at ``spec.seq_len`` tokens (eval rows and prompts)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from finetune.model.generation import greedy_tokens
    from finetune.objectives.loss import causal_lm_loss
    from finetune.plan.activations import build_meta_model, mask_checks
    from finetune.plan.tracker import WindowTracker

    model, compute, autocast = build_meta_model(config, replace(spec, checkpointing=False), num_layers)
    model.eval()

    def ac() -> Any:
        return torch.autocast("cpu", dtype=compute) if autocast else contextlib.nullcontext()

    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        fakeify(model)
        layers = decoder_layer_names(model)
        ids = torch.zeros(batch, spec.seq_len, dtype=torch.long)
        mask = torch.ones_like(ids)
        tracker = WindowTracker(type(model).__name__, layers, model, {w: WindowPeaks() for w in WINDOWS})
        with tracker, attention_kernels(spec.attn_implementation), ac(), grouped_mm_any_dtype(), \
                mask_checks(spec):
            if spec.objective in ("sft", "grpo"):  # grpo's eval loss is the answers' next-token loss
                causal_lm_loss(model, {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}, spec.loss)
            else:  # preference pairs, 2 rows a sample (dpo's reference forward, or its precompute pass, alike)
                from finetune.objectives.preference import sequence_logps

                rows = torch.cat([ids, ids])
                sequence_logps(model, {"input_ids": rows, "labels": rows.clone(), "attention_mask": torch.cat([mask, mask])})
        loss = tracker.windows["head"].acts

        # One peak per call of the model: prefill, then each decode step.
        peaks: list[int] = []
        tracker = WindowTracker(type(model).__name__, layers, model, {w: WindowPeaks() for w in WINDOWS})

        def next_call(_module: Any, _args: Any) -> None:
            peaks.append(tracker.windows["head"].acts)  # the peak since the previous call (first: the setup)
            tracker.windows["head"].acts = tracker.acts  # what is alive between calls starts the next peak

        hook = model.register_forward_pre_hook(next_call)
        try:
            with tracker, attention_kernels(spec.attn_implementation), grouped_mm_any_dtype(), mask_checks(spec):
                out = greedy_tokens(model, ids, mask, 3, ac)
                del out
        finally:
            hook.remove()
        peaks.append(tracker.windows["head"].acts)
    _setup, prefill, decode2, decode3 = peaks
    return EvalTrace(loss, prefill, decode2, decode3)


_CACHE: dict[Any, EvalTrace] = {}


def _traced(config: Any, spec: TraceSpec, layers: int, batch: int) -> EvalTrace:
    key = (config.to_json_string(use_diff=False), spec, layers, batch, "eval", EVAL_TRACE_VERSION, *spec.preference_key)
    if key in _CACHE:
        return _CACHE[key]
    from finetune.plan.cache import read_json, write_json

    path = disk_path(key, spec.loss)
    stored = read_json(path)
    found = None
    if isinstance(stored, dict):
        with contextlib.suppress(TypeError):
            found = EvalTrace(**stored)
    if found is None:
        found = trace_eval(config, spec, layers, batch)
        write_json(path, asdict(found))
    _CACHE[key] = found
    return found


def eval_peak(config: Any, spec: TraceSpec, layers: int, batch: int, max_new_tokens: int) -> EvalPeak:
    """The evaluation's activation peak of the ``layers``-layer model at eval batch ``batch`` generating
    ``max_new_tokens`` tokens, from the four small traces (bilinear in depth and batch)."""
    t = {(n, b): _traced(config, spec, n, b) for n in (1, 2) for b in (1, 2)}

    def at(field: str) -> int:
        v11, v21, v12, v22 = (getattr(t[k], field) for k in ((1, 1), (2, 1), (1, 2), (2, 2)))
        dl, db = layers - 1, batch - 1
        return max(0, int(v11 + dl * (v21 - v11) + db * (v12 - v11) + dl * db * (v22 - v21 - v12 + v11)))

    decode2, decode3 = at("decode2"), at("decode3")
    last_step = decode2 + max(0, max_new_tokens - 2) * max(0, decode3 - decode2)
    generation = at("prefill") if max_new_tokens < 2 else max(at("prefill"), last_step)
    return EvalPeak(batch, at("loss"), generation)


def eval_memory(
    inv: Any, config: Any, spec: TraceSpec, strategy: str, setup: Any, batch: int, max_new_tokens: int
) -> tuple[int, EvalPeak]:
    """Per-GPU bytes at an evaluation's peak on ``strategy``: parameters, AdamW state (evaluations after the
    first step), the strategy's resident buffers, no gradients (set to None after each step), and the traced
    activations; plus the runtime overhead as for training (the CUDA context, NCCL's buffers, the allocator's
    slack). Returns (total, activations)."""
    total, peak, _ = eval_phases(inv, config, spec, strategy, setup, batch, max_new_tokens)
    return total, peak


def eval_phases(
    inv: Any, config: Any, spec: TraceSpec, strategy: str, setup: Any, batch: int, max_new_tokens: int
) -> tuple[int, EvalPeak, dict[str, int]]:
    """:func:`eval_memory`'s total and activations, and the tensors of each pass at its own peak (without the
    runtime overhead, as a run's measurement counts them): ``evaluation`` (the eval loss) and ``generation``."""
    from finetune.plan.memory import (
        offloads_to_host,
        optimizer_state_bytes,
        reference_bytes,
        runtime_overhead,
        shard_ranks,
        unsharded_bytes,
    )
    from finetune.spec import DTYPE_BYTES

    sb = inv.storage(setup.spec)
    n = max(1, setup.world) if strategy != "single" else 1
    opt = optimizer_state_bytes(inv, setup.spec.method.adapters, setup.optimizer, sb.param_dtype_bytes)
    if strategy in ("zero2", "fsdp", "hsdp"):
        n = shard_ranks(setup)  # hsdp: the GPUs of one node
        params, opt = -(-sb.param_bytes // n), -(-opt // n)
        if offloads_to_host(setup):  # the shards and the state live in host memory
            params = opt = 0
        gathered = unsharded_bytes(inv, setup.spec)
        root = unsharded_bytes(inv, setup.spec, root_only=True)
        unit = unsharded_bytes(inv, setup.spec, block_only=True)
        buffers = gathered if strategy == "zero2" else root + 2 * unit  # zero2 keeps units gathered
    else:
        params = sb.param_bytes
        opt = opt if strategy != "zero1" else -(-opt // n)
        buffers = sb.trainable * sb.param_dtype_bytes if strategy in ("ddp", "zero1") else 0  # DDP's buckets
    ref = reference_bytes(inv, setup.spec)  # dpo's frozen copy, sharded or replicated as the parameters
    params += -(-ref // n) if strategy in ("zero2", "fsdp", "hsdp") else ref
    peak = eval_peak(config, spec, inv.num_layers, batch, max_new_tokens)
    extra = 0
    if setup.spec.quant is not None:  # bitsandbytes dequantizes one 4-bit weight at a time
        extra = inv.largest_base_numel(quantizable_only=True) * DTYPE_BYTES[setup.spec.quant.compute_dtype]
    states = params + opt + buffers
    tensors = states + peak.activations + extra
    overhead = runtime_overhead(tensors, setup)
    passes = {"evaluation": states + peak.loss + extra, "generation": states + peak.generation + extra}
    return tensors + overhead, peak, passes
