"""The planner's walk as a structured log: one typed step per decision, each rendered as one sentence.

The planner (finetune/plan/flowchart.py) records what it did as these steps, with the numbers that decided
it; ``Plan.walk`` is their sentences and ``Plan.steps`` their fields (``plan --json``). Nothing here decides
anything: a step only says what happened.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from finetune.spec import Method, Strategy
from finetune.units import fmt_bytes

PRECISION_NAMES = {
    "bf16": "bf16 mixed precision (fp32 master weights, no loss scaler)",
    "fp16": "fp16 mixed precision (fp32 master weights, dynamic loss scaling)",
    "fp32": "fp32",
    "bf16-pure": "pure bf16 (weights, gradients and AdamW state in bf16)",
}
OPTIMIZER_NAMES = {
    "adamw": "AdamW",
    "adamw8bit": "8-bit AdamW (bitsandbytes: each moment in 1 byte with blockwise scales)",
    "paged_adamw8bit": "paged 8-bit AdamW (its state in CUDA unified memory, paged to the host while the "
    "forward and backward need the room)",
}
OFFLOAD_NAMES = {
    "optimizer": "each rank's shards of parameters, gradients and optimizer state in host memory, the "
    "optimizer step there (ZeRO-2 with FSDP2's CPU offload)",
    "parameters": "the same under FSDP, each unit copied up for its forward and its backward",
}


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _count(n: float) -> str:
    """30.53e9 -> '30.53B', 158080 -> '0.16M'."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def method_name(method: str) -> str:
    """How a sentence names a method: ``full fine-tuning``, ``LoRA``."""
    return Method(method).title


def strategy_name(strategy: str) -> str:
    """How a sentence names a strategy: ``one process``, ``DDP``, ``ZeRO-2``."""
    return Strategy(strategy).title


@dataclass(frozen=True)
class Step:
    """One step of the walk."""

    def render(self) -> str:  # pragma: no cover - every step overrides it
        """The step as one sentence."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """JSON form: the step's kind and its fields."""
        return {"kind": type(self).__name__, **asdict(self)}


@dataclass(frozen=True)
class Note(Step):
    """A sentence about the request itself (no GPU visible, a fallback the architecture needs)."""

    text: str

    def render(self) -> str:
        """The sentence as given."""
        return self.text


@dataclass(frozen=True)
class ExpertParallelism(Step):
    """What distributed.ep does for a mixture of experts on these processes (or would do, when it is 1)."""

    ep: int  # the recipe's degree (1: none)
    suggested: int  # the largest degree the processes and the experts allow (1: none)
    experts: int
    layer_expert_bytes: int  # one layer's routed experts as gathered (compute dtype)
    row_bytes: int  # one routed (token, slot) row sent by all-to-all (compute dtype)
    top_k: int

    def render(self) -> str:
        """The sentence."""
        if self.ep > 1:
            return (
                f"distributed.ep: {self.ep}: each rank holds {self.experts // self.ep} of the {self.experts} routed "
                f"experts of every layer, so a block's FSDP unit gathers {_mib(self.layer_expert_bytes // self.ep)} "
                f"of experts instead of {_mib(self.layer_expert_bytes)}, and each token's {self.top_k} routed rows "
                f"({self.row_bytes:,} bytes each) go to their experts' ranks by all-to-all and back, four times a "
                "micro-batch (six with activation checkpointing)"
            )
        return (
            f"distributed.ep: {self.suggested} would split the {self.experts} routed experts over {self.suggested} "
            f"ranks: a block would gather {_mib(self.layer_expert_bytes // self.suggested)} of experts instead of "
            f"{_mib(self.layer_expert_bytes)} and send its {self.top_k} routed rows per token by all-to-all; "
            "kept at 1 (the recipe's)"
        )


