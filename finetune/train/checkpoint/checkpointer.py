"""Checkpoints: save, find, check, load and prune them; every write is atomic.

Layout of ``output.dir/checkpoints/step-N/`` (N = optimizer steps done)::

    state/              torch.distributed.checkpoint (DCP): every rank writes its own shards of the model
                        (full fine-tuning: every weight; lora/qlora: the adapters) and of AdamW's state, keyed
                        by parameter name; ``.metadata`` says which slice of which tensor lies where
    trainer.pt          LR scheduler, fp16 loss scaler, and the RNG states of every rank
                        (python, numpy, torch CPU, torch CUDA)
    recipe.yaml         the resolved recipe of the run
    plan.json           its plan
    meta.json           step, token and skipped-step counters, the data position, per-step losses (metrics.jsonl
                        is cut back to this step on resume), and what a resume must match (method, model,
                        precision, global batch, seed, adapter shape); written last

No rank ever gathers the model or the optimizer state: each writes what it holds (under DDP, replicated
tensors are written once, by one rank). Resuming reads, on every rank, the slices it needs for the
*current* sharding, so a checkpoint saved by fsdp on 2 processes resumes under fsdp on 3, ddp, zero1 or one
process. Every rank writes into, and reads from, the same directory: on several nodes it must be on a
filesystem they all see.

Atomicity: every rank writes into ``checkpoints/.tmp-step-N-<pid of rank 0>/``; rank 0 then writes the small
files and ``meta.json``, fsyncs everything, renames the directory to ``step-N`` and fsyncs ``checkpoints/``.
Only names ``step-N`` holding a ``meta.json`` count as checkpoints, so a write cut short (kill, crash, full
disk) is never chosen by ``--resume``; leftovers are removed by the next save.

Loading runs no code from the checkpoint: DCP's ``.metadata`` (a pickle) is read by :class:`SafeReader`'s
restricted unpickler, which admits only the classes DCP's metadata is made of (its dataclasses, torch sizes,
dtypes, layouts and memory formats, paths); ``trainer.pt`` and DCP's non-tensor values are read with
``torch.load(weights_only=True)`` (the latter through a load planner that overrides DCP's default); meta.json is
JSON. A checkpoint naming anything else is refused in one sentence, before anything of it is used.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from finetune.errors import UserError
from finetune.model.methods import method_type
from finetune.storage.swap import swap_in

if TYPE_CHECKING:  # torch is imported where it is used: finding and checking checkpoints needs none of it
    import torch

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
#: What a run writes at the top of output.dir besides checkpoints/ and base/ (``--overwrite`` removes them).
RUN_FILES = (
    METRICS,
    "trackers.json",  # tracker run ids (finetune.train.metrics.trackers): a fresh run starts new tracker runs
    "recipe.yaml",
    "plan.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "adapter_config.json",
)
META = "meta.json"
FORMAT_VERSION = 2
#: ``checkpoints/best.json``: early stopping's best checkpoint (its step, path and figure), never pruned.
BEST = "best.json"
#: The hidden directory of output.dir a final save writes into before its files are moved in (then a pid).
FINAL_STAGING_PREFIX = ".tmp-final-"


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
    return list_checkpoints_in(checkpoints_dir(out_dir))


def list_checkpoints_in(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints (``step-N`` with a meta.json) directly in the folder ``root``, oldest first."""
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
    """The ``meta.json`` of a checkpoint directory; one sentence when it is not a JSON object."""
    path = Path(ckpt) / META
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, not UTF-8, an integer too long, ...
        reason = type(exc).__name__
        meta = None
    else:
        reason = f"a JSON {type(meta).__name__}, not an object"
    if not isinstance(meta, dict):
        raise UserError(f"{path} is not a checkpoint's meta.json ({reason}); the checkpoint is damaged: choose another")
    return meta


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
    method: str, model_path: str, world_size: int, strategy: str, precision: str, recipe: Any, tp: int = 1,
    pp: int = 1,
) -> dict[str, Any]:
    """What a checkpoint records about its run; a resume must match all of it but the world size, the
    strategy and the tensor- and pipeline-parallel degrees (:data:`RESHARDABLE`: the sharded checkpoint is
    re-sliced for the resuming run's layout)."""
    ident = {
        "method": method,
        "model": str(model_path),
        "precision": precision,
        "world_size": int(world_size),
        "strategy": strategy,
        "tp": int(tp),
        "pp": int(pp),
        "global_batch_size": recipe.train.global_batch_size,
        "seed": recipe.train.seed,
    }
    ident.update(method_type(method)().checkpoint_identity(recipe))  # the method's own settings
    return ident


