"""Build the model a Plan asks for: tokenizer, weights (pretrained or seeded random), dtype, adapters.

Order: load -> (quantize) -> adapters; tensor parallelism, activation checkpointing, compilation, sharding
and data parallelism are applied afterwards, once for every load path, by finetune.train.parallel.parallelize.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import torch

from finetune.model import flex
from finetune.model.kernels import use_experts_kernel
from finetune.model.methods import training_of
from finetune.recipe.schema import LoadedRecipe
from finetune.spec import ExecSpec
from finetune.train.precision import keep_fp32
from finetune.units import DTYPE_NAMES, torch_dtype


def resolve_model_path(loaded: LoadedRecipe) -> str:
    """The directory to load ``model.path`` from (resolved once by load_recipe); a clear error otherwise."""
    assert loaded.inputs is not None, "load_recipe resolves the inputs"
    return loaded.inputs.model.weights_dir()


def load_tokenizer(loaded: LoadedRecipe) -> Any:
    """The model's tokenizer, with a pad token (eos when the tokenizer has none)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(loaded)
    tok = AutoTokenizer.from_pretrained(
        path, trust_remote_code=loaded.recipe.model.trust_remote_code, local_files_only=True
    )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_base_model(
    loaded: LoadedRecipe, spec: ExecSpec, device: torch.device, base_dir: Path | None = None
) -> torch.nn.Module:
    """The base model on ``device`` in its storage dtype (4-bit for qlora), before adapters.

    ``base_dir``: where a random-init base is saved (full precision, before quantization or adapters), so
    that an adapter run can be reloaded and merged without re-deriving the seed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.train.runtime.heap import fix_mmap_threshold

    fix_mmap_threshold()  # before the first large block is freed (finetune/train/runtime/heap.py)
    r = loaded.recipe
    path = resolve_model_path(loaded)
    dtype = torch_dtype(spec.base_dtype(False))
    common = {"trust_remote_code": r.model.trust_remote_code, "attn_implementation": spec.attention}
    flex.install_if(spec.attention)
    if spec.quant is not None:
        from finetune.train.model.quantize import load_quantized

        return load_quantized(loaded, path, spec, device, base_dir=base_dir)
    if r.model.init == "random":
        config = AutoConfig.from_pretrained(path, trust_remote_code=r.model.trust_remote_code, local_files_only=True)
        torch.manual_seed(r.train.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **common)
        keep_fp32(model, spec)
        if base_dir is not None:
            save_pretrained_base(model, base_dir)
    else:
        # Straight onto the device in the storage dtype, tensor by tensor: no whole copy in host memory.
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, device_map={"": device}, **common
        )
    return use_experts_kernel(keep_fp32(model, spec).to(device), device, spec.compute_dtype)


def add_adapters(
    model: torch.nn.Module, loaded: LoadedRecipe, spec: ExecSpec, *, on_meta: bool = False
) -> torch.nn.Module:
    """What ``spec.adapter`` trains, on the frozen ``model`` (finetune.model.adapters.inject: peft LoRA/DoRA, peft
    prefix tuning, or bottleneck adapters); full fine-tuning trains every weight.

    ``on_meta``: the base has no values yet, so pissa/olora are not decomposed here (the sharded load does it
    after loading, finetune.train.model.load.init_decomposed); the peft config still names the init.
    """
    # QLoRA: no peft prepare_model_for_kbit_training. It would upcast the frozen embeddings, norms and head to
    # fp32, which doubles the residual stream's activations (every 4-bit matmul returns its input's dtype) and
    # the head's storage: Llama-3.1-8B at 4096 tokens needed more memory under QLoRA than under LoRA. They stay
    # in the compute dtype, as LoRA's frozen base does; get_peft_model freezes them and keeps adapters fp32.
    training = training_of(spec)
    adapted = training.inject(model, stand_in=on_meta)
    if on_meta:
        training.prepare_on_meta(adapted)
    return adapted


def build_model(
    loaded: LoadedRecipe, spec: ExecSpec, device: torch.device, *, base_dir: Path | None = None
) -> torch.nn.Module:
    """Base model + adapters, stored as ``spec`` says (activation checkpointing, compilation and wrapping
    are finetune.train.parallel.parallelize's, applied once for every strategy and load path).

    ``base_dir``: see :func:`load_base_model` (given by rank 0 of an adapter run from a random init).
    """
    model = load_base_model(loaded, spec, device, base_dir)
    model = add_adapters(model, loaded, spec)
    seeded = training_of(spec).seeded_init  # None for pissa/olora: A and B are the decomposition peft made
    if seeded is not None:
        init_adapters(model, loaded.recipe.train.seed, gaussian=seeded == "gaussian")
    if hasattr(model, "config"):
        config: Any = model.config  # a transformers PretrainedConfig (nn.Module types attributes as tensors)
        config.use_cache = False
    return model


def broadcast_decomposed(model: torch.nn.Module) -> None:
    """Rank 0's pissa/olora decomposition on every rank of a whole-model run (ddp, zero1): the residual base
    weights, A and B, and the kept initial adapter (every rank calls; nothing to do for other inits).

    Each rank decomposed its own copy when peft injected the adapters; an SVD's signs and order are only as
    reproducible as the LAPACK build and its threads, and DDP broadcasts no frozen weight, so without this a
    rank could train on another residual than rank 0's, and rank 0 alone saves the initial adapter.
    """
    import torch.distributed as dist

    from finetune.model.adapters import LORA_INIT_ATTR

    initial = getattr(model, LORA_INIT_ATTR, None)
    if initial is None or not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict):
                layer: Any = module  # a peft LoRA layer (it has lora_A)
                dist.broadcast(layer.get_base_layer().weight.data, src=0)
        for name, p in model.named_parameters():
            if name in initial:
                dist.broadcast(p.data, src=0)
                dist.broadcast(initial[name], src=0)


def stored_bytes_by_dtype(model: torch.nn.Module) -> dict[str, int]:
    """Parameter bytes of ``model`` per dtype name (quantized codes as stored, without their constants)."""
    names = {v: k for k, v in DTYPE_NAMES.items() if k != "bf16-pure"}
    names.update({"uint8": "uint8", "int8": "int8"})
    out: dict[str, int] = {}
    for p in model.parameters():
        name = names.get(str(p.dtype).removeprefix("torch."), str(p.dtype))
        out[name] = out.get(name, 0) + p.numel() * p.element_size()
    return out


def check_model_storage(model: torch.nn.Module, spec: ExecSpec, expected: dict[str, int] | None) -> None:
    """The built model stores every tensor as the execution spec says: trained weights in its trainable dtype,
    the frozen base in its frozen or quantized dtype, and ``expected`` bytes per dtype (the planner's inventory).

    Called at run start on every rank, before wrapping; a mismatch is a bug in the trainer or the planner, so
    it is an ``AssertionError`` naming the first tensor (or dtype) that differs, not a user error.
    """
    for name, p in model.named_parameters():
        quantized = type(p).__name__ in ("Params4bit", "Int8Params", "ExpertCodes4bit")
        if p.requires_grad and spec.method.adapters:
            want = spec.trainable_dtype
        elif quantized:
            assert spec.quant is not None, f"{name} is quantized but the execution spec has no quantization"
            want = spec.quant.storage_dtype
        else:  # a base weight: trained (full) or frozen, or one the architecture keeps in fp32
            want = spec.tensor_dtype(name, False)
        got = str(p.dtype).removeprefix("torch.")
        assert got == DTYPE_NAMES.get(want, want), f"{name} is stored as {got}, the execution spec says {want}"
    if expected is not None:
        actual = stored_bytes_by_dtype(model)
        assert actual == expected, f"the model stores {actual} bytes per dtype, the plan counted {expected}"


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts, a 4-bit weight counted as the weights it stands for (as peft's
    ``get_nb_trainable_parameters``)."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        if type(p).__name__ in ("Params4bit", "ExpertCodes4bit"):
            # bitsandbytes packs two 4-bit codes per byte of its storage dtype (uint8, or bf16 under FSDP)
            n *= 2 * p.element_size()
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def save_pretrained_base(model: torch.nn.Module, out: Path) -> None:
    """Save a (random-init) base model as a HF directory, so an adapter run is reproducible and mergeable."""
    out.mkdir(parents=True, exist_ok=True)
    hf: Any = model  # a transformers PreTrainedModel
    hf.save_pretrained(out, safe_serialization=True)


def copy_slice(dest: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``dest`` (a DTensor's local shard, or a whole tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(dest, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, dest.device_mesh, dest.placements)
        local = dest.to_local()
        if local.numel():
            index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
            local.copy_(full[index])
        return
    dest.copy_(full)


def init_adapters(model: torch.nn.Module, seed: int, *, gaussian: bool = False) -> None:
    """LoRA's initial adapters, independent of sharding and of the global RNG, with peft's default
    distributions: for a linear layer ``lora_A`` Kaiming-uniform (a=sqrt(5)) and ``lora_B`` zero; for an
    embedding ``lora_embedding_A`` zero and ``lora_embedding_B`` standard normal; ``gaussian`` (lora.init:
    gaussian) draws ``lora_A`` from N(0, 1/r) instead. Each random tensor is drawn from a generator seeded by
    (``seed``, its name), so the adapted model starts as the base everywhere."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind = next(
                (k for k in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B") if f".{k}." in name),
                None,
            )
            if kind is None:
                continue
            full = torch.zeros(p.shape, dtype=torch.float32)
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if kind == "lora_A" and gaussian:
                torch.nn.init.normal_(full, std=1 / p.shape[-2], generator=g)
            elif kind == "lora_A" and p.dim() == 3:  # an expert weight's (experts x r x in): each (r x in) as peft draws it
                from finetune.model.experts import init_lora_a

                init_lora_a(full, g)
            elif kind == "lora_A":
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=g)
            elif kind == "lora_embedding_B":
                torch.nn.init.normal_(full, generator=g)
            copy_slice(p, full.to(p.dtype))