@dataclass(frozen=True)
class MixtureOfExperts(Step):
    """The model is a mixture of experts: what its experts hold and what a token computes with."""

    arch: str
    experts: int
    top_k: int
    shared_experts: int
    layers: int
    expert_params: int  # the routed experts' weights, whole model
    params: int
    active_params: int
    aux_loss_coef: float  # the load-balancing loss's coefficient (0: none)
    method: str  # the recipe's method (auto: the walk's)
    experts_adapted: bool = False  # lora.target_modules reaches the fused expert weights

    def render(self) -> str:
        """The sentence."""
        shared = f" and {self.shared_experts} shared" if self.shared_experts else ""
        share = 100 * self.expert_params / max(1, self.params)
        text = (
            f"{self.arch} is a mixture of experts: {self.experts} routed experts{shared} in "
            f"{'each of ' + str(self.layers) + ' layers' if self.layers != 1 else 'its 1 layer with experts'}, each "
            f"token routed to {self.top_k}; the experts hold {share:.0f}% of the weights "
            f"({_count(self.expert_params)} of {_count(self.params)}) and a token computes with "
            f"{_count(self.active_params)}"
        )
        if self.method in ("lora", "qlora"):
            text += ("; LoRA adapts the experts' weights too" if self.experts_adapted
                     else f"; LoRA on these targets leaves the experts ({share:.0f}% of the weights) frozen")
        if self.aux_loss_coef:
            text += f"; its load-balancing loss is added x {self.aux_loss_coef:g}"
        return text + "."


@dataclass(frozen=True)
class OneProcess(Step):
    """``distributed.strategy: single`` on hardware with several GPUs."""

    world: int

    def render(self) -> str:
        """The sentence."""
        return f"distributed.strategy is single: planning for one process, not {self.world}."


@dataclass(frozen=True)
class PinnedTensorParallel(Step):
    """The recipe pins a TP degree: how it splits each block."""

    tp: int
    what: str  # processes | GPUs
    heads: int
    kv_heads: int
    mlp: int
    replicas: int

    def render(self) -> str:
        """The sentence."""
        t = self.tp
        return (
            f"Tensor parallelism: tp {t} as the recipe pins: each block's linears split over {t} {self.what} of a "
            f"node ({self.heads} heads, {self.kv_heads} KV heads, {self.mlp} MLP features -> {self.heads // t}, "
            f"{self.kv_heads // t}, {self.mlp // t} per rank), {self.replicas} data-parallel replica(s)."
        )


@dataclass(frozen=True)
class PinnedPipeline(Step):
    """The recipe pins a pipeline degree: how the layers split into stages."""

    pp: int
    schedule: str
    stages_per_rank: int
    layers: int
    what: str  # processes | GPUs
    replicas: int
    split: tuple[int, ...] = ()  # the recipe's layers per stage (empty: balanced by cost)

    def render(self) -> str:
        """The sentence."""
        stages = self.pp * self.stages_per_rank
        how = (f"the recipe's split {list(self.split)}" if self.split else
               "a split balanced by cost, the embeddings on the first stage and the head on the last counted as "
               "layers")
        per = f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
        return (
            f"Pipeline parallelism: pp {self.pp} as the recipe pins: the {self.layers} decoder layers in {stages} "
            f"stages over {self.pp} {self.what}{per} ({how}), schedule {self.schedule}, "
            f"{self.replicas} data-parallel replica(s) per stage."
        )


@dataclass(frozen=True)
class PrecisionChosen(Step):
    """Step 1 of the flowchart."""

    precision: str
    why: str  # pinned | cpu | bf16 | assumed | fp16
    gpu: str = ""
    no_bf16: bool = False  # pinned bf16 on a GPU without it

    def render(self) -> str:
        """The sentence."""
        name = PRECISION_NAMES[self.precision]
        if self.why == "pinned":
            extra = f" (pinned, but {self.gpu} has no bf16 support: expect it to fail or run slowly)" if self.no_bf16 else ""
            return f"Precision: {name}, as the recipe pins{extra}."
        if self.why == "cpu":
            return "Precision: fp32 (a CPU run)."
        if self.why == "bf16":
            return f"Precision: {name}: {self.gpu} supports bf16."
        if self.why == "assumed":
            return f"Precision: {name}: assumed a bf16 GPU (--gpu-type v100/t4 for older ones)."
        return f"Precision: {name}: {self.gpu} has no bf16 (compute capability < 8.0)."


