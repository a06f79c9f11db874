"""Pipeline parallelism in the plan: how the decoder layers split into stages, what each schedule keeps in
flight, its bubble, and the sentences that refuse a pipeline that cannot run.

The layers are split over ``pp`` ranks x ``v`` stages per rank (``v`` > 1 only for interleaved-1f1b, whose
virtual stage ``s`` runs on rank ``s % pp``). The first stage also holds the embeddings, the last the final norm,
the head and the loss (finetune/train/parallel/pipeline.py builds exactly that), so a balanced split gives those two
stages fewer decoder layers: each part counts as layer-equivalents, the larger of its forward FLOPs and its
parameters over one decoder layer's (:func:`layer_equivalents`), and :func:`balanced_split` minimises the
costliest stage.

Micro-batches in flight, one stage's activations of one micro-batch each, as torch.distributed.pipelining's
schedules run them (:func:`in_flight`):

  gpipe             every forward, then every backward: all ``m`` micro-batches on every stage.
  1f1b              ``min(m, pp - r)`` forwards of warm-up on rank ``r``, then one backward, one forward: stage 0
                    holds ``pp`` (torch's Schedule1F1B; it refuses fewer micro-batches than stages).
  interleaved-1f1b  torch's ScheduleInterleaved1F1B warms up ``(v - 1) x pp + 2 (pp - 1 - r)`` forwards of its
                    virtual stages on rank ``r`` (capped at ``m x v``), then one forward, one backward: one more.

Every schedule runs a rank's first backward with the most micro-batches in flight and none of the stage's
gradients allocated (the optimizer sets them to None after every step): they appear as that backward runs. Its
later backwards find every gradient of the stage (accumulating) beside :func:`in_flight_with_gradients`
micro-batches: as many as at the first when a forward runs between two backwards (1F1B's steady state), one
fewer when every forward came first (GPipe; a 1F1B rank whose warm-up takes every micro-batch). The planner
takes the larger of the two peaks (finetune/plan/memory.py: stage_memory): under GPipe the first backward's,
unless the stage's gradients outweigh one micro-batch's activations.

The bubble (idle fraction of a step) is ``(pp - 1) / (m + pp - 1)`` for gpipe and 1f1b and
``(pp - 1) / (v m + pp - 1)`` for interleaved-1f1b.

Rules (finetune/recipe/capabilities.py: ``pipeline_problem``, ``split_problem``, ``stage_problem``; here
:func:`microbatch_problem`): pp x tp divides the processes; each stage keeps at least one decoder layer;
interleaved-1f1b runs 2 or more stages per rank and gradient accumulation (the pipeline's micro-batches) a
multiple of pp (Megatron's interleaved schedule; torch's in-flight counts above hold for it); 1f1b needs at
least pp micro-batches (torch refuses fewer); gpipe runs with fewer, but its bubble is then most of the step
(a note, :func:`pipeline_note`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.recipe.capabilities import INTERLEAVED

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def stages_per_rank(schedule: str, pinned: int | None = None) -> int:
    """Stages each pp rank runs: ``distributed.pp_stages_per_rank``, else 2 for interleaved-1f1b and 1 for
    the others."""
    if pinned is not None:
        return int(pinned)
    return 2 if schedule == INTERLEAVED else 1


# -- the split -------------------------------------------------------------------------------------------------
def balanced_split(num_layers: int, stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> tuple[int, ...]:
    """Decoder layers of each of ``stages`` stages (each at least one, summing to ``num_layers``) that minimise
    the costliest stage, where a decoder layer costs 1, the first stage ``first_extra`` more and the last
    ``last_extra`` more (layer-equivalents of the embeddings and of the norm + head + loss). Among the splits
    with that maximum, layers are taken from the costliest stages first, later stages before earlier ones on a
    tie (the first stage keeps the most activations in flight under 1f1b)."""
    assert 1 <= stages <= num_layers, f"{stages} stages for {num_layers} layers"
    if stages == 1:
        return (num_layers,)
    extra = [float(first_extra)] + [0.0] * (stages - 2) + [float(last_extra)]

    def capacity(t: float) -> list[int]:  # layers each stage can take under a maximum cost t
        return [int(t - e + 1e-9) for e in extra]

    # the optimum is k + e for an integer k and some stage's e: try them in increasing order
    options = sorted({k + e for e in set(extra) for k in range(1, num_layers + 1)})
    best = next(t for t in options if min(capacity(t)) >= 1 and sum(capacity(t)) >= num_layers)
    counts = capacity(best)
    while sum(counts) > num_layers:  # shave the costliest stage that can spare a layer (later ones first)
        i = max((j for j in range(stages) if counts[j] > 1), key=lambda j: (counts[j] + extra[j], j))
        counts[i] -= 1
    return tuple(counts)


def memory_balanced_split(fixed: list[float], per_layer: list[float], num_layers: int) -> tuple[int, ...]:
    """Decoder layers of each pp rank (one stage per rank) that minimise the largest ``fixed[r] + per_layer[r]
    x layers[r]``: each rank's peak, linear in its layers (the model states of a layer, and its activations
    times the micro-batches the rank keeps in flight). Each layer goes, one at a time, to the rank it raises
    least (optimal for increasing linear costs); every rank keeps at least one."""
    ranks = len(fixed)
    assert ranks == len(per_layer) and 1 <= ranks <= num_layers, f"{ranks} ranks for {num_layers} layers"
    counts = [1] * ranks
    for _ in range(num_layers - ranks):
        r = min(range(ranks), key=lambda i: (fixed[i] + per_layer[i] * (counts[i] + 1), i))
        counts[r] += 1
    return tuple(counts)


@dataclass(frozen=True)
class StageParts:
    """Values of the parts a pipeline stage may hold: one decoder layer's parameters, the first stage's
    (embeddings, and adapters outside the layers), the last stage's (final norm, head: the embedding matrix
    again when the model ties them), and the forward FLOPs per token of a layer and of the head."""

    layer_params: int
    first_params: int
    last_params: int
    layer_flops: float
    head_flops: float

    def layer_equivalents(self) -> tuple[float, float]:
        """(first stage's extra cost, last stage's) in decoder layers: the larger of the part's share of FLOPs
        and of parameters (the embeddings compute no matmul, the head both computes and stores)."""
        lp, lf = max(1, self.layer_params), max(1.0, self.layer_flops)
        first = self.first_params / lp
        last = max(self.last_params / lp, self.head_flops / lf)
        return first, last


def stage_parts(inv: Any, config: Any, shape: Any, seq_len: int, tp: int = 1) -> StageParts:
    """The :class:`StageParts` of one TP rank of a model from that rank's inventory (finetune/plan/shapes.py),
    the config and the model's FLOP shape (finetune/plan/flops.py) at ``seq_len`` tokens per row: a TP rank
    computes 1/tp of each decoder layer and the whole head (TP replicates what lies outside the layers)."""
    first = last = 0
    embed = 0
    for t in list(inv.base) + list(inv.adapters):
        if t.in_block:
            continue
        if is_first_stage_tensor(t.name) or t.adapter:
            first += t.numel
            if not t.adapter and ("embed_tokens" in t.name or t.name.endswith("wte.weight")):
                embed = max(embed, t.numel)
        else:
            last += t.numel
    if getattr(config, "tie_word_embeddings", False) and not any("lm_head" in t.name for t in inv.base):
        last += embed  # the last stage holds its own copy of the tied head
    layer_flops = (2.0 * shape.block + 4.0 * seq_len * shape.attention_channels) / max(1, tp)
    return StageParts(
        layer_params=inv.block_numel() + inv.block_numel(adapters=True), first_params=first, last_params=last,
        layer_flops=layer_flops, head_flops=2.0 * shape.outside,
    )


def stage_inventory(inv: Any, layers: int, first: bool, last: bool, tied: bool = False) -> Any:
    """The :class:`~finetune.plan.shapes.Inventory` of what one pp rank holds: ``layers`` decoder layers, the
    embeddings (and adapters outside the layers) when it runs the first stage, the final norm and head when it
    runs the last (the tied embedding matrix again as its head when ``tied`` and the model has no head of its
    own), so the memory model (finetune/plan/memory.py) sizes a stage as it sizes a model."""
    from dataclasses import replace

    from finetune.plan.shapes import Tensor

    key = (id(inv), layers, first, last, tied)
    if key in _STAGE_INVENTORIES and _STAGE_INVENTORIES[key][0] is inv:
        return _STAGE_INVENTORIES[key][1]

    def keep(t: Tensor) -> bool:
        if t.in_block:
            return inv.in_unit(t)  # layers of different kinds: a stage's layers sized as the largest kind
        return first if (t.adapter or is_first_stage_tensor(t.name)) else last

    base = [replace(t, layers=0) if t.in_block else t for t in inv.base if keep(t)]
    if last and not first and tied and not any("lm_head" in t.name for t in inv.base):
        base += [replace(t, name="lm_head.weight") for t in inv.base if not t.in_block and "embed_tokens" in t.name]
    adapters = [replace(t, layers=0) if t.in_block else t for t in inv.adapters if keep(t)]
    sub = replace(inv, num_layers=layers, base=base, adapters=adapters)
    _STAGE_INVENTORIES[key] = (inv, sub)
    return sub


#: stage inventories already made, by (id of the model's inventory, layers, first, last, tied) -> (that
#: inventory, kept so that its id is not reused, the stage's)
_STAGE_INVENTORIES: dict[tuple[int, int, bool, bool, bool], tuple[Any, Any]] = {}


def is_first_stage_tensor(name: str) -> bool:
    """Whether a parameter outside the decoder layers lives on the first stage (token and position
    embeddings); the rest (final norm, head) lives on the last."""
    leaf = name.rsplit(".", 2)[-2] if "." in name else name
    if leaf in ("embed_out",):  # GPT-NeoX's head
        return False
    return "embed" in leaf or leaf in ("wte", "wpe")


# -- the schedule --------------------------------------------------------------------------------------------
def stage_rank(stage: int, pp: int) -> int:
    """The pp rank that runs (virtual) stage ``stage`` (interleaved: stage s on rank s % pp)."""
    return stage % pp


def rank_stages(rank: int, pp: int, v: int) -> tuple[int, ...]:
    """The (virtual) stages pp rank ``rank`` runs, in order."""
    return tuple(rank + k * pp for k in range(v))


def in_flight(schedule: str, pp: int, v: int, microbatches: int, rank: int) -> int:
    """(Stage, micro-batch) activations pp rank ``rank`` holds at once at its peak (see the module docstring):
    each is one of its stages' activations for one micro-batch."""
    m = max(1, microbatches)
    if schedule == "gpipe":
        return m * v
    if schedule == "1f1b":
        return min(m, pp - rank)
    # torch's ScheduleInterleaved1F1B: rounds of pp micro-batches (m a multiple of pp here)
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    return min(warmup + 1, m * v)


