"""Checkpoints: save, find, check, load and prune them; every write is atomic.

Layout of ``output.dir/checkpoints/step-N/`` (N = optimizer steps done)::

    model.safetensors   full fine-tuning: every weight; lora/qlora: the trainable (adapter) weights only
    optimizer.pt        optimizer state (keyed by parameter name; ZeRO-1: consolidated on rank 0)
    trainer.pt          LR scheduler, fp16 loss scaler, and the RNG states of every rank
                        (python, numpy, torch CPU, torch CUDA)
    recipe.yaml         the resolved recipe of the run
    plan.json           its plan
    meta.json           step, token and skipped-step counters, the data position, per-step losses, and
                        what a resume must match (method, model, world size, strategy); written last

Weights and optimizer state are *gathered* to full tensors on rank 0 and written by rank 0 alone (under FSDP
through ``torch.distributed.checkpoint.state_dict`` with ``full_state_dict=True``), so a checkpoint is the same
files whatever the strategy and needs no shared filesystem to write. To resume, every rank reads
``meta.json`` and ``trainer.pt`` (its own RNG state); under FSDP/ZeRO-2 rank 0 alone reads the weights and
optimizer state and broadcasts them, elsewhere every rank reads them. So on several nodes the checkpoint must
be on a filesystem every node sees. Gathering needs the full state in rank 0's CPU memory.

Atomicity: rank 0 writes into ``checkpoints/.tmp-step-N-<pid>/``, fsyncs every file and the directory, then
renames it to ``step-N`` and fsyncs ``checkpoints/``. Only names ``step-N`` holding a ``meta.json`` count as
checkpoints, so a write cut short (kill, crash, full disk) is never chosen by ``--resume``; leftovers are
removed by the next save.

Loading uses ``torch.load(weights_only=True)`` and ``safetensors``: a checkpoint cannot run code.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: finding and checking checkpoints needs none of it
    import torch

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
#: What a run writes at the top of output.dir besides checkpoints/ and base/ (``--overwrite`` removes them).
RUN_FILES = (
    METRICS,
    "trackers.json",  # tracker run ids (finetune.train.trackers): a fresh run starts new tracker runs
    "recipe.yaml",
    "plan.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "adapter_config.json",
)
META = "meta.json"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------------------------------
# Finding checkpoints (no torch needed: used by the CLI's preflight)
# --------------------------------------------------------------------------------------------------


def checkpoints_dir(out_dir: str | os.PathLike[str]) -> Path:
    """``output.dir/checkpoints``."""
    return Path(out_dir) / CHECKPOINTS


def _step_of(name: str) -> int | None:
    if not name.startswith("step-"):
        return None
    tail = name[len("step-") :]
    return int(tail) if tail.isdigit() else None


def list_checkpoints(out_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``out_dir`` as (step, path), oldest first."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = _step_of(p.name)
        if step is not None and p.is_dir() and (p / META).is_file():
            found.append((step, p))
    return sorted(found)


def latest_checkpoint(out_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``out_dir``, or None."""
    found = list_checkpoints(out_dir)
    return found[-1][1] if found else None