@dataclass(frozen=True)
class BatchRounded(Step):
    """The global batch is not a multiple of the data-parallel ranks (a preview rounds it up)."""

    asked: int
    ranks: int
    planned: int

    def render(self) -> str:
        """The sentence."""
        return f"The global batch {self.asked} is not a multiple of {self.ranks} processes: planning for {self.planned}."


@dataclass(frozen=True)
class Attempt:
    """One candidate as a tried-step names it."""

    label: str  # the strategy as people say it (DDP, TP 2 x FSDP)
    total: int
    fits: bool
    states_only: bool  # the model states alone already exceed the memory (activations not traced)


@dataclass(frozen=True)
class Tried(Step):
    """The strategies tried for one method at one checkpointing setting, in order, up to the first that fits."""

    method: str
    attempts: tuple[Attempt, ...]
    capacity: int
    micro_batch_size: int
    seq_len: int
    checkpointing_clause: bool  # say "With activation checkpointing, " (both settings are being tried)
    with_method: bool = True  # name the method before the first strategy
    setting: str = ""  # what else differs from the plain run ("8-bit AdamW", "optimizer state offloaded")

    def render(self) -> str:
        """The sentence: each attempt's per-GPU need against the capacity, and which fits."""
        parts = []
        for i, a in enumerate(self.attempts):
            head = f"{method_name(self.method)}{self.setting} under {a.label}" if i == 0 and self.with_method else a.label
            need = f"{head} needs {fmt_bytes(a.total)} per GPU"
            if a.states_only:
                need += " for the model states alone"
            if a.fits:
                parts.append(f"{need}: fits (micro-batch {self.micro_batch_size}, {self.seq_len} tokens)")
            else:
                parts.append(f"{need} > {fmt_bytes(self.capacity)}")
        text = "; ".join(parts) + "."
        if self.checkpointing_clause:
            return "With activation checkpointing, " + text
        return _cap(text)


@dataclass(frozen=True)
class RuledOut(Step):
    """The capability table refuses a candidate the walk would consider."""

    method: str
    strategy: str
    tp: int
    reason: str

    def render(self) -> str:
        """The sentence."""
        tp = f" x tp {self.tp}" if self.tp > 1 else ""
        return f"{_cap(method_name(self.method))} under {strategy_name(self.strategy)}{tp} is ruled out: {self.reason}."


@dataclass(frozen=True)
class NextMethod(Step):
    """A method fits under no strategy: the walk tries the next one."""

    method: str
    next: str
    micro_batch_size: int
    trainable: int
    r: int
    targets: str
    base: str  # "" | "NF4 4-bit" | "LLM.int8 8-bit"
    base_bytes: int

    def render(self) -> str:
        """The sentence."""
        base = f" {self.base}" if self.base else ""
        return (
            f"{_cap(method_name(self.method))} does not fit at micro-batch {self.micro_batch_size} under any strategy: "
            f"trying {method_name(self.next)} ({self.trainable / 1e6:.1f}M trainable parameters, r={self.r} on "
            f"{self.targets},{base} base weights {fmt_bytes(self.base_bytes)})."
        )


@dataclass(frozen=True)
class TryTensorParallel(Step):
    """FSDP alone does not fit: the walk tries TP degrees inside a node."""

    method: str
    micro_batch_size: int
    best_fsdp: int | None
    degrees: tuple[int, ...]
    seq_len: int
    hidden: int

    def render(self) -> str:
        """The sentence."""
        need = f" ({fmt_bytes(self.best_fsdp)} at best)" if self.best_fsdp is not None else ""
        return (
            f"{_cap(method_name(self.method))} does not fit under FSDP alone at micro-batch {self.micro_batch_size}"
            f"{need}: trying tensor parallelism inside a node, tp {', '.join(map(str, self.degrees))} (never across "
            f"nodes: its 4 all-reduces per block of micro-batch x {self.seq_len} x {self.hidden} values need the "
            "intra-node link)."
        )


