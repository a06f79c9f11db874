"""A GPU plan's trace keeps what CUDA keeps where the CPU's kernels keep something else
(finetune/plan/cuda_trace.py): dropout's boolean mask, autocast's fp32 ops."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoConfig

from finetune.plan.activations import TraceSpec, trace_windows
from finetune.plan.cuda_trace import cuda_kernels
from finetune.recipe.schema import LoraConfig
from finetune.spec import execution_spec
from tests.support import TINY_MODEL


@pytest.fixture(autouse=True)
def fresh_trace_cache(tmp_path, monkeypatch):
    """Trace for real (not from ~/.cache/finetune)."""
    import finetune.plan.activations as acts

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(acts, "_CACHE", {})


def _lora_layer(dropout: float, device: str, batch: int, seq: int) -> int:
    """One decoder layer's retained activations in the planner's trace of bf16 LoRA (q_proj, v_proj) on one GPU
    (autocast over a bf16 base) or on a CPU."""
    spec = execution_spec("lora", "single", "bf16", checkpointing=False,
                          lora=LoraConfig(r=8, alpha=16, dropout=dropout, target_modules=["q_proj", "v_proj"]))
    trace = TraceSpec.of(spec, seq_len=seq, packed=False, attn_implementation="sdpa", device=device)
    return trace_windows(AutoConfig.from_pretrained(TINY_MODEL), trace, 2, batch).layer_acts


def test_a_gpu_plan_of_lora_dropout_counts_a_one_byte_mask_per_dropped_element() -> None:
    """LoRA's dropout (0.05) on each adapted projection's input: the CUDA trace keeps the fused kernel's bool mask,
    1 byte per element of the (B, T, hidden) input, per adapted module; the CPU trace keeps the unfused path's
    fp32 noise (peft casts the input to the adapters' fp32 first), 4 bytes."""
    batch, seq, hidden, modules = 2, 32, 256, 2
    elements = modules * batch * seq * hidden
    dropped = _lora_layer(0.05, "cuda", batch, seq)
    assert dropped - _lora_layer(0.0, "cuda", batch, seq) == 1 * elements
    assert _lora_layer(0.05, "cpu", batch, seq) - dropped == (4 - 1) * elements


def test_dropout_saves_cudas_bool_mask_and_autocast_runs_cudas_fp32_ops() -> None:
    """Each rule on its own, on fake CPU tensors under CPU autocast (what the planner's trace runs)."""
    with FakeTensorMode(), cuda_kernels():
        x = torch.empty(4, 8, requires_grad=True)
        y = torch.nn.functional.dropout(x, 0.1, training=True)
        assert y.grad_fn.name() == "NativeDropoutBackward0"
        assert y.grad_fn._saved_result1.dtype == torch.bool  # the mask
        assert torch.nn.functional.dropout(x, 0.1, training=False) is x  # eval: the input itself
        z = torch.nn.functional.dropout(x.clone(), 0.1, training=True, inplace=True)
        assert z.grad_fn.name() != "NativeDropoutBackward0"  # in place: unfused on CUDA too
        w = torch.empty(8, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.nn.functional.linear(x, w)  # 16-bit on both devices
            assert h.dtype == torch.bfloat16
            assert torch.pow(h, 3.0).dtype == torch.float32  # GPT-2's gelu_new on CUDA
            assert (h**3.0).dtype == torch.float32
            assert h.exp().dtype == torch.float32
            assert torch.nn.functional.layer_norm(h, (8,)).dtype == torch.float32
            assert torch.softmax(h, -1).dtype == torch.float32
            assert torch.softmax(h, -1, dtype=torch.bfloat16).dtype == torch.bfloat16  # an explicit dtype stays
            assert h.sum().dtype == torch.float32
            assert torch.einsum("ij,jk->ik", x, w).dtype == torch.bfloat16
            assert torch.tanh(h).dtype == torch.bfloat16  # in neither list
        assert torch.pow(h, 3.0).dtype == torch.bfloat16  # outside autocast nothing is cast


def test_the_trace_key_names_the_device() -> None:
    """CPU and CUDA traces of one spec are different traces (and different files in the disk cache)."""
    spec = execution_spec("lora", "single", "bf16", checkpointing=False)
    of = TraceSpec.of(spec, seq_len=64, packed=False, attn_implementation="sdpa")
    assert of.device == "cuda"
    cpu = TraceSpec.of(spec, seq_len=64, packed=False, attn_implementation="sdpa", device="cpu")
    assert of != cpu and repr(of) != repr(cpu)


@pytest.mark.slow  # three fake-tensor traces of the tiny model (seconds each on 2 cores)
def test_eight_bit_qlora_keeps_no_layer_input_in_the_cuda_trace() -> None:
    """8-bit QLoRA trains through the frozen dequantize-and-matmul path on CUDA too (finetune/train/model/quantize.py),
    which keeps none of a quantized layer's input: the CUDA trace equals the CPU trace and the 4-bit one (the same
    stand-in), where bitsandbytes' MatMul8bitLt would keep every quantized linear's input."""
    from finetune.recipe.schema import QuantizationConfig

    def layer(bits: int, device: str) -> int:
        spec = execution_spec("qlora", "single", "bf16", checkpointing=False, quantization=QuantizationConfig(bits=bits),
                              lora=LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
        trace = TraceSpec.of(spec, seq_len=32, packed=False, attn_implementation="sdpa", device=device)
        return trace_windows(AutoConfig.from_pretrained(TINY_MODEL), trace, 2, 2).layer_acts

    cuda = layer(8, "cuda")
    assert cuda == layer(8, "cpu") == layer(4, "cuda")
