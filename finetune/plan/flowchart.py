"""INTERIM: resolves "auto" settings without predicting memory. Replaced by the real planner (issue 3)."""

from __future__ import annotations

from finetune.plan.types import Candidate, Plan
from finetune.recipe import LoadedRecipe


def plan_for_run(loaded: LoadedRecipe, *, nproc: int, nnodes: int, device: str) -> Plan:
    """Resolve the recipe's "auto" choices for a run on ``nproc`` x ``nnodes`` processes on ``device``."""
    r = loaded.recipe
    world = nproc * nnodes
    method = "full" if r.method == "auto" else r.method
    strategy = r.distributed.strategy
    if strategy == "auto":
        strategy = "single" if world == 1 else "ddp"
    precision = r.precision
    if precision == "auto":
        precision = "fp32" if device == "cpu" else "bf16"
    per_rank = max(1, r.train.global_batch_size // world)
    mbs = r.train.micro_batch_size if r.train.micro_batch_size != "auto" else min(per_rank, 8)
    accum = max(1, r.train.global_batch_size // (mbs * world))
    ac = r.train.activation_checkpointing if r.train.activation_checkpointing != "auto" else False
    chosen = Candidate(method, strategy, precision, mbs, accum, bool(ac), nproc, nnodes)
    return Plan(chosen=chosen, candidates=[chosen], walk=["interim plan: no memory prediction"], hardware={"device": device})
