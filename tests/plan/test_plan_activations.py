"""Activations traced on fake tensors equal a real MemTracker measurement of the same micro-step."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

from finetune.model.kernels import experts_kernel_of, use_experts_kernel
from finetune.objectives.loss import causal_lm_loss
from finetune.objectives.loss_chunks import LossChunks
from finetune.plan.activations import TraceSpec, activation_profile, trace_windows
from finetune.spec import execution_spec
from finetune.train.metrics.memory import mem_tracker_class
from tests.support import ARCH_COMMON, ARCHITECTURES, TINY_MODEL

LORA = (8, 16.0, 0.0, ("q_proj", "v_proj"))


def trace_spec(method: str, precision: str, ac: bool, seq: int, packed: bool, lora: tuple | None = None) -> TraceSpec:
    """The trace of one process's execution spec, as the planner asks for it on a CPU (what these tests measure)."""
    spec = execution_spec(method, "single", precision, checkpointing=ac)
    return TraceSpec.of(spec, seq_len=seq, packed=packed, attn_implementation="sdpa", lora=lora, device="cpu")


@pytest.fixture(autouse=True)
def fresh_trace_cache(tmp_path, monkeypatch):
    """Trace for real (not from ~/.cache/finetune): these tests check the tracer itself."""
    import finetune.plan.activations as acts

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(acts, "_CACHE", {})


def measured_peak_above_params(
    cfg, method: str, precision: str, ac: bool, batch: int, seq: int, packed: bool = True,
    chunks: LossChunks | None = None,
) -> int:
    """Real forward + backward on CPU under MemTracker: peak minus parameters and buffers (``packed``: two
    documents per row; else one causal row without any mask; ``chunks``: the loss's settings)."""
    torch.manual_seed(0)
    base_dtype = torch.float32 if method == "full" or precision == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=base_dtype)
    use_experts_kernel(model, "cpu", precision)  # a mixture of experts runs the trainer's kernel on CPU
    model.train()
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    if ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    half = seq // 2  # two packed documents per row, as the trainer's packing makes them
    pos = torch.cat([torch.arange(half), torch.arange(seq - half)]).repeat(batch, 1)
    batch_dict = {"input_ids": ids, "labels": ids}
    if packed:
        batch_dict["position_ids"] = pos
    tracker = mem_tracker_class()()
    tracker.track_external(model)
    with tracker:
        if precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = causal_lm_loss(model, batch_dict, chunks)
        else:
            loss, _ = causal_lm_loss(model, batch_dict, chunks)
        loss.backward()
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return snap["Total"] - snap["Parameter"] - snap["Buffer"]


@pytest.mark.parametrize(
    ("method", "precision", "ac", "batch", "tolerance"),
    [
        ("full", "fp32", False, 2, 0.002),
        ("full", "bf16", True, 2, 0.002),
        ("lora", "bf16", False, 2, 0.002),
        # Beyond the traced micro-batches (1 and 2) a window's peak, a maximum over time of lines in the
        # batch size, can come out slightly low: measured -1.0% (no checkpointing) to -1.6% (checkpointing).
        ("full", "fp32", False, 3, 0.02),
    ],
)
def test_traced_activations_match_measurement(method, precision, ac, batch, tolerance):
    cfg = AutoConfig.from_pretrained(TINY_MODEL)  # 4 layers; traced with 2, extrapolated
    spec = trace_spec(method, precision, ac, 96, packed=True, lora=LORA if method == "lora" else None)
    windows = activation_profile(cfg, spec).at(cfg.num_hidden_layers, batch)
    predicted = max(w.grads_and_acts for w in windows.values())
    measured = measured_peak_above_params(cfg, method, precision, ac, batch=batch, seq=96)
    assert abs(predicted - measured) / measured < tolerance, (predicted, measured)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_traced_chunked_loss_matches_measurement(precision):
    """With the loss split into chunks of 16 rows (a large vocabulary's case) the trace still equals a real
    measurement: the planner sees the chunked cross-entropy because it traces the trainer's own loss."""
    cfg = AutoConfig.from_pretrained(TINY_MODEL)
    chunks = LossChunks(logits_bytes=4 * cfg.vocab_size * 16)
    spec = replace(trace_spec("full", precision, False, 96, packed=True), loss=chunks)
    windows = activation_profile(cfg, spec).at(cfg.num_hidden_layers, 2)
    predicted = max(w.grads_and_acts for w in windows.values())
    measured = measured_peak_above_params(cfg, "full", precision, False, batch=2, seq=96, chunks=chunks)
    assert abs(predicted - measured) / measured < 0.002, (predicted, measured)


