"""Sharded loading: no rank ever holds the whole model (zero2/fsdp; full fine-tuning and the LoRA base).

The model is built on the meta device (parameters without storage; the small non-persistent buffers such
as rotary tables are real), adapters are injected, then ``finetune.train.parallel.parallelize`` applies
activation checkpointing and ``fully_shard`` as for any run. Only then does :func:`materialize` give each
rank storage for *its* shards and fill them:

- pretrained weights through ``torch.distributed.checkpoint`` with its Hugging Face safetensors reader:
  each rank reads only the slices of its shards (``safe_open(...).get_slice(name)[rows]``, memory-mapped),
  one tensor at a time, and ``copy_`` casts each slice into the storage dtype. No broadcast is needed: the
  file is read where it lies, so a rank's anonymous memory is its shards plus one slice.
- ``model.init: random``: the seeded model is built whole on CPU exactly as before (the draws of
  transformers' init are one sequence over the whole model, so a slice cannot be drawn alone), and each
  rank keeps its slices. This costs the whole model per rank while loading, as it did; random init is for
  tests and tiny models.

Adapters start the same way on every path (:func:`init_adapters`): lora_A drawn per tensor from a generator
seeded by ``train.seed`` and the tensor's name, lora_B zero. The values therefore do not depend on the
sharding, the order of construction or what the base's loading drew from the global RNG.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

from finetune.errors import UserError
from finetune.recipe import LoadedRecipe
from finetune.spec import ExecSpec
from finetune.units import torch_dtype


def loads_sharded(spec: ExecSpec, world_size: int) -> bool:
    """Whether this run builds on meta and materialises per-rank shards (zero2/fsdp on several processes).

    QLoRA keeps transformers' quantizing loader: each rank quantizes the base one tensor at a time and holds
    the 4-bit model until ``fully_shard`` shards it (a quarter of the 16-bit model; see docs/architecture.md).
    """
    return spec.strategy.uses_fsdp and world_size > 1 and spec.quant is None


def build_on_meta(loaded: LoadedRecipe, spec: ExecSpec) -> torch.nn.Module:
    """The base model (storage dtype, parameters on meta, buffers real) with adapters, ready for parallelize."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.train.model import add_adapters, resolve_model_path

    r = loaded.recipe
    path = resolve_model_path(loaded)
    config = AutoConfig.from_pretrained(
        path, trust_remote_code=r.model.trust_remote_code, local_files_only=True
    )
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=torch_dtype(spec.base_dtype(False)),
            trust_remote_code=r.model.trust_remote_code,
            attn_implementation=r.model.attn_implementation,
        )
        model = add_adapters(model, loaded, spec)
    model.config.use_cache = False
    return model


def materialize(
    model: torch.nn.Module,
    loaded: LoadedRecipe,
    spec: ExecSpec,
    device: torch.device,
    base_dir: Path | None = None,
) -> None:
    """Give every (sharded) parameter storage on ``device`` and fill this rank's part (every rank calls).

    ``base_dir``: rank 0 of an adapter run from a random init saves the seeded base there.
    """
    from finetune.train.model import resolve_model_path, save_pretrained_base

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    r = loaded.recipe
    targets = base_targets(model)
    if r.model.init == "random":
        seeded = _seeded_model(loaded, spec)
        if base_dir is not None:
            save_pretrained_base(seeded, base_dir)
        source = seeded.state_dict()
        with torch.no_grad():
            for key, dest in targets.items():
                copy_slice(dest, source.pop(key))
        del seeded, source
    else:
        load_pretrained_shards(targets, Path(resolve_model_path(loaded)))
    init_adapters(model, r.train.seed)


def _seeded_model(loaded: LoadedRecipe, spec: ExecSpec) -> torch.nn.Module:
    """Today's seeded random init, bit for bit: ``torch.manual_seed(train.seed)`` then ``from_config``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.train.model import resolve_model_path

    r = loaded.recipe
    path = resolve_model_path(loaded)
    config = AutoConfig.from_pretrained(
        path, trust_remote_code=r.model.trust_remote_code, local_files_only=True
    )
    torch.manual_seed(r.train.seed)
    return AutoModelForCausalLM.from_config(
        config,
        dtype=torch_dtype(spec.base_dtype(False)),
        trust_remote_code=r.model.trust_remote_code,
        attn_implementation=r.model.attn_implementation,
    )


def base_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights to fill, keyed by their name in a Hugging Face checkpoint (adapters left out).

    A peft model's ``base_model.model.X.base_layer.weight`` is ``X.weight`` in the checkpoint. A parameter
    shared by two names (tied embeddings) is listed once, under its first name.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in model.state_dict(keep_vars=True).items():
        if ".lora_" in name:
            continue
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        p = params.get(name, t)
        if id(p) in seen:
            continue
        seen.add(id(p))
        out[key] = t.detach()
    return out


def checkpoint_keys(path: Path) -> set[str]:
    """The tensor names of a Hugging Face safetensors directory (header only)."""
    from safetensors import safe_open

    from finetune.safetensors_stream import SAFE_INDEX

    if (path / SAFE_INDEX).is_file():
        return set(json.loads((path / SAFE_INDEX).read_text())["weight_map"])
    keys: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            keys.update(st.keys())
    return keys


def load_pretrained_shards(targets: dict[str, torch.Tensor], path: Path) -> None:
    """Fill ``targets`` (DTensor shards or whole tensors) from the safetensors files in ``path``; each rank
    reads its own slices (torch.distributed.checkpoint's Hugging Face reader), cast by ``copy_``."""
    import torch.distributed.checkpoint as dcp

    have = checkpoint_keys(path)
    wanted: dict[str, torch.Tensor] = {}
    for key, t in targets.items():
        found = key if key in have else _unprefixed(key, have)
        if found is None:
            raise UserError(
                f"model.path: {path} has no tensor {key}; is it a checkpoint of this architecture?"
            )
        wanted[found] = t
    dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(path)))


def _unprefixed(key: str, have: set[str]) -> str | None:
    """Older checkpoints store the base model without its prefix (GPT-2's ``h.0...`` for ``transformer.h.0``)."""
    _, _, tail = key.partition(".")
    return tail if tail in have else None


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


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """LoRA's initial adapters, independent of sharding and of the global RNG, with peft's default
    distributions: for a linear layer ``lora_A`` Kaiming-uniform (a=sqrt(5)) and ``lora_B`` zero; for an
    embedding ``lora_embedding_A`` zero and ``lora_embedding_B`` standard normal. Each random tensor is drawn
    from a generator seeded by (``seed``, its name), so the adapted model starts as the base everywhere."""
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
            if kind == "lora_A":
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=g)
            elif kind == "lora_embedding_B":
                torch.nn.init.normal_(full, generator=g)
            copy_slice(p, full.to(p.dtype))
