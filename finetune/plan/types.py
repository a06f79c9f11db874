"""The Plan: the contract between the planner and the trainer.

The trainer executes exactly ``Plan.chosen`` (method, strategy, precision, micro-batch, gradient
accumulation, activation checkpointing, processes) and reports its measured peak next to
``chosen.memory.total``. Nothing downstream re-decides what the Plan decided.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, TypedDict, cast

from finetune.spec import ExecSpec, Method, Precision, Strategy


@dataclass
class MemoryBreakdown:
    """Predicted bytes per GPU (per rank), by category."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0
    overhead: int = 0
    rollout: int = 0  # grpo: the sampled completions' memory beyond the step's activations (finetune/plan/rollout.py)

    @property
    def total(self) -> int:
        """Sum of every category."""
        return (
            self.params + self.grads + self.optimizer + self.activations + self.buffers + self.overhead + self.rollout
        )

    def to_dict(self) -> dict[str, int]:
        """JSON form, with ``total``."""
        d = asdict(self)
        d["total"] = self.total
        return d


class Status(str, Enum):
    """Where a candidate stands against the memory (and the capability table)."""

    FITS = "fits"
    OVER = "does not fit"  # traced total over the GPU's memory
    STATES_OVER = "model states do not fit"  # the model states alone exceed it (activations not traced)
    NOT_TRACED = "not traced"  # the walk did not need this method's activations (a table row)
    HOST_OVER = "host memory does not fit"  # the whole job's host memory per node exceeds --host-memory
    REFUSED = "refused"  # the capability table rules it out (``Candidate.why`` says why)

    @property
    def note(self) -> str:
        """The short note ``plan --json`` has always carried (empty unless activations were not traced)."""
        return _NOTES.get(self, "")


