"""What a run writes into output.dir: the run files before training (the resolved recipe and the plan) and,
at the end, the trained model (streamed one tensor at a time) or adapter, with the tokenizer.

The final model is written into a hidden directory of output.dir (:class:`FinalStaging`), fsynced, and only
then moved in file by file (config.json last), so a kill or a full disk during the save never leaves a
half-written model file under a name a loader reads, and an earlier model's files stay whole until replaced.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import torch

from finetune.errors import UserError
from finetune.recipe.schema import LoadedRecipe, recipe_to_yaml
from finetune.train.checkpoint.checkpointer import FINAL_STAGING_PREFIX, remove_final_leftovers
from finetune.train.parallel.distributed import DistContext

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


def _save_plain_lora(inner: Any, out_dir: Path, state: dict[str, Any]) -> None:
    """A pissa/olora run's adapter saved as a plain LoRA (rank 2r) of the original base: the base weights the
    run trained on had the initial adapter subtracted, and no one else has them (merge and
    PeftModel.from_pretrained load the original base)."""
    import math

    from finetune.model.adapters import LORA_INIT_ATTR, plain_lora

    config = inner.peft_config["default"]
    kept = (config.r, config.lora_alpha, config.init_lora_weights)
    config.r, config.init_lora_weights = 2 * kept[0], True
    config.lora_alpha = kept[1] * (math.sqrt(2) if config.use_rslora else 2)
    try:
        plain = plain_lora(state, getattr(inner, LORA_INIT_ATTR))
        inner.save_pretrained(out_dir, state_dict=plain, safe_serialization=True)
    finally:
        config.r, config.lora_alpha, config.init_lora_weights = kept


#: What a new final model replaces beyond its own names: an earlier model's shards and index.
MODEL_FILES = ("model.safetensors", "model-*.safetensors", "model.safetensors.index.json")


class FinalStaging:
    """``with FinalStaging(out_dir, ctx) as where:`` the directory the final save writes into: on rank 0 a new
    hidden directory of ``out_dir`` (an earlier one, left by a save cut short, removed first), moved into
    ``out_dir`` when the block succeeds and removed when it fails; on the other ranks ``out_dir`` itself (they
    write nothing). ``files``: what was moved in (rank 0)."""

    def __init__(self, out_dir: Path, ctx: DistContext) -> None:
        self.out_dir, self.main = out_dir, ctx.is_main
        self.dir = out_dir / f"{FINAL_STAGING_PREFIX}{os.getpid()}"
        self.files: list[str] = []

    def __enter__(self) -> Path:
        if not self.main:
            return self.out_dir
        self.out_dir.mkdir(parents=True, exist_ok=True)
        remove_final_leftovers(self.out_dir)
        self.dir.mkdir()
        return self.dir

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.main:
            return
        if kind is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        from finetune.storage.swap import move_in

        replaces = MODEL_FILES if any(p.name.startswith("model") for p in self.dir.glob("*.safetensors")) else ()
        self.files = move_in(self.dir, self.out_dir, last=("config.json",), stale=replaces)


def save_final(
    model: torch.nn.Module, inner: torch.nn.Module, tokenizer: Any, out_dir: Path, ctx: DistContext, *,
    adapters: bool, max_shard_bytes: int,
) -> list[str]:
    """Write the trained model (HF directory) or adapter (PEFT directory) and the tokenizer, on rank 0, staged
    and moved into ``out_dir`` (:class:`FinalStaging`); returns the names written (on rank 0; [] elsewhere).

    Every rank calls this. Nothing is gathered whole: a full fine-tune is streamed one tensor at a time
    (:func:`write_model_streamed`); an adapter run gathers only the adapters. Under a pipeline ``model`` is
    this rank's stage model and the output holds every stage's weights (:func:`stage_specs`).
    """
    from transformers.utils import logging as hf_logging

    from finetune.model.adapters import (
        LORA_INIT_ATTR,
        has_bottlenecks,
        prefix_tokens,
        prompt_tokens,
        save_bottlenecks,
    )
    from finetune.model.experts import add_to_peft_dir, experts_layer_names, peft_layout
    from finetune.train.parallel.parallelize import is_sharded

    hf_logging.disable_progress_bar()  # "Writing model shards" bars between our own lines
    # peft saves a prefix (or a prompt) by running its prompt encoder, which FSDP2 keeps sharded in the root
    # unit: gather the root's parameters on every rank for the save (a collective), and shard them again after.
    gather_root = ctx.distributed and is_sharded(model) and (prefix_tokens(inner) > 0 or prompt_tokens(inner) > 0)
    if is_sharded(model):
        # An evaluation leaves FSDP2's root unit gathered (it never reshards after forward): its registered
        # parameters are then the all-gather's views, whose values a save read as garbage (measured: the final
        # norm's weights at 1e-22, the embeddings NaN). Back to the sharded parameters, which hold the trained
        # values, before anything reads them.
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    if gather_root:
        cast("FSDPModule", model).unshard()  # is_sharded(model) said so
    hf: Any = inner  # a transformers PreTrainedModel or a peft model
    staging = FinalStaging(out_dir, ctx)
    with staging as where:
        if adapters:  # the trained parameters only, each gathered whole (the frozen base is never gathered)
            trained: dict[str, torch.Tensor] = {name: p for name, p in inner.named_parameters() if p.requires_grad}
            state = (
                stage_tensors_on_main(trained, ctx) if ctx.layout.pp_enabled
                else {n: _whole(p) for n, p in trained.items()}
            )
            if ctx.is_main:
                if has_bottlenecks(inner):  # our own adapter format; the base stays where it is
                    save_bottlenecks(inner, where, state, base=getattr(inner.config, "_name_or_path", None))
                elif getattr(inner, LORA_INIT_ATTR, None) is not None:
                    _save_plain_lora(inner, where, state)
                elif experts_layer_names(inner):  # expert adapters in peft's target_parameters layout
                    rest, tensors, targets = peft_layout(state, inner)
                    hf.save_pretrained(where, state_dict=rest, safe_serialization=True)
                    add_to_peft_dir(where, tensors, targets, experts_layer_names(inner))
                else:
                    hf.save_pretrained(where, state_dict=state, safe_serialization=True)
                if ctx.layout.pp_enabled:
                    _save_every_stage_adapter(hf, where, state)
        else:
            write_model_streamed(inner, where, ctx, max_shard_bytes)
            if ctx.is_main:
                hf.config.save_pretrained(where)
                if getattr(inner, "generation_config", None) is not None:
                    hf.generation_config.save_pretrained(where)
        if ctx.is_main:
            tokenizer.save_pretrained(where)
    ctx.wait_barrier()  # rank 0 writes the files while the others wait (the wait group's timeout)
    if gather_root:
        cast("FSDPModule", model).reshard()
    return staging.files


def _save_every_stage_adapter(peft_model: Any, out_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """The adapter file with every stage's tensors: peft's save keeps only the adapters of the layers this
    rank's stage model holds; the file is rewritten with all of them, named as peft names them (without the
    adapter's name)."""
    from safetensors.torch import save_file

    name = f".{peft_model.active_adapter}."
    renamed = {k.replace(name, "."): v.contiguous() for k, v in state.items()}
    save_file(renamed, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})


