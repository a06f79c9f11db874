"""What a CUDA device keeps where the planner's CPU trace would keep something else: substitution rules.

The planner traces on fake tensors of the CPU device (finetune/plan/activations.py). Fake tensors on a ``cuda``
device do not get through autograd on a CPU-only torch build (every autograd node asks the device's guard for
its stream, and a CPU build registers none for CUDA), so a GPU plan's trace is the CPU trace with the kernels
that differ on CUDA substituted, op by op, at the level where the difference is decided (a
``TorchFunctionMode`` around the traced micro-step: above autograd, so that what a substituted op saves for
backward is what autograd saves on CUDA). Each rule is torch's own code path for a CUDA tensor:

dropout (``F.dropout``, out of place, training, 0 < p < 1)
    ATen's ``dropout`` runs the fused ``native_dropout`` kernel for a CUDA input (``is_fused_kernel_acceptable``
    in aten/src/ATen/native/Dropout.cpp) and saves its boolean mask, 1 byte per element; on CPU it multiplies
    by a noise tensor of the input's dtype (4 bytes per element in fp32) and saves that. LoRA's dropout, GPT-2's
    residual and embedding dropout. The in-place form takes the unfused path on CUDA too: no rule.
autocast's float32 policy (only where the traced step runs under autocast)
    CUDA's autocast runs ``pow``, ``exp``, ``log``, ``rsqrt``, ``softplus``, ``layer_norm``, ``group_norm``,
    the losses and norms of ``AT_FORALL_FP32`` in fp32, and ``softmax``, ``log_softmax``, ``cumsum``, ``sum``
    ... of ``AT_FORALL_FP32_SET_OPT_DTYPE`` with an fp32 result when no dtype is given; CPU's autocast has
    most of them in neither list, so a bf16 input stays bf16 there. GPT-2's ``gelu_new`` (``torch.pow`` on
    the MLP's bf16 activation) makes the whole activation chain fp32 on CUDA. The rule casts the op's
    16-bit floating inputs to fp32 (or asks for an fp32 result), as autocast does on CUDA; the ops both
    devices run in 16 bits (``linear``, ``matmul``, ``bmm``...) keep CPU autocast's treatment, and so its
    weight cache, whose rule (fp32 leaves that require gradients, cached per autocast region) is the same on
    both devices. CUDA's extra 16-bit ops (``einsum``, ``mv``, ``addmv``, ``addr``, ``chain_matmul``,
    ``linalg_multi_dot``) are cast to the autocast dtype.

Read and found not to matter (no rule): the fused attention kernels. CPU's flash kernel saves q, k, v, the
output and a (B, H, T) fp32 log-sum-exp, as CUDA's flash and cuDNN kernels do; CUDA's memory-efficient kernel
(fp32 inputs, or a mask) pads the log-sum-exp to a multiple of 32 rows (at most 31 x B x H x 4 bytes a layer),
and the kernels that draw dropout keep two 8-byte philox tensors (seed, offset) a layer. Attention with
dropout runs on CPU through :mod:`finetune.model.attention` (q, k, v and a seed, the probabilities recomputed), on
CUDA through the fused kernels (q, k, v, the output, the log-sum-exp, the philox state): the same within the
output, which the next projection keeps anyway. 8-bit quantized linears train through the frozen
dequantize-and-matmul path on CUDA as on CPU (finetune/train/model/quantize.py: int8_frozen_matmuls), which keeps
nothing of its input, so the trace's stand-in is right on both.
"""

from __future__ import annotations

from typing import Any

#: Ops CUDA's autocast runs in fp32 (aten's AT_FORALL_FP32), by the name of their torch, Tensor or
#: functional entry point.
FP32_OPS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "float_power", "softplus", "layer_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
})
#: Ops CUDA's autocast gives an fp32 result when no dtype is asked for (AT_FORALL_FP32_SET_OPT_DTYPE).
FP32_RESULT_OPS = frozenset({
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "vector_norm",
    "linalg_matrix_norm", "matrix_norm", "sum",
})
#: Ops CUDA's autocast runs in the autocast dtype and CPU's does not (AT_FORALL_LOWER_PRECISION_FP less CPU's).
LOW_PRECISION_OPS = frozenset({"einsum", "mv", "addmv", "addr", "chain_matmul", "multi_dot", "linalg_multi_dot"})


def cuda_kernels() -> Any:
    """A ``TorchFunctionMode`` that runs the traced micro-step as a CUDA device would keep it (the module
    docstring's rules), for the fake CPU tensors of the planner's trace."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_map

    dropout = torch.nn.functional.dropout
    low = (torch.float16, torch.bfloat16)

    def autocast_dtype() -> Any:
        return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None

    class CudaKernels(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            if func is dropout:
                return _dropout(func, args, kwargs)
            name = getattr(func, "__name__", "")
            target = autocast_dtype()
            if target is None or (name.endswith("_") and not name.endswith("__")):  # no autocast; in place
                return func(*args, **kwargs)
            if name in FP32_OPS and _any_tensor(args, kwargs, low):
                def up(x: Any) -> Any:
                    return x.float() if isinstance(x, torch.Tensor) and x.dtype in low else x

                return func(*tree_map(up, args), **tree_map(up, kwargs))
            if name in FP32_RESULT_OPS and "dtype" not in kwargs and not _dtype_given(args):
                first = args[0] if args else None
                if isinstance(first, torch.Tensor) and first.dtype in low:
                    return func(*args, **kwargs, dtype=torch.float32)
            if name in LOW_PRECISION_OPS:
                def down(x: Any) -> Any:
                    return x.to(target) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x

                return func(*tree_map(down, args), **tree_map(down, kwargs))
            return func(*args, **kwargs)

    return CudaKernels()


def _dropout(func: Any, args: tuple, kwargs: dict) -> Any:
    """``F.dropout`` as ATen runs it for a CUDA input: the fused kernel (its output; autograd keeps its boolean
    mask) when training out of place with 0 < p < 1, else the call as it was."""
    import torch

    names = ("input", "p", "training", "inplace")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    x, p = given["input"], float(given.get("p", 0.5))
    if given.get("training", True) and not given.get("inplace", False) and 0.0 < p < 1.0 and x.numel() > 0:
        return torch.ops.aten.native_dropout(x, p, True)[0]
    return func(*args, **kwargs)


def _any_tensor(args: tuple, kwargs: dict, dtypes: tuple) -> bool:
    """Whether a tensor of one of ``dtypes`` is among the arguments (one level of lists and tuples)."""
    import torch

    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, list | tuple) else (a,):
            if isinstance(t, torch.Tensor) and t.dtype in dtypes:
                return True
    return False


def _dtype_given(args: tuple) -> bool:
    """Whether a dtype is among the positional arguments."""
    import torch

    return any(isinstance(a, torch.dtype) for a in args)