@dataclass(frozen=True)
class TryPipeline(Step):
    """FSDP with TP does not fit: the walk tries pipeline layouts (pp across nodes, tp inside a node, the
    strategy over the rest)."""

    method: str
    micro_batch_size: int
    best_so_far: int | None
    degrees: tuple[int, ...]
    tps: tuple[int, ...]
    schedule: str
    layers: int

    def render(self) -> str:
        """The sentence."""
        need = f" ({fmt_bytes(self.best_so_far)} at best)" if self.best_so_far is not None else ""
        return (
            f"{_cap(method_name(self.method))} does not fit under FSDP or TP x FSDP at micro-batch "
            f"{self.micro_batch_size}{need}: splitting the model's {self.layers} layers across GPUs, pipeline "
            f"parallelism pp {', '.join(map(str, self.degrees))} ({self.schedule}; stages across nodes, tp "
            f"{', '.join(map(str, self.tps))} inside a node, the strategy over the rest), the fewest stages first."
        )


@dataclass(frozen=True)
class PipelineAttempt:
    """One pipeline layout the walk sized: its best configuration's worst stage."""

    pp: int
    tp: int
    dp: int
    label: str  # the best configuration of the layout (``PP 4 x TP 8 x FSDP``, checkpointing said apart)
    checkpointing: bool
    total: int
    fits: bool
    why: str = ""  # why the layout was not sized (the schedule's micro-batch rule)
    states_only: bool = False  # the model states alone exceed the memory (activations not traced)


@dataclass(frozen=True)
class PipelineTried(Step):
    """The pipeline layouts the walk sized, in order, up to the first that fits."""

    attempts: tuple[PipelineAttempt, ...]
    capacity: int
    # when none fits: the closest traced layout's worst stage, by part (rank, model states, activations of the
    # micro-batches in flight, the strategy's and point-to-point buffers, runtime overhead)
    closest: tuple[int, int, int, int, int] | None = None
    closest_in_flight: int = 0

    def render(self) -> str:
        """The sentence."""
        parts = []
        for a in self.attempts:
            if a.why:
                parts.append(f"pp {a.pp} x tp {a.tp}: {a.why}")
                continue
            ckpt = " with activation checkpointing" if a.checkpointing else ""
            verdict = "fits" if a.fits else f"> {fmt_bytes(self.capacity)}"
            what = " for the model states alone" if a.states_only else ""
            parts.append(f"{a.label}{ckpt} needs {fmt_bytes(a.total)} on its worst stage{what} ({verdict})")
        text = "Pipeline layouts: " + "; ".join(parts) + "."
        if self.closest is not None:
            rank, states, acts, buffers, overhead = self.closest
            text += (
                f" None fits: the closest one's worst stage, rank {rank}, holds {fmt_bytes(states)} of model states, "
                f"{fmt_bytes(acts)} of activations ({self.closest_in_flight} micro-batch"
                f"{'es' if self.closest_in_flight != 1 else ''} in flight), {fmt_bytes(buffers)} of buffers (its "
                f"strategy's and the stages' receive buffers, one per micro-batch) and {fmt_bytes(overhead)} of "
                "runtime overhead."
            )
        return text