def stage_specs(tensors: dict[str, torch.Tensor], ctx: DistContext) -> list[tuple[int, str, list[int], torch.dtype]]:
    """(owner pp rank, name, whole shape, dtype) of every pipeline stage's ``tensors``, in the whole model's order
    (stage by stage: pp rank r runs stage r first), on every rank (a collective of every rank: each sends its
    names, shapes and dtypes as JSON, never unpickled, and takes those of its pipeline group's ranks; shapes are
    known without gathering)."""
    import torch.distributed as dist

    from finetune.train.parallel.distributed import all_gather_json

    # a DTensor's shape is its whole shape; a dtype travels as its name (torch.bfloat16 -> "bfloat16")
    mine = [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in tensors.items()]
    everyone = all_gather_json(mine)
    stages = [everyone[rank] for rank in dist.get_process_group_ranks(ctx.layout.pp_group)]  # in pp order
    return [(owner, str(n), [int(x) for x in shape], _dtype(name))
            for owner in range(ctx.layout.pp) for n, shape, name in stages[owner]]


def _dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (``bfloat16``), as :func:`stage_specs` sends it."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a pipeline stage sent `{name}`, which is no torch dtype")
    return dtype


def stage_tensor_to_main(
    owner: int, name: str, shape: list[int], dtype: torch.dtype, tensors: dict[str, torch.Tensor], ctx: DistContext
) -> torch.Tensor | None:
    """One stage's tensor, whole, on global rank 0 (None elsewhere): gathered over its stage's dp x tp ranks when
    it is a DTensor, then sent to rank 0 by the stage's rank at dp 0, tp 0 (rank 0's pipeline group). Every rank
    calls, in the same order."""
    import torch.distributed as dist

    layout = ctx.layout
    group = layout.pp_group
    if owner == layout.pp_rank:
        whole = _whole(tensors[name])
        if ctx.is_main:
            return whole
        if layout.dp_rank == 0 and layout.tp_rank == 0:
            dist.send(whole.to(ctx.device).contiguous(), group=group, group_dst=0)
        return None
    if ctx.is_main:
        buf = torch.empty(shape, dtype=dtype, device=ctx.device)
        dist.recv(buf, group=group, group_src=owner)
        return buf.cpu()
    return None