#: Recorded, but a resume may change them: DCP reshards the checkpoint to the resuming run's layout. The
#: tensor-parallel degree too: TP's DTensors are saved as slices of whole tensors, and the data order and the
#: loss normalisation depend on the global batch, not on how many replicas (dp = world / tp) share it. The
#: pipeline degree too: stages save their parameters under the whole model's names.
RESHARDABLE = frozenset({"world_size", "strategy", "tp", "pp"})

_WHAT = {
    "method": ("method", "the method"),
    "model": ("model.path", "the model"),
    "precision": ("precision", "the precision"),
    "world_size": ("--nproc", "the number of processes"),
    "strategy": ("distributed.strategy", "the strategy"),
    "tp": ("distributed.tp", "the tensor-parallel degree"),
    "pp": ("distributed.pp", "the pipeline-parallel degree"),
    "global_batch_size": ("train.global_batch_size", "the global batch size"),
    "seed": ("train.seed", "the seed"),
    "lora": ("lora", "the adapter shape (lora.r, lora.target_modules)"),
    "prefix": ("prefix", "the prefix settings"),
    "adapter": ("adapter", "the bottleneck adapter settings"),
    "prompt": ("prompt", "the prompt tuning settings"),
}


def check_resume_matches(ckpt: Path, identity: dict[str, Any]) -> None:
    """Refuse (one line) to resume ``ckpt`` with a run that differs in what the checkpoint depends on."""
    saved = read_meta(ckpt).get("identity", {})
    for key, want in identity.items():
        if key in RESHARDABLE:
            continue
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
    """``--overwrite``: remove what an earlier run left in ``out_dir`` (checkpoints, those a resume moved aside,
    metrics, saved model or adapter, a final save cut short), so nothing of it mixes with the new run. Only
    names finetune writes are touched."""
    out = Path(out_dir)
    clear_checkpoints(out)
    root = checkpoints_dir(out)
    if root.is_dir():  # checkpoints a resume moved aside belong to the run being replaced too
        for p in root.iterdir():
            if p.name.startswith(SET_ASIDE_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
    if out.is_dir():
        for p in out.iterdir():
            if p.name in RUN_FILES or (p.name.startswith("model-") and p.name.endswith(".safetensors")):
                p.unlink(missing_ok=True)
        if (out / "base").is_dir() and (out / "base" / "config.json").is_file():
            shutil.rmtree(out / "base", ignore_errors=True)
        remove_final_leftovers(out)


def remove_final_leftovers(out_dir: str | os.PathLike[str]) -> None:
    """Remove the staging directories of final saves that never finished (a kill, a full disk)."""
    for p in Path(out_dir).glob(f"{FINAL_STAGING_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)


def clear_checkpoints(out_dir: str | os.PathLike[str]) -> int:
    """Remove every checkpoint of a finished earlier run in ``out_dir`` (a fresh start), and its best pointer;
    return how many."""
    found = list_checkpoints(out_dir)
    for _, p in found:
        shutil.rmtree(p, ignore_errors=True)
    _remove_leftovers(checkpoints_dir(out_dir))
    (checkpoints_dir(out_dir) / BEST).unlink(missing_ok=True)
    return len(found)


def best_step(out_dir: str | os.PathLike[str]) -> int | None:
    """The step of the checkpoint ``checkpoints/best.json`` names (early stopping's best), or None."""
    try:
        record = json.loads((checkpoints_dir(out_dir) / BEST).read_text())
    except (OSError, ValueError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def write_best(out_dir: str | os.PathLike[str], record: dict[str, Any] | None) -> None:
    """Write ``checkpoints/best.json`` atomically (rank 0), or remove it (``record`` None)."""
    path = checkpoints_dir(out_dir) / BEST
    if record is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_text(path, json.dumps(record, indent=1) + "\n")


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

    # numpy's stubs type the argument-less call as the dict form; the legacy default returns this tuple
    legacy = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    kind, keys, pos, has_gauss, gauss = legacy
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


def rng_state_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """:func:`rng_state`'s ``state`` as a JSON value (the byte states in base64), for sending to another rank."""
    import base64

    def encoded(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    version, internal, gauss = state["python"]
    n = state["numpy"]
    out: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": {**n, "keys": n["keys"].tolist()},
        "torch": encoded(state["torch"]),
    }
    if "cuda" in state:
        out["cuda"] = [encoded(t) for t in state["cuda"]]
    return out


def rng_state_from_json(value: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`rng_state_to_json`: the state with :func:`rng_state`'s own types (what a checkpoint
    saves and :func:`set_rng_state` restores)."""
    import base64

    import torch

    def decoded(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    version, internal, gauss = value["python"]
    n = value["numpy"]
    state: dict[str, Any] = {
        "python": (int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss)),
        "numpy": {"kind": str(n["kind"]), "keys": torch.tensor(n["keys"], dtype=torch.int64), "pos": int(n["pos"]),
                  "has_gauss": int(n["has_gauss"]), "gauss": float(n["gauss"])},
        "torch": decoded(value["torch"]),
    }
    if "cuda" in value:
        state["cuda"] = [decoded(t) for t in value["cuda"]]
    return state


# --------------------------------------------------------------------------------------------------
# What a checkpoint holds: each part exposes state_dict() / load_state_dict() (DCP's Stateful protocol)
# --------------------------------------------------------------------------------------------------


class ModelState:
    """The weights a checkpoint keeps: every weight (full fine-tuning) or the adapters (lora/qlora), as each
    rank holds them (DTensor shards under FSDP2, whole tensors otherwise; DCP records which part is whose)."""

    def __init__(self, model: torch.nn.Module, adapters_only: bool) -> None:
        self.model, self.adapters_only = model, adapters_only

    def state_dict(self) -> dict[str, Any]:
        """Parameter name -> tensor (this rank's shard)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from finetune.train.parallel.parallelize import has_dtensors, is_sharded, unwrap

        if self.adapters_only and not is_sharded(self.model) and not has_dtensors(self.model):
            # The adapters alone, read from the module: torch's state-dict helpers walk every key of the model,
            # and bitsandbytes' 8-bit layers list keys (SCB, weight_format) that are no attributes, which they
            # fail on. The live tensors: DCP loads into them in place.
            return {n: p.detach() for n, p in unwrap(self.model).named_parameters() if p.requires_grad}
        state = get_model_state_dict(self.model)
        if self.adapters_only:
            keep = {n for n, p in self.model.named_parameters() if p.requires_grad}
            state = {k: v for k, v in state.items() if k in keep}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy ``state`` into the model (a frozen base is not in a checkpoint: not strict then)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from finetune.train.parallel.parallelize import has_dtensors, is_sharded, unwrap

        if self.adapters_only and not is_sharded(self.model) and not has_dtensors(self.model):
            unwrap(self.model).load_state_dict(state, strict=False)  # see state_dict (already loaded in place)
            return
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=not self.adapters_only))


#: Optimizer options that choose a kernel, not the update: a resume keeps the resuming run's.
IMPLEMENTATION_OPTIONS = ("foreach", "fused", "capturable", "differentiable")


class OptimizerState:
    """AdamW's state keyed by parameter name, flattened (``state.<name>.exp_avg``, ``param_groups.<name>.lr``),
    so it reshards between strategies and world sizes. ZeRO-1 saves and loads the local optimizer of each
    rank's share of the parameters; the names of all ranks together make the whole state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def _local(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer's own share

    def _holds_nothing(self) -> bool:
        """ZeRO-1 gave this rank no parameters (fewer trained tensors than ranks, e.g. one prefix encoder):
        torch's state-dict helpers refuse an empty optimizer, and there is nothing of this rank's to save."""
        return not any(group["params"] for group in self._local().param_groups)

    def state_dict(self) -> dict[str, Any]:
        """Name-keyed, flattened optimizer state (this rank's shards). 8-bit AdamW on shards gives its moments
        as placeholders that the checkpoint's planners write and read one at a time (its ``streamed``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if self._holds_nothing():
            return {}
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        local = self._local()
        with getattr(local, "streamed", contextlib.nullcontext)():
            return get_optimizer_state_dict(self.model, local, options=opts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the moments, step counts and hyperparameters (lr as the scheduler left it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        local = self._local()
        if self._holds_nothing():
            return
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        # How this run's optimizer computes is its own, not the checkpoint's: a tensor-parallel run needs the
        # per-parameter loop (foreach cannot mix DTensors and plain tensors), a run saved without TP had foreach.
        kernels = [{k: g[k] for k in IMPLEMENTATION_OPTIONS if k in g} for g in local.param_groups]
        # 8-bit AdamW on shards (finetune/train/optimizer.py) saves its moments under AdamW's names, not its own
        as_saved = getattr(local, "keys_as_saved", contextlib.nullcontext)
        with as_saved():
            set_optimizer_state_dict(self.model, local, state, options=opts)
        for group, own in zip(local.param_groups, kernels, strict=True):
            group.update(own)
        if local is not self.optimizer:
            # ZeRO-1 copies its own param_groups onto the local optimizer before every step: give it the
            # restored hyperparameters, or the first resumed step would run at the initial lr.
            for group, restored in zip(self.optimizer.param_groups, local.param_groups, strict=True):
                group.update({k: v for k, v in restored.items() if k != "params"})


class RNGState:
    """Every rank's RNG states (python, numpy, torch CPU and CUDA). Saving gathers them all to rank 0 (a
    collective, as JSON: never unpickled); loading keeps this rank's (rank 0's when the checkpoint had fewer
    processes) until :meth:`restore`, which the trainer calls just before the first resumed step."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """``{"ranks": [state of rank 0, 1, ...]}`` on rank 0 (no ranks elsewhere); every rank must call."""
        from finetune.train.parallel.distributed import all_gather_json

        mine = rng_state()
        if self.world_size == 1:
            return {"ranks": [mine]}
        gathered = all_gather_json(rng_state_to_json(mine))
        return {"ranks": [rng_state_from_json(s) for s in gathered] if self.rank == 0 else []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep this rank's state for :meth:`restore`."""
        ranks = state["ranks"]
        self.pending = ranks[self.rank] if self.rank < len(ranks) else ranks[0]

    def restore(self) -> None:
        """Apply the loaded state (once)."""
        if self.pending is not None:
            set_rng_state(self.pending)
            self.pending = None


# --------------------------------------------------------------------------------------------------
# The checkpointer
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunFiles:
    """What every checkpoint of a run records beside its state (constant during the run)."""

    identity: dict[str, Any]
    recipe_yaml: str
    plan: dict[str, Any]
    keep: int
    total_steps: int


#: Parts written by DCP (tensors, each rank its own), by rank 0 with torch.save (weights_only-loadable
#: small state), and into meta.json (counters and the data position, readable without torch).
SHARDED_PARTS = ("model", "optimizer")
TORCH_PARTS = ("scheduler", "scaler", "rng")
STATE_DIR = "state"


class Checkpointer:
    """Saves and loads ``output.dir/checkpoints/step-N`` for one rank (every rank calls both).

    ``states`` maps part names to objects with ``state_dict()`` / ``load_state_dict()``: ``model`` and
    ``optimizer`` (written by every rank through ``torch.distributed.checkpoint``: each its own shards),
    ``scheduler``, ``scaler`` (may be None) and ``rng`` (rank 0 writes ``trainer.pt``), ``train`` and
    ``data`` (``meta.json``, written last: its presence is what makes a checkpoint complete).
    """

    def __init__(
        self,
        out_dir: Path,
        rank: int,
        world_size: int,
        states: dict[str, Any],
        files: RunFiles,
        half_written: Callable[[int], None] | None = None,
    ) -> None:
        self.out_dir, self.rank, self.world_size = Path(out_dir), rank, world_size
        self.states, self.files, self.half_written = states, files, half_written

    def _agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank, through the wait group: the others wait here while rank 0 removes
        leftovers or finishes a checkpoint (fsync of every file), which may take longer than the training
        group's timeout (finetune/train/parallel/distributed.py)."""
        if self.world_size == 1:
            return value
        from finetune.train.parallel.distributed import wait_broadcast

        return wait_broadcast(value)

    def save(self, step: int) -> Path:
        """Write ``checkpoints/step-<step>`` atomically and prune to ``output.keep``; returns its path.

        A failed write (a full disk, say) raises a one-line :class:`UserError` on every rank and leaves the
        previous checkpoints as they were (the half-written directory is removed by the next save).
        """
        import torch
        from torch.distributed.checkpoint.api import CheckpointException

        root = checkpoints_dir(self.out_dir)
        final = root / f"step-{step}"
        error: str | None = None
        if self.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(root)
        tmp = root / self._agree(f".tmp-step-{step}-{os.getpid()}")
        small = {k: self.states[k].state_dict() for k in TORCH_PARTS if self.states.get(k) is not None}
        try:
            # DCP's own coordination (plans, the gather of every rank's write results) in the wait group: a
            # rank whose shards are written waits there for the slowest storage, unseen by NCCL's watchdog
            save_sharded({k: self.states[k] for k in SHARDED_PARTS}, tmp / STATE_DIR, self.world_size)
        except (Exception, CheckpointException) as exc:  # DCP reports every rank's failure on every rank
            error = _first_error(exc)
        if self.rank == 0 and error is None:
            try:
                self._finish(tmp, final, step, small, torch)
            except OSError as exc:
                error = f"{exc.strerror or exc} ({exc.filename or tmp})"
        error = self._agree(error)
        if error is not None:
            previous = [p.name for s, p in list_checkpoints(self.out_dir) if s != step]
            kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
            raise UserError(
                f"output.dir: writing checkpoint step-{step} in {root} failed: {error}; {kept}; free space in "
                "output.dir (or lower output.keep) and continue with --resume"
            )
        self._barrier()
        return final

    def _finish(self, tmp: Path, final: Path, step: int, small: dict[str, Any], torch: Any) -> None:
        """Rank 0: the small files, the hook, meta.json last, fsync, rename into place, prune."""
        f, early = self.files, self.states.get("early_stopping")
        torch.save(small, tmp / "trainer.pt")
        (tmp / "recipe.yaml").write_text(f.recipe_yaml)
        (tmp / "plan.json").write_text(json.dumps(f.plan, indent=2) + "\n")
        if self.half_written is not None:
            self.half_written(step)
        meta = {
            "format": FORMAT_VERSION,
            **self.states["train"].state_dict(),
            "total_steps": f.total_steps,
            "final": step >= f.total_steps or (early is not None and early.stopped),
            "position": self.states["data"].state_dict(),
            **({"early_stopping": early.state_dict()} if early is not None else {}),
            "identity": f.identity,
            "saved_by": {"world_size": self.world_size},
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
        for p in tmp.rglob("*"):
            if p.is_file():
                _fsync_file(p)
        _fsync_dir(tmp / STATE_DIR)
        _fsync_dir(tmp)
        # a step saved again after resuming from an older checkpoint replaces it; a replacement cut short
        # leaves a ".old-" directory, which the next save removes
        swap_in(tmp, final, aside_prefix=f".old-step-{step}-")
        _fsync_dir(tmp.parent)
        prune(self.out_dir, f.keep)

    def _barrier(self) -> None:
        if self.world_size > 1:
            from finetune.train.parallel.distributed import wait_barrier

            wait_barrier()

    def load(self, path: Path) -> dict[str, Any]:
        """Load every part from the checkpoint ``path`` (resharding as needed); returns its meta.json.

        The RNG state is only staged: ``states["rng"].restore()`` applies it just before the first step.
        """
        from torch.distributed.checkpoint.api import CheckpointException

        meta = read_meta(path)
        if meta.get("format") != FORMAT_VERSION:
            raise UserError(
                f"--resume: {path} has checkpoint format {meta.get('format')}, this finetune reads {FORMAT_VERSION}; "
                "resume it with the finetune version that wrote it, or start a new run"
            )
        if not (path / STATE_DIR / ".metadata").is_file() or not (path / "trainer.pt").is_file():
            raise UserError(f"--resume: {path} is incomplete (its {STATE_DIR}/ or trainer.pt is missing); choose another")
        try:
            load_sharded({k: self.states[k] for k in SHARDED_PARTS}, path / STATE_DIR, self.world_size)
        except (Exception, CheckpointException) as exc:
            refused = _refused(path, exc)
            if refused is not None:
                raise refused from None
            raise UserError(
                f"--resume: {path} cannot be loaded into this run ({_first_error(exc)}); it is damaged or was saved "
                "by another run or model: choose another checkpoint of this run"
            ) from None
        small = _load_trainer_state(path)
        try:
            for k in TORCH_PARTS:
                if self.states.get(k) is not None and small.get(k) is not None:
                    self.states[k].load_state_dict(small[k])
            self.states["train"].load_state_dict(meta)
            self.states["data"].load_state_dict(meta["position"])
            if self.states.get("early_stopping") is not None:
                self.states["early_stopping"].load_state_dict(meta.get("early_stopping"))
        except UserError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
            raise UserError(
                f"--resume: {path} holds counters or states this run cannot use ({type(exc).__name__}: "
                f"{str(exc)[:200]}); it is damaged or was written by another tool: choose another checkpoint"
            ) from None
        return meta

    def load_weights(self, path: Path) -> None:
        """Load only the weights of the checkpoint ``path`` into the model (every rank calls): early stopping's
        best checkpoint, as the final model; its metadata read as ``--resume`` reads it (no code runs)."""
        from torch.distributed.checkpoint.api import CheckpointException

        if not (path / STATE_DIR / ".metadata").is_file():
            raise UserError(
                f"train.early_stopping: the best checkpoint {path} is gone; the final model is the last step's "
                "(train.early_stopping.final_model: last keeps it so)"
            )
        try:
            load_sharded({"model": self.states["model"]}, path / STATE_DIR, self.world_size)
        except (Exception, CheckpointException) as exc:
            raise UserError(
                f"train.early_stopping: the best checkpoint {path} cannot be loaded ({_first_error(exc)}); it was "
                "changed since this run wrote it, and nothing of it was loaded: set train.early_stopping.final_model: "
                "last, or resume from another checkpoint"
            ) from None


def save_sharded(parts: dict[str, Any], path: Path, world_size: int) -> None:
    """Every rank writes its shards of ``parts`` (stateful objects) to the DCP directory ``path``: DCP's own
    coordination (plans, the gather of every rank's write results) in the wait group, where a rank whose shards
    are written waits for the slowest storage unseen by NCCL's watchdog; 8-bit AdamW's moments streamed."""
    import torch.distributed.checkpoint as dcp

    from finetune.train.parallel.distributed import wait_group

    dcp.save(parts, checkpoint_id=str(path), no_dist=world_size == 1, process_group=wait_group(),
             planner=StreamingSavePlanner())


def load_sharded(parts: dict[str, Any], path: Path, world_size: int) -> None:
    """Every rank loads its shards of ``parts`` from the DCP directory ``path`` (resharded as needed), with a
    reader whose unpickler admits only the classes DCP's metadata is made of and a planner that never unpickles
    code and streams 8-bit AdamW's moments."""
    import torch.distributed.checkpoint as dcp

    from finetune.train.parallel.distributed import wait_group

    dcp.load(parts, storage_reader=safe_reader(path), planner=_SafeLoadPlanner(), no_dist=world_size == 1,
             process_group=wait_group())


def _streaming_save_planner_class() -> Any:
    from torch.distributed.checkpoint import DefaultSavePlanner

    from finetune.train.optimizer import moment_stream

    class StreamingSave(DefaultSavePlanner):
        """DCP's default save planner; a streamed moment (finetune.train.optimizer.MomentStream) is asked
        for its values when the writer reaches it, so that the device dequantizes one at a time."""

        def lookup_object(self, index: Any) -> Any:
            stream = moment_stream(self.state_dict.get(index.fqn))
            return stream.values() if stream is not None else super().lookup_object(index)

    return StreamingSave


def StreamingSavePlanner() -> Any:
    """The checkpoint's save planner (DCP's default, streaming 8-bit AdamW's moments)."""
    return _streaming_save_planner_class()()


def _first_error(exc: BaseException) -> str:
    """One line for a failure inside torch.distributed.checkpoint (it wraps every rank's exception)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))  # (exception, traceback summary)
        exc = first[0] if isinstance(first, tuple) else first
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


#: What DCP's metadata pickle may name: module -> the names in it. torch's dtypes, layouts and memory formats
#: are admitted by their type (:func:`_metadata_global`), so a new dtype needs no entry here.
METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed.checkpoint.planner": frozenset({"LoadItemType", "WriteItemType"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice"}),
}


class RefusedMetadata(pickle.UnpicklingError):
    """DCP metadata that names something no metadata of a checkpoint holds (a function, another class)."""


def _metadata_global(module: str, name: str) -> Any:
    """The object a metadata pickle's global names, if DCP's metadata may hold it; else :class:`RefusedMetadata`."""
    import importlib

    import torch

    if name in METADATA_CLASSES.get(module, ()):
        return getattr(importlib.import_module(module), name)
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
        return getattr(torch, name)
    raise RefusedMetadata(f"{module}.{name}")


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves globals only through :func:`_metadata_global`: what the pickle can call is a
    metadata dataclass, a torch size or dtype, a path; nothing that runs a command or imports a module."""

    def find_class(self, module: str, name: str) -> Any:
        return _metadata_global(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedMetadata("a persistent id")


def read_dcp_metadata(data: bytes) -> Any:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file, unpickled without running code (raises
    :class:`RefusedMetadata` for a global DCP's metadata never holds)."""
    return _MetadataUnpickler(io.BytesIO(data)).load()


def _safe_reader_class() -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file-system reader, but ``.metadata`` is unpickled by :func:`read_dcp_metadata`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = read_dcp_metadata(f.read())
            if not isinstance(metadata, Metadata):
                raise RefusedMetadata(f"a {type(metadata).__name__} in place of DCP's Metadata")
            storage = getattr(metadata, "storage_meta", None) or StorageMeta()  # older pickles lack it
            storage.load_id = self.load_id
            metadata.storage_meta = storage
            return metadata

    return SafeReader


def safe_reader(state_dir: str | os.PathLike[str]) -> Any:
    """A DCP storage reader of ``state_dir`` whose metadata is read without running code."""
    return _safe_reader_class()(str(state_dir))


def _refused(path: Path, exc: BaseException) -> UserError | None:
    """The one sentence for a checkpoint whose metadata names what no checkpoint holds (None for other failures)."""
    failures = getattr(exc, "failures", None)
    causes = [exc, *(f[0] if isinstance(f, tuple) else f for f in failures.values())] if isinstance(failures, dict) else [exc]
    refused = next((c for c in causes if isinstance(c, RefusedMetadata)), None)
    if refused is None:
        return None
    return UserError(
        f"--resume: {path / STATE_DIR / '.metadata'} names {refused}, which no checkpoint's metadata holds: it was "
        "not written by finetune (or was changed since), and loading it could run code; nothing of it was loaded. "
        "Choose a checkpoint this run wrote"
    )


def check_safe_to_load(ckpt: Path) -> None:
    """Read a checkpoint's pickles the safe way before anything else happens (the launcher's preflight of
    ``--resume``): DCP's ``.metadata`` through :func:`read_dcp_metadata`, ``trainer.pt`` with
    ``weights_only=True``; one naming what no checkpoint holds is refused while nothing is written yet."""
    path = ckpt / STATE_DIR / ".metadata"
    if path.is_file():
        try:
            read_dcp_metadata(path.read_bytes())
        except RefusedMetadata as exc:
            raise _refused(ckpt, exc) or exc from None
        except Exception as exc:  # a truncated or garbled pickle
            raise UserError(
                f"--resume: {path} is not DCP metadata ({type(exc).__name__}); the checkpoint is damaged: choose another"
            ) from None
    if (ckpt / "trainer.pt").is_file():
        _load_trainer_state(ckpt)


def _load_trainer_state(ckpt: Path) -> Any:
    """``trainer.pt`` (scheduler, scaler, RNG states) with ``weights_only=True``; one sentence when that refuses it."""
    import torch

    try:
        return torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only's unpickler refuses any global it does not know
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(
            f"--resume: {ckpt / 'trainer.pt'} cannot be read as plain tensors and numbers ({first}); it was not "
            "written by finetune, or is damaged, and nothing of it was loaded: choose a checkpoint this run wrote"
        ) from None


def _safe_load_planner_class() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from finetune.train.optimizer import moment_stream

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default load planner, but non-tensor values are unpickled with ``weights_only=True``, and a
        streamed moment (finetune.train.optimizer.MomentStream) is read into its own host buffer and handed
        over once complete."""

        def lookup_tensor(self, index: Any) -> Any:
            stream = moment_stream(self.state_dict.get(index.fqn))
            return stream.buffer() if stream is not None else super().lookup_tensor(index)

        def commit_tensor(self, read_item: Any, tensor: Any) -> None:
            stream = moment_stream(self.state_dict.get(read_item.dest_index.fqn))
            if stream is not None:
                stream.commit(tensor.numel())

        def load_bytes(self, read_item: Any, value: Any) -> None:
            import torch

            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element as set_path

                set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner


def _SafeLoadPlanner() -> Any:
    return _safe_load_planner_class()()


def read_weights(ckpt: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The saved weights of a checkpoint as whole tensors, read in this process (no process group needed)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state_dir = Path(ckpt) / STATE_DIR
    try:
        metadata = safe_reader(state_dir).read_metadata()
    except RefusedMetadata as exc:
        raise _refused(Path(ckpt), exc) or exc from None
    weights: dict[str, torch.Tensor] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):  # not the bytes entries
            weights[key[len("model.") :]] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load({"model": weights}, storage_reader=safe_reader(state_dir), no_dist=True, planner=_SafeLoadPlanner())
    return weights


def prune(out_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and never the one ``checkpoints/best.json``
    names; return the deleted ones."""
    found = list_checkpoints(out_dir)
    best = best_step(out_dir)
    doomed = [p for s, p in (found[:-keep] if keep > 0 else found) if s != best]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


#: The folder of checkpoints/ that the checkpoints newer than a resumed one are moved into (then its step and
#: the time): not a ``step-N`` name, so no resume, prune or leftover clean-up ever takes or removes it.
SET_ASIDE_PREFIX = "set-aside-after-step-"


def set_aside_newer(out_dir: Path, step: int, metrics: Path | None = None) -> Path | None:
    """Move the checkpoints newer than ``step`` (the future a resume from an older one leaves behind) into one
    new folder of checkpoints/, with the metrics.jsonl rows after ``step`` and early stopping's best.json as
    that run left them; nothing is deleted. Returns the
    folder (None when there was nothing newer). Rank 0 only."""
    newer = [p for s, p in list_checkpoints(out_dir) if s > step]
    if not newer:
        return None
    folder = checkpoints_dir(out_dir) / f"{SET_ASIDE_PREFIX}{step}-{time.strftime('%Y%m%dT%H%M%S')}"
    suffix = 0
    while folder.exists():  # two resumes in the same second
        suffix += 1
        folder = folder.with_name(f"{folder.name.split('.')[0]}.{suffix}")
    folder.mkdir()
    for p in newer:
        os.rename(p, folder / p.name)
    if metrics is not None and metrics.is_file():
        shutil.copyfile(metrics, folder / METRICS)  # every row, the ones after `step` included
    if (checkpoints_dir(out_dir) / BEST).is_file():  # early stopping's pointer as that run left it
        shutil.copyfile(checkpoints_dir(out_dir) / BEST, folder / BEST)
    _fsync_dir(folder)
    _fsync_dir(folder.parent)
    return folder