@dataclass(frozen=True)
class PipelineLayout(Step):
    """The pipeline the plan runs: its stages, what each holds, the schedule's bubble and its sends."""

    pp: int
    tp: int
    dp: int
    schedule: str
    layers: tuple[int, ...]
    microbatches: int
    in_flight: tuple[int, ...]  # micro-batches each pp rank keeps at its peak
    stage_totals: tuple[int, ...]  # each pp rank's peak
    bubble_fraction: float
    p2p_bytes: int  # a rank's sends per step
    p2p_seconds: float
    link: str
    crossing: int  # stage boundaries between nodes
    by_memory: bool = False  # the layers split by memory (the split by cost did not fit)
    settings: tuple[str, ...] = ()  # the recipe settings that run this layout (the walk chose it)

    def render(self) -> str:
        """The sentence."""
        worst = max(range(len(self.stage_totals)), key=lambda i: self.stage_totals[i])
        chunks = "micro-batches'" if len(self.layers) == self.pp else "stage micro-batches'"  # interleaved: per stage
        m = self.microbatches
        return (
            f"Pipeline: {self.pp} ranks ({self.pp} x dp {self.dp} x tp {self.tp} mesh, pp outermost) run "
            f"{len(self.layers)} stages of {list(self.layers)} decoder layers (the first also the embeddings, the "
            f"last the norm, head and loss), {self.schedule} over {m} micro-batch{'es' if m != 1 else ''} (the "
            f"gradient accumulation steps): rank 0 keeps {self.in_flight[0]} {chunks} activations in flight, the "
            f"last {self.in_flight[-1]}; the worst stage is rank {worst} at {fmt_bytes(self.stage_totals[worst])} "
            f"(from {fmt_bytes(min(self.stage_totals))}); the bubble idles {self.bubble_fraction:.0%} of the step; "
            f"each GPU sends its neighbours {self.p2p_bytes / 1e9:.2f} GB per step (activations forward, their "
            f"gradients back), {self.p2p_seconds:.2f} s over {self.link}"
            f"{f', {self.crossing} of {self.pp - 1} boundaries between nodes' if self.crossing else ''}."
            + (" The layers are split by memory: the split by cost does not fit." if self.by_memory else "")
            + (f" To run it: {', '.join(self.settings)}." if self.settings else "")
        )


@dataclass(frozen=True)
class SmallerState(Step):
    """No method fits with the plain optimizer state: the walk tries the next way to shrink or move it."""

    optimizer: str
    offload: str  # none | optimizer | parameters
    saved: int  # bytes per GPU this saves on the smallest candidate so far
    host_per_node: int = 0  # host memory per node the offloaded state takes
    link_bytes: int = 0  # bytes over the host link per step
    link_seconds: float = 0.0

    def render(self) -> str:
        """The sentence."""
        if self.offload == "none":
            what = OPTIMIZER_NAMES[self.optimizer]
            return (
                f"No configuration fits with the optimizer state as planned: trying {what}, which saves "
                f"{fmt_bytes(self.saved)} per GPU."
            )
        return (
            f"No configuration fits with every state on the GPU: trying {OFFLOAD_NAMES[self.offload]}, which saves "
            f"{fmt_bytes(self.saved)} per GPU and costs {fmt_bytes(self.host_per_node)} of host memory per node and "
            f"{self.link_bytes / 1e9:.2f} GB over the host link per step ({self.link_seconds:.2f} s)."
        )


@dataclass(frozen=True)
class LargestMicroBatch(Step):
    """Step 4 of the flowchart."""

    seq_len: int
    micro_batch_size: int
    checkpointing: bool
    total: int
    grad_accum_steps: int
    global_batch: int

    def render(self) -> str:
        """The sentence."""
        ac = "on" if self.checkpointing else "off"
        return (
            f"Largest micro-batch that fits at {self.seq_len} tokens: {self.micro_batch_size} (activation "
            f"checkpointing {ac}, {fmt_bytes(self.total)} per GPU); gradient accumulation {self.grad_accum_steps} "
            f"keeps the global batch at {self.global_batch}."
        )


@dataclass(frozen=True)
class PipelineMicroBatch(LargestMicroBatch):
    """Step 4 under a pipeline: a micro-batch smaller than the largest that fits, for a shorter step."""

    step_seconds: float
    bubble_seconds: float
    largest: int
    largest_step_seconds: float
    largest_bubble_seconds: float

    def render(self) -> str:
        """The sentence."""
        ac = "on" if self.checkpointing else "off"
        return (
            f"Micro-batch at {self.seq_len} tokens: {self.micro_batch_size}, not the largest that fits "
            f"({self.largest}): its {self.grad_accum_steps} micro-batches a step leave the pipeline idle "
            f"{self.bubble_seconds:.2f} s of a {self.step_seconds:.2f} s step, against "
            f"{self.largest_bubble_seconds:.2f} s of {self.largest_step_seconds:.2f} s (activation checkpointing "
            f"{ac}, {fmt_bytes(self.total)} per GPU); gradient accumulation {self.grad_accum_steps} keeps the global "
            f"batch at {self.global_batch}."
        )