def test_depth_and_batch_extrapolation_is_exact_for_another_architecture():
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2)
    spec = trace_spec("full", "bf16", False, 64, packed=True)
    predicted = activation_profile(cfg, spec).at(5, 2)
    traced = trace_windows(cfg, spec, 5, 2).windows
    for name, w in traced.items():
        assert predicted[name].grads_and_acts == pytest.approx(w.grads_and_acts, rel=1e-3), name
        assert predicted[name].acts == pytest.approx(w.acts, rel=1e-3), name


def test_batch_extrapolation_is_exact_for_gpt2_with_attention_dropout():
    """GPT-2's attention dropout (math SDPA) keeps one more (1, heads, T, T) tensor per layer at micro-batch 1
    than the line through micro-batches 2, 3, 4...: a line through 1 and 2 under-predicted
    micro-batch 16 by 4.4% (scripts/plan_accuracy.py, gpt2 full fp32 mb16)."""
    from transformers import GPT2Config

    cfg = GPT2Config(vocab_size=300, n_embd=64, n_layer=3, n_head=4, n_positions=128, attn_pdrop=0.1)
    spec = trace_spec("full", "fp32", False, 64, packed=True)
    predicted = activation_profile(cfg, spec).at(3, 6)
    traced = trace_windows(cfg, spec, 3, 6).windows
    for name, w in traced.items():
        assert predicted[name].grads_and_acts == pytest.approx(w.grads_and_acts, rel=1e-3), name
        assert predicted[name].acts == pytest.approx(w.acts, rel=1e-3), name


def test_larger_micro_batches_are_traced_only_when_asked_and_all_traces_are_cached(tmp_path, monkeypatch):
    import finetune.plan.activations as acts

    cfg = AutoConfig.from_pretrained(TINY_MODEL)
    spec = trace_spec("lora", "fp32", False, 64, packed=True, lora=LORA)
    traces = tmp_path / "traces"
    one = activation_profile(cfg, spec).at(cfg.num_hidden_layers, 1)
    assert len(list(traces.glob("*.json"))) == 1
    four = activation_profile(cfg, spec).at(cfg.num_hidden_layers, 4)
    assert len(list(traces.glob("*.json"))) == 3  # micro-batch 1, and the line through 2 and 4
    assert four["head"].acts > one["head"].acts
    # A new process (empty memory cache) reads both traces back from disk, tracing nothing, same answer.
    acts._CACHE.clear()

    def no_tracing(*args, **kwargs):
        raise AssertionError("traced although the disk cache holds the trace")

    monkeypatch.setattr(acts, "trace_windows", no_tracing)
    assert activation_profile(cfg, spec).at(cfg.num_hidden_layers, 4) == four


def test_flex_plan_drops_exactly_the_packed_mask_bytes():
    """At 1024 tokens a packed row under sdpa carries a (1, 1, T, T) boolean mask and, in every layer, sdpa's
    additive copy of it saved for backward (fp32 here: 4 bytes per entry); flex attention's BlockMask has none of
    that. The planned difference between the two equals the difference measured for real (MemTracker, CPU)
    between a packed sdpa row and an unmasked causal row (flex's memory: q, k, v, output and log-sum-exp saved),
    and the flex plan equals that unmasked row's measurement."""
    cfg = AutoConfig.from_pretrained(TINY_MODEL)
    seq = 1024
    planned = {}
    for attn in ("sdpa", "flex_attention"):
        spec = TraceSpec.of(
            execution_spec("full", "single", "fp32", checkpointing=False),
            seq_len=seq,
            packed=True,
            attn_implementation=attn,
        )
        windows = activation_profile(cfg, spec).at(cfg.num_hidden_layers, 1)
        planned[attn] = max(w.grads_and_acts for w in windows.values())
    packed = measured_peak_above_params(cfg, "full", "fp32", False, batch=1, seq=seq)
    causal = measured_peak_above_params(cfg, "full", "fp32", False, batch=1, seq=seq, packed=False)
    mask_bytes = packed - causal
    assert mask_bytes > cfg.num_hidden_layers * 4 * seq * seq  # quadratic: every layer's saved copy at least
    assert planned["sdpa"] - planned["flex_attention"] == pytest.approx(mask_bytes, rel=0.01)
    assert planned["flex_attention"] == pytest.approx(causal, rel=0.01)