_NOTES = {
    Status.STATES_OVER: "model states alone exceed the memory (activations not traced)",
    Status.NOT_TRACED: "activations not traced (the walk did not need this method)",
}


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step, by what takes them, and of the whole job."""

    compute: float = 0.0  # forward, backward (and recompute) arithmetic at the assumed utilisation
    communication: float = 0.0  # collectives not hidden behind compute
    offload: float = 0.0  # host <-> device transfers (and the host's optimizer step) not hidden
    bubble: float = 0.0  # pipeline bubbles
    rollout: float = 0.0  # grpo: sampling the completions and scoring them (finetune/plan/rollout.py), per step
    steps: int | None = None  # optimizer steps of the job (None: not known without the data)
    peak_flops: float = 0.0  # FLOP/s of one device the compute figure assumes
    utilisation: float = 0.0  # the fraction of ``peak_flops`` assumed

    @property
    def step(self) -> float:
        """Seconds per optimizer step."""
        return self.compute + self.communication + self.offload + self.bubble + self.rollout

    @property
    def job(self) -> float | None:
        """Seconds for the whole job (None when the step count is not known)."""
        return None if self.steps is None else self.step * self.steps

    def to_dict(self) -> dict[str, Any]:
        """JSON form, with ``step`` and ``job``."""
        return {**asdict(self), "step": self.step, "job": self.job}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepTime:
        """Inverse of :meth:`to_dict`."""
        return cls(**{k: v for k, v in d.items() if k not in ("step", "job")})


@dataclass(frozen=True)
class Config:
    """What the walk tries: one configuration, before it is sized.

    The records that describe a configuration, from what the user asked to what runs: the recipe (what the user
    wrote) -> :class:`~finetune.plan.request.Request` (what to plan, the recipe's ``auto`` left open) ->
    :class:`Config` (one configuration the walk tries) -> :class:`Candidate` (a configuration with its memory,
    communication and time) -> :class:`~finetune.spec.ExecSpec` (how the chosen one stores, computes and shards
    every tensor: what the trainer runs). The capability table reads a configuration as its ``Cell``.
    ``optimizer`` and ``offload`` of None are the recipe's."""

    method: str
    strategy: str
    micro_batch_size: int = 1
    activation_checkpointing: bool = False
    tp: int = 1
    pp: int = 1
    optimizer: str | None = None
    offload: str | None = None

    def with_(self, **changes: Any) -> Config:
        """This configuration with ``changes`` (field names) applied."""
        return replace(self, **changes)


@dataclass
class Candidate:
    """One configuration the planner considered (and the chosen one), with its figures."""

    method: Method
    strategy: Strategy
    precision: Precision
    micro_batch_size: int
    grad_accum_steps: int
    activation_checkpointing: bool
    nproc: int  # processes per node
    nnodes: int = 1
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    comm_bytes_per_step: int = 0
    comm_seconds_per_step: float | None = None
    # comm_bytes_per_step split by link: inside a node, and across nodes (a flat strategy on several nodes counts
    # all of it across nodes: its rings cross the slowest link); the seconds of each over its link
    comm_intra_node_bytes_per_step: int = 0
    comm_inter_node_bytes_per_step: int = 0
    comm_intra_node_seconds_per_step: float = 0.0
    comm_inter_node_seconds_per_step: float = 0.0
    fits: bool = True  # status is FITS (kept in the JSON)
    note: str = ""  # the status's note (kept in the JSON)
    eval_batch_size: int = 0  # rows per evaluation batch (eval.batch_size, or the largest that fits); 0: not planned
    eval_memory: int = 0  # predicted per-GPU peak of an evaluation at that batch (states + logits + KV cache)
    tp: int = 1  # tensor-parallel degree (inside a node); the strategy runs over world_size / tp replicas
    tp_comm_bytes_per_step: int = 0  # bytes each GPU sends per step for TP's all-reduces (intra-node link)
    optimizer: str = "adamw"  # adamw | adamw8bit | paged_adamw8bit
    offload: str = "none"  # none | optimizer | parameters: what lives in host memory
    offload_bytes_per_step: int = 0  # bytes over the host link per step for the offloaded state
    time: StepTime | None = None  # predicted seconds per step and for the job
    status: Status | None = None  # None: from ``fits`` and ``note`` (a plan written before statuses)
    why: str = ""  # the capability table's sentence of a refused candidate
    # pipeline parallelism: pp ranks (the mesh's outermost dimension), their schedule, the decoder layers of each
    # stage; every pp rank's peak (``memory`` is the worst one's) and the bytes a rank sends to its neighbours
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_layers: tuple[int, ...] = ()
    stage_memory: list[MemoryBreakdown] = field(default_factory=list)
    pp_comm_bytes_per_step: int = 0
    # expert parallelism (distributed.ep): the experts split over ep ranks of the shard dimension; the bytes a
    # rank sends per step by the experts' all-to-alls, the buffers of one layer's dispatch (in ``buffers``), and
    # the routed experts' weights a rank computes with (its 1/ep, whole model, as FSDP gathers them)
    ep: int = 1
    ep_comm_bytes_per_step: int = 0
    ep_dispatch_bytes: int = 0
    expert_bytes_per_rank: int = 0

    @property
    def dp(self) -> int:
        """Data-parallel replicas (processes / (pp x tp); 1 for a single process)."""
        return self.world_size // (self.tp * self.pp) if self.strategy.distributed else 1

    @property
    def label(self) -> str:
        """The strategy as people say it: ``FSDP``, ``TP 2 x FSDP`` (2-D), ``TP 8`` (one replica),
        ``PP 4 x TP 8 x FSDP`` (3-D)."""
        pipe = f"PP {self.pp} x " if self.pp > 1 else ""
        if self.ep > 1:
            return f"EP {self.ep} x {self.strategy.title}"
        if self.tp == 1:
            if self.pp > 1 and self.dp == 1:
                return f"PP {self.pp}"
            return pipe + self.strategy.title
        return pipe + (f"TP {self.tp}" if self.dp == 1 else f"TP {self.tp} x {self.strategy.title}")

    @property
    def world_size(self) -> int:
        """Processes over all nodes."""
        return self.nproc * self.nnodes

    @property
    def config(self) -> Config:
        """The configuration these figures are of."""
        return Config(
            self.method.value, self.strategy.value, self.micro_batch_size, self.activation_checkpointing, self.tp,
            self.pp, self.optimizer, self.offload,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        d = asdict(self)
        d["memory"] = self.memory.to_dict()
        d["time"] = self.time.to_dict() if self.time is not None else None
        d["pp_layers"] = list(self.pp_layers)
        d["stage_memory"] = [m.to_dict() for m in self.stage_memory]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        mem = {k: v for k, v in d.pop("memory", {}).items() if k != "total"}
        time = d.pop("time", None)
        stages = [MemoryBreakdown(**{k: v for k, v in m.items() if k != "total"}) for m in d.pop("stage_memory", [])]
        d["pp_layers"] = tuple(d.get("pp_layers", ()))
        return cls(memory=MemoryBreakdown(**mem), time=StepTime.from_dict(time) if time else None,
                   stage_memory=stages, **d)

    def __post_init__(self) -> None:  # plain names (JSON, tests) become the enums
        self.method, self.strategy = Method(self.method), Strategy(self.strategy)
        self.precision = Precision(self.precision)
        if self.status is None:
            by_note = {st.note: st for st in (Status.STATES_OVER, Status.NOT_TRACED)}
            self.status = by_note.get(self.note, Status.FITS if self.fits else Status.OVER)
        self.status = Status(self.status)
        self.fits, self.note = self.status is Status.FITS, self.status.note


class ModelFacts(TypedDict, total=False):
    """The plan's ``model``: what was planned (the trainer reads the layers, the attention the architecture needs,
    the expert and mixture figures and the stored bytes by dtype from here)."""

    source: str  # the model's path, hub id or catalog name
    model_type: str
    layers: int
    parameters: int
    trainable: int  # values with gradients and optimizer state under the chosen method
    seq_len: int
    global_batch_size: int
    packed: bool
    checkpoint_bytes: int  # one resumable checkpoint of the chosen configuration
    param_bytes: int  # every stored parameter (base + adapters)
    param_bytes_by_dtype: dict[str, int]  # what the built model must hold, by dtype name
    attention_for_architecture: bool  # eager because the architecture has no sdpa (gpt-oss's sinks)
    experts: dict[str, int]  # a mixture's fused expert weights: tensors, values, adapted, quantized, stored bytes
    moe: dict[str, Any]  # a mixture's layout (experts, top-k, shared experts, dense layers)
    expert_parameters: int
    active_parameters: int  # the weights one token computes with
    expert_fraction: float
    aux_loss_coef: float  # the load-balancing loss's coefficient (0: not added)
    routed_activation_bytes_per_token: int


class HardwareFacts(TypedDict, total=False):
    """The plan's ``hardware``: what it was planned for (finetune/plan/hardware.py's Hardware, and the world)."""

    device: str  # cuda | cpu
    gpus_per_node: int
    nodes: int
    memory_bytes: int  # per GPU (per process on CPU)
    bf16: bool
    name: str
    interconnect: str
    bandwidth: float
    detected: bool
    host_memory: int  # per node (0: not checked)
    gpu_type: str | None
    world: int


class JobFacts(TypedDict, total=False):
    """The plan's ``job``: the chosen configuration's whole job beyond the step (bytes; finetune/plan/job.py)."""

    load_peak_per_gpu: int
    host_loading_per_node: int
    host_checkpoint_per_node: int
    host_final_save_per_node: int
    checkpoint_bytes: int
    final_model_bytes: int
    host_offload_per_node: int
    host_training_per_node: int
    host_peak_per_node: int


@dataclass
class Plan:
    """The planner's answer: the chosen configuration, every candidate, and the walk in sentences."""

    chosen: Candidate
    candidates: list[Candidate] = field(default_factory=list)
    walk: list[str] = field(default_factory=list)
    hardware: HardwareFacts = field(default_factory=lambda: HardwareFacts())
    model: ModelFacts = field(default_factory=lambda: ModelFacts())  # source, parameter counts, sequence length
    execution: ExecSpec | None = None  # how the chosen configuration stores and computes every tensor
    job: JobFacts = field(default_factory=lambda: JobFacts())  # the chosen row's loading/checkpoint/final-save figures
    steps: list[dict[str, Any]] = field(default_factory=list)  # the walk's typed steps (finetune/plan/walk.py)
    refused: list[dict[str, Any]] = field(default_factory=list)  # candidates the capability table ruled out

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form written as ``plan.json`` and printed by ``finetune plan --json``."""
        return {
            "chosen": self.chosen.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "walk": list(self.walk),
            "hardware": dict(self.hardware),
            "model": dict(self.model),
            "execution": self.execution.to_dict() if self.execution else None,
            "job": dict(self.job),
            "steps": list(self.steps),
            "refused": list(self.refused),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`."""
        return cls(
            chosen=Candidate.from_dict(d["chosen"]),
            candidates=[Candidate.from_dict(c) for c in d.get("candidates", [])],
            walk=list(d.get("walk", [])),
            hardware=cast(HardwareFacts, dict(d.get("hardware", {}))),
            model=cast(ModelFacts, dict(d.get("model", {}))),
            execution=ExecSpec.from_dict(d["execution"]) if d.get("execution") else None,
            job=cast(JobFacts, dict(d.get("job", {}))),
            steps=list(d.get("steps", [])),
            refused=list(d.get("refused", [])),
        )
