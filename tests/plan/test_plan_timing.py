"""Predicted seconds per optimizer step (finetune.plan.timing): the arithmetic on known configurations, and the
CPU's measured matmul rate."""

from __future__ import annotations

import time

import pytest

from finetune.plan.hardware import GiB, Hardware
from finetune.plan.types import Candidate

A100 = 312e12  # bf16 dense peak
SEQ = 512

# Llama-2-7B's shape
LLAMA7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def llama7b():
    from transformers import LlamaConfig

    return LlamaConfig(**LLAMA7B)


def a100(gpus: int = 1, nodes: int = 1) -> Hardware:
    return Hardware("cuda", gpus, nodes, 80 * GiB, True, "a100", "nvlink", 300e9, gpu_type="a100")


def cand(**kw) -> Candidate:
    base = dict(method="full", strategy="single", precision="bf16", micro_batch_size=4, grad_accum_steps=2,
                activation_checkpointing=False, nproc=1)
    return Candidate(**{**base, **kw})


def lora_spec():
    from finetune.recipe.schema import LoraConfig
    from finetune.spec import adapter_spec

    return adapter_spec("lora", LoraConfig(r=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


def matmul_weights_7b() -> int:
    h, i, layers, vocab = 4096, 11008, 32, 32000
    return layers * (4 * h * h + 3 * h * i) + vocab * h  # q, k, v, o, gate, up, down; the LM head


def test_full_fine_tuning_on_an_a100_is_6n_flops_per_token_at_40_percent(llama7b):
    """Compute = (6 N + 12 L T d) x tokens / (312 TFLOP/s x 0.4): N the matmul weights (6.61e9), L T d the
    attention's score and value matmuls; within 3% of the 6 x 6.74e9 parameters people quote."""
    from finetune.plan.timing import step_time

    c = cand()
    t = step_time(c, llama7b, a100(), seq_len=SEQ, steps=100)
    tokens = 4 * SEQ * 2
    exact = (6 * matmul_weights_7b() + 12 * 32 * SEQ * 4096) * tokens / (A100 * 0.4)
    assert t.compute == pytest.approx(exact, rel=1e-12)
    assert t.compute == pytest.approx(6 * 6.74e9 * tokens / (A100 * 0.4), rel=0.03)
    assert (t.peak_flops, t.utilisation) == (A100, pytest.approx(0.4))
    assert (t.communication, t.offload, t.bubble) == (0.0, 0.0, 0.0)
    assert t.step == t.compute and t.job == pytest.approx(100 * t.compute)
    assert step_time(c, llama7b, a100(), seq_len=SEQ).job is None
    # fp32 runs at the plain fp32 peak (19.5 TFLOP/s; TF32 off), 16x slower
    fp32 = step_time(cand(precision="fp32"), llama7b, a100(), seq_len=SEQ)
    assert fp32.compute == pytest.approx(t.compute * 312 / 19.5)


def test_checkpointing_adds_the_layers_forward(llama7b):
    """Recomputing the decoder layers' forward adds about a third (not the head's forward: 1.3% less)."""
    from finetune.plan.timing import step_time

    plain = step_time(cand(), llama7b, a100(), seq_len=SEQ).compute
    ckpt = step_time(cand(activation_checkpointing=True), llama7b, a100(), seq_len=SEQ).compute
    layers_forward = 2 * (matmul_weights_7b() - 32000 * 4096) + 4 * 32 * SEQ * 4096
    assert ckpt - plain == pytest.approx(layers_forward * 4 * SEQ * 2 / (A100 * 0.4), rel=1e-12)
    assert ckpt / plain == pytest.approx(4 / 3, rel=0.02)


def test_lora_computes_about_two_thirds_of_full(llama7b):
    """No weight gradients for the frozen base (and no input gradients for the first layer's q/k/v)."""
    from finetune.plan.timing import step_time

    full = step_time(cand(), llama7b, a100(), seq_len=SEQ).compute
    lora = step_time(cand(method="lora"), llama7b, a100(), seq_len=SEQ, adapter=lora_spec()).compute
    qlora = step_time(cand(method="qlora"), llama7b, a100(), seq_len=SEQ, adapter=lora_spec()).compute
    assert 0.64 < lora / full < 0.68
    assert qlora == lora  # dequantization is not counted


def test_tensor_parallelism_divides_the_layers_not_the_head(llama7b):
    """A TP rank computes half of every layer and the whole head: (6.48e9 / 2 + 0.13e9) / 6.61e9 of the work."""
    from finetune.plan.timing import step_time

    one = step_time(cand(), llama7b, a100(2), seq_len=SEQ).compute
    tp2 = step_time(cand(strategy="ddp", nproc=2, tp=2), llama7b, a100(2), seq_len=SEQ).compute
    assert 0.505 < tp2 / one < 0.515


def test_exposed_communication(llama7b):
    """DDP's all-reduce hides behind the last micro-batch's backward: zero exposed when the backward is longer;
    the excess when it is not. ZeRO-2/FSDP hide behind every micro-batch (each all-gathers and reduce-scatters its
    own). TP's all-reduces are never hidden."""
    from finetune.plan.timing import step_time

    hw = a100(8)
    small = step_time(cand(strategy="ddp", nproc=8, comm_bytes_per_step=10**9), llama7b, hw, seq_len=SEQ)
    assert small.communication == 0.0  # 3.3 ms of all-reduce behind ~0.3 s of backward
    micro = small.compute / 2
    backward = micro * 2 / 3  # input + weight gradients of 6N + attention: two thirds of a micro-batch
    big = 300e9 * 1.0  # one second of all-reduce
    ddp = step_time(cand(strategy="ddp", nproc=8, comm_bytes_per_step=int(big)), llama7b, hw, seq_len=SEQ)
    assert ddp.communication == pytest.approx(1.0 - backward, rel=1e-9)
    fsdp = step_time(cand(strategy="fsdp", nproc=8, comm_bytes_per_step=int(2 * big)), llama7b, hw, seq_len=SEQ)
    assert fsdp.communication == pytest.approx(2.0 - 2 * micro, rel=1e-9)  # two micro-batches a step
    tp = step_time(cand(strategy="ddp", nproc=8, tp=8, tp_comm_bytes_per_step=3 * 10**9), llama7b, hw, seq_len=SEQ)
    assert tp.communication == pytest.approx(0.01)  # 3 GB over 300 GB/s, all exposed
    # across nodes the DP collectives cross the slowest link; TP stays on NVLink
    two = Hardware("cuda", 8, 2, 80 * GiB, True, "a100", "infiniband", 50e9, gpu_type="a100")
    tp2 = step_time(cand(strategy="ddp", nproc=8, nnodes=2, tp=8, tp_comm_bytes_per_step=3 * 10**9), llama7b, two,
                    seq_len=SEQ)
    assert tp2.communication == pytest.approx(0.01)


def test_offloaded_optimizer_state_costs_the_host_link_and_the_host_step(llama7b):
    """Bytes over an A100's PCIe 4.0 x16 (25 GB/s), plus AdamW on the host: each rank's shard of the 6.74e9
    trainable values x 28 bytes, the node's 8 ranks sharing 50 GB/s of host memory bandwidth."""
    from finetune.plan.timing import step_time

    c = cand(strategy="zero2", nproc=8, offload="optimizer", offload_bytes_per_step=5 * 10**9)
    t = step_time(c, llama7b, a100(8), seq_len=SEQ)
    trainable = 6_738_415_616  # Llama-2-7B's parameters
    assert t.offload == pytest.approx(5e9 / 25e9 + trainable / 8 * 28 * 8 / 50e9, rel=1e-9)
    assert t.step == pytest.approx(t.compute + t.communication + t.offload)
    # on an H100 the link is PCIe 5.0 (50 GB/s)
    h100 = Hardware("cuda", 8, 1, 80 * GiB, True, "h100", "nvlink", 300e9, gpu_type="h100")
    assert step_time(c, llama7b, h100, seq_len=SEQ).offload == pytest.approx(t.offload - 5e9 / 25e9 + 5e9 / 50e9)


def test_the_cpu_peak_is_measured_once_and_is_sane():
    """One core multiplies fp32 matrices at between 0.1 GFLOP/s and 10 TFLOP/s; the second ask is the cached
    figure; two processes on the host get half of what one does (or their OMP_NUM_THREADS' worth)."""
    import os

    from finetune.plan.hardware import cpu_core_flops, cpu_process_flops

    rate = cpu_core_flops("fp32")
    assert 1e8 < rate < 1e13
    start = time.perf_counter()
    assert cpu_core_flops("fp32") == rate
    assert time.perf_counter() - start < 0.01
    if "OMP_NUM_THREADS" not in os.environ and len(os.sched_getaffinity(0)) % 2 == 0:
        assert cpu_process_flops(2) == pytest.approx(cpu_process_flops(1) / 2)


def test_a_cpu_plan_uses_the_measured_rate():
    """On CPU the peak is the measured rate x the process's threads, at CPU_UTILISATION, and no offload."""
    from transformers import AutoConfig

    from finetune.plan.hardware import cpu_process_flops
    from finetune.plan.timing import CPU_UTILISATION, step_time
    from tests.support import TINY_MODEL

    config = AutoConfig.from_pretrained(TINY_MODEL)
    hw = Hardware("cpu", 2, 1, 8 * GiB, True, "cpu", "gloo", 10e9)
    c = cand(strategy="fsdp", precision="fp32", nproc=2, offload="optimizer", offload_bytes_per_step=10**9)
    t = step_time(c, config, hw, seq_len=64)
    assert t.peak_flops == cpu_process_flops(2, "fp32")
    assert t.utilisation == pytest.approx(CPU_UTILISATION)
    assert t.offload == 0.0
    assert 0 < t.compute < 10


def test_flops_shape_is_the_built_models_flops():
    """The one-layer build gives what finetune.plan.flops counts on the whole model, for full, LoRA and prefix."""
    from transformers import AutoConfig

    from finetune.plan.flops import config_flops_per_token, flops_shape
    from finetune.recipe.schema import PrefixConfig
    from finetune.spec import adapter_spec
    from tests.support import TINY_MODEL

    config = AutoConfig.from_pretrained(TINY_MODEL)
    for adapter in (None, lora_spec(), adapter_spec("prefix", None, PrefixConfig(num_virtual_tokens=8))):
        assert flops_shape(config, adapter).flops(96) == config_flops_per_token(config, seq_len=96, adapter=adapter)


def test_flops_shapes_are_cached_on_disk(llama7b, monkeypatch, tmp_path):
    """A second process (here: empty memory caches) reads the shape from $FINETUNE_CACHE/flops and builds no model."""
    import finetune.plan.flops as flops

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(flops, "_SHAPES", {})
    monkeypatch.setattr(flops, "_BY_OBJECT", {})
    built = flops.flops_shape(llama7b, lora_spec())
    assert len(list((tmp_path / "flops").glob("*.json"))) == 1
    monkeypatch.setattr(flops, "_SHAPES", {})
    monkeypatch.setattr(flops, "_BY_OBJECT", {})

    def no_build(*args):
        raise AssertionError("built a model")

    monkeypatch.setattr(flops, "_build_shape", no_build)
    assert flops.flops_shape(llama7b, lora_spec()) == built
    assert built.trainable_params == 32 * 4 * 16 * (4096 + 4096)  # LoRA r=16 on q, k, v, o of 32 layers


def test_hundreds_of_candidates_take_milliseconds(llama7b):
    """The planner times every candidate: after the first call per model and adapter, a call is arithmetic."""
    from finetune.plan.timing import step_time

    step_time(cand(), llama7b, a100(), seq_len=SEQ)
    start = time.perf_counter()
    for mbs in range(1, 301):
        step_time(cand(micro_batch_size=mbs), llama7b, a100(), seq_len=SEQ)
    assert time.perf_counter() - start < 0.3
