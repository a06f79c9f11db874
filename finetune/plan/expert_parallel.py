"""What expert parallelism (``distributed.ep``) changes in a plan: the experts a rank gathers, the routed
tokens it sends by all-to-all, and the buffers of that exchange (finetune/train/parallel/expert_parallel.py runs it).

Under FSDP each rank stores ``1/dp`` of every weight with or without ep: ep borrows its ranks from dp_shard, and
FSDP shards each rank's ``E/ep`` experts over the ``dp/ep`` ranks ep leaves. What ep divides is what a rank
*gathers*: a block's unit holds ``1/ep`` of its routed experts once all-gathered (and their unsharded gradient
before its reduce-scatter), and the experts' all-gathers and reduce-scatters move ``1/ep`` of their bytes over
``dp/ep`` ranks. In exchange, every micro-batch sends each routed (token, slot) row to the rank holding its
expert and back: per layer with experts, a forward dispatch and combine, the same two in backward, and again
in a recomputed forward under activation checkpointing, each moving ``(ep - 1) / ep`` of the rows off the rank
(routing spread evenly). Those exchanges sit between the router and the experts: none of them overlaps.
"""

from __future__ import annotations

from finetune.plan.shapes import MoE, Tensor


def is_expert_tensor(t: Tensor) -> bool:
    """Whether ``t`` is split by expert under ep: a routed experts' fused weight, or its LoRA factors."""
    return t.role == "experts" or ".experts." in t.name


def routed_rows(moe: MoE, tokens: int) -> int:
    """(token, slot) rows one layer with experts routes for ``tokens`` tokens of a micro-batch."""
    return tokens * moe.top_k


def all_to_all_bytes(
    moe: MoE, ep: int, tokens: int, micro_batches: int, compute_bytes: int, checkpointing: bool
) -> int:
    """Bytes one rank sends per optimizer step by the experts' all-to-alls: per micro-batch of ``tokens`` tokens
    and per layer with experts, the dispatch and the combine of the forward (twice with a recomputed forward)
    and of the backward, ``(ep - 1) / ep`` of ``tokens x top-k x hidden`` values each; 0 without ep."""
    if ep <= 1:
        return 0
    passes = 4 + (2 if checkpointing else 0)
    per_pass = routed_rows(moe, tokens) * moe.hidden * compute_bytes * (ep - 1) // ep
    return passes * per_pass * moe.layers * max(1, micro_batches)


def dispatch_buffer_bytes(moe: MoE, ep: int, tokens: int, compute_bytes: int) -> int:
    """Bytes one layer's dispatch holds beside what the experts keep for backward: the rows sorted for sending,
    the rows received and the outputs returned (``tokens x top-k x hidden`` values each); 0 without ep."""
    if ep <= 1:
        return 0
    return 3 * routed_rows(moe, tokens) * moe.hidden * compute_bytes