def read_meta(ckpt: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``meta.json`` of a checkpoint directory."""
    return json.loads((Path(ckpt) / META).read_text())


def resolve_resume(spec: str, out_dir: str | os.PathLike[str]) -> Path:
    """The checkpoint ``--resume`` means: ``latest`` (newest complete one in output.dir) or a directory.

    A run directory (holding ``checkpoints/``) stands for its newest checkpoint. Raises a one-line
    :class:`UserError` when there is nothing complete to resume from.
    """
    if spec == "latest":
        found = latest_checkpoint(out_dir)
        if found is None:
            raise UserError(
                f"--resume: no complete checkpoint in {checkpoints_dir(out_dir)}; run without --resume to start, "
                "or give --resume PATH"
            )
        return found
    p = Path(spec).expanduser()
    if p.is_dir() and (p / CHECKPOINTS).is_dir() and not (p / META).is_file():
        found = latest_checkpoint(p)
        if found is None:
            raise UserError(f"--resume: {p} holds no complete checkpoint; give a checkpoints/step-N directory")
        return found
    if not p.is_dir():
        raise UserError(f"--resume: {p} does not exist; give a checkpoints/step-N directory or `latest`")
    if not (p / META).is_file():
        raise UserError(f"--resume: {p} is not a complete checkpoint (no {META}); choose another, or `latest`")
    return p


def run_identity(
    method: str, model_path: str, world_size: int, strategy: str, recipe: Any, tp: int = 1
) -> dict[str, Any]:
    """What a checkpoint records about its run and a resume must match (a TP run resumes on the same mesh)."""
    ident = {
        "method": method,
        "model": str(model_path),
        "world_size": int(world_size),
        "strategy": strategy,
        "tp": int(tp),
        "global_batch_size": recipe.train.global_batch_size,
        "seed": recipe.train.seed,
    }
    if method in ("lora", "qlora"):
        ident["lora"] = {"r": recipe.lora.r, "target_modules": recipe.lora.target_modules}
        if recipe.lora.use_dora:
            ident["lora"]["use_dora"] = True
    elif method == "prefix":
        ident["prefix"] = recipe.prefix.model_dump()
    elif method == "adapter":
        ident["adapter"] = recipe.adapter.model_dump()
    return ident


_WHAT = {
    "method": ("method", "the method"),
    "model": ("model.path", "the model"),
    "world_size": ("--nproc", "the number of processes"),
    "strategy": ("distributed.strategy", "the strategy"),
    "tp": ("distributed.tp", "the tensor-parallel degree"),
    "global_batch_size": ("train.global_batch_size", "the global batch size"),
    "seed": ("train.seed", "the seed"),
    "lora": ("lora", "the adapter shape (lora.r, lora.target_modules)"),
    "prefix": ("prefix", "the prefix settings"),
    "adapter": ("adapter", "the bottleneck adapter settings"),
}


def check_resume_matches(ckpt: Path, identity: dict[str, Any]) -> None:
    """Refuse (one line) to resume ``ckpt`` with a run that differs in what the checkpoint depends on."""
    saved = read_meta(ckpt).get("identity", {})
    for key, want in identity.items():
        have = saved.get(key, 1 if key == "tp" else None)  # checkpoints from before TP: tp 1
        if have != want:
            knob, what = _WHAT.get(key, (key, key))
            raise UserError(
                f"--resume: {ckpt} was saved with {what} {_show(have)} but this run has {_show(want)}; "
                f"set {knob} back to {_show(have)} or start a new run in another output.dir"
            )


def _show(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def check_fresh_start(out_dir: str | os.PathLike[str]) -> None:
    """Refuse to start from scratch over an earlier run (its checkpoints or metrics.jsonl) in ``out_dir``:
    a fresh start would destroy it. ``--resume`` continues it, ``--overwrite`` (:func:`clear_run`) replaces it."""
    newest = latest_checkpoint(out_dir)
    if newest is not None:
        state = "a finished" if read_meta(newest).get("final") else "an unfinished"
        raise UserError(
            f"output.dir: {out_dir} holds {state} run (newest checkpoint {newest.name}); continue it with "
            "--resume, replace it with --overwrite, or choose another output.dir"
        )
    if (Path(out_dir) / METRICS).is_file():
        raise UserError(
            f"output.dir: {out_dir} holds the {METRICS} of an earlier run (no checkpoint to resume); "
            "replace it with --overwrite, or choose another output.dir"
        )


def clear_run(out_dir: str | os.PathLike[str]) -> None:
    """``--overwrite``: remove what an earlier run left in ``out_dir`` (checkpoints, metrics, saved model or
    adapter), so nothing of it mixes with the new run. Only names finetune writes are touched."""
    out = Path(out_dir)
    clear_checkpoints(out)
    if out.is_dir():
        for p in out.iterdir():
            if p.name in RUN_FILES or (p.name.startswith("model-") and p.name.endswith(".safetensors")):
                p.unlink(missing_ok=True)
        if (out / "base").is_dir() and (out / "base" / "config.json").is_file():
            shutil.rmtree(out / "base", ignore_errors=True)


def clear_checkpoints(out_dir: str | os.PathLike[str]) -> int:
    """Remove every checkpoint of a finished earlier run in ``out_dir`` (a fresh start); return how many."""
    found = list_checkpoints(out_dir)
    for _, p in found:
        shutil.rmtree(p, ignore_errors=True)
    _remove_leftovers(checkpoints_dir(out_dir))
    return len(found)


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics.jsonl rows of steps <= ``step`` (the resumed step), atomically; drop the rest."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(row, dict) and int(row.get("step", 0)) <= step:
            kept.append(line)
    _atomic_text(path, "".join(f"{ln}\n" for ln in kept))


# --------------------------------------------------------------------------------------------------
# Disk space
# --------------------------------------------------------------------------------------------------


def check_free_disk(out_dir: str | os.PathLike[str], one_checkpoint: int, keep: int, existing: int = 0) -> None:
    """Refuse to start when ``out_dir`` cannot hold ``keep`` checkpoints plus the one being written.

    ``existing`` checkpoints already on disk are reused space (pruned or replaced as the run goes).
    """
    from finetune.units import fmt_bytes

    count = max(1, keep + 1 - existing)
    need = one_checkpoint * count
    free = shutil.disk_usage(out_dir).free
    if free < need:
        already = f", less the {existing} already there" if existing else ""
        raise UserError(
            f"output.dir: {out_dir} has {fmt_bytes(free)} free but the checkpoints need about {fmt_bytes(need)} "
            f"({count} x {fmt_bytes(one_checkpoint)}: output.keep={keep} plus one being written{already}); free "
            "space, lower output.keep, or choose another output.dir"
        )


# --------------------------------------------------------------------------------------------------
# Atomic files
# --------------------------------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory
    finally:
        os.close(fd)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    _fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _remove_leftovers(root: Path) -> None:
    """Temporary directories of writes that never finished (only rank 0 of one run writes here)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# RNG states
# --------------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's RNG states in types ``torch.load(weights_only=True)`` accepts."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        # one state per GPU visible when saving; restore those this node still has
        for i, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, i)