def stage_tensors_on_main(tensors: dict[str, torch.Tensor], ctx: DistContext) -> dict[str, torch.Tensor]:
    """Every pipeline stage's ``tensors``, whole, on rank 0 (an empty dict elsewhere), one at a time."""
    out = {}
    for owner, name, shape, dtype in stage_specs(tensors, ctx):
        t = stage_tensor_to_main(owner, name, shape, dtype, tensors, ctx)
        if t is not None:
            out[name] = t
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on CPU (a DTensor is all-gathered: every rank must call)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().cpu()


def unique_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict tensors by name, in its order; a weight shared by two names (tied embeddings) is
    kept once, under its first name, as ``save_pretrained`` writes it."""
    named: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    for name in model.state_dict(keep_vars=True):
        t = tensors[name]
        if id(t) not in seen:
            seen.add(id(t))
            named[name] = t
    return named


def write_shards(
    out_dir: Path,
    specs: list[tuple[str, list[int], torch.dtype]],
    fetch: Callable[[str], torch.Tensor | None],
    ctx: DistContext,
    max_shard_bytes: int,
) -> list[str]:
    """Safetensors files of at most ``max_shard_bytes`` and their index, written one tensor at a time (every rank
    calls, in the same order).

    ``specs``: (name, shape, dtype) of every tensor, so the headers and the split are fixed before any tensor is
    whole; ``fetch(name)``: that tensor whole on rank 0 (other ranks may get None), a collective where the
    tensor is sharded. ``out_dir`` is a new directory (:class:`FinalStaging`'s): an earlier model's shards are
    replaced when it is moved in. Returns the file names (on every rank).
    """
    from finetune.storage.safetensors_stream import ShardWriter, plan_shards, write_index

    shards = plan_shards(specs, max_shard_bytes)
    for file, file_specs in shards:
        writer = ShardWriter(out_dir / file, file_specs) if ctx.is_main else None
        for name, _, _ in file_specs:
            whole = fetch(name)
            if writer is not None:
                assert whole is not None
                writer.write(name, whole)
            del whole
        if writer is not None:
            writer.close()
    if ctx.is_main:
        write_index(out_dir, shards)
    return [file for file, _ in shards]


def write_model_streamed(inner: torch.nn.Module, out_dir: Path, ctx: DistContext, max_shard_bytes: int) -> list[str]:
    """The model's weights as ``from_pretrained`` reads them, one tensor at a time (every rank calls).

    Shapes and dtypes are known without gathering, so the safetensors headers and the split into files of
    at most ``max_shard_bytes`` are fixed up front; then each tensor is all-gathered (a DTensor), written by
    rank 0 and dropped, so no rank holds more than one whole tensor beyond its shards. Under a pipeline
    ``inner`` is this rank's stage model: the files hold every stage's tensors, each sent to rank 0 by its stage. A weight shared by two
    names (tied embeddings) is written once, under its first name, as ``save_pretrained`` does. Returns the
    file names (on every rank).
    """
    named = unique_tensors(inner)
    if ctx.layout.pp_enabled:  # every stage's tensors, planned from their shapes, each sent to rank 0 in turn
        where = {name: (owner, shape, dtype) for owner, name, shape, dtype in stage_specs(named, ctx)}
        return write_shards(
            out_dir, [(name, shape, dtype) for name, (_, shape, dtype) in where.items()],
            lambda name: stage_tensor_to_main(where[name][0], name, *where[name][1:], named, ctx), ctx, max_shard_bytes,
        )
    specs = [(name, list(t.shape), t.dtype) for name, t in named.items()]
    return write_shards(out_dir, specs, lambda name: _whole(named[name]), ctx, max_shard_bytes)


def write_run_files(loaded: LoadedRecipe, plan_dict: dict[str, Any]) -> Path:
    """Save the resolved recipe and the plan in the output directory (before training, by global rank 0)."""
    out = Path(loaded.recipe.output.dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"output.dir: cannot create {out} ({exc.strerror}); choose a writable directory") from None
    if not os.access(out, os.W_OK):
        raise UserError(f"output.dir: {out} is not writable; choose a writable directory")
    (out / "recipe.yaml").write_text(recipe_to_yaml(loaded.recipe))
    (out / "plan.json").write_text(json.dumps(plan_dict, indent=2) + "\n")
    return out
