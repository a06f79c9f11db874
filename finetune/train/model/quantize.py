"""QLoRA's base model: bitsandbytes 4-bit (NF4/FP4, double quantization) or LLM.int8 weights.

The base is loaded through transformers' ``BitsAndBytesConfig``: every ``nn.Linear`` (and GPT-2's
``Conv1D``) except the output head becomes a bitsandbytes ``Linear4bit``/``Linear8bitLt`` whose weight is
quantized as it is loaded. The weights are handed to the quantizer in the compute dtype (``dtype=`` of
``from_pretrained``), so the 4-bit codes are those of the compute-dtype weights; ``dequantized_weight``
reproduces exactly that for ``finetune merge --into-dequantized``.

A ``model.init: random`` base is first built in fp32 from its config with ``train.seed`` and saved (to the
run's ``base/`` directory when given, else a temporary one), then loaded quantized from there: the same code
path as a pretrained checkpoint, so the 4-bit model is the quantization of weights a user can reload.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from transformers import BitsAndBytesConfig, PreTrainedModel

    from finetune.recipe.schema import LoadedRecipe, QuantizationConfig, Recipe
    from finetune.spec import ExecSpec, QuantSpec
from finetune.model.kernels import use_experts_kernel
from finetune.units import torch_dtype

#: Values per quantization block (bitsandbytes' and transformers' default for 4-bit weights).
BLOCKSIZE_4BIT = 64


def bnb_config(
    recipe: Recipe, compute_dtype: torch.dtype, quant_storage: torch.dtype | None = None
) -> BitsAndBytesConfig:
    """The ``BitsAndBytesConfig`` for ``recipe.quantization``.

    4 bits: ``quant_type`` (nf4/fp4) with double quantization as set, dequantized to ``compute_dtype`` for
    the matmuls. ``quant_storage`` is the dtype the packed 4-bit codes are stored in (uint8 by default); give
    the compute dtype for FSDP, which can then shard the quantized weights like any other parameter.
    8 bits: LLM.int8 weights (outlier threshold 6.0, no fp16 copy kept).
    """
    import torch
    from transformers import BitsAndBytesConfig

    q = recipe.quantization
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=quant_storage if quant_storage is not None else torch.uint8,
    )


def build_random_base(loaded: LoadedRecipe, path: str) -> torch.nn.Module:
    """The fp32 model of ``path``'s config with weights drawn from ``train.seed`` (``model.init: random``), in
    transformers' default attention for the architecture (the kernel does not change the draws)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    r = loaded.recipe
    config = AutoConfig.from_pretrained(
        path, trust_remote_code=r.model.trust_remote_code, local_files_only=True
    )
    torch.manual_seed(r.train.seed)
    # the kernel does not change the drawn weights: the recipe's, auto as for unpacked rows
    return AutoModelForCausalLM.from_config(
        config,
        dtype=torch.float32,
        trust_remote_code=r.model.trust_remote_code,
    )