# --------------------------------------------------------------------------------------------------
# Model and optimizer state (gathered)
# --------------------------------------------------------------------------------------------------


def _sharded(strategy: str) -> bool:
    return strategy in ("zero2", "fsdp")


def trainable_names(inner: torch.nn.Module) -> set[str]:
    """Names of the parameters that train (the adapter under lora/qlora)."""
    return {n for n, p in inner.named_parameters() if p.requires_grad}


def gather_model_state(model: torch.nn.Module, inner: torch.nn.Module, method: str) -> dict[str, Any]:
    """Full (unsharded) CPU tensors of what a checkpoint keeps, on rank 0 (empty elsewhere). Every rank calls."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from finetune.train.parallel import has_dtensors, is_sharded

    if method != "full" and not is_sharded(model) and not has_dtensors(model):  # TP adapters: gathered below
        # The adapters alone, read from the module: torch's state-dict helpers walk every key of the model,
        # and bitsandbytes' 8-bit layers list keys (SCB, weight_format) that are no attributes, which they fail on.
        return {n: p.detach().to("cpu", copy=True) for n, p in inner.named_parameters() if p.requires_grad}
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=opts)
    if method != "full":
        keep = trainable_names(inner)
        state = {k: v for k, v in state.items() if k in keep}
    return state


def gather_optimizer_state(model: torch.nn.Module, optimizer: Any, strategy: str, rank: int) -> dict[str, Any] | None:
    """The whole optimizer state on rank 0 (None elsewhere). Every rank calls (collectives)."""
    if strategy == "zero1":
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if rank == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(model, optimizer, options=opts)
    return state if rank == 0 else None


def _save_tensors(state: dict[str, torch.Tensor], path: Path) -> dict[str, str]:
    """safetensors cannot hold two names of one storage (tied weights): keep the first, return the aliases."""
    from safetensors.torch import save_file

    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return aliases


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """Everything of a run at a step boundary except the modules: counters, position, losses."""

    step: int
    tokens: int
    skipped_steps: int
    position: dict[str, Any]  # BatchStream.position_state: epoch, step_in_epoch, fingerprint
    history: list[float]
    total_steps: int


def save_checkpoint(
    out_dir: Path,
    snap: Snapshot,
    *,
    model: torch.nn.Module,
    inner: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    method: str,
    strategy: str,
    rank: int,
    world_size: int,
    identity: dict[str, Any],
    recipe_yaml: str,
    plan: dict[str, Any],
    keep: int,
    half_written: Callable[[int], None] | None = None,
) -> Path:
    """Write ``checkpoints/step-N`` atomically (rank 0 writes; every rank must call), prune to ``keep``.

    ``half_written(step)`` runs once the tensors are on disk and before meta.json and the rename (a hook).

    Returns the checkpoint's path (on every rank).
    """
    import torch
    import torch.distributed as dist

    model_state = gather_model_state(model, inner, method)
    optim_state = gather_optimizer_state(model, optimizer, strategy, rank)
    rng = [rng_state()]
    if world_size > 1:
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(rng[0], gathered, dst=0)
        rng = gathered or []
    root = checkpoints_dir(out_dir)
    final = root / f"step-{snap.step}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        tmp = root / f".tmp-step-{snap.step}-{os.getpid()}"
        tmp.mkdir()
        aliases = _save_tensors(model_state, tmp / "model.safetensors")
        torch.save(optim_state, tmp / "optimizer.pt")
        trainer = {
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng,
        }
        torch.save(trainer, tmp / "trainer.pt")
        (tmp / "recipe.yaml").write_text(recipe_yaml)
        (tmp / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
        if half_written is not None:
            half_written(snap.step)
        meta = {
            "format": FORMAT_VERSION,
            "step": snap.step,
            "total_steps": snap.total_steps,
            "final": snap.step >= snap.total_steps,
            "tokens": snap.tokens,
            "skipped_steps": snap.skipped_steps,
            "position": snap.position,
            "identity": identity,
            "tied": aliases,
            "history": snap.history,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step after resuming from an older checkpoint
            old = root / f".old-step-{snap.step}-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        prune(out_dir, keep)
    if world_size > 1:
        dist.barrier()
    return final


def prune(out_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; return the deleted ones."""
    found = list_checkpoints(out_dir)
    doomed = [p for _, p in found[:-keep]] if keep > 0 else [p for _, p in found]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def drop_newer(out_dir: Path, step: int) -> list[Path]:
    """Delete checkpoints newer than ``step`` (an abandoned future when resuming an older one)."""
    doomed = [p for s, p in list_checkpoints(out_dir) if s > step]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------