@dataclass(frozen=True)
class FasterChoice(Step):
    """Several configurations fit at the same step of the walk: the one with the shortest predicted step."""

    chosen: str
    chosen_seconds: float
    other: str
    other_seconds: float

    def render(self) -> str:
        """The sentence."""
        return (
            f"{self.chosen} and {self.other} both fit: {self.chosen} is predicted faster ({self.chosen_seconds:.2f} s "
            f"per step against {self.other_seconds:.2f} s)."
        )


@dataclass(frozen=True)
class Pinned(Step):
    """The recipe keys the walk took as given."""

    keys: tuple[str, ...]

    def render(self) -> str:
        """The sentence."""
        return f"Pinned by the recipe and checked: {', '.join(self.keys)}."


@dataclass(frozen=True)
class EvaluationPlanned(Step):
    """The evaluation's peak on the chosen configuration."""

    seq_len: int
    pinned: bool
    batch_size: int
    total: int
    loss: int
    generation: int
    max_new_tokens: int
    capacity: int
    fix: str = ""  # what to change when it does not fit

    def render(self) -> str:
        """The sentence."""
        how = "eval.batch_size" if self.pinned else "eval.batch_size auto, the largest that fits"
        text = (
            f"Evaluation at {self.seq_len} tokens ({how}: {self.batch_size}): {fmt_bytes(self.total)} per GPU "
            f"(loss forward {fmt_bytes(self.loss)}, generating {self.max_new_tokens} tokens with a KV cache "
            f"{fmt_bytes(self.generation)}, beside the model states)"
        )
        if self.total > self.capacity:
            text += f" > {fmt_bytes(self.capacity)}: the run would fail at its first evaluation; {self.fix}"
        return text + "."


@dataclass(frozen=True)
class RolloutPlanned(Step):
    """grpo's rollouts on the chosen configuration: their memory beyond the step's activations, and the time to
    sample them (finetune/plan/rollout.py)."""

    completions: int  # per rank per step
    completion_len: int
    rollout: int
    seconds: float | None  # generation time per batch of completions, from the time model's compute rate

    def render(self) -> str:
        """The sentence."""
        when = f", sampled in about {self.seconds:.2f} s" if self.seconds is not None else ""
        return (
            f"Rollouts: {self.completions} completions of up to {self.completion_len} tokens per GPU a step, with "
            f"their KV cache and kept log-probabilities: {fmt_bytes(self.rollout)} beyond the step's activations"
            f"{when}."
        )


@dataclass(frozen=True)
class Link:
    """Bytes and seconds of one strategy's communication per step."""

    bytes: int
    seconds: float


@dataclass(frozen=True)
class Communication(Step):
    """What DDP, ZeRO-2 and FSDP send per step for the chosen method."""

    method: str
    link: str
    ddp: Link
    zero2: Link
    fsdp: Link
    micro_batches: int = 1  # per step: ZeRO-2 and FSDP gather and reduce-scatter in each, DDP all-reduces once

    def render(self) -> str:
        """The sentence."""
        def gb(c: Link) -> str:
            return f"{c.bytes / 1e9:.2f} GB, {c.seconds:.2f} s over {self.link}"

        n = max(1, self.micro_batches)
        if self.zero2.bytes <= 1.05 * self.ddp.bytes:
            zero2 = (f"ZeRO-2 reduce-scatters gradients and all-gathers parameters, no more than that all-reduce "
                     f"(an all-reduce is a reduce-scatter plus an all-gather), so its memory saving is free "
                     f"({gb(self.zero2)})")
        elif self.zero2.bytes <= 1.05 * n * self.ddp.bytes:
            zero2 = (f"ZeRO-2 reduce-scatters gradients and all-gathers parameters in each of the step's {n} "
                     f"micro-batches, each no more than that all-reduce ({gb(self.zero2)}, "
                     f"{self.zero2.bytes / max(1, self.ddp.bytes):.1f}x DDP): the price of gradients that stay sharded "
                     "between micro-batches")
        else:
            zero2 = (f"ZeRO-2 sends more here ({gb(self.zero2)}): FSDP2 all-gathers the frozen base weights too"
                     + (f", in each of the step's {n} micro-batches," if n > 1 else "")
                     + " while DDP only all-reduces the small trainable gradients")
        return (
            f"Communication per GPU per step ({method_name(self.method)}): DDP all-reduces the gradients "
            f"({gb(self.ddp)}); {zero2}; FSDP all-gathers the parameters again in backward "
            f"({gb(self.fsdp)}, {self.fsdp.bytes / max(1, self.zero2.bytes):.2f}x ZeRO-2)."
        )


