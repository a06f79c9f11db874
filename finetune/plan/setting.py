"""The request settled for the hardware: the capability table checked, the process count, tensor-parallel
degree, attention kernel, precision and global batch resolved, the inventory built. Never changed once made."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from finetune.errors import UserError
from finetune.model.experts import expert_facts, routed_experts
from finetune.plan import walk as w
from finetune.plan.activations import ActivationProfile, TraceSpec, activation_profile
from finetune.plan.config import config_class_name
from finetune.plan.hardware import GPU_TYPES, INTERCONNECTS, Hardware
from finetune.plan.pipeline import stages_per_rank
from finetune.plan.request import Request
from finetune.plan.shapes import Inventory, build_inventory
from finetune.plan.tensor_parallel import degrees, tp_config, tp_problem
from finetune.plan.types import Config
from finetune.recipe.capabilities import (
    Cell,
    check,
    first_refusal,
    pipeline_problem,
    split_problem,
    stage_problem,
)
from finetune.spec import AdapterSpec, ExecSpec, adapter_spec, attention_kernel, execution_spec

# -- the settled request ------------------------------------------------------------------------------------
#: What a pipeline layout the walk chooses runs with (Setting.for_pipeline), for the capability table's check.
PIPELINE_CELL = {"packing": False}


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
    # the pipeline (distributed.pp): the pinned degree (1: none) or the degrees the walk may try (auto), the
    # schedule, the stages each rank runs, and the recipe's split of the layers (None: balanced by cost)
    pp: int = 1
    pp_auto: tuple[int, ...] = ()
    pp_schedule: str = "1f1b"
    pp_v: int = 1
    pp_layers: tuple[int, ...] | None = None
    # memo of traces and per-TP inventories: (tp, TraceSpec) -> profile, tp -> inventory (pure caches)
    profiles: dict[tuple[int, TraceSpec], ActivationProfile] = field(default_factory=dict, compare=False, repr=False)
    inventories: dict[int, Inventory] = field(default_factory=dict, compare=False, repr=False)
    splits: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)

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

    def for_pipeline(self) -> Setting:
        """This setting as pipeline stages run it: unpacked rows (padded to data.max_seq_len), with sequence
        parallelism as the recipe sets it (each tp rank's stage passes its shard of the sequence): what the walk
        plans a PP layout with."""
        return replace(self, req=replace(self.req, packed=False))

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
            self.inventories[tp] = with_reference(
                build_inventory(tp_config(self.req.config, tp), self.req.source, self.adapter), self.req, tp
            )
        return self.inventories[tp]

    def pp_split(self, pp: int, tp: int = 1) -> tuple[int, ...]:
        """Decoder layers of each pipeline stage at ``pp`` ranks (the recipe's, else balanced by the cost of one
        TP rank's parts at ``tp``: finetune/plan/pipeline.py); () without a pipeline."""
        if pp <= 1:
            return ()
        if self.pp_layers is not None and pp == self.pp:
            return self.pp_layers
        if (pp, tp) not in self.splits:
            from finetune.plan.flops import flops_shape
            from finetune.plan.pipeline import balanced_split, stage_parts

            config = self.req.config
            parts = stage_parts(self.inventory(tp), config, flops_shape(config), self.req.seq_len, tp)
            self.splits[(pp, tp)] = balanced_split(self.inv.num_layers, pp * self.pp_v, *parts.layer_equivalents())
        return self.splits[(pp, tp)]

    def exec_spec(
        self, method: str, strategy: str, ac: bool, world: int | None = None, tp: int = 1,
        optimizer: str | None = None, offload: str | None = None, pp: int = 1,
        pp_layers: tuple[int, ...] | None = None,
    ) -> ExecSpec:
        """How ``method`` under ``strategy`` stores and computes each tensor (what the trainer will build), with
        ``pp`` pipeline ranks (the layers split as ``pp_layers`` says, else by :meth:`pp_split`, in this
        setting's schedule)."""
        r = self.req
        return execution_spec(
            method, strategy, self.precision, checkpointing=ac, world_size=world or self.world,
            model_dtype=r.model_dtype, quantization=r.quantization, lora=self.lora, prefix=r.prefix,
            adapter=r.adapter, tp=tp, compile=r.compile, optimizer=optimizer or r.optimizer,
            offload=offload or r.offload, objective=r.objective, reference=r.reference, nodes=self.hw.nodes,
            pp=pp, pp_schedule=self.pp_schedule, pp_layers=pp_layers or self.pp_split(pp, tp),
            sequence_parallel=r.sequence_parallel, attention=r.attn_implementation, keep_fp32=self.inv.keep_fp32,
            aux_loss_coef=aux_loss_coef(r, self.inv), ep=self.ep_for(strategy, world or self.world, tp, pp),
            prompt=r.prompt,
        )

    def ep_for(self, strategy: str, world: int, tp: int = 1, pp: int = 1) -> int:
        """The expert-parallel degree a candidate runs with: the recipe's ``distributed.ep`` under a sharded
        strategy whose data-parallel ranks it divides, else 1 (a candidate of another strategy has none)."""
        dp = world // max(1, tp * pp)
        ok = strategy in ("zero2", "fsdp") and tp == 1 and pp == 1 and dp % self.req.ep == 0
        return self.req.ep if ok else 1

    def profile(self, spec: ExecSpec) -> ActivationProfile:
        """The traced activations of ``spec`` at this setting's sequence length (one TP rank's)."""
        trace = TraceSpec.of(
            spec, seq_len=self.req.seq_len, packed=self.req.packed,
            attn_implementation=self.req.attn_implementation, device=self.hw.device, depth=self.inv.trace_depth,
        )
        key = (spec.tp, trace)
        if key not in self.profiles:
            self.profiles[key] = activation_profile(tp_config(self.req.config, spec.tp), trace)
        return self.profiles[key]

    def refusal(self, config: Config) -> str | None:
        """The capability table's sentence when ``config`` cannot run with the recipe's other settings (None: it
        can)."""
        pp = config.pp
        cell = self.cell.with_(
            method=config.method, strategy=config.strategy, tp=config.tp, pp=pp, pp_schedule=self.pp_schedule,
            processes=1 if config.strategy == "single" else self.cell.processes,
            **(PIPELINE_CELL if pp > 1 and self.pp == 1 else {}),  # the walk's own pipeline (distributed.pp: auto)
            checkpointing=config.activation_checkpointing, precision=self.precision,
            optimizer=config.optimizer or self.cell.optimizer, offload=config.offload or self.cell.offload,
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
        from finetune.recipe.schema import LoraConfig

        lora = LoraConfig()
    # What the recipe pins, checked against the capability table before anything is traced. A preview on
    # one GPU leaves the process count open (a sharded strategy is planned as it would run on more).
    facts = expert_facts(req.config, lora.target_modules)
    cell = Cell.of(
        method=req.method, strategy=req.strategy, processes=world if req.for_run or world > 1 else None,
        tp=req.tp, precision=req.precision, optimizer=req.optimizer, offload=req.offload, compile=req.compile,
        attention=req.attn_implementation, packing=req.packed, checkpointing=req.checkpointing,
        lora=lora, prefix=req.prefix, quantization=req.quantization, objective=req.objective,
        reference=req.reference, nodes=hw.nodes, pp=req.pp, pp_schedule=req.pp_schedule,
        reference_model=req.reference_config is not None, experts=facts["experts"], expert_lora=facts["expert_lora"],
        ep=req.ep, num_experts=routed_experts(req.config), prompt=req.prompt,
    )
    check(cell)
    # full, LoRA and QLoRA (the auto ladder) share LoRA's adapters; a pinned full run never reads lora:
    adapter = adapter_spec("lora" if req.method == "auto" else req.method, lora, req.prefix, req.adapter, req.prompt)
    inv = with_reference(build_inventory(req.config, req.source, adapter), req, 1)
    tp, tp_auto = _resolve_tp(req, hw, world, cell, log)
    v = stages_per_rank(req.pp_schedule, req.pp_stages_per_rank)
    pp, pp_auto = _resolve_pp(req, hw, world, tp, v, inv, log)
    req = _resolve_attention(req, inv, hw, log)
    if inv.moe is not None:
        log.append(w.MixtureOfExperts(
            config_class_name(req.config).replace("Config", ""), inv.moe.experts, inv.moe.top_k, inv.moe.shared_experts,
            inv.moe.layers, inv.expert_params, inv.n_params, inv.active_params, aux_loss_coef(req, inv), req.method,
            any(".experts." in t.name for t in inv.adapters),
        ))
    if inv.moe is not None and req.strategy in ("auto", "zero2", "fsdp") and world > 1:
        log.append(_expert_parallelism(req, inv, world // (tp * pp)))
    precision = _resolve_precision(req, hw, log)
    global_batch = _resolve_batch(req, world // (tp * pp), tp * pp, log)
    return Setting(
        req=req, hw=hw, world=world, precision=precision, global_batch=global_batch, tp=tp, tp_auto=tp_auto,
        lora=lora, adapter=adapter, inv=inv, cell=cell, pp=pp, pp_auto=pp_auto, pp_schedule=req.pp_schedule,
        pp_v=v, pp_layers=req.pp_layers if pp > 1 else None,
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


def _resolve_pp(
    req: Request, hw: Hardware, world: int, tp: int, v: int, inv: Inventory, log: list[w.Step],
) -> tuple[int, tuple[int, ...]]:
    """The pinned pipeline degree (checked: one sentence naming the recipe key when it cannot run), and the
    degrees the walk may try when FSDP with TP does not fit (``distributed.pp: auto``): divisors of the
    processes over tp, stages across nodes first (finetune/plan/pipeline.py)."""
    what = "processes" if hw.device == "cpu" or req.for_run else "GPUs"
    layers = inv.num_layers
    if req.pp == "auto":
        # a run's packed rows stay packed (the data is the recipe's), and stages take unpacked ones
        runnable = stage_problem(req.config) is None and not (req.for_run and req.packed)
        if req.strategy in ("auto", "ddp", "zero2", "fsdp") and world > 1 and runnable:
            return 1, pp_degrees(world, hw.gpus_per_node, hw.nodes, layers, v, req.tp)
        return 1, ()
    pp = int(req.pp)
    if pp == 1:
        if req.pp_layers is not None:
            raise UserError(
                "distributed.pp_layers: set without a pipeline (distributed.pp is 1); set distributed.pp or remove "
                "distributed.pp_layers"
            )
        return 1, ()
    problem = stage_problem(req.config) or pipeline_problem(
        pp=pp, tp=tp, world=world, what=what, schedule=req.pp_schedule, v=v, num_layers=layers,
        pinned_v=req.pp_stages_per_rank,
    )
    if problem is None and req.pp_layers is not None:
        problem = split_problem(req.pp_layers, pp * v, layers, pp, v)
    if problem:
        raise UserError(problem)
    log.append(w.PinnedPipeline(
        pp=pp, schedule=req.pp_schedule, stages_per_rank=v, layers=layers, what=what, replicas=world // (pp * tp),
        split=tuple(req.pp_layers) if req.pp_layers is not None else (),
    ))
    return pp, ()


def pp_degrees(world: int, per_node: int, nodes: int, layers: int, v: int, tp: int | str) -> tuple[int, ...]:
    """Pipeline degrees the walk tries (``distributed.pp: auto``), smallest first: powers of two that divide the
    processes left over by the largest TP degree a node allows, leave each stage at least one layer, and up to
    the node count (stages across nodes: a stage's ranks stay inside a node or span whole nodes)."""
    inner = per_node if tp == "auto" else int(tp)
    out = []
    k = 2
    while k * v <= layers and world % (k * inner) == 0 and k <= max(nodes, 1) * (1 if nodes > 1 else per_node):
        out.append(k)
        k *= 2
    return tuple(out)


def _resolve_attention(req: Request, inv: Inventory, hw: Hardware, log: list[w.Step]) -> Request:
    """The request with the attention kernel it runs: ``auto`` as :func:`finetune.spec.attention_kernel`
    decides for the hardware and the packing, a pinned one as the architecture has it in transformers
    (``inv`` knows)."""
    arch = config_class_name(req.config).replace("Config", "")
    if req.attn_implementation == "auto":
        kernel = attention_kernel("auto", packed=req.packed, device=hw.device, flex=inv.flex, sdpa=inv.sdpa)
        if kernel == "flex_attention":
            log.append(w.Note(
                "Attention: flex_attention for the packed rows on the GPUs (model.attn_implementation: auto): a "
                "block-sparse document mask, where sdpa would take a (B, 1, T, T) mask and lose its flash kernel."
            ))
        elif req.packed and hw.device == "cuda":
            log.append(w.Note(
                f"Attention: {kernel} for the packed rows ({arch} has no flex attention in transformers): a "
                "(B, 1, T, T) document mask per micro-batch."
            ))
        return replace(req, attn_implementation=kernel)
    if req.attn_implementation == "sdpa" and not inv.sdpa:
        log.append(w.Note(
            f"{arch} has no sdpa attention in transformers: planned and trained with eager attention "
            "(model.attn_implementation: flex_attention is the other kernel it has)."
            if inv.flex else f"{arch} has no sdpa attention in transformers: planned and trained with eager attention."
        ))
        return replace(req, attn_implementation="eager")
    if req.attn_implementation == "flex_attention" and not inv.flex:
        raise UserError(
            f"model.attn_implementation: {arch} has no flex attention in transformers; use sdpa (packed rows then "
            "carry a T x T mask)"
        )
    return req


def _expert_parallelism(req: Request, inv: Inventory, dp: int) -> w.ExpertParallelism:
    """The walk's sentence on ``distributed.ep`` for a mixture of experts over ``dp`` data-parallel ranks: what
    the recipe's degree does, or what the largest degree dividing both the ranks and the experts would do."""
    moe = inv.moe
    assert moe is not None, "a mixture of experts"
    cb = 2 if req.precision in ("auto", "bf16", "fp16", "bf16-pure") else 4
    suggested = max((d for d in range(1, dp + 1) if dp % d == 0 and moe.experts % d == 0), default=1)
    return w.ExpertParallelism(
        ep=req.ep, suggested=suggested, experts=moe.experts, layer_expert_bytes=moe.experts * moe.expert_params * cb,
        row_bytes=moe.hidden * cb, top_k=moe.top_k,
    )


def aux_loss_coef(req: Request, inv: Inventory) -> float:
    """train.router_aux_loss_coef resolved: auto is the model config's coefficient (0 for a model without a
    load-balancing loss, dense ones included); one sentence when a number is asked of a model that has none."""
    own = inv.moe.aux_loss_coef if inv.moe is not None else None
    if req.aux_loss_coef == "auto":
        return float(own or 0.0)
    value = float(req.aux_loss_coef)
    if value and own is None:
        kind = "a mixture of experts without a load-balancing loss" if inv.moe is not None else "not a mixture of experts"
        raise UserError(
            f"train.router_aux_loss_coef: {value:g} asks for a load-balancing loss, but {inv.model_type} is {kind}; "
            "leave it at auto (or 0)"
        )
    return value


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


def with_reference(inv: Inventory, req: Request, tp: int) -> Inventory:
    """``inv`` with the inventory of dpo.reference_model (one TP rank's) beside it, when the request names one:
    the frozen reference copy is counted from its own config."""
    if req.reference_config is None:
        return inv
    return replace(inv, reference=build_inventory(tp_config(req.reference_config, tp), "dpo.reference_model"))
