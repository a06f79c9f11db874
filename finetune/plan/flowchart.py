"""The lecture's flowchart as a pure function: ``decide(request, hardware) -> Decision``.

1. Precision: bf16 mixed precision where the GPU has it, else fp16 with loss scaling; fp32 on CPU.
2. Full fine-tuning at micro-batch 1 under DDP, else ZeRO-2 (free: same communication), else FSDP
   (shards the parameters too; all-gathers them again in backward).
3. If FSDP alone does not fit at micro-batch 1 (``distributed.tp: auto``): tensor parallelism inside a node,
   the smallest degree that fits, with ZeRO-2/FSDP over the data-parallel replicas (a 2-D mesh).
   If full fine-tuning fits under none of them: LoRA, then QLoRA, each under the cheapest strategy that fits.
   Activation checkpointing is tried only when a method fits under no strategy without it.
4. If nothing fits yet, what still helps: the optimizer state in 8 bits, then paged (on GPUs), then the
   optimizer state offloaded to host memory, then the parameters too; then shorter sequences or more GPUs.
5. The largest micro-batch that fits, and gradient accumulation that keeps the recipe's global batch.
Where several strategies fit at the same step, the predicted time per step breaks the tie.
Everything the recipe pins is respected and checked. Every step is recorded as a typed
:mod:`finetune.plan.walk` step with the numbers that decided it; the request and hardware are never changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from finetune.capabilities import Cell, check, first_refusal
from finetune.errors import UserError
from finetune.methods import method_type
from finetune.plan import walk as w
from finetune.plan.activations import ActivationProfile, TraceSpec, activation_profile
from finetune.plan.hardware import GPU_TYPES, INTERCONNECTS, Hardware, detect_hardware
from finetune.plan.memory import CUDA_CONTEXT_BYTES, FRAGMENTATION, Setup, candidate_memory
from finetune.plan.shapes import Inventory, build_inventory, lora_targets
from finetune.plan.tensor_parallel import degrees, tp_comm_bytes, tp_config, tp_problem
from finetune.plan.types import Candidate, MemoryBreakdown, Plan, Status
from finetune.recipe import LoadedRecipe
from finetune.spec import AdapterSpec, ExecSpec, Method, Precision, Strategy, adapter_spec, execution_spec

#: The ways the walk shrinks or moves the optimizer state when nothing fits, in order (optimizer, offload).
STATE_STAGES: tuple[tuple[str, str], ...] = (
    ("adamw8bit", "none"),
    ("paged_adamw8bit", "none"),
    ("adamw", "optimizer"),
    ("adamw", "parameters"),
)

#: A strategy later in the flowchart's order than the first that fits is chosen only when it is predicted
#: this much faster per step: within the time model's error the lecture's order (simplest first) stands.
TIME_MARGIN = 0.2


@dataclass
class Request:
    """What to plan: the recipe's choices ("auto" = let the planner pick) and the model's config."""

    config: Any
    source: str
    method: str = "auto"
    strategy: str = "auto"
    precision: str = "auto"
    micro_batch_size: int | None = None
    checkpointing: bool | None = None
    global_batch_size: int = 8
    seq_len: int = 512
    packed: bool = False
    lora: Any = None
    prefix: Any = None  # the recipe's prefix section (method prefix)
    adapter: Any = None  # the recipe's adapter section (method adapter)
    model_dtype: str = "auto"  # model.dtype: the frozen base's storage (lora)
    quantization: Any = None  # the recipe's quantization section (qlora); None: its defaults
    attn_implementation: str = "sdpa"
    optimizer: str = "auto"  # train.optimizer (auto: adamw unless nothing fits without 8-bit state)
    offload: str = "auto"  # train.offload (auto: none unless nothing fits without it)
    compile: bool = False  # train.compile: every decoder block compiled
    tp: int | str = 1  # distributed.tp: a degree, or auto (the walk tries TP when FSDP alone does not fit)
    for_run: bool = False  # a real run: impossible batch settings are errors, not adjustments
    eval_batch_size: int | None = None  # None: auto (the largest that fits)
    eval_max_new_tokens: int = 32
    steps: int | None = None  # optimizer steps of the job when known (train.max_steps), for its time


def request_from_recipe(loaded: LoadedRecipe) -> Request:
    """A :class:`Request` from a validated recipe (model config from its path, the catalog or the cache)."""
    from finetune.locate import model_config

    r = loaded.recipe
    assert loaded.inputs is not None, "load_recipe resolves the inputs"
    config, source = model_config(loaded.inputs.model, r.model.trust_remote_code)
    mbs = r.train.micro_batch_size
    ac = r.train.activation_checkpointing
    return Request(
        config=config,
        source=source,
        method=r.method,
        strategy=r.distributed.strategy,
        precision=r.precision,
        micro_batch_size=None if mbs == "auto" else int(mbs),
        checkpointing=None if ac == "auto" else bool(ac),
        global_batch_size=r.train.global_batch_size,
        seq_len=r.data.max_seq_len,
        packed=r.data.packing,
        lora=r.lora,
        prefix=r.prefix,
        adapter=r.adapter,
        model_dtype=r.model.dtype,
        quantization=r.quantization,
        attn_implementation=r.model.attn_implementation,
        eval_batch_size=None if r.eval.batch_size == "auto" else int(r.eval.batch_size),
        eval_max_new_tokens=r.eval.max_new_tokens,
        optimizer=r.train.optimizer,
        offload=r.train.offload,
        tp=r.distributed.tp,
        compile=r.train.compile,
        steps=r.train.max_steps,
    )


def plan_for_run(loaded: LoadedRecipe, *, nproc: int, nnodes: int, device: str) -> Plan:
    """The plan the trainer executes for ``nproc`` x ``nnodes`` processes on ``device`` ("cuda" or "cpu")."""
    req = replace(request_from_recipe(loaded), for_run=True)
    hw = replace(detect_hardware(device=device, gpus=nproc, nodes=nnodes, nproc=nproc), gpus_per_node=nproc)
    return make_plan(req, hw)


def chosen_memory(
    loaded: LoadedRecipe, plan: Plan, *, device: str, first_step: bool = False, seq_len: int | None = None
) -> MemoryBreakdown:
    """Predicted peak of ``plan.chosen`` (the first optimizer step's with ``first_step``: AdamW's state does
    not exist yet during its forward and backward), at ``seq_len`` tokens per row instead of
    ``data.max_seq_len`` when given: the trainer pads each micro-batch to its longest row, so a run on short
    rows is compared with the prediction at the width that ran."""
    c = plan.chosen
    req = replace(request_from_recipe(loaded), for_run=True)
    if seq_len is not None:
        req = replace(req, seq_len=seq_len)
    hw = detect_hardware(device=device, gpus=c.nproc, nodes=c.nnodes, nproc=c.nproc)
    s = replace(settle(req, hw), precision=str(c.precision), global_batch=c.micro_batch_size * c.grad_accum_steps * c.dp)
    return evaluate(
        s, c.method, c.strategy, c.micro_batch_size, c.activation_checkpointing, first_step=first_step, tp=c.tp,
        optimizer=c.optimizer, offload=c.offload,
    ).memory


# -- the settled request ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """The request and hardware with everything the walk decides before it tries configurations: the
    process count, precision, global batch, the pinned TP degree (or the degrees to try), the inventory.
    Never changed once made; a variant (another sequence length, more GPUs) is a new one."""

    req: Request
    hw: Hardware
    world: int
    precision: str
    global_batch: int
    tp: int
    tp_auto: tuple[int, ...]
    lora: Any
    adapter: AdapterSpec | None  # what is trained on the frozen base (None: full fine-tuning pinned)
    inv: Inventory
    cell: Cell
    # memo of traces and per-TP inventories: (tp, TraceSpec) -> profile, tp -> inventory (pure caches)
    profiles: dict[tuple[int, TraceSpec], ActivationProfile] = field(default_factory=dict, compare=False, repr=False)
    inventories: dict[int, Inventory] = field(default_factory=dict, compare=False, repr=False)

    @property
    def capacity(self) -> int:
        """Bytes of memory per GPU (per process on CPU)."""
        return self.hw.memory_bytes

    @property
    def intra_node_bandwidth(self) -> float:
        """Bytes/s of the link inside a node, which TP's all-reduces use (NVLink when several nodes are given)."""
        if self.hw.nodes == 1 or self.hw.device != "cuda":
            return self.hw.bandwidth
        return INTERCONNECTS["nvlink"]

    def at_seq_len(self, seq: int) -> Setting:
        """This setting at ``seq`` tokens per sample (the traces are shared: they are keyed by length)."""
        return replace(self, req=replace(self.req, seq_len=seq))

    def on_gpus(self, k: int) -> Setting:
        """This setting on ``k`` GPUs over the same nodes."""
        return replace(self, world=k, hw=replace(self.hw, gpus_per_node=k // self.hw.nodes or 1))

    def inventory(self, tp: int) -> Inventory:
        """One TP rank's parameters (the whole model's at tp 1)."""
        if tp == 1:
            return self.inv
        if tp not in self.inventories:
            self.inventories[tp] = build_inventory(tp_config(self.req.config, tp), self.req.source, self.adapter)
        return self.inventories[tp]

    def exec_spec(
        self, method: str, strategy: str, ac: bool, world: int | None = None, tp: int = 1,
        optimizer: str | None = None, offload: str | None = None,
    ) -> ExecSpec:
        """How ``method`` under ``strategy`` stores and computes each tensor (what the trainer will build)."""
        r = self.req
        return execution_spec(
            method, strategy, self.precision, checkpointing=ac, world_size=world or self.world,
            model_dtype=r.model_dtype, quantization=r.quantization, lora=self.lora, prefix=r.prefix,
            adapter=r.adapter, tp=tp, compile=r.compile, optimizer=optimizer or r.optimizer,
            offload=offload or r.offload,
        )

    def profile(self, spec: ExecSpec) -> ActivationProfile:
        """The traced activations of ``spec`` at this setting's sequence length (one TP rank's)."""
        trace = TraceSpec.of(
            spec, seq_len=self.req.seq_len, packed=self.req.packed,
            attn_implementation=self.req.attn_implementation, device=self.hw.device,
        )
        key = (spec.tp, trace)
        if key not in self.profiles:
            self.profiles[key] = activation_profile(tp_config(self.req.config, spec.tp), trace)
        return self.profiles[key]

    def refusal(
        self, method: str, strategy: str, tp: int = 1, ac: bool | None = None, optimizer: str | None = None,
        offload: str | None = None,
    ) -> str | None:
        """The capability table's sentence when this configuration cannot run with the recipe's other
        settings (None: it can)."""
        cell = self.cell.with_(
            method=method, strategy=strategy, tp=tp, processes=1 if strategy == "single" else self.cell.processes,
            checkpointing=self.cell.checkpointing if ac is None else ac, precision=self.precision,
            optimizer=optimizer or self.cell.optimizer, offload=offload or self.cell.offload,
        )
        found = first_refusal(cell)
        return None if found is None else str(found)


def settle(req: Request, hw: Hardware, log: list[w.Step] | None = None) -> Setting:
    """The :class:`Setting` of ``req`` on ``hw``: the capability table checked, the TP degree, attention,
    precision and global batch resolved, each decision appended to ``log``."""
    log = [] if log is None else log
    if req.strategy == "single" and hw.world > 1 and not req.for_run:  # a run: the launcher decides
        log.append(w.OneProcess(hw.world))
        hw = replace(hw, gpus_per_node=1, nodes=1)
    world = hw.world
    lora = req.lora
    if lora is None:
        from finetune.recipe import LoraConfig

        lora = LoraConfig()
    # What the recipe pins, checked against the capability table before anything is traced. A preview on
    # one GPU leaves the process count open (a sharded strategy is planned as it would run on more).
    cell = Cell.of(
        method=req.method, strategy=req.strategy, processes=world if req.for_run or world > 1 else None,
        tp=req.tp, precision=req.precision, optimizer=req.optimizer, offload=req.offload, compile=req.compile,
        attention=req.attn_implementation, packing=req.packed, checkpointing=req.checkpointing,
        lora=lora, prefix=req.prefix, quantization=req.quantization,
    )
    check(cell)
    # full, LoRA and QLoRA (the auto ladder) share LoRA's adapters; a pinned full run never reads lora:
    adapter = adapter_spec("lora" if req.method == "auto" else req.method, lora, req.prefix, req.adapter)
    inv = build_inventory(req.config, req.source, adapter)
    tp, tp_auto = _resolve_tp(req, hw, world, cell, log)
    req = _resolve_attention(req, inv, log)
    precision = _resolve_precision(req, hw, log)
    global_batch = _resolve_batch(req, world // tp, tp, log)
    return Setting(
        req=req, hw=hw, world=world, precision=precision, global_batch=global_batch, tp=tp, tp_auto=tp_auto,
        lora=lora, adapter=adapter, inv=inv, cell=cell,
    )


def _resolve_tp(req: Request, hw: Hardware, world: int, cell: Cell, log: list[w.Step]) -> tuple[int, tuple[int, ...]]:
    """The pinned TP degree (checked, one sentence with the numbers when it cannot run), and the degrees the
    walk may try when FSDP alone does not fit (``distributed.tp: auto``)."""
    per_node = hw.gpus_per_node
    if req.tp == "auto":
        if req.strategy in ("auto", "zero2", "fsdp") and world > 1:
            return 1, tuple(degrees(req.config, per_node))
        return 1, ()
    tp = int(req.tp)
    if tp == 1:
        return 1, ()
    what = "processes" if hw.device == "cpu" or req.for_run else "GPUs"
    if tp > per_node:
        raise UserError(
            f"distributed.tp: {tp} is more than the {per_node} {what} of a node (--nproc); tensor parallelism "
            f"stays inside a node: use a tp of at most {per_node}"
        )
    if per_node % tp:
        raise UserError(
            f"distributed.tp: {tp} does not divide the {per_node} {what} of a node (--nproc); use a divisor "
            f"of {per_node}"
        )
    problem = tp_problem(req.config, tp)
    if problem:
        raise UserError(problem)
    check(cell.with_(processes=world))  # ddp/zero1 cannot replicate TP over several replicas
    cfg = req.config
    log.append(w.PinnedTensorParallel(
        tp=tp, what=what, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
        mlp=cfg.intermediate_size, replicas=world // tp,
    ))
    return tp, ()


def _resolve_attention(req: Request, inv: Inventory, log: list[w.Step]) -> Request:
    """The request with the attention kernel the architecture has in transformers (``inv`` knows)."""
    arch = type(req.config).__name__.replace("Config", "")
    if req.attn_implementation == "sdpa" and not inv.sdpa:
        log.append(w.Note(
            f"{arch} has no sdpa attention in transformers: planned with eager attention (set "
            "model.attn_implementation: eager in the recipe to train it)."
        ))
        return replace(req, attn_implementation="eager")
    if req.attn_implementation == "flex_attention" and not inv.flex:
        raise UserError(
            f"model.attn_implementation: {arch} has no flex attention in transformers; use sdpa (packed rows then "
            "carry a T x T mask)"
        )
    return req


def _resolve_precision(req: Request, hw: Hardware, log: list[w.Step]) -> str:
    """Step 1: the precision, pinned or chosen for the hardware."""
    if req.precision != "auto":
        no_bf16 = hw.device == "cuda" and req.precision.startswith("bf16") and not hw.bf16
        log.append(w.PrecisionChosen(req.precision, "pinned", hw.name, no_bf16))
        return req.precision
    if hw.device == "cpu":
        log.append(w.PrecisionChosen("fp32", "cpu"))
        return "fp32"
    if hw.bf16:
        known = hw.detected or hw.name in GPU_TYPES
        log.append(w.PrecisionChosen("bf16", "bf16" if known else "assumed", hw.name))
        return "bf16"
    log.append(w.PrecisionChosen("fp16", "fp16", hw.name))
    return "fp16"


def _resolve_batch(req: Request, ranks: int, tp: int, log: list[w.Step]) -> int:
    """The global batch over ``ranks`` data-parallel ranks (the ranks of a TP group share a slice)."""
    g = req.global_batch_size
    if g % ranks:
        if req.for_run:
            raise UserError(
                f"train.global_batch_size ({g}) must be a multiple of the number of processes ({ranks}); "
                f"use e.g. {ranks * max(1, round(g / ranks))}"
            )
        new = ranks * (-(-g // ranks))
        log.append(w.BatchRounded(g, ranks, new))
        g = new
    mbs = req.micro_batch_size
    if mbs is not None and g % (mbs * ranks):
        raise UserError(
            f"train.global_batch_size ({g}) must be divisible by micro_batch_size x "
            f"{'data-parallel replicas' if tp > 1 else 'processes'} ({mbs} x {ranks} = {mbs * ranks})"
        )
    return g


# -- one candidate --------------------------------------------------------------------------------------------
def evaluate(
    s: Setting, method: str, strategy: str, mbs: int, ac: bool, *, tp: int = 1, first_step: bool = False,
    traced: frozenset[tuple[str, bool, int]] | None = None, optimizer: str | None = None,
    offload: str | None = None,
) -> Candidate:
    """One configuration's per-GPU memory, communication and time. ``traced``: trace activations only for
    the (method, checkpointing, tp) the walk traced (the table's other rows are marked not traced)."""
    world = 1 if strategy == "single" else s.world
    dp = world // tp
    accum = max(1, s.global_batch // (mbs * dp))
    spec = s.exec_spec(method, strategy, ac, world, tp, optimizer, offload)
    inv = s.inventory(tp)
    setup = Setup(spec, mbs, accum, dp, s.hw.device, spec.optimizer)
    mem, comm = candidate_memory(inv, None, setup)
    if mem.total > s.capacity:
        status = Status.STATES_OVER
    elif traced is not None and (method, ac, tp) not in traced:
        status = Status.NOT_TRACED
    else:
        mem, comm = candidate_memory(inv, s.profile(spec), setup, first_step)
        status = Status.FITS if mem.total <= s.capacity else Status.OVER
    tp_comm = tp_comm_bytes(
        s.req.config, tp, seq_len=s.req.seq_len, micro_batch_size=mbs, grad_accum_steps=accum,
        compute_bytes=spec.compute_bytes, checkpointing=ac,
    )
    secs = (comm / s.hw.bandwidth if comm else 0.0) + tp_comm / s.intra_node_bandwidth
    c = Candidate(
        method=Method(method), strategy=Strategy(strategy), precision=Precision(s.precision),
        micro_batch_size=mbs, grad_accum_steps=accum, activation_checkpointing=ac, nproc=s.hw.gpus_per_node,
        nnodes=s.hw.nodes, memory=mem, comm_bytes_per_step=comm, comm_seconds_per_step=secs, status=status,
        tp=tp, tp_comm_bytes_per_step=tp_comm, optimizer=spec.optimizer, offload=spec.offload,
        offload_bytes_per_step=_offload_bytes(inv, setup),
    )
    return replace(c, time=_time(s, c))


def _offload_bytes(inv: Inventory, setup: Setup) -> int:
    """Bytes over the host link per step for what ``setup`` offloads (0 when nothing is)."""
    if setup.spec.offload == "none":
        return 0
    from finetune.plan import memory

    fn = getattr(memory, "offload_bytes_per_step", None)
    return int(fn(inv, setup)) if fn is not None else 0


def _time(s: Setting, c: Candidate) -> Any:
    """The predicted :class:`~finetune.plan.types.StepTime` of ``c`` (None until the time model applies)."""
    try:
        from finetune.plan.timing import step_time
    except ImportError:
        return None
    adapter = s.adapter
    if adapter is None and c.method.adapters:  # a pinned full run's advice prices QLoRA: LoRA's adapters
        adapter = adapter_spec(str(c.method), s.lora, s.req.prefix, s.req.adapter)
    return step_time(c, s.req.config, s.hw, seq_len=s.req.seq_len, adapter=adapter, steps=s.req.steps)


def _step_seconds(c: Candidate) -> float:
    return c.time.step if c.time is not None else 0.0


# -- the walk -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    """What the walk decided: the chosen configuration, the table's rows (chosen first), every candidate
    the walk tried (refused ones with why), and the walk as typed steps."""

    setting: Setting
    chosen: Candidate
    rows: tuple[Candidate, ...]
    tried: tuple[Candidate, ...]
    steps: tuple[w.Step, ...]
    execution: ExecSpec
    job: dict[str, Any]

    @property
    def walk(self) -> list[str]:
        """The walk in sentences."""
        return [step.render() for step in self.steps]

    def plan(self) -> Plan:
        """The :class:`Plan` (the trainer's contract) of this decision."""
        s, chosen = self.setting, self.chosen
        sb = s.inv.storage(self.execution)  # the whole model: what is built (before TP splits it) and saved
        model = {
            "source": s.req.source, "model_type": s.inv.model_type, "layers": s.inv.num_layers,
            "parameters": s.inv.n_params, "trainable": sb.trainable, "seq_len": s.req.seq_len,
            "global_batch_size": s.global_batch, "packed": s.req.packed,
            "checkpoint_bytes": _checkpoint_size(chosen.method, sb),
            "param_bytes": sb.param_bytes, "param_bytes_by_dtype": s.inv.bytes_by_dtype(self.execution),
        }
        hw = s.hw.to_dict()
        hw["world"] = s.world
        return Plan(
            chosen=chosen, candidates=list(self.rows), walk=self.walk, hardware=hw, model=model,
            execution=self.execution, job=self.job, steps=[step.to_dict() for step in self.steps],
            refused=[c.to_dict() for c in self.tried if c.status is Status.REFUSED],
        )


class _Walk:
    """The log and the candidates of one walk (local to :func:`decide`; the setting is never changed)."""

    def __init__(self, s: Setting, log: list[w.Step]) -> None:
        self.s, self.log = s, log
        self.tried: list[Candidate] = []
        self.said: set[str] = set()

    def refused(
        self, method: str, strategy: str, tp: int, ac: bool, optimizer: str | None = None,
        offload: str | None = None, *, say: bool = True,
    ) -> bool:
        """Whether the capability table refuses the configuration; the first time a sentence rules out a
        candidate the walk considers, it is said (and the refused candidate kept with why)."""
        text = self.s.refusal(method, strategy, tp, ac, optimizer, offload)
        if text is None:
            return False
        if say and text not in self.said:
            self.said.add(text)
            self.log.append(w.RuledOut(method, strategy, tp, text))
            self.tried.append(_refused(self.s, method, strategy, tp, ac, text, optimizer, offload))
        return True

    def attempt(
        self, method: str, strategies: list[str], mbs: int, ac: bool, tp: int, clause: bool,
        optimizer: str | None = None, offload: str | None = None, with_method: bool = True, setting: str = "",
        say: bool = True,
    ) -> Candidate | None:
        """``method`` under each of ``strategies`` in order (tp, checkpointing and state fixed). The first
        that fits is the answer, unless a later one that also fits is predicted faster by more than
        :data:`TIME_MARGIN` (every strategy after the first fit is evaluated for that); the sentence lists
        the attempts up to the first fit."""
        attempts: list[w.Attempt] = []
        fitting: list[Candidate] = []
        for strategy in strategies:
            if self.refused(method, strategy, tp, ac, optimizer, offload, say=not fitting):
                continue
            c = self.host_checked(
                evaluate(self.s, method, strategy, mbs, ac, tp=tp, optimizer=optimizer, offload=offload)
            )
            self.tried.append(c)
            if fitting:  # past the first fit: only to compare the predicted time
                if c.fits:
                    fitting.append(c)
                continue
            attempts.append(w.Attempt(_label(c), c.memory.total, c.fits, c.status is Status.STATES_OVER))
            if c.fits:
                fitting.append(c)
                if c.time is None:
                    break
        if say and attempts:
            self.log.append(w.Tried(
                method, tuple(attempts), self.s.capacity, mbs, self.s.req.seq_len, clause, with_method, setting,
            ))
        if not fitting:
            return None
        first, best = fitting[0], min(fitting, key=_step_seconds)
        if best is not first and _step_seconds(best) < (1 - TIME_MARGIN) * _step_seconds(first):
            self.log.append(w.FasterChoice(_label(best), _step_seconds(best), _label(first), _step_seconds(first)))
            return best
        return first

    def host_checked(self, c: Candidate) -> Candidate:
        """An offloading candidate whose host memory per node exceeds ``hw.host_memory`` does not fit."""
        limit = self.s.hw.host_memory
        if c.offload == "none" or not limit or not c.fits:
            return c
        need, phase = _host_peak(self.s, c)
        if need <= limit:
            return c
        self.log.append(w.HostMemoryOver(c.method, c.strategy, need, phase, limit))
        return replace(c, status=Status.HOST_OVER)


def _refused(
    s: Setting, method: str, strategy: str, tp: int, ac: bool, why: str, optimizer: str | None, offload: str | None,
) -> Candidate:
    optimizer = optimizer or (s.req.optimizer if s.req.optimizer != "auto" else "adamw")
    offload = offload or (s.req.offload if s.req.offload != "auto" else "none")
    return Candidate(
        method=Method(method), strategy=Strategy(strategy), precision=Precision(s.precision), micro_batch_size=1,
        grad_accum_steps=1, activation_checkpointing=ac, nproc=s.hw.gpus_per_node, nnodes=s.hw.nodes,
        status=Status.REFUSED, why=why, tp=tp, optimizer=optimizer, offload=offload,
    )


def _label(c: Candidate) -> str:
    return c.label


def _host_peak(s: Setting, c: Candidate) -> tuple[int, str]:
    """The whole job's host memory per node of ``c`` and the phase that peaks."""
    from finetune.plan.job import host_peak_phase, job_figures

    world = 1 if c.strategy == "single" else s.world
    spec = s.exec_spec(c.method, c.strategy, c.activation_checkpointing, world, c.tp, c.optimizer, c.offload)
    per_node = 1 if c.strategy == "single" else s.hw.gpus_per_node
    job = job_figures(s.inv, spec, world, per_node, s.hw.device)
    return job.host_peak_per_node, host_peak_phase(job.to_dict())[0]


def _strategies(s: Setting) -> list[str]:
    if s.req.strategy != "auto":
        return [s.req.strategy]
    return ["single"] if s.world == 1 else ["ddp", "zero2", "fsdp"]


def _tp_strategies(s: Setting, tp: int) -> list[str]:
    """Strategies over the data-parallel replicas of a TP run (none to choose with one replica)."""
    if s.req.strategy != "auto":
        return [s.req.strategy]
    return ["ddp"] if s.world // tp == 1 else ["zero2", "fsdp"]


def _table_strategies(s: Setting) -> list[str]:
    if s.world == 1:
        return ["single"] if s.req.strategy in ("auto", "single") else [s.req.strategy]
    return ["ddp", "zero1", "zero2", "fsdp"]


def _methods(s: Setting) -> list[str]:
    return ["full", "lora", "qlora"] if s.req.method == "auto" else [s.req.method]


def _checkpointing_options(s: Setting) -> list[bool]:
    acs = [False, True] if s.req.checkpointing is None else [s.req.checkpointing]
    if s.req.method != "auto" and not Method(s.req.method).recomputable:
        return [False]  # prefix tuning: checkpointed layers would drop the prefix (see Method.recomputable)
    return acs


def _try_method(
    wk: _Walk, method: str, mbs1: int, acs: list[bool], optimizer: str | None = None, offload: str | None = None,
    setting: str = "", say: bool = True,
) -> Candidate | None:
    """``method`` under every strategy (the pinned TP degree), without then with checkpointing."""
    s = wk.s
    strategies = _strategies(s) if s.tp == 1 else _tp_strategies(s, s.tp)
    for ac in acs:
        if offload == "parameters":
            strategies = [x for x in strategies if x in ("zero2", "fsdp")]
        found = wk.attempt(
            method, strategies, mbs1, ac, s.tp, ac and len(acs) > 1, optimizer, offload, setting=setting, say=say,
        )
        if found is not None:
            return found
    return None


def _try_tensor_parallel(wk: _Walk, method: str, mbs1: int, acs: list[bool]) -> Candidate | None:
    """The smallest TP degree (inside a node) under which ``method`` fits at micro-batch ``mbs1``."""
    s = wk.s
    if not s.tp_auto or all(wk.refused(method, x, 2, acs[0], say=False) for x in _tp_strategies(s, 2)):
        return None
    fsdp = [c for c in wk.tried if c.method == method and c.strategy == "fsdp" and c.tp == 1 and c.memory.total]
    wk.log.append(w.TryTensorParallel(
        method, mbs1, min(c.memory.total for c in fsdp) if fsdp else None, s.tp_auto, s.req.seq_len,
        s.req.config.hidden_size,
    ))
    for tp in s.tp_auto:
        for ac in acs:
            found = wk.attempt(method, _tp_strategies(s, tp), mbs1, ac, tp, ac and len(acs) > 1, with_method=False)
            if found is not None:
                return found
    return None


def _next_method_step(s: Setting, method: str, nxt: str, mbs1: int) -> w.NextMethod:
    sb = s.inv.storage(s.exec_spec(nxt, "single", False))
    # the modules the inventory's adapters sit on (peft's default for the architecture when the recipe names none)
    injected = sorted({t.name.split(".lora_")[0].rsplit(".", 1)[-1] for t in s.inv.adapters if ".lora_" in t.name})
    targets = injected if s.lora.target_modules is None and injected else lora_targets(s.lora, s.req.config.model_type)
    targets = targets if isinstance(targets, str) else ", ".join(targets)
    base = ""
    if Method(nxt).quantized:  # 4-bit NF4 on the ladder; 8-bit only when quantization.bits pins it
        q = s.exec_spec(nxt, "single", False).quant
        assert q is not None
        base = f"{q.quant_type.upper()} 4-bit" if q.bits == 4 else "LLM.int8 8-bit"
    return w.NextMethod(method, nxt, mbs1, sb.trainable, s.lora.r, targets, base, sb.param_bytes)


def _choose(wk: _Walk) -> Candidate | None:
    """Steps 2 and 3: the first method (in the ladder's order) that fits under some strategy."""
    s = wk.s
    mbs1 = s.req.micro_batch_size or 1
    acs = _checkpointing_options(s)
    methods = _methods(s)
    for mi, method in enumerate(methods):
        found = _try_method(wk, method, mbs1, acs) or _try_tensor_parallel(wk, method, mbs1, acs)
        if found is not None:
            return found
        if mi + 1 < len(methods):
            wk.log.append(_next_method_step(s, method, methods[mi + 1], mbs1))
    return _smaller_state(wk, mbs1, acs)


def _stages(s: Setting) -> list[tuple[str, str]]:
    """The (optimizer, offload) stages the walk may try: only what the recipe leaves to it."""
    optimizer, offload = s.req.optimizer, s.req.offload
    out = []
    if optimizer == "auto" and offload in ("auto", "none"):
        out.append(("adamw8bit", "none"))
        if s.hw.device == "cuda":  # on a CPU, paged and plain 8-bit states are the same memory
            out.append(("paged_adamw8bit", "none"))
    if offload == "auto":
        kept = "adamw" if optimizer == "auto" else optimizer
        out += [(kept, "optimizer"), (kept, "parameters")]
    return out


def _smaller_state(wk: _Walk, mbs1: int, acs: list[bool]) -> Candidate | None:
    """Step 4: when nothing fits with the optimizer state as planned, the ways to shrink or move it, each
    tried over the ladder's methods (the first method that fits wins; the last is described if none)."""
    s = wk.s
    methods = _methods(s)
    for optimizer, offload in _stages(s):
        sized = [c for c in wk.tried if c.status in (Status.OVER, Status.STATES_OVER)]
        if not sized:
            return None
        best = min(sized, key=lambda c: c.memory.total)
        if wk.refused(best.method, best.strategy, best.tp, best.activation_checkpointing, optimizer, offload, say=False):
            same = best
        else:
            same = evaluate(s, best.method, best.strategy, best.micro_batch_size, best.activation_checkpointing,
                            tp=best.tp, optimizer=optimizer, offload=offload)
        if same.memory.total >= best.memory.total:
            continue  # saves nothing on the smallest configuration so far (e.g. adapters too small for 8 bits)
        host = _host_peak(s, same)[0] if offload != "none" else 0
        link = same.offload_bytes_per_step
        wk.log.append(w.SmallerState(
            optimizer, offload, max(0, best.memory.total - same.memory.total), host, link,
            same.time.offload if same.time is not None else link / INTERCONNECTS["pcie"],
        ))
        label = _state_words(optimizer, offload)
        for mi, method in enumerate(methods):
            last = mi + 1 == len(methods)
            mark = len(wk.log)
            found = _try_method(wk, method, mbs1, acs, optimizer, offload, setting=label)
            if found is not None:
                return found
            if not last:
                del wk.log[mark:]  # only the lightest method's attempts are worth a sentence
    return None


def _largest_micro_batch(wk: _Walk, c: Candidate) -> Candidate:
    """Step 5: the largest micro-batch that fits (a divisor of each rank's share of the global batch)."""
    s = wk.s
    per_rank = s.global_batch // c.dp
    if s.req.micro_batch_size is not None:
        return c
    best = c
    for b in sorted(b for b in range(2, per_rank + 1) if per_rank % b == 0):
        cand = evaluate(s, c.method, c.strategy, b, c.activation_checkpointing, tp=c.tp, optimizer=c.optimizer,
                        offload=c.offload)
        if not cand.fits:
            break
        best = cand
    wk.log.append(w.LargestMicroBatch(
        s.req.seq_len, best.micro_batch_size, best.activation_checkpointing, best.memory.total,
        best.grad_accum_steps, s.global_batch,
    ))
    return best


def _shorter_sequences(s: Setting, tried: list[Candidate]) -> tuple[int, Candidate] | None:
    """The longest sequence length (a multiple of 64) at which one of ``tried`` fits, found by tracing.

    The candidate is the one whose other memory leaves activations the most room (not necessarily the
    smallest: at long sequences QLoRA's fp32 activations outgrow full fine-tuning's). Memory is not
    linear in the length (autocast weight copies do not grow; packed rows under sdpa carry a T x T mask),
    so the length is searched on traced totals: secant steps from the two longest, then false position
    inside the bracket, at most eight traces.
    """
    def room(m: MemoryBreakdown) -> float:  # bytes left for activations; the overhead shrinks with them
        ctx, frag = (CUDA_CONTEXT_BYTES, FRAGMENTATION) if m.overhead else (0, 0.0)
        return (s.capacity - ctx) / (1 + frag) - (m.total - m.overhead - m.activations)

    cap, seq_len = s.capacity, s.req.seq_len
    options = [c for c in tried if c.memory.activations > 0 and room(c.memory) > 0]
    if not options or seq_len < 128:
        return None
    c = max(options, key=lambda o: room(o.memory) / o.memory.activations)
    over = [(seq_len, c.memory.total - cap)]  # (length, bytes over the cap), longest first
    best: tuple[int, Candidate, float] | None = None  # the longest length that fits
    t: float = max(64, seq_len // 2 // 64 * 64)
    for _ in range(8):
        t = int(t)
        found = evaluate(s.at_seq_len(t), c.method, c.strategy, c.micro_batch_size, c.activation_checkpointing,
                         tp=c.tp, optimizer=c.optimizer, offload=c.offload)
        excess = found.memory.total - cap
        if found.fits:
            best = (t, found, excess)
        else:
            over.append((t, excess))
            over.sort(reverse=True)
        hi, g_hi = min(over)  # the shortest length that does not fit
        if best is not None:
            lo, _, g_lo = best
            if hi - lo <= 64:
                break
            t = lo + (hi - lo) * (-g_lo) / (g_hi - g_lo)  # false position
            t = min(max(int(t) // 64 * 64, lo + 64), hi - 64)
        else:
            (t1, g1), (t2, g2) = over[-1], over[-2]  # secant through the two shortest that do not fit
            t = t1 - g1 * (t2 - t1) / (g2 - g1) if g2 != g1 else t1 / 2
            t = int(min(t, t1 / 2 if t >= t1 else t)) // 64 * 64
            if t < 64:
                if t1 == 64:
                    return None
                t = 64
    return (best[0], best[1]) if best is not None else None


def _nothing_fits(wk: _Walk) -> Candidate:
    """No configuration fits: the smallest one, and what would make one fit (more GPUs, QLoRA, shorter
    sequences)."""
    s = wk.s
    sized = [c for c in wk.tried if c.status is not Status.REFUSED]
    planned = [c for c in sized if (c.optimizer, c.offload) == _planned_state(s)] or sized
    best = min(planned, key=lambda c: c.memory.total)
    advice = []
    moved = [c for c in sized if c not in planned]
    if moved:
        least = min(moved, key=lambda c: c.memory.total)
        advice.append(f"Shrinking or moving the optimizer state does not make it fit either: {_state_label(least)} "
                      f"needs {'at least ' if least.status is Status.STATES_OVER else ''}"
                      f"{w.fmt_bytes(least.memory.total)} per GPU.")
    smallest = "fsdp" if s.req.strategy == "auto" else s.req.strategy
    method = best.method if s.req.method != "auto" else "qlora"
    if smallest in ("zero1", "zero2", "fsdp") or s.world == 1:  # sharded strategies shrink with the world
        strat = smallest if smallest != "single" else "fsdp"
        ac = Method(method).recomputable if s.req.checkpointing is None else s.req.checkpointing
        for k in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            if k <= s.world:
                continue
            c = evaluate(s.on_gpus(k), method, strat, 1, ac, optimizer=best.optimizer, offload=best.offload)
            if c.fits:
                advice.append(f"{w.method_name(method)} under {w.strategy_name(strat)} would fit on {k} GPUs "
                              f"({w.fmt_bytes(c.memory.total)} per GPU).")
                break
    if s.req.method not in ("auto", "qlora"):
        q = evaluate(s, "qlora", best.strategy, 1, best.activation_checkpointing)
        advice.append(f"QLoRA would need {w.fmt_bytes(q.memory.total)} per GPU "
                      f"({'fits' if q.fits else 'still too much'}).")
    shorter = _shorter_sequences(s, [c for c in wk.tried if c.status is not Status.REFUSED])
    if shorter is not None:
        seq, c = shorter
        ckpt = ", activation checkpointing on" if c.activation_checkpointing else ""
        advice.append(f"Shorter sequences would fit: {seq} tokens instead of {s.req.seq_len} "
                      f"({w.method_name(c.method)} under {w.strategy_name(c.strategy)}{ckpt}: "
                      f"{w.fmt_bytes(c.memory.total)} per GPU).")
    wk.log.append(w.NothingFits(
        s.capacity, best.method, best.strategy, best.micro_batch_size, best.memory.total,
        best.status is Status.STATES_OVER, tuple(advice),
    ))
    return best


def _planned_state(s: Setting) -> tuple[str, str]:
    """The (optimizer, offload) the recipe asks for before the walk shrinks or moves anything."""
    return (s.req.optimizer if s.req.optimizer != "auto" else "adamw", s.req.offload if s.req.offload != "auto" else "none")


def _state_label(c: Candidate) -> str:
    """``QLoRA with 8-bit AdamW under FSDP``: a candidate with its optimizer state's setting."""
    return f"{w.method_name(c.method)}{_state_words(c.optimizer, c.offload)} under {c.label}"


def _state_words(optimizer: str, offload: str) -> str:
    """`` with 8-bit AdamW``, `` with the optimizer state offloaded`` (empty for plain AdamW on the GPU)."""
    if offload == "optimizer":
        return " with the optimizer state offloaded"
    if offload == "parameters":
        return " with parameters and optimizer state offloaded"
    return "" if optimizer == "adamw" else f" with {w.OPTIMIZER_NAMES[optimizer].split(' (')[0]}"


def _pinned_keys(r: Request) -> tuple[str, ...]:
    """The recipe keys the walk took as given instead of choosing them (named as in the recipe)."""
    given = (
        ("method", r.method != "auto"),
        ("distributed.strategy", r.strategy != "auto"),
        ("precision", r.precision != "auto"),
        ("train.micro_batch_size", r.micro_batch_size is not None),
        ("train.activation_checkpointing", r.checkpointing is not None),
    )
    return tuple(key for key, pinned in given if pinned)


def plan_evaluation(s: Setting, c: Candidate) -> tuple[Candidate, w.EvaluationPlanned]:
    """The evaluation's peak at eval.batch_size (or the largest batch that fits, for auto) on ``c``: the
    candidate with its evaluation figures, and the step that says them."""
    from finetune.plan.evaluation import MAX_AUTO_EVAL_BATCH, eval_memory

    world = 1 if c.strategy == "single" else s.world
    execution = s.exec_spec(c.method, c.strategy, False, world, c.tp, c.optimizer, c.offload)
    spec = TraceSpec.of(execution, seq_len=s.req.seq_len, packed=False, attn_implementation=s.req.attn_implementation)
    setup = Setup(execution, c.micro_batch_size, c.grad_accum_steps, c.dp, s.hw.device, execution.optimizer)
    # one TP rank's model; a single TP replica has no data-parallel wrapper (no DDP buckets)
    inv, config = s.inventory(c.tp), tp_config(s.req.config, c.tp)
    strategy = "single" if c.tp > 1 and c.dp == 1 else str(c.strategy)

    def at(batch: int) -> tuple[int, Any]:
        return eval_memory(inv, config, spec, strategy, setup, batch, s.req.eval_max_new_tokens)

    pinned = s.req.eval_batch_size
    if pinned is not None:
        total, peak = at(pinned)
    else:  # arithmetic on four cached traces: trying every batch costs nothing
        batch = next((b for b in range(MAX_AUTO_EVAL_BATCH, 0, -1) if at(b)[0] <= s.capacity), 1)
        total, peak = at(batch)
    fix = ""
    if total > s.capacity:
        fix = "set eval.batch_size: auto" if pinned is not None and at(1)[0] <= s.capacity else (
            "lower eval.max_new_tokens or data.max_seq_len")
    step = w.EvaluationPlanned(
        s.req.seq_len, pinned is not None, peak.batch_size, total, peak.loss, peak.generation,
        s.req.eval_max_new_tokens, s.capacity, fix,
    )
    return replace(c, eval_batch_size=peak.batch_size, eval_memory=total), step


def _communication(s: Setting, chosen: Candidate, table: list[Candidate]) -> list[w.Step]:
    """What the chosen configuration sends, and what the other strategies would (several processes)."""
    if s.world == 1:
        return []
    out: list[w.Step] = []
    if chosen.tp > 1:
        link = s.hw.interconnect if s.hw.nodes == 1 else "nvlink (inside a node)"
        out.append(w.TensorParallelCommunication(
            chosen.tp, chosen.activation_checkpointing, chosen.micro_batch_size, s.req.seq_len,
            s.req.config.hidden_size, chosen.tp_comm_bytes_per_step,
            chosen.tp_comm_bytes_per_step / s.intra_node_bandwidth, link,
        ))
    by = {c.strategy: c for c in table if c.method == chosen.method and c.micro_batch_size == 1 and c.tp == 1}
    ddp, z2, fs = by.get(Strategy.DDP), by.get(Strategy.ZERO2), by.get(Strategy.FSDP)
    zero1 = by.get(Strategy.ZERO1)
    if zero1 is not None and chosen.method == "full" and s.precision in ("bf16", "fp16"):
        trainable = s.inv.storage(s.exec_spec("full", "zero1", False)).trainable
        out.append(w.ZeroOneAccounting(trainable, zero1.dp, s.precision))
    if ddp and z2 and fs:
        def link_of(c: Candidate) -> w.Link:
            return w.Link(c.comm_bytes_per_step, c.comm_seconds_per_step or 0.0)

        out.append(w.Communication(chosen.method, s.hw.interconnect, link_of(ddp), link_of(z2), link_of(fs)))
    return out


def _table(s: Setting, traced: frozenset[tuple[str, bool, int]]) -> list[Candidate]:
    """Every method x strategy (x TP degree) at micro-batch 1, for the table (refused cells left out)."""
    out = []
    mbs1 = s.req.micro_batch_size or 1
    ac = bool(s.req.checkpointing)
    for method in _methods(s):
        if s.tp == 1:
            for strategy in _table_strategies(s):
                if not s.refusal(method, strategy, 1, ac):
                    out.append(evaluate(s, method, strategy, mbs1, ac, traced=traced))
        for tp in [s.tp] if s.tp > 1 else s.tp_auto:
            for strategy in _tp_strategies(s, tp):
                if not s.refusal(method, strategy, tp, ac):
                    out.append(evaluate(s, method, strategy, mbs1, ac, tp=tp, traced=traced))
    return out


def _check_host_memory(s: Setting, rows: list[Candidate]) -> tuple[list[Candidate], dict[str, Any], list[w.Step]]:
    """The whole job's figures (finetune/plan/job.py) of the chosen row (first); rows whose host memory per
    node exceeds ``hw.host_memory`` do not fit, with the reason in the walk."""
    from finetune.plan.job import host_peak_phase, job_figures

    out: list[Candidate] = []
    steps: list[w.Step] = []
    chosen_job: dict[str, Any] = {}
    for i, c in enumerate(rows):
        world = 1 if c.strategy == "single" else s.world
        spec = s.exec_spec(c.method, c.strategy, c.activation_checkpointing, world, c.tp, c.optimizer, c.offload)
        per_node = 1 if c.strategy == "single" else s.hw.gpus_per_node
        job = job_figures(s.inv, spec, world, per_node, s.hw.device)
        if i == 0:
            chosen_job = job.to_dict()
        limit = s.hw.host_memory
        if limit and job.host_peak_per_node > limit and (c.fits or i == 0):
            if c.status is not Status.HOST_OVER:
                steps.append(w.HostMemoryOver(
                    c.method, c.strategy, job.host_peak_per_node, host_peak_phase(job.to_dict())[0], limit,
                ))
            c = replace(c, status=Status.HOST_OVER)
        out.append(c)
    return out, chosen_job, steps


def _checkpoint_size(method: str, sb: Any) -> int:
    """Bytes of one checkpoint of ``method``: the saved weights (all of them for full fine-tuning, the
    fp32 adapters otherwise) and AdamW's two moments per trainable parameter (what the trainer writes)."""
    from finetune.units import checkpoint_bytes

    weights = method_type(method)().saved_weight_bytes(sb.param_bytes, sb.trainable)
    return checkpoint_bytes(weights, sb.trainable)


def _key(c: Candidate) -> tuple[Any, ...]:
    return (c.method, c.strategy, c.micro_batch_size, c.activation_checkpointing, c.tp, c.optimizer, c.offload)


def decide(req: Request, hw: Hardware) -> Decision:
    """Walk the flowchart for ``req`` on ``hw`` (neither is changed); every step is recorded."""
    log: list[w.Step] = []
    s = settle(req, hw, log)
    wk = _Walk(s, log)
    chosen = _choose(wk)
    if chosen is None:
        chosen = _nothing_fits(wk)
    else:
        chosen = _largest_micro_batch(wk, chosen)
        pinned = _pinned_keys(s.req)
        if pinned:
            log.append(w.Pinned(pinned))
    if chosen.fits:
        chosen, step = plan_evaluation(s, chosen)
        log.append(step)
    if chosen.time is not None and chosen.fits:
        t = chosen.time
        log.append(w.Timing(t.step, t.compute, t.communication, t.offload, t.utilisation, t.peak_flops / 1e12,
                            t.steps, t.job))
    traced = frozenset(
        (str(c.method), c.activation_checkpointing, c.tp) for c in wk.tried
        if c.status in (Status.FITS, Status.OVER, Status.HOST_OVER)
    )
    table = _table(s, traced)
    log.extend(_communication(s, chosen, table))
    rows = [chosen] + [c for c in table if _key(c) != _key(chosen)]
    rows, job, host_steps = _check_host_memory(s, rows)
    log.extend(host_steps)
    execution = s.exec_spec(
        rows[0].method, rows[0].strategy, rows[0].activation_checkpointing,
        1 if rows[0].strategy == "single" else s.world, rows[0].tp, rows[0].optimizer, rows[0].offload,
    )
    return Decision(
        setting=s, chosen=rows[0], rows=tuple(rows), tried=tuple(wk.tried), steps=tuple(log), execution=execution,
        job=job,
    )


def make_plan(req: Request, hw: Hardware) -> Plan:
    """Walk the flowchart for ``req`` on ``hw``; every step is recorded in ``Plan.walk``."""
    return decide(req, hw).plan()