def in_flight_with_gradients(schedule: str, pp: int, v: int, microbatches: int, rank: int) -> int:
    """(Stage, micro-batch) activations pp rank ``rank`` holds at a backward after its first, when the stage's
    gradients exist: :func:`in_flight` when the schedule runs a forward between the first backward and the next
    (more micro-batches than its warm-up took), one fewer when every forward came before the first backward
    (GPipe); 0 with a single micro-batch (there is no later backward)."""
    k = in_flight(schedule, pp, v, microbatches, rank)
    return k if max(1, microbatches) * v > k else k - 1


def bubble_fraction(schedule: str, pp: int, v: int, microbatches: int) -> float:
    """The idle fraction of a pipelined step: (pp - 1) / (m + pp - 1), or (pp - 1) / (v m + pp - 1) for
    interleaved-1f1b with ``v`` stages per rank (0 without a pipeline)."""
    if pp <= 1:
        return 0.0
    m = max(1, microbatches)
    chunks = v * m if schedule == INTERLEAVED else m
    return (pp - 1) / (chunks + pp - 1)


def boundaries_across_nodes(pp: int, world: int, per_node: int) -> int:
    """Stage boundaries (between consecutive pp ranks) whose ranks sit on different nodes: pp is the mesh's
    outermost dimension, so pp rank ``i`` is processes ``i x world / pp ...``; a boundary crosses when that
    block starts a node."""
    if pp <= 1 or per_node <= 0:
        return 0
    block = world // pp
    return sum(1 for i in range(1, pp) if (i * block) // per_node != (i * block - 1) // per_node)


# -- the rules (the model's and the layout's: finetune/recipe/capabilities.py) -------------------------------------


def microbatch_problem(schedule: str, pp: int, microbatches: int) -> str | None:
    """The sentence refusing ``microbatches`` (gradient accumulation steps) for ``schedule`` (None: fine)."""
    if schedule == INTERLEAVED and microbatches % pp:
        return (
            f"distributed.pp_schedule: interleaved-1f1b needs gradient accumulation (the pipeline's micro-batches) "
            f"a multiple of pp {pp}, and train.global_batch_size / (train.micro_batch_size x data-parallel "
            f"replicas) gives {microbatches}; change train.global_batch_size or train.micro_batch_size"
        )
    if schedule == "1f1b" and microbatches < pp:
        return (
            f"distributed.pp_schedule: 1f1b needs at least pp = {pp} micro-batches (gradient accumulation steps) "
            f"and train.global_batch_size / (train.micro_batch_size x data-parallel replicas) gives "
            f"{microbatches}; raise train.global_batch_size or lower train.micro_batch_size"
        )
    return None


def pipeline_note(schedule: str, pp: int, microbatches: int) -> str | None:
    """A sentence when the pipeline runs but mostly idles: gpipe with fewer micro-batches than stages."""
    if schedule == "gpipe" and microbatches < pp:
        idle = bubble_fraction(schedule, pp, 1, microbatches)
        return (
            f"GPipe runs {microbatches} micro-batch{'es' if microbatches != 1 else ''} through {pp} stages: the bubble "
            f"is {idle:.0%} of the step; more gradient accumulation steps (a larger train.global_batch_size or a "
            f"smaller train.micro_batch_size) fill it."
        )
    return None