def load_checkpoint(
    ckpt: Path,
    *,
    model: torch.nn.Module,
    inner: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    method: str,
    strategy: str,
    rank: int,
    world_size: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load weights, optimizer, scheduler and scaler from ``ckpt`` into the built objects (every rank calls).

    Returns (meta, this rank's RNG state); restore the RNG state last, just before the first step.
    """
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    meta = read_meta(ckpt)
    if meta.get("format") != FORMAT_VERSION:
        raise UserError(f"--resume: {ckpt} has checkpoint format {meta.get('format')}, this finetune reads {FORMAT_VERSION}")
    sharded = _sharded(strategy) and world_size > 1
    reads = rank == 0 or not sharded  # under FSDP rank 0 reads and broadcasts
    weights: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    if reads:
        weights = load_file(str(ckpt / "model.safetensors"))
        for alias, name in meta.get("tied", {}).items():
            weights[alias] = weights[name]
        optim = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=sharded, strict=method == "full")
    from finetune.train.parallel import has_dtensors

    if method != "full" and not sharded and not has_dtensors(model):  # into the module (see gather_model_state)
        result = inner.load_state_dict(weights, strict=False)
    else:
        result = set_model_state_dict(model, weights, options=opts)
    if reads and method != "full":
        missing = trainable_names(inner) - set(weights)
        if missing:
            raise UserError(f"--resume: {ckpt} lacks adapter weights such as {sorted(missing)[0]}; it is from another run")
    del result
    if strategy == "zero1":
        optimizer.load_state_dict(optim)
    else:
        set_optimizer_state_dict(
            model, optimizer, optim,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=sharded),
        )
    trainer = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=True)
    scheduler.load_state_dict(trainer["scheduler"])
    if scaler is not None and trainer.get("scaler"):
        scaler.load_state_dict(trainer["scaler"])
    rngs = trainer["rng"]
    if len(rngs) != world_size:
        raise UserError(f"--resume: {ckpt} holds {len(rngs)} processes' state but this run has {world_size}")
    return meta, rngs[rank]
