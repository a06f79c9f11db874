"""dpo's reference policy on a rank: what the preference loss compares the policy with (finetune/objectives/preference.py).

The execution spec names it (``ExecSpec.reference``):

    base         an adapter method's base: the policy itself with its adapters switched off for the reference's
                 forward (peft's ``disable_adapter``; bottlenecks shadowed, finetune/model/methods.py): no memory
    model        full fine-tuning: a frozen copy of the starting weights (or of ``dpo.reference_model``, another
                 checkpoint of the same architecture and tokenizer), built and loaded like the policy, stored
                 in the compute dtype (as an adapter method's frozen base is), without gradients or optimizer
                 state, sharded like the policy under zero2/fsdp (resharded after each forward: it has no
                 backward), split like it under tensor parallelism, replicated under single/ddp/zero1
    precomputed  the reference's log-probabilities of every train and eval pair, computed in one pass before the
                 first step (with the starting weights, ``dpo.reference_model``, or the base for an adapter
                 method) and kept with the pairs: no reference in memory while training
    none         simpo and orpo, which need none

Precomputed log-probabilities are stored beside the tokenized data (data.cache_dir), in a file keyed by the
pairs' token rows and the reference's fingerprint (its weight files' names, sizes and modification times, or
the seed of a random init; the method, precision and dtypes it runs in): a second run on the same data and
model reads them back instead of running the pass (:class:`ReferenceCache`); other weights compute them again.

The reference's forward runs under the same autocast as the policy's and through the same
:func:`~finetune.objectives.preference.sequence_logps`, so both log-probabilities take the same precision path.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import socket
from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from finetune.model.methods import training_of
from finetune.objectives.preference import (
    PreferenceObjective,
    PreferenceSettings,
    reference_logps,
    sequence_logps,
)
from finetune.recipe.reference_model import locate_reference, weights_fingerprint
from finetune.recipe.schema import LoadedRecipe
from finetune.spec import ExecSpec
from finetune.train.data.batches import to_device
from finetune.train.data.preference import PreferenceExample, collate_pairs
from finetune.train.model.build import build_model
from finetune.train.model.load import build_on_meta, loads_sharded, materialize
from finetune.train.parallel.distributed import DistContext
from finetune.train.parallel.parallelize import parallelize, unwrap
from finetune.units import torch_dtype


def reference_recipe(loaded: LoadedRecipe) -> LoadedRecipe:
    """The recipe whose model is the reference: ``loaded`` itself (the policy's start), or a copy whose model is
    ``dpo.reference_model`` (loaded from its weights; checked by recipe.check_files)."""
    r = loaded.recipe
    if not r.dpo.reference_model:
        return loaded
    assert loaded.inputs is not None, "load_recipe resolves the inputs"
    ref = copy.deepcopy(loaded)
    ref.recipe.model.path = r.dpo.reference_model
    ref.recipe.model.init = "pretrained"
    ref.inputs = replace(loaded.inputs, model=locate_reference(r.dpo.reference_model, loaded.base_dir))
    return ref


def build_reference_model(loaded: LoadedRecipe, spec: ExecSpec, ctx: DistContext) -> torch.nn.Module:
    """The frozen reference of full fine-tuning (a copy of the starting weights, or ``dpo.reference_model``'s
    when ``loaded`` is its :func:`reference_recipe`), placed as the policy is: sharded under zero2/fsdp, split
    under tensor parallelism, whole elsewhere (no DDP: nothing of it is trained)."""
    ref_spec = replace(
        spec, trainable_dtype=spec.reference_dtype, checkpointing=False, compile=False, offload="none",
        reshard_after_forward=True,
    )
    if loads_sharded(spec, ctx.world_size):
        model = build_on_meta(loaded, ref_spec, ctx.device)
        model.requires_grad_(False)
        model = parallelize(model, ref_spec, ctx)
        materialize(model, loaded, ref_spec, ctx.device)
    else:
        # built as the policy is (the same seed and dtype, so the same values), then cast to the frozen dtype
        model = build_model(loaded, spec, ctx.device).to(torch_dtype(spec.reference_dtype))
        model.requires_grad_(False)
        if spec.strategy.uses_fsdp or spec.tensor_parallel:
            model = parallelize(model, ref_spec, ctx)
    model.requires_grad_(False)
    return model.eval()


def reference_forward(
    spec: ExecSpec, policy: torch.nn.Module, reference: torch.nn.Module | None
) -> Callable[[dict[str, Any]], tuple[torch.Tensor, torch.Tensor]]:
    """``batch -> (log-probs, counts)`` of the reference policy: the frozen copy, or the policy's base."""
    if reference is not None:
        frozen: Any = reference

        def copy(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
            out = sequence_logps(frozen, batch)
            if hasattr(frozen, "reshard"):  # FSDP2 keeps a root unit gathered for a backward that never comes
                frozen.reshard()
            return out

        return copy
    if not spec.method.adapters:  # precomputed under full fine-tuning: the policy before its first step
        return lambda batch: sequence_logps(policy, batch)
    training = training_of(spec)

    def base(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        with training.base_only(unwrap(policy)):
            return sequence_logps(policy, batch)

    return base


def setup_objective(
    loaded: LoadedRecipe, spec: ExecSpec, model: torch.nn.Module, data: Any, ctx: DistContext,
    autocast: Callable[[], Any], pad_id: int, batch_size: int,
) -> tuple[PreferenceObjective | None, torch.nn.Module | None]:
    """The preference objective of the run (None for sft) and the frozen reference model when it holds one.

    ``precomputed``: the reference's log-probs of every pair are read from the cache, or computed here (with the
    starting weights, or dpo.reference_model's) before any step and before a resumed checkpoint is loaded (the
    reference is the run's start), then stored in the cache. A note in ``data.notes`` says which.
    """
    if not spec.preference:
        return None, None
    r = loaded.recipe
    settings = PreferenceSettings.of(spec.objective, r.dpo)
    if spec.reference == "none":
        return PreferenceObjective(settings), None
    source = reference_recipe(loaded)
    if spec.reference == "precomputed":
        pairs = [*data.train, *data.eval]
        cache = ReferenceCache.of(loaded, spec, pairs)
        if cache.read(pairs, ctx):
            data.stats["reference_logps_cached"] = 1
            data.notes.append(
                f"dpo.reference: precomputed: the reference log-probabilities of {len(pairs)} pairs were read from "
                f"the cache ({cache.path})"
            )
        else:
            frozen = build_reference_model(source, spec, ctx) if r.dpo.reference_model else None
            precompute(reference_forward(spec, model, frozen), pairs, ctx, autocast, pad_id, batch_size, model)
            del frozen  # nothing of the reference stays in memory while training
            cache.write(pairs)
            data.notes.append(
                f"dpo.reference: precomputed: the reference log-probabilities of {len(pairs)} pairs were computed "
                f"and stored in the cache ({cache.path})"
            )
        return PreferenceObjective(settings), None
    reference = build_reference_model(source, spec, ctx) if spec.reference == "model" else None
    forward = reference_forward(spec, model, reference)
    return PreferenceObjective(settings, lambda batch: reference_logps(forward, batch)), reference


#: Bump when what the cached reference log-probabilities hold, or how they are computed, changes.
REFERENCE_CACHE_VERSION = "1"


def rows_digest(pairs: list[PreferenceExample]) -> str:
    """A hash of the pairs' token rows in order (ids and labels of both completions): what the tokenization
    cache's key decides, and the eval split and max_samples after it."""
    h = hashlib.sha256()
    for p in pairs:
        for row in (p.input_ids, p.labels, p.rejected_ids or [], p.rejected_labels or []):
            h.update(len(row).to_bytes(8, "little"))
            h.update(array("q", row).tobytes())
    return h.hexdigest()


def reference_fingerprint(loaded: LoadedRecipe, spec: ExecSpec) -> list[Any]:
    """What decides the reference's log-probabilities besides the rows: its weights (dpo.reference_model's
    files, model.path's files, or model.path's config and the seed of a random init), and how it runs (the
    method and its adapter's settings, whose base is the reference; quantization, precision and dtypes)."""
    r = loaded.recipe
    source = reference_recipe(loaded)
    assert source.inputs is not None, "load_recipe resolves the inputs"
    location = source.inputs.model
    if source.recipe.model.init == "random":
        config = Path(location.path) / "config.json"
        weights: list[Any] = ["random", r.train.seed, hashlib.sha256(config.read_bytes()).hexdigest()]
    else:
        weights = ["pretrained", weights_fingerprint(location)]
    how = [
        spec.method.value, repr(spec.adapter), repr(spec.quant), spec.precision.value, spec.compute_dtype,
        spec.trainable_dtype, spec.frozen_dtype, spec.autocast, spec.fsdp_param_dtype, spec.reference_dtype,
        r.model.dtype, spec.attention,
    ]
    return [weights, how]


@dataclass
class ReferenceCache:
    """The file of precomputed reference log-probabilities (a (pairs, 2) float64 safetensors tensor, chosen then
    rejected) in the tokenization cache's directory, named by the rows and the reference's fingerprint."""

    path: Path

    @classmethod
    def of(cls, loaded: LoadedRecipe, spec: ExecSpec, pairs: list[PreferenceExample]) -> ReferenceCache:
        """The cache file of ``pairs`` under the run's reference."""
        from finetune.train.data import default_cache_dir

        d = loaded.recipe.data
        cache_dir = Path(os.path.expanduser(d.cache_dir)) if d.cache_dir else default_cache_dir()
        key = hashlib.sha256(json.dumps(
            [REFERENCE_CACHE_VERSION, rows_digest(pairs), reference_fingerprint(loaded, spec)], default=str,
        ).encode()).hexdigest()[:32]
        return cls(cache_dir / f"reference-logps-{key}.safetensors")

    def _load(self, n: int) -> torch.Tensor | None:
        """The stored values when the file holds ``n`` pairs' (None: absent or unreadable)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if not self.path.is_file():
            return None
        try:
            values = load_file(self.path).get("logps")
        except (OSError, SafetensorError):
            return None
        if values is None or tuple(values.shape) != (n, 2):
            return None
        return values

    def read(self, pairs: list[PreferenceExample], ctx: DistContext) -> bool:
        """Fill every pair's ``ref_logps`` from the cache when every rank finds it (then True): the ranks agree,
        since a miss on one rank (a node-local cache) makes them all run the pass, whose forwards are
        collectives under FSDP."""
        values = self._load(len(pairs))
        found = ctx.all_reduce_sum(float(values is not None))
        if round(float(found)) != ctx.world_size:
            return False
        assert values is not None
        for pair, (c, rj) in zip(pairs, values.tolist(), strict=True):
            pair.ref_logps = (float(c), float(rj))
        return True

    def write(self, pairs: list[PreferenceExample]) -> None:
        """Store the pairs' ``ref_logps`` (every rank holds them all after the pass): the first rank of each node
        writes a temporary file and renames it into place, so a reader never sees a partial one."""
        from safetensors.torch import save_file

        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return
        values = torch.tensor([p.ref_logps for p in pairs], dtype=torch.float64).reshape(len(pairs), 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
        save_file({"logps": values}, str(tmp), metadata={"pairs": str(len(pairs))})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # readable as the tokenized files beside it are
        os.replace(tmp, self.path)


@torch.no_grad()
def precompute(
    forward: Callable[[dict[str, Any]], tuple[torch.Tensor, torch.Tensor]], pairs: list[PreferenceExample],
    ctx: DistContext, autocast: Callable[[], Any], pad_id: int, batch_size: int, model: torch.nn.Module,
) -> None:
    """Every pair's reference log-probs (chosen, rejected) into ``pair.ref_logps``: each data-parallel rank
    computes a strided share in batches of ``batch_size`` pairs (every rank runs the same number of forwards,
    which are collectives under FSDP), then the shares are summed over the ranks."""
    if not pairs:
        return
    mine = list(range(ctx.layout.dp_rank, len(pairs), ctx.layout.dp))
    n_batches = math.ceil(math.ceil(len(pairs) / ctx.layout.dp) / batch_size)
    values = torch.zeros((len(pairs), 2), dtype=torch.float64, device=ctx.device)
    was_training = model.training
    model.eval()
    try:
        for b in range(n_batches):
            idx = mine[b * batch_size : (b + 1) * batch_size]
            chunk = [pairs[i] for i in idx] or pairs[:1]  # a dummy batch keeps the ranks in step
            batch = {k: to_device(v, ctx.device) for k, v in collate_pairs(chunk, pad_id).items()}
            with autocast():
                logps = reference_logps(forward, batch)
            if idx:
                values[torch.tensor(idx, device=ctx.device)] = logps.double()
    finally:
        model.train(was_training)
        reshard(model)
    total = ctx.data_sum(values, on_device=True).cpu().tolist()
    for pair, (c, r) in zip(pairs, total, strict=True):
        pair.ref_logps = (float(c), float(r))


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP2 unit of ``model`` back to its sharded parameters after forwards without a backward.

    Such a forward leaves the root unit gathered (it never reshards after forward), and under zero2 every unit:
    their registered parameters are then the all-gather's views, not the sharded parameters the optimizer
    steps, and a list of the model's parameters taken then (the trainer's, for gradient clipping) would hold
    views that never get a gradient (measured: a gradient norm of 0 under zero2, the clipping skipped)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def preference_figures(objective: PreferenceObjective, ctx: DistContext, pairs: float) -> dict[str, float]:
    """The figures the objective summed since the last call, over every data-parallel rank, as means over
    ``pairs`` (the global batch's): metrics.jsonl's ``rewards/*`` and ``logps/*`` columns."""
    sums = objective.take()
    if not sums:
        return {}
    keys = sorted(sums)
    total = ctx.data_sum(torch.stack([sums[k] for k in keys]), on_device=True).cpu().tolist()
    return {k: v / max(pairs, 1.0) for k, v in zip(keys, total, strict=True)}


@torch.no_grad()
def preference_eval(
    model: torch.nn.Module, pairs: list[PreferenceExample], ctx: DistContext, batch_size: int, pad_id: int,
    autocast: Callable[[], Any], objective: PreferenceObjective,
) -> tuple[float | None, dict[str, float]]:
    """The objective's mean loss over the eval pairs and its figures (reward accuracy, margin, ...), every rank
    running the same number of forwards (a strided share each, dummy batches where it has none left)."""
    if not pairs:
        return None, {}
    mine = pairs[ctx.layout.dp_rank :: ctx.layout.dp]
    n_batches = math.ceil(math.ceil(len(pairs) / ctx.layout.dp) / batch_size)
    objective.take()  # nothing of the training steps' figures is left to count here
    loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for b in range(n_batches):
        chunk = mine[b * batch_size : (b + 1) * batch_size]
        batch = {k: to_device(v, ctx.device) for k, v in collate_pairs(chunk or pairs[:1], pad_id).items()}
        with autocast():
            s, _ = objective(model, batch)
        if chunk:
            loss += s.double()
        else:
            objective.take()  # the dummy batch counts nothing
    figures = preference_figures(objective, ctx, float(len(pairs)))
    total = float(ctx.data_sum(loss, on_device=True).cpu())
    return total / len(pairs), figures