def arch_config(arch: str, **changes):
    """The config of a tiny model of :data:`tests.support.ARCHITECTURES`."""
    from transformers import AutoConfig

    values = {**ARCH_COMMON, **ARCHITECTURES[arch], **changes}
    return AutoConfig.for_model(values.pop("model_type"), **values)


@pytest.mark.parametrize(
    ("arch", "method", "precision"),
    [("qwen3_moe", "full", "fp32"), ("qwen3_moe", "lora", "fp32"), ("qwen3_moe", "full", "bf16"), ("mixtral", "full", "fp32")],
)
def test_mixture_of_experts_trace_in_any_dtype_matches_measurement(arch, method, precision):
    """torch's meta registration of the experts' grouped matmul accepts bf16 only, while its CPU kernel (and
    CUDA's fallback) runs fp32: the trace runs it in the model's dtype and keeps what the real kernel keeps.
    Three layers (traced with two, extrapolated), one causal row per sample (a packed row's document boundaries
    drop targets the trace cannot see); the real run routes its random tokens however the router sends them,
    and grouped_mm's memory does not depend on it."""
    cfg = arch_config(arch, num_hidden_layers=3)
    spec = trace_spec(method, precision, False, 64, packed=False, lora=LORA if method == "lora" else None)
    assert spec.experts == "grouped_mm"
    windows = activation_profile(cfg, spec).at(cfg.num_hidden_layers, 2)
    predicted = max(w.grads_and_acts for w in windows.values())
    measured = measured_peak_above_params(cfg, method, precision, False, batch=2, seq=64, packed=False)
    assert abs(predicted - measured) / measured < 0.002, (predicted, measured)


def test_experts_kernel_is_chosen_per_device_for_models_with_fused_experts():
    """grouped_mm on CPU and CUDA (any dtype), eager where torch has no grouped matmul (mps); a dense model has
    no experts kernel to choose."""
    from finetune.model.kernels import experts_implementation

    assert [experts_implementation(d, t) for d, t in [("cpu", "fp32"), ("cpu", torch.bfloat16), ("cuda", "bf16"),
                                                      ("cuda", "fp32"), ("mps", "fp32")]] == [
        "grouped_mm", "grouped_mm", "grouped_mm", "grouped_mm", "eager"]
    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(arch_config("qwen3_moe"))
        dense = AutoModelForCausalLM.from_config(arch_config("qwen3"))
    assert experts_kernel_of(use_experts_kernel(moe, "mps", "fp32")) == "eager"
    assert experts_kernel_of(use_experts_kernel(moe, torch.device("cpu"), "fp32")) == "grouped_mm"
    assert experts_kernel_of(use_experts_kernel(dense, "cpu")) is None


def test_torchs_module_tracking_says_nothing_under_the_planners_tracer() -> None:
    """Two modules of one class, each first seen as a root, the second called inside the first's forward: torch's
    ModTracker warns that its hierarchy may be messed up and replaces warnings.formatwarning for the process.
    Under quiet_module_tracking (the planner's tracer and the run's MemTracker enter it) neither happens."""
    import warnings

    from torch.distributed._tools.mod_tracker import ModTracker

    from finetune.plan.tracker import quiet_module_tracking

    outer, inner = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 2))

    def nested() -> None:
        with ModTracker():
            hook = outer.register_forward_pre_hook(lambda _mod, args: inner(args[0]))
            try:
                outer(torch.ones(1, 2))
            finally:
                hook.remove()

    fmt = warnings.formatwarning
    try:
        for quiet in (False, True):
            warnings.formatwarning = fmt
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                with quiet_module_tracking() if quiet else contextlib.nullcontext():
                    nested()
            messages = [str(w.message) for w in seen if "module hierarchy" in str(w.message)]
            assert (messages == []) is quiet, messages
            assert (warnings.formatwarning is fmt) is quiet
    finally:
        warnings.formatwarning = fmt
