"""Build the model a Plan asks for: tokenizer, weights (pretrained or seeded random), dtype, adapters.

Order (as in torchtitan's parallelize): load -> (quantize) -> adapters -> activation checkpointing;
sharding and data parallelism are applied afterwards by finetune.train.parallel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from finetune.errors import UserError
from finetune.plan.shapes import lora_targets
from finetune.plan.types import Candidate
from finetune.recipe import LoadedRecipe
from finetune.units import torch_dtype


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls run in for a precision setting."""
    return torch_dtype(precision)


def storage_dtype(loaded: LoadedRecipe, chosen: Candidate) -> torch.dtype:
    """dtype the model's weights are stored in.

    Full fine-tuning under mixed precision keeps fp32 master weights (autocast makes 16-bit copies for the
    matmuls); pure bf16 stores bf16. A frozen LoRA base needs no master copy, so it is stored in the compute
    dtype unless the recipe pins ``model.dtype``.
    """
    pinned = loaded.recipe.model.dtype
    if chosen.precision == "bf16-pure":
        return torch.bfloat16
    if chosen.method == "full":
        return torch.float32
    if pinned != "auto":
        return torch_dtype(pinned)
    return compute_dtype(chosen.precision)


def resolve_model_path(loaded: LoadedRecipe) -> str:
    """A local model directory or a hub id present in the local cache; a clear error otherwise."""
    value = loaded.recipe.model.path
    p = loaded.resolve_input(value)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(f"model.path: {p} has no config.json; it is not a Hugging Face model directory")
        return str(p)
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(value, "config.json")
    except Exception:
        cached = None
    if isinstance(cached, str):
        return value
    from finetune.plan.catalog import catalog_name

    if catalog_name(value) is not None:
        raise UserError(
            f"model.path: `{value}` is a planning-only catalog entry (its public config, no weights); "
            "`finetune plan` can use it, but to train, point model.path at a local copy of the model"
        )
    raise UserError(
        f"model.path: `{value}` is neither a local model directory nor in the Hugging Face cache, and this "
        "tool does not download; download it first or point model.path at a local directory"
    )


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
    loaded: LoadedRecipe, chosen: Candidate, device: torch.device, base_dir: Path | None = None
) -> torch.nn.Module:
    """The base model on ``device`` in its storage dtype (4-bit for qlora), before adapters.

    ``base_dir``: where a random-init base is saved (full precision, before quantization or adapters), so
    that an adapter run can be reloaded and merged without re-deriving the seed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    r = loaded.recipe
    path = resolve_model_path(loaded)
    dtype = storage_dtype(loaded, chosen)
    common = {"trust_remote_code": r.model.trust_remote_code, "attn_implementation": r.model.attn_implementation}
    if chosen.method == "qlora":
        from finetune.train.quantize import load_quantized

        return load_quantized(loaded, path, chosen, device, base_dir=base_dir)
    if r.model.init == "random":
        config = AutoConfig.from_pretrained(path, trust_remote_code=r.model.trust_remote_code, local_files_only=True)
        torch.manual_seed(r.train.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **common)
        if base_dir is not None:
            save_pretrained_base(model, base_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **common)
    return model.to(device)


def add_adapters(model: torch.nn.Module, loaded: LoadedRecipe, chosen: Candidate) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters (lora/qlora); full fine-tuning trains every weight."""
    if chosen.method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    lc = loaded.recipe.lora
    # QLoRA: no peft prepare_model_for_kbit_training. It would upcast the frozen embeddings, norms and head to
    # fp32, which doubles the residual stream's activations (every 4-bit matmul returns its input's dtype) and
    # the head's storage: Llama-3.1-8B at 4096 tokens needed more memory under QLoRA than under LoRA. They stay
    # in the compute dtype, as LoRA's frozen base does; get_peft_model freezes them and keeps adapters fp32.
    config = LoraConfig(
        r=lc.r,
        lora_alpha=lc.alpha,
        lora_dropout=lc.dropout,
        target_modules=lora_targets(lc, model.config.model_type),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"lora.target_modules: {exc}") from None


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder block in backward (non-reentrant torch.utils.checkpoint)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(base, "enable_input_require_grads"):
        # With a frozen embedding, the checkpointed blocks' inputs must require grad for backward to reach them.
        base.enable_input_require_grads()


def build_model(
    loaded: LoadedRecipe, chosen: Candidate, device: torch.device, *, base_dir: Path | None = None
) -> torch.nn.Module:
    """Base model + adapters + activation checkpointing, as the Plan says (single process or per rank).

    ``base_dir``: see :func:`load_base_model` (given by rank 0 of an adapter run from a random init).
    """
    model = load_base_model(loaded, chosen, device, base_dir)
    model = add_adapters(model, loaded, chosen)
    if chosen.activation_checkpointing and chosen.strategy not in ("zero2", "fsdp"):
        enable_activation_checkpointing(model)
    if hasattr(model, "config"):
        model.config.use_cache = False
    return model


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def save_pretrained_base(model: torch.nn.Module, out: Path) -> None:
    """Save a (random-init) base model as a HF directory, so an adapter run is reproducible and mergeable."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