@dataclass(frozen=True)
class HybridCommunication(Step):
    """What HSDP sends per step, inside a node and across nodes, beside flat FSDP over every GPU."""

    method: str
    nodes: int
    per_node: int
    intra_link: str
    inter_link: str
    intra: Link
    inter: Link
    fsdp: Link | None = None

    def render(self) -> str:
        """The sentence."""
        flat = ""
        if self.fsdp is not None:
            flat = (f"; FSDP over all {self.nodes * self.per_node} GPUs sends {self.fsdp.bytes / 1e9:.2f} GB, all of "
                    f"it over {self.inter_link} ({self.fsdp.seconds:.2f} s)")
        return (
            f"HSDP ({method_name(self.method)}) shards over the {self.per_node} GPUs of each node and replicates "
            f"over {self.nodes} nodes: its all-gathers and reduce-scatters stay inside a node "
            f"({self.intra.bytes / 1e9:.2f} GB per GPU per step, {self.intra.seconds:.2f} s over {self.intra_link}) "
            f"and only the all-reduce of each GPU's gradient shard crosses nodes ({self.inter.bytes / 1e9:.2f} GB, "
            f"{self.inter.seconds:.2f} s over {self.inter_link}){flat}."
        )


@dataclass(frozen=True)
class ZeroOneAccounting(Step):
    """How the ZeRO-1 row's model states differ from the ZeRO paper's accounting."""

    trainable: int
    world: int
    compute_dtype: str

    def render(self) -> str:
        """The sentence (finetune/plan/memory.py: zero1_accounting_note)."""
        from finetune.plan.memory import zero1_accounting_note

        return zero1_accounting_note(self.trainable, self.world, self.compute_dtype)


@dataclass(frozen=True)
class TensorParallelCommunication(Step):
    """TP's all-reduces of the chosen configuration."""

    tp: int
    checkpointing: bool
    micro_batch_size: int
    seq_len: int
    hidden: int
    bytes: int
    seconds: float
    link: str
    sequence_parallel: bool = False

    def render(self) -> str:
        """The sentence."""
        per_block = 6 if self.checkpointing else 4
        if self.sequence_parallel:
            return (
                f"Tensor parallelism (tp {self.tp}) with sequence parallelism all-gathers each block's attention "
                f"and MLP inputs and reduce-scatters their outputs in forward, and the reverse in backward "
                f"({2 * per_block} per block per micro-batch"
                f"{', 4 of them for the recomputed forward' if self.checkpointing else ''}, each "
                f"{self.micro_batch_size} x {self.seq_len} x {self.hidden} values: in a ring the bytes of the "
                f"{per_block} all-reduces without it), plus the embeddings' gradient all-gather and a trained "
                f"head's gradient all-reduce: {self.bytes / 1e9:.2f} GB per GPU per step, {self.seconds:.2f} s "
                f"over {self.link}."
            )
        return (
            f"Tensor parallelism (tp {self.tp}) all-reduces each block's attention and MLP outputs in forward and "
            f"their input gradients in backward ({per_block} per block per micro-batch"
            f"{', 2 of them for the recomputed forward' if self.checkpointing else ''}, each "
            f"{self.micro_batch_size} x {self.seq_len} x {self.hidden} values): "
            f"{self.bytes / 1e9:.2f} GB per GPU per step, {self.seconds:.2f} s over {self.link}."
        )