def load_quantized(
    loaded: LoadedRecipe,
    path: str,
    spec: ExecSpec,
    device: torch.device | str,
    base_dir: Path | None = None,
) -> torch.nn.Module:
    """The base model of ``path`` with 4-bit (or 8-bit) linear weights on ``device``, ready for adapters.

    Non-quantized parameters (embeddings, norms, the head) are in the compute dtype and stay there (see
    ``finetune.train.model.build.add_adapters``: no fp32 upcast).
    For ``model.init: random`` the seeded fp32 model is saved to ``base_dir`` (the run's ``base/``; a
    temporary directory when None) and quantized while loading from there. The codes' storage dtype and the
    compute dtype are the execution spec's (the compute dtype under FSDP2, so it can shard them; else uint8).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.train.precision import keep_fp32

    r = loaded.recipe
    assert spec.quant is not None, "load_quantized builds a quantized base"
    compute_dtype = torch_dtype(spec.quant.compute_dtype)
    quant_storage = torch_dtype(spec.quant.storage_dtype) if spec.quant.shardable else None
    if spec.quant.bits == 8:
        # LLM.int8 casts fp32/bf16 inputs to fp16 by design; bitsandbytes warns on every matmul.
        warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kwargs: dict[str, Any] = {
        "quantization_config": bnb_config(r, compute_dtype, quant_storage),
        "dtype": compute_dtype,
        "device_map": {"": device},
        "local_files_only": True,
        "trust_remote_code": r.model.trust_remote_code,
        "attn_implementation": spec.attention,
    }

    def load(source: str) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        model = use_experts_kernel(keep_fp32(model, spec), device, compute_dtype)
        return quantize_fused_experts(_training_paths(model), spec)

    if r.model.init != "random":
        return load(path)
    model = build_random_base(loaded, path)
    if base_dir is not None:
        base_dir.mkdir(parents=True, exist_ok=True)
        _save_unquantized(model, base_dir)
        del model
        return load(str(base_dir))
    with tempfile.TemporaryDirectory(prefix="finetune-random-base-") as tmp:
        _save_unquantized(model, Path(tmp))
        del model
        return load(tmp)


def _save_unquantized(model: torch.nn.Module, directory: Path) -> None:
    """Write config.json and model.safetensors for quantized loading, on every rank.

    ``save_pretrained`` writes nothing on ranks other than 0 once torch.distributed is initialised, but every
    rank of a multi-process run quantizes its own copy of the base.
    """
    from safetensors.torch import save_model

    config: Any = model.config  # a transformers PretrainedConfig
    config.save_pretrained(directory)
    save_model(model, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})


def disable_cpu_packed_inference(model: torch.nn.Module) -> torch.nn.Module:
    """Keep bitsandbytes' CPU ``Linear4bit`` on the path training uses, also in eval under no_grad.

    On CPUs with AVX512-BF16, bitsandbytes 0.50 repacks a 4-bit weight for a faster inference kernel the
    first time it runs in eval mode without gradients; that repacking asserts out_features % 32 == 0
    (the tiny models' 688-wide MLP fails) and changes the numerics between training and evaluation.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            linear4bit: Any = module  # bitsandbytes' Linear4bit (nn.Module types attributes as tensors)
            linear4bit.support_avx512bf16_for_cpu = False
    return model


def _training_paths(model: torch.nn.Module) -> torch.nn.Module:
    return int8_frozen_matmuls(disable_cpu_packed_inference(model))


def quantize_fused_experts(model: torch.nn.Module, spec: ExecSpec) -> torch.nn.Module:
    """A 4-bit QLoRA's fused expert weights in NF4 per expert (finetune.model.experts), each freed as it is quantized:
    transformers' quantizer converts only ``nn.Linear`` layers, and a mixture's experts hold most of its weights."""
    from finetune.model.experts import fused_experts, quantize_experts, quantized_forward

    if spec.quant is None or spec.quant.bits != 4:
        return model
    quantize_experts(model, spec.quant)
    for experts in fused_experts(model).values():
        quantized_forward(experts)
    return model


def int8_frozen_matmuls(model: torch.nn.Module) -> torch.nn.Module:
    """Run bitsandbytes' ``Linear8bitLt`` in training without keeping its input for backward, on every device.

    bitsandbytes 0.50 keeps the layer's input on the autograd context for the weight's gradient even when the
    weight is frozen, as QLoRA's always is: on CPU (``MatMul8bitFp``, dequantize + matmul: ``ctx.A``) and on
    CUDA (``MatMul8bitLt``: ``ctx.tensors = (CAt, subA, A)`` whenever the input needs a gradient, although its
    backward reads only the codes for it), so the input of every quantized linear layer (the attention output
    before o_proj, the MLP's normed input, the (tokens x intermediate) input of down_proj...) stayed alive until
    backward: about 19 GB for Llama-3.1-8B at micro-batch 4 x 4096 without checkpointing, memory no gradient
    needs. CUDA's path also casts a bf16 input to fp16 to quantize it (LLM.int8's activation quantization and
    outlier decomposition). Here the arithmetic of bitsandbytes' own input gradient (codes x per-row scale / 127
    in the input's dtype, then a matmul) runs forward and backward in an autograd function that keeps nothing
    but the module, whose int8 codes and scales are resident anyway: the input is not quantized (the product
    is the dequantized weight's, in the input's dtype, as the 4-bit path computes), and the weight is
    dequantized once per forward and once per backward, a transient the size of one 16-bit weight (which the
    planner counts). Eval and layers whose weight trains keep bitsandbytes' own path.
    """
    from bitsandbytes.nn import Linear8bitLt

    for module in model.modules():
        if isinstance(module, Linear8bitLt) and not module.state.has_fp16_weights:
            module.forward = _int8_forward.__get__(module)  # type: ignore[method-assign]  # this instance only
    return model


def _int8_forward(module: Any, x: torch.Tensor) -> torch.Tensor:
    from bitsandbytes.nn import Linear8bitLt

    if module.weight.CB is not None:  # the first call moves the codes onto the state, as bitsandbytes does
        module.init_8bit_state()
    state = module.state
    if not (module.training and state.CB is not None and state.SCB is not None):
        return Linear8bitLt.forward(module, x)
    state.is_training = True
    bias = module.bias
    if bias is not None and bias.dtype != x.dtype:
        bias.data = bias.data.to(x.dtype)  # as bitsandbytes does
    out = _FrozenInt8Matmul.apply(x, state.CB, state.SCB, bias)
    module.weight.data = state.CB
    return out


def _frozen_int8_class() -> Any:
    import torch

    class FrozenInt8Matmul(torch.autograd.Function):
        """``x @ (CB * SCB / 127).T + bias`` with a frozen int8 weight: only the codes are kept for backward."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor, bias: Any) -> Any:
            w = cb.to(x.dtype).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))
            ctx.save_for_backward(cb, scb)  # resident module tensors: no new memory
            ctx.bias_dtype = None if bias is None else bias.dtype
            return torch.nn.functional.linear(x, w, bias)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:
            cb, scb = ctx.saved_tensors
            grad_x = None
            if ctx.needs_input_grad[0]:
                w = cb.to(grad.dtype, copy=True).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))
                grad_x = torch.matmul(grad, w)
            grad_bias = None
            if ctx.needs_input_grad[3]:
                grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0, dtype=ctx.bias_dtype)
            return grad_x, None, None, grad_bias

    return FrozenInt8Matmul


class _FrozenInt8MatmulMeta(type):
    """Builds the autograd function when first used (this module is imported without torch)."""

    _fn: Any = None

    def apply(cls, *args: Any) -> Any:
        if cls._fn is None:
            cls._fn = _frozen_int8_class()
        return cls._fn.apply(*args)


class _FrozenInt8Matmul(metaclass=_FrozenInt8MatmulMeta):
    pass


def quantized_modules(config: Any) -> dict[str, bool]:
    """Names of the modules transformers quantizes for ``config``, each mapped to "is a GPT-2 Conv1D".

    Built on the meta device (no memory): every ``nn.Linear``/``Conv1D`` except the ones transformers
    keeps in full precision (the output head and anything tied to the embeddings).
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    skip = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    out: dict[str, bool] = {}
    for name, module in model.named_modules():
        if not should_convert_module(name, skip):
            continue
        if isinstance(module, Conv1D) or type(module) is torch.nn.Linear:
            out[name] = isinstance(module, Conv1D)
    return out


def dequantized_weight(
    weight: torch.Tensor, q: QuantizationConfig, compute_dtype: torch.dtype, conv1d: bool = False
) -> torch.Tensor:
    """``weight`` as a quantized model computes with it: quantized the way loading does, then dequantized.

    The weight is cast to ``compute_dtype`` (the dtype loading hands to the quantizer), quantized with the
    recipe's bits / quant_type / double_quant, and dequantized; returned in fp32 in ``weight``'s layout
    (``conv1d``: GPT-2 stores [in, out] and transformers quantizes the transpose).
    """
    import bitsandbytes.functional as bnbf
    import torch

    w = weight.to(compute_dtype)
    if conv1d:
        w = w.t()
    w = w.contiguous().cpu()
    if q.bits == 4:
        packed, state = bnbf.quantize_4bit(
            w, blocksize=BLOCKSIZE_4BIT, compress_statistics=q.double_quant, quant_type=q.quant_type
        )
        deq = bnbf.dequantize_4bit(packed, state)
    else:
        # LLM.int8: symmetric per-row absmax to int8 (the outlier columns are computed from these same
        # int8 rows' fp16 copy only when has_fp16_weights, which QLoRA does not use).
        codes, row_absmax, _ = bnbf.int8_vectorwise_quant(w.to(torch.float16))
        deq = codes.float() * (row_absmax.float().unsqueeze(1) / 127.0)
    deq = deq.float()
    return deq.t().contiguous() if conv1d else deq


def quantize_on_meta(model: torch.nn.Module, loaded: LoadedRecipe, spec: ExecSpec) -> dict[str, bool]:
    """Swap ``model``'s quantizable linears (on meta) for bitsandbytes ``Linear4bit`` whose weights are packed
    4-bit codes on meta, shaped and typed as the quantizing loader stores them; returns the swapped modules'
    names, each mapped to "is a GPT-2 Conv1D" (whose checkpoint weight is the transpose of what is quantized).

    transformers' own ``replace_with_bnb_linear`` picks the modules and builds them, so the set and the
    modules' settings are those of ``from_pretrained(quantization_config=...)``. The weights are then given
    the packed shape, ``[ceil(n / per element), 1]`` in the storage dtype, so that ``fully_shard`` shards the
    codes as it does those of a loaded model; :func:`quantize_weight` fills them.
    """
    import bitsandbytes as bnb
    import torch
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer

    from finetune.model.experts import storage_dtype

    assert spec.quant is not None and spec.quant.bits == 4, "only 4-bit weights are quantized on meta"
    storage = storage_dtype(spec.quant)  # uint8 on one process, the compute dtype under FSDP2
    config = bnb_config(loaded.recipe, torch_dtype(spec.quant.compute_dtype), storage)
    hf = cast("PreTrainedModel", model)  # a transformers model built from its config
    skip = HfQuantizer.get_modules_to_not_convert(hf, None, getattr(model, "_keep_in_fp32_modules", None))
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=config)
    out: dict[str, bool] = {}
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        w = cast(bnb.nn.Params4bit, module.weight)  # Linear4bit's weight; nn.Linear's type says Tensor
        n = w.numel()
        packed = torch.empty(((n + 1) // (storage.itemsize * 2), 1), dtype=storage, device="meta")
        module.weight = bnb.nn.Params4bit(
            packed,
            requires_grad=False,
            blocksize=w.blocksize,
            compress_statistics=w.compress_statistics,
            quant_type=w.quant_type,
            quant_storage=storage,
            module=module,
            bnb_quantized=True,
        )
        if module.bias is not None:  # built in torch's default dtype; the quantizing loader loads it as the base
            module.bias.data = module.bias.data.to(torch_dtype(spec.tensor_dtype(f"{name}.bias", False)))
        source_cls: Any = module.source_cls  # the class replace_with_bnb_linear replaced
        out[name] = issubclass(source_cls, Conv1D)
    # What transformers' quantizer marks after loading; peft's LoRA reads it to wrap Linear4bit layers.
    marked: Any = model  # (nn.Module types attributes as tensors)
    marked.is_loaded_in_4bit = True
    return out


def quantize_weight(weight: torch.Tensor, q: QuantSpec, conv1d: bool = False) -> tuple[torch.Tensor, Any]:
    """The packed 4-bit codes and bitsandbytes ``QuantState`` of one checkpoint weight, exactly as the
    quantizing loader computes them: cast to the compute dtype, transposed for a GPT-2 Conv1D, quantized in
    blocks of 64 with the spec's quant_type / double quantization, packed into the storage dtype."""
    import bitsandbytes.functional as bnbf

    from finetune.model.experts import storage_dtype

    w = weight.to(torch_dtype(q.compute_dtype))
    if conv1d:
        w = w.t()
    return bnbf.quantize_4bit(
        w.contiguous(),
        blocksize=BLOCKSIZE_4BIT,
        compress_statistics=q.double_quant,
        quant_type=q.quant_type,
        quant_storage=storage_dtype(q),
    )
