"""The experts kernel of a mixture of experts, chosen in one place for every model build.

transformers 5 stores a mixture of experts' weights fused (``mlp.experts.gate_up_proj``: experts x 2*ffn x hidden)
and runs them through one of several implementations (``config._experts_implementation``):

  eager       a Python loop over the experts that got tokens: one ``nonzero`` (a host sync), a gather, two matmuls
              and an ``index_add_`` per expert
  batched_mm  one weight gathered per (token, expert) pair: a (tokens x top-k) x 2*ffn x hidden copy of the
              experts, so memory grows with the tokens; never a training kernel
  grouped_mm  tokens sorted by expert, then ``torch._grouped_mm`` over the contiguous groups (CUTLASS on a GPU in
              bf16; ATen's per-group matmul loop for other dtypes and on CPU)

Measured on a 2-core CPU (a training step of a Qwen3-MoE of hidden 256, 16 experts, top-4, 4 x 128 tokens, 1
thread; ``scripts/bench_experts.py``, docs/benchmarks.md): grouped_mm 1.8x eager's tokens/s in fp32 and 2.0x in
bf16, batched_mm 0.05-0.07x.
On a GPU grouped_mm is the one kernel for the whole batch; what autograd keeps is the same for every dtype (each
grouped matmul saves its input and the weights), and it does not depend on how the tokens are routed, so the
planner's fake-tensor trace of it (``finetune.plan.activations``) holds for any routing.

The trainer's model (every load path), the planner's traces and counts, chat, evaluation and merge all build
through :func:`use_experts_kernel`, so they run and count the same kernel.
"""

from __future__ import annotations

from typing import Any

#: The experts implementation per device type and compute dtype (None: any dtype). A device not listed runs
#: transformers' eager loop (``torch._grouped_mm`` has CPU and CUDA kernels only).
EXPERTS_KERNELS: dict[tuple[str, str | None], str] = {
    ("cpu", None): "grouped_mm",  # fp32 and bf16 alike: about twice eager's tokens/s (module docstring)
    ("cuda", "bf16"): "grouped_mm",  # CUTLASS grouped GEMM
    ("cuda", None): "grouped_mm",  # fp32/fp16: ATen's loop over groups, one host sync, no per-expert Python
}
FALLBACK = "eager"


def experts_implementation(device: Any, dtype: Any = None) -> str:
    """The experts implementation for a model computed on ``device`` (a ``torch.device`` or its type: cpu, cuda,
    mps) in ``dtype`` (a recipe dtype name, fp32 / bf16 / fp16, or a torch dtype; None: any)."""
    kind = device if isinstance(device, str) else device.type
    name = _dtype_name(dtype)
    for key in ((kind, name), (kind, None)):
        if key in EXPERTS_KERNELS:
            return EXPERTS_KERNELS[key]
    return FALLBACK


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None or isinstance(dtype, str):
        return {"bf16-pure": "bf16"}.get(dtype, dtype) if dtype else None
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(dtype))


def has_experts_kernel(model: Any) -> bool:
    """Whether ``model`` (a transformers model) runs fused experts through transformers' experts interface."""
    can = getattr(type(model), "_can_set_experts_implementation", None)
    return bool(can is not None and can())


def set_experts_kernel(model: Any, implementation: str) -> Any:
    """``model`` (a transformers model, before adapters) running its experts with ``implementation`` (Llama 4's
    mixture first put behind the experts interface: :mod:`finetune.model.llama4`); a model without fused experts
    is returned as it is. Returns ``model``."""
    from finetune.model import llama4

    if has_experts_kernel(model):
        if model.config._experts_implementation != implementation:
            model.set_experts_implementation(implementation)
    elif llama4.adopt(model):
        model.config._experts_implementation_internal = implementation  # as set_experts_implementation sets it
    return model


def use_experts_kernel(model: Any, device: Any, dtype: Any = None) -> Any:
    """``model`` (a transformers model, before adapters) with the experts implementation of ``device`` and
    ``dtype`` (:func:`experts_implementation`). Returns ``model``."""
    return set_experts_kernel(model, experts_implementation(device, dtype))


def experts_kernel_of(model: Any) -> str | None:
    """The experts implementation ``model`` (any wrapper of a transformers model: peft, DDP, a pipeline stage)
    runs its fused experts with (None: it has none)."""
    for module in model.modules():
        if hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(module, "config"):
            return str(module.config._experts_implementation)
    return None