@dataclass(frozen=True)
class AdapterStorage(Step):
    """The dtype LoRA's adapters are kept in (``lora.dtype``), with what they and their state cost."""

    dtype: str  # lora.dtype: fp32 | bf16
    values: int  # trained adapter values, the whole model's
    state_bytes: int  # the adapters, their gradients and the optimizer state, before sharding
    other_bytes: int  # the same in the other dtype (bf16 for fp32 adapters, fp32 for bf16 ones)
    compute: str  # the run's compute dtype

    def render(self) -> str:
        """The sentence."""
        head = (f"LoRA's adapters ({self.values / 1e6:.2f}M values) are kept in {self.dtype} (lora.dtype), with their "
                f"gradients and the optimizer state: {fmt_bytes(self.state_bytes)} before sharding")
        if self.dtype == "fp32" and self.compute == "bf16":
            return f"{head}; lora.dtype: bf16 keeps them in the compute dtype ({fmt_bytes(self.other_bytes)})."
        if self.dtype != "fp32":
            return f"{head}, the compute dtype (fp32 adapters: {fmt_bytes(self.other_bytes)})."
        return head + "."


@dataclass(frozen=True)
class Timing(Step):
    """The chosen configuration's predicted time per step and for the job."""

    step_seconds: float
    compute: float
    communication: float
    offload: float
    utilisation: float
    peak_tflops: float
    steps: int | None
    job_seconds: float | None
    bubble: float = 0.0  # the pipeline's idle time per step
    bubble_fraction: float = 0.0  # ... as a fraction of the step: (pp - 1) / (m + pp - 1) (or v m)

    def render(self) -> str:
        """The sentence."""
        parts = [f"compute {self.compute:.2f} s at {self.utilisation:.0%} of {self.peak_tflops:.1f} TFLOP/s"]
        if self.bubble:
            parts.append(f"the pipeline's bubble {self.bubble:.2f} s ({self.bubble_fraction:.0%} of the step idle)")
        if self.communication:
            parts.append(f"communication not hidden by compute {self.communication:.2f} s")
        if self.offload:
            parts.append(f"host transfers and the host's optimizer step {self.offload:.2f} s")
        job = ""
        if self.steps is not None and self.job_seconds is not None:
            job = f"; {self.steps} steps: {_duration(self.job_seconds)} for the job"
        return f"Time per optimizer step: {self.step_seconds:.2f} s ({', '.join(parts)}){job}."


def _duration(seconds: float) -> str:
    """3725 -> '1 h 2 min'."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    if minutes < 120:
        return f"{minutes:.0f} min"
    return f"{int(minutes // 60)} h {int(minutes % 60)} min"


@dataclass(frozen=True)
class HostMemoryOver(Step):
    """A configuration needs more host memory per node than a node has."""

    method: str
    strategy: str
    need: int
    phase: str
    limit: int

    def render(self) -> str:
        """The sentence."""
        return (
            f"{method_name(self.method)} under {strategy_name(self.strategy)} needs {fmt_bytes(self.need)} of host "
            f"memory per node ({self.phase}) but a node has {fmt_bytes(self.limit)} (--host-memory): it does not fit."
        )


@dataclass(frozen=True)
class NothingFits(Step):
    """No configuration fits: the smallest, and what would make one fit."""

    capacity: int
    method: str
    strategy: str
    micro_batch_size: int
    total: int
    at_least: bool  # the model states alone already exceed the memory
    advice: tuple[str, ...] = field(default_factory=tuple)

    def render(self) -> str:
        """The sentence, then the advice."""
        head = (
            f"Nothing fits in {fmt_bytes(self.capacity)} per GPU: the smallest option, {method_name(self.method)} "
            f"under {strategy_name(self.strategy)} at micro-batch {self.micro_batch_size}, needs "
            f"{'at least ' if self.at_least else ''}{fmt_bytes(self.total)}."
        )
        return " ".join((head, *self.advice))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
