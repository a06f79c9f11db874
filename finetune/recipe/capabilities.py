"""The capability table: every constraint between the dimensions of a recipe, stated once.

A recipe is a point in a large space (method and its options x strategy x processes x tensor parallelism x
optimizer x precision x compile x attention x packing x activation checkpointing). Most points train; the
rows of :data:`TABLE` are the ones that do not, each with the keys that clash, why, and what to write instead.

The table is checked where a configuration becomes known:

- ``finetune validate`` and ``finetune run`` (``recipe.check_files``): the recipe's pinned values;
- the planner (``finetune plan`` and the plan a run executes): each candidate it considers, so an ``auto``
  choice never lands on a refused cell, and the chosen cell once more with the real process count.

All three print the same sentence for the same cell, before any weights load. the guide's support matrix is
rendered from this table (:func:`support_matrix_markdown`); a test fails when the two disagree.

Pure Python (no torch): ``finetune validate`` stays instant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

#: The recipe's methods (``method``), without ``auto``.
METHODS = ("full", "lora", "qlora", "prefix", "adapter", "prompt")
#: The data-parallel strategies (``distributed.strategy``), without ``auto``.
STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp", "hsdp")
SHARDED = ("zero2", "fsdp", "hsdp")  # FSDP2 fully_shard: parameters become DTensors
EIGHT_BIT_OPTIMIZERS = ("adamw8bit", "paged_adamw8bit")
OFFLOADS = ("optimizer", "parameters")  # train.offload values that move state to the host


@dataclass(frozen=True)
class Cell:
    """One configuration, as far as it is known: ``None`` is a value not decided yet (``auto``, or a process
    count given only at launch). A rule that needs an unknown value does not fire."""

    method: str | None = "full"
    quant_bits: int = 4
    quant_compute_dtype: str = "auto"
    use_dora: bool = False
    use_rslora: bool = False
    lora_init: str = "default"
    lora_dtype: str = "fp32"  # lora.dtype: the adapters' storage dtype
    prefix_init: str = "random"
    prefix_init_text: str | None = None
    prefix_projection: bool = False
    prompt_init: str = "random"
    prompt_init_text: str | None = None
    strategy: str | None = None
    processes: int | None = None  # every process of the run (nodes x per node)
    nodes: int | None = None  # the run's nodes (None: not known, as in `finetune validate`)
    tp: int | None = 1
    pp: int | None = 1  # distributed.pp (None: auto)
    pp_schedule: str = "1f1b"
    sequence_parallel: bool = True
    optimizer: str | None = "adamw"
    offload: str | None = "none"  # none | optimizer | parameters
    precision: str | None = None
    compile: bool = False
    attention: str | None = "sdpa"  # None: auto, resolved by the planner
    packing: bool = False
    checkpointing: bool | None = None
    objective: str = "sft"  # train.objective
    reference: str = "model"  # dpo.reference
    reference_model: bool = False  # dpo.reference_model is set (another checkpoint as the reference)
    data_format: str | None = None  # data.format (None: not known, as in `finetune plan` of a bare config)
    # the model: a mixture of experts with fused expert weights, and whether LoRA's targets adapt them
    # (finetune.model.experts; None: not known, as in `finetune validate` without a reason to read the config)
    experts: bool | None = None
    expert_lora: bool | None = None
    num_experts: int | None = None  # routed experts per layer (None: not known)
    ep: int = 1  # distributed.ep: the routed experts split over ep ranks of the data-parallel shard dimension
    # the data: data.streaming, data.train a {path, weight} mixture, train.max_steps set, data.eval_fraction set
    streaming: bool = False
    mixture: bool = False
    max_steps: bool = True
    eval_fraction: bool = False

    @classmethod
    def of(
        cls, *, method: str, strategy: str, processes: int | None, tp: int | str, precision: str,
        optimizer: str = "adamw", compile: bool = False, attention: str = "sdpa", packing: bool = False,
        checkpointing: bool | None = None, lora: Any = None, prefix: Any = None, quantization: Any = None,
        offload: str = "none", objective: str = "sft", reference: str = "model", data_format: str | None = None,
        nodes: int | None = None, pp: int | str = 1, pp_schedule: str = "1f1b", sequence_parallel: bool = True,
        reference_model: bool = False, experts: bool | None = None, expert_lora: bool | None = None,
        ep: int = 1, num_experts: int | None = None, prompt: Any = None,
    ) -> Cell:
        """A cell from the recipe's values (``auto``: unknown) and its ``lora`` / ``prefix`` / ``prompt`` /
        ``quantization`` sections (None: their defaults)."""
        return cls(
            method=None if method == "auto" else method,
            quant_bits=int(getattr(quantization, "bits", 4)),
            quant_compute_dtype=str(getattr(quantization, "compute_dtype", "auto")),
            use_dora=bool(getattr(lora, "use_dora", False)),
            use_rslora=bool(getattr(lora, "use_rslora", False)),
            lora_init=str(getattr(lora, "init", "default")),
            lora_dtype=str(getattr(lora, "dtype", "fp32")),
            prefix_init=str(getattr(prefix, "init", "random")),
            prefix_init_text=getattr(prefix, "init_text", None),
            prefix_projection=bool(getattr(prefix, "projection", False)),
            prompt_init=str(getattr(prompt, "init", "random")),
            prompt_init_text=getattr(prompt, "init_text", None),
            strategy=None if strategy == "auto" else strategy,
            processes=processes,
            nodes=nodes,
            tp=None if tp == "auto" else int(tp),
            pp=None if pp == "auto" else int(pp),
            pp_schedule=pp_schedule,
            sequence_parallel=bool(sequence_parallel),
            optimizer=None if optimizer == "auto" else optimizer,
            offload=None if offload == "auto" else offload,
            precision=None if precision == "auto" else precision,
            compile=bool(compile),
            attention=None if attention == "auto" else attention,
            packing=bool(packing),
            checkpointing=checkpointing,
            objective=objective,
            reference=reference,
            reference_model=bool(reference_model),
            data_format=data_format,
            experts=experts,
            expert_lora=expert_lora,
            num_experts=num_experts,
            ep=int(ep),
        )

    @classmethod
    def of_recipe(cls, recipe: Any, processes: int | None = None) -> Cell:
        """The cell a validated :class:`~finetune.recipe.schema.Recipe` pins (``auto`` values unknown);
        ``processes``: the run's process count when known, else the recipe's ``distributed.nproc`` x nodes."""
        d, t = recipe.distributed, recipe.train
        if processes is None and d.nproc != "auto":
            processes = int(d.nproc) * int(recipe.hardware.nodes)
        ac = t.activation_checkpointing
        data = recipe.data
        return replace(cls.of(
            method=recipe.method, strategy=d.strategy, processes=processes, tp=d.tp, precision=recipe.precision,
            optimizer=t.optimizer, offload=t.offload, compile=t.compile, attention=recipe.model.attn_implementation,
            packing=recipe.data.packing, checkpointing=None if ac == "auto" else bool(ac), lora=recipe.lora,
            prefix=recipe.prefix, quantization=recipe.quantization, objective=t.objective,
            reference=reference_setting(recipe), data_format=recipe.data.format, pp=d.pp, pp_schedule=d.pp_schedule,
            sequence_parallel=d.sequence_parallel, reference_model=recipe.dpo.reference_model is not None,
            ep=d.ep, prompt=recipe.prompt,
        ), streaming=data.streaming, mixture=data.mixture, max_steps=t.max_steps is not None,
            eval_fraction=data.eval_fraction is not None)

    def with_(self, **changes: Any) -> Cell:
        """This cell with some dimensions decided (the planner's candidates)."""
        return replace(self, **changes)

    # -- derived facts the rules read -------------------------------------------------------------------
    @property
    def lora_family(self) -> bool:
        """Trains LoRA adapters (lora, qlora)."""
        return self.method in ("lora", "qlora")

    @property
    def preference(self) -> bool:
        """Trains on chosen/rejected pairs (train.objective dpo, simpo, orpo)."""
        return self.objective in ("dpo", "simpo", "orpo")

    @property
    def split(self) -> bool:
        """Tensor parallelism is on (known and above 1)."""
        return self.tp is not None and self.tp > 1

    @property
    def pipelined(self) -> bool:
        """Pipeline parallelism is on (known and above 1)."""
        return self.pp is not None and self.pp > 1

    @property
    def expert_parallel(self) -> bool:
        """Expert parallelism is on (distributed.ep above 1)."""
        return self.ep > 1

    @property
    def dp(self) -> int | None:
        """Data-parallel replicas (processes / (pp x tp)) when all are known."""
        if self.processes is None or self.tp is None or self.pp is None:
            return None
        return self.processes // (max(1, self.tp) * max(1, self.pp))


@dataclass(frozen=True)
class Rule:
    """One row of the table: a cell it refuses, why, and what to write instead.

    ``keys``: the recipe keys that clash; the first names the problem (and its line in the recipe).
    ``refuses``: whether the row applies to a cell (False when a value it needs is unknown).
    ``says``: the sentence after ``key: `` (why, then ``;`` and what to do), from the cell.
    ``methods``: the methods the row concerns (for the support matrix and ``TrainingMethod.supports``).
    ``topic``: the support matrix's grouping (method x strategy x tp rows, or a note about another dimension).
    """

    name: str
    keys: tuple[str, ...]
    refuses: Callable[[Cell], bool]
    says: Callable[[Cell], str]
    methods: tuple[str, ...] = METHODS
    topic: str = "parallelism"

    def sentence(self, cell: Cell) -> str:
        """The full refusal: ``key: why; what to do``."""
        return f"{self.keys[0]}: {self.says(cell)}"


@dataclass(frozen=True)
class Refusal:
    """A rule that refuses a cell, with its sentence."""

    rule: Rule
    key: str
    message: str  # the sentence after ``key: ``

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def _tp(c: Cell) -> int:
    return c.tp or 1


_TP_WHY = {
    "prefix": "a prefix holds every KV head",
    "adapter": "a bottleneck reads the whole hidden state, which TP's column-parallel layers hand on in parts",
    "prompt": "the virtual tokens lengthen every row, which sequence parallelism splits with the real ones",
}


def _lora_dp(c: Cell) -> bool:
    return c.strategy in ("ddp", "zero1") and c.split and (c.dp or 0) > 1


def _quant_mismatch(c: Cell) -> bool:
    if c.method != "qlora" or c.quant_bits != 4 or c.strategy not in SHARDED:
        return False
    if c.precision not in ("bf16", "fp16") or c.quant_compute_dtype in ("auto", None):
        return False
    return c.quant_compute_dtype != c.precision


def _lora_option(name: str, flag: str, what: str) -> Rule:
    """The row refusing a LoRA option (``lora.<flag>``) on a method that trains no LoRA."""
    return Rule(
        name, (f"lora.{flag}", "method"),
        lambda c: getattr(c, flag) and c.method is not None and not c.lora_family,
        lambda c: f"{what} is a kind of LoRA but method is {c.method}; set method: lora or qlora, or remove "
        f"lora.{flag}",
        methods=("full", "prefix", "adapter", "prompt"), topic="options",
    )


TABLE: tuple[Rule, ...] = (
    # -- processes and strategy --------------------------------------------------------------------------
    Rule(
        "sharding-one-process", ("distributed.strategy", "distributed.nproc"),
        lambda c: c.strategy in ("zero1", "zero2", "fsdp", "hsdp") and c.processes == 1,
        lambda c: f"`{c.strategy}` shards over several processes but this run has one; use --nproc N (N >= 2), "
        "or strategy single or auto",
    ),
    Rule(
        "hsdp-one-node", ("distributed.strategy", "hardware.nodes"),
        lambda c: c.strategy == "hsdp" and c.nodes == 1,
        lambda c: "hsdp shards inside each node and replicates across nodes, but this run has one node; use fsdp "
        "(it shards over every process of the node), or run on 2 or more nodes (--nnodes)",
    ),
    # -- tensor parallelism ------------------------------------------------------------------------------
    Rule(
        "tp-single", ("distributed.tp", "distributed.strategy"),
        lambda c: c.split and c.strategy == "single",
        lambda c: f"{_tp(c)} splits the model over {_tp(c)} processes, but distributed.strategy is single (one "
        "process); use auto, ddp, zero2 or fsdp, or distributed.tp: 1",
    ),
    Rule(
        "single-several-processes", ("distributed.strategy", "distributed.nproc"),
        lambda c: c.strategy == "single" and (c.processes or 1) > 1,
        lambda c: f"`single` trains one process but {c.processes} were asked for (--nproc/--nnodes or "
        "distributed.nproc); choose ddp, zero1, zero2, fsdp or auto, or run 1 process",
    ),
    Rule(
        "tp-replicated", ("distributed.strategy", "distributed.tp"),
        _lora_dp,
        lambda c: f"{c.strategy} cannot replicate a tensor-parallel model over the {c.dp} data-parallel groups of "
        f"distributed.tp: {_tp(c)} (DDP does not take TP's sharded parameters); use zero2, fsdp or auto",
    ),
    Rule(
        "tp-zero1", ("distributed.strategy", "distributed.tp"),
        lambda c: c.split and c.strategy == "zero1",
        lambda c: "zero1 shards AdamW with torch's ZeroRedundancyOptimizer, which does not take the DTensor "
        f"parameters of distributed.tp: {_tp(c)}; use zero2 or fsdp (or ddp with one data-parallel replica)",
    ),
    Rule(
        "tp-prefix-adapter", ("distributed.tp", "method"),
        lambda c: c.split and c.method in ("prefix", "adapter", "prompt"),
        lambda c: f"{_tp(c)} with method {c.method} is not supported: tensor parallelism splits full fine-tuning "
        f"and LoRA only ({_TP_WHY[c.method or 'prefix']}); use method lora, or distributed.tp: 1",
        methods=("prefix", "adapter", "prompt"),
    ),
    Rule(
        "tp-qlora", ("distributed.tp", "method"),
        lambda c: c.split and c.method == "qlora",
        lambda c: f"{_tp(c)} with method qlora is not supported: torch's tensor-parallel styles cannot split "
        "bitsandbytes' 4-bit weights; use method lora, or distributed.tp: 1",
        methods=("qlora",),
    ),
    Rule(
        "tp-dora", ("distributed.tp", "lora.use_dora"),
        lambda c: c.split and c.lora_family and c.use_dora,
        lambda c: f"{_tp(c)} with lora.use_dora is not supported: DoRA's per-row weight norm needs the whole "
        "weight; set lora.use_dora: false, or distributed.tp: 1",
        methods=("lora", "qlora"),
    ),
    Rule(
        "tp-decomposing-init", ("lora.init", "distributed.tp"),
        lambda c: c.split and c.lora_family and c.lora_init in ("pissa", "olora"),
        lambda c: f"{c.lora_init} decomposes whole weights, which tensor parallelism splits; use distributed.tp: "
        "1, or init: default",
        methods=("lora",),
    ),
    Rule(
        "tp-experts", ("distributed.tp", "lora.target_modules"),
        lambda c: c.split and c.lora_family and bool(c.expert_lora),
        lambda c: f"{_tp(c)} with LoRA on a mixture's fused expert weights is not supported (tensor parallelism "
        "splits linear layers, not the experts' adapters); use distributed.tp: 1 (fsdp shards the experts), or "
        "lora.target_modules without the experts (e.g. [q_proj, k_proj, v_proj, o_proj])",
        methods=("lora",),
    ),
    Rule(
        "tp-compile", ("distributed.tp", "train.compile"),
        lambda c: c.split and c.compile,
        lambda c: f"{_tp(c)} with train.compile: true is not supported (tensor parallelism runs eager blocks); "
        "set train.compile: false, or distributed.tp: 1",
        topic="compile",
    ),
    Rule(
        "tp-8bit-optimizer", ("distributed.tp", "train.optimizer"),
        lambda c: c.split and c.optimizer in EIGHT_BIT_OPTIMIZERS,
        lambda c: f"{_tp(c)} with train.optimizer: {c.optimizer} is not supported (tensor parallelism runs "
        "torch's AdamW); set train.optimizer: adamw, or distributed.tp: 1",
        topic="optimizer",
    ),
    Rule(
        "hsdp-tp", ("distributed.tp", "distributed.strategy"),
        lambda c: c.split and c.strategy == "hsdp",
        lambda c: f"{_tp(c)} with hsdp is not supported (a replicate x shard x tp mesh is not built by finetune); "
        "use fsdp with tensor parallelism, or distributed.tp: 1",
    ),
    # -- offload (FSDP2's CPUOffloadPolicy: finetune/train/parallel/parallelize.py) -----------------------------------
    Rule(
        "offload-unsharded", ("train.offload", "distributed.strategy"),
        lambda c: c.offload in OFFLOADS and c.strategy in ("single", "ddp", "zero1"),
        lambda c: f"{c.offload} runs FSDP2's CPU offload policy, which moves each process's shards of the "
        f"parameters, gradients and optimizer state to host memory, but distributed.strategy {c.strategy} does not "
        "shard them; use strategy "
        f"{'zero2' if c.offload == 'optimizer' else 'fsdp'} on 2 or more processes, or train.offload: none",
        topic="offload",
    ),
    Rule(
        "offload-optimizer-fsdp", ("train.offload", "distributed.strategy"),
        lambda c: c.offload == "optimizer" and c.strategy == "fsdp",
        lambda c: "optimizer keeps the gathered parameters on the GPU through the forward and backward, which is "
        "zero2; under fsdp each unit is gathered from host memory for its forward and again for its backward "
        "(parameter offload); write train.offload: parameters with fsdp, or distributed.strategy: zero2",
        topic="offload",
    ),
    Rule(
        "offload-parameters-zero2", ("train.offload", "distributed.strategy"),
        lambda c: c.offload == "parameters" and c.strategy == "zero2",
        lambda c: "parameters frees each unit's gathered parameters after use, but zero2 keeps every unit "
        "gathered on the GPU from its forward to its backward; write train.offload: optimizer with zero2, or "
        "distributed.strategy: fsdp",
        topic="offload",
    ),
    Rule(
        "offload-hsdp", ("train.offload", "distributed.strategy"),
        lambda c: c.offload in OFFLOADS and c.strategy == "hsdp",
        lambda c: f"{c.offload} with hsdp is not supported (finetune runs FSDP2's CPU offload over one flat mesh, "
        "not over hsdp's replicas); use strategy "
        f"{'zero2' if c.offload == 'optimizer' else 'fsdp'} with train.offload: {c.offload}, or train.offload: none",
        topic="offload",
    ),
    Rule(
        "offload-tp", ("train.offload", "distributed.tp"),
        lambda c: c.offload in OFFLOADS and c.split,
        lambda c: f"{c.offload} with distributed.tp: {_tp(c)} is not supported (FSDP2's CPU offload over "
        "tensor-parallel DTensors is not run by finetune); set distributed.tp: 1, or train.offload: none",
        topic="offload",
    ),
    Rule(
        "offload-paged", ("train.optimizer", "train.offload"),
        lambda c: c.optimizer == "paged_adamw8bit" and c.offload in OFFLOADS,
        lambda c: f"paged_adamw8bit pages its state between the GPU and the host itself, but train.offload: "
        f"{c.offload} already keeps it in host memory; use train.optimizer: adamw8bit (or adamw) with offload, "
        "or train.offload: none",
        topic="offload",
    ),
    # -- quantization ------------------------------------------------------------------------------------
    Rule(
        "int8-sharded", ("quantization.bits", "distributed.strategy"),
        lambda c: c.method == "qlora" and c.quant_bits == 8 and c.strategy in SHARDED,
        lambda c: f"8 (LLM.int8) keeps its scales beside each weight, which distributed.strategy {c.strategy} "
        "replaces with shards; use quantization.bits: 4 (NF4 shards under zero2 and fsdp), or strategy ddp "
        "(or zero1) for 8-bit",
        methods=("qlora",),
    ),
    Rule(
        "nf4-storage-dtype", ("quantization.compute_dtype", "precision"),
        _quant_mismatch,
        lambda c: f"the 4-bit weights are stored in {c.quant_compute_dtype} but {c.strategy} computes in "
        f"{c.precision}; leave quantization.compute_dtype at auto so both follow `precision`",
        methods=("qlora",), topic="precision",
    ),
    # -- the LoRA family's options -----------------------------------------------------------------------
    _lora_option("dora-not-lora", "use_dora", "DoRA"),
    _lora_option("rslora-not-lora", "use_rslora", "rsLoRA"),
    Rule(
        "decomposing-init-qlora", ("lora.init", "method"),
        lambda c: c.method == "qlora" and c.lora_init in ("pissa", "olora"),
        lambda c: f"{c.lora_init} rewrites the base weights, which QLoRA keeps quantized (the saved adapter could "
        "not be converted exactly against the original base); use method: lora, or init: default",
        methods=("qlora",), topic="options",
    ),
    Rule(
        "decomposing-init-dora", ("lora.init", "lora.use_dora"),
        lambda c: c.method == "lora" and c.lora_init in ("pissa", "olora") and c.use_dora,
        lambda c: f"{c.lora_init} with DoRA cannot be saved as an adapter of the original base (the magnitudes "
        "are those of the rewritten weights); use init: default with use_dora, or use_dora: false",
        methods=("lora",), topic="options",
    ),
    Rule(
        "lora-dtype-not-lora", ("lora.dtype", "method"),
        lambda c: c.lora_dtype != "fp32" and c.method is not None and not c.lora_family,
        lambda c: f"{c.lora_dtype} is the storage dtype of LoRA's adapters, but method is {c.method}, which trains "
        "none; set method: lora or qlora, or remove lora.dtype",
        methods=("full", "prefix", "adapter", "prompt"), topic="options",
    ),
    Rule(
        "lora-dtype-fp16", ("lora.dtype", "precision"),
        lambda c: c.lora_family and c.lora_dtype == "fp16",
        lambda c: "fp16 adapters cannot train here: without loss scaling (precision bf16 or fp32) their small "
        "gradients underflow, and the fp16 loss scaler (precision fp16) refuses fp16 gradients (torch's GradScaler "
        "unscales fp32 ones only); use lora.dtype: fp32, or bf16 with precision bf16",
        methods=("lora", "qlora"), topic="precision",
    ),
    Rule(
        "lora-dtype-compute", ("lora.dtype", "precision"),
        lambda c: c.lora_family and c.lora_dtype == "bf16" and c.precision is not None
        and c.precision not in ("bf16", "bf16-pure"),
        lambda c: f"bf16 keeps the adapters in the compute dtype, but precision {c.precision} computes in "
        f"{'fp16' if c.precision == 'fp16' else 'fp32'}; set precision: bf16 (auto chooses it on a GPU with bf16), or "
        "lora.dtype: fp32",
        methods=("lora", "qlora"), topic="precision",
    ),
    Rule(
        "lora-dtype-decomposing-init", ("lora.dtype", "lora.init"),
        lambda c: c.lora_family and c.lora_dtype != "fp32" and c.lora_init in ("pissa", "olora"),
        lambda c: f"{c.lora_dtype} adapters cannot start from {c.lora_init}: the initial adapter is subtracted from "
        "the base weights in fp32, and rounded to a 16-bit adapter it no longer cancels (nor converts exactly to a "
        "plain LoRA of the original base); use lora.dtype: fp32 with init: "
        f"{c.lora_init}, or init: default",
        methods=("lora",), topic="options",
    ),
    # -- a mixture of experts' fused expert weights (finetune/model/experts.py) ---------------------------------
    Rule(
        "experts-dora", ("lora.use_dora", "lora.target_modules"),
        lambda c: c.lora_family and c.use_dora and bool(c.expert_lora),
        lambda c: "DoRA is not available on a mixture's fused expert weights (its per-row magnitudes are for "
        "linear layers); set lora.use_dora: false, or lora.target_modules without the experts (e.g. [q_proj, "
        "k_proj, v_proj, o_proj])",
        methods=("lora", "qlora"), topic="options",
    ),
    Rule(
        "experts-decomposing-init", ("lora.init", "lora.target_modules"),
        lambda c: c.method == "lora" and c.lora_init in ("pissa", "olora") and bool(c.expert_lora),
        lambda c: f"{c.lora_init} decomposes linear weights, not a mixture's fused expert weights; use init: "
        "default, or lora.target_modules without the experts (e.g. [q_proj, k_proj, v_proj, o_proj])",
        methods=("lora",), topic="options",
    ),
    Rule(
        "qlora-8bit-experts", ("quantization.bits", "method"),
        lambda c: c.method == "qlora" and c.quant_bits == 8 and bool(c.experts),
        lambda c: "8 (LLM.int8) quantizes linear layers only, so this mixture's fused experts, most of its "
        "weights, would stay in 16 bits; use quantization.bits: 4 (NF4, each expert on its own)",
        methods=("qlora",), topic="options",
    ),
    # -- prefix tuning -----------------------------------------------------------------------------------
    Rule(
        "prefix-text-empty", ("prefix.init_text", "prefix.init"),
        lambda c: c.method == "prefix" and c.prefix_init == "text" and not (c.prefix_init_text or "").strip(),
        lambda c: "is empty, but prefix.init: text starts the prefix from a text's keys and values; set "
        "prefix.init_text to that text (a task instruction, say), or use prefix.init: random",
        methods=("prefix",), topic="options",
    ),
    Rule(
        "prefix-text-projection", ("prefix.init", "prefix.projection"),
        lambda c: c.method == "prefix" and c.prefix_init == "text" and c.prefix_projection,
        lambda c: "init: text sets the prefix's keys and values themselves, which the projection MLP would "
        "recompute; use prefix.projection: false with init: text, or init: random",
        methods=("prefix",), topic="options",
    ),
    Rule(
        "prefix-text-sharded", ("prefix.init", "distributed.strategy"),
        lambda c: c.method == "prefix" and c.prefix_init == "text" and c.strategy in SHARDED
        and (c.processes or 0) > 1,
        lambda c: f"text runs the whole base over prefix.init_text on each process, which distributed.strategy "
        f"{c.strategy} on {c.processes} processes shards; use strategy ddp (or single), or prefix.init: random",
        methods=("prefix",),
    ),
    Rule(
        "prefix-checkpointing", ("train.activation_checkpointing", "method"),
        lambda c: c.method == "prefix" and c.checkpointing is True,
        lambda c: "transformers drops the key/value cache, which holds the trained prefix, in checkpointed "
        "layers; set it to false or auto for method: prefix",
        methods=("prefix",), topic="activations",
    ),
    Rule(
        "prefix-packing", ("data.packing", "method"),
        lambda c: c.method == "prefix" and c.packing,
        lambda c: "packed rows would all attend to one prefix across documents; set data.packing: false for "
        "method: prefix",
        methods=("prefix",), topic="data",
    ),
    # -- prompt tuning -----------------------------------------------------------------------------------
    Rule(
        "prompt-text-empty", ("prompt.init_text", "prompt.init"),
        lambda c: c.method == "prompt" and c.prompt_init == "text" and not (c.prompt_init_text or "").strip(),
        lambda c: "is empty, but prompt.init: text starts the virtual tokens from a text's token embeddings; set "
        "prompt.init_text to that text (a task instruction, say), or use prompt.init: random",
        methods=("prompt",), topic="options",
    ),
    Rule(
        "prompt-text-sharded", ("prompt.init", "distributed.strategy"),
        lambda c: c.method == "prompt" and c.prompt_init == "text" and c.strategy in SHARDED
        and (c.processes or 0) > 1,
        lambda c: f"text reads init_text's rows of the base's input embeddings on each process, which "
        f"distributed.strategy {c.strategy} on {c.processes} processes shards; use strategy ddp (or single), or "
        "prompt.init: random",
        methods=("prompt",),
    ),
    Rule(
        "prompt-packing", ("data.packing", "method"),
        lambda c: c.method == "prompt" and c.packing,
        lambda c: "the virtual tokens go before each row, so the packed documents after a row's first would not "
        "follow them (and peft drops the position ids that separate the documents); set data.packing: false for "
        "method: prompt",
        methods=("prompt",), topic="data",
    ),
)


def reference_setting(recipe: Any) -> str:
    """How a recipe asks for a reference policy: dpo.reference for dpo; for grpo ``model`` when its KL term is
    on (grpo.beta above 0: the starting weights, as dpo's), else ``none``."""
    if recipe.train.objective == "grpo":
        return "model" if recipe.grpo.beta > 0 else "none"
    return str(recipe.dpo.reference)


PREFERENCE_RULES: tuple[Rule, ...] = (
    Rule(
        "preference-data", ("train.objective", "data.format"),
        lambda c: c.preference and c.data_format is not None and c.data_format != "preference",
        lambda c: f"{c.objective} learns from chosen/rejected pairs but data.format is {c.data_format}; set "
        "data.format: preference (rows with prompt, chosen and rejected), or train.objective: sft",
        topic="objective",
    ),
    Rule(
        "preference-sft", ("data.format", "train.objective"),
        lambda c: c.data_format == "preference" and not c.preference,
        lambda c: "preference rows (prompt, chosen, rejected) need a preference objective but train.objective is "
        f"{c.objective}; set train.objective: dpo, simpo or orpo, or use the instruction or chat format",
        topic="objective",
    ),
    Rule(
        "preference-packing", ("data.packing", "train.objective"),
        lambda c: c.preference and c.packing,
        lambda c: f"{c.objective} scores each chosen completion against its own rejected one, row by row, which "
        "packed rows would mix; set data.packing: false",
        topic="objective",
    ),
    Rule(
        "mixture-preference", ("data.train", "train.objective"),
        lambda c: c.mixture and c.preference,
        lambda c: f"a mixture of {{path, weight}} sources is drawn for sft's samples, not for {c.objective}'s "
        "pairs or prompts; give data.train a list of paths (concatenated)",
        topic="data",
    ),
    # -- data.streaming: the data is read while training, never whole -------------------------------------
    Rule(
        "streaming-max-steps", ("data.streaming", "train.max_steps"),
        lambda c: c.streaming and not c.max_steps,
        lambda c: "a stream's length is not known before it is read, so train.epochs cannot give the number of "
        "steps (nor the learning-rate schedule's length); set train.max_steps (the stream starts over at its end)",
        topic="data",
    ),
    Rule(
        "streaming-packing", ("data.streaming", "data.packing"),
        lambda c: c.streaming and c.packing,
        lambda c: "packing fits samples into rows over the whole data set, which a stream never holds; set "
        "data.packing: false, or data.streaming: false",
        topic="data",
    ),
    Rule(
        "streaming-eval-fraction", ("data.streaming", "data.eval_fraction"),
        lambda c: c.streaming and c.eval_fraction,
        lambda c: "holding out a fraction of data.train chooses from the whole set before training, which a stream "
        "never holds; give data.eval its own file, or set data.streaming: false",
        topic="data",
    ),
    Rule(
        "streaming-preference", ("data.streaming", "train.objective"),
        lambda c: c.streaming and (c.preference or c.data_format == "preference"),
        lambda c: f"{c.objective} reads its pairs or prompts whole before training (a reference's log-probabilities "
        "may be precomputed over them); set data.streaming: false",
        topic="data",
    ),
    Rule(
        "reference-offload", ("dpo.reference", "train.offload"),
        lambda c: c.objective == "dpo" and c.reference == "model" and c.method == "full" and c.offload in OFFLOADS,
        lambda c: f"model keeps a frozen copy of the weights on the GPUs, beside the state train.offload: {c.offload} "
        "moves to the host; set dpo.reference: precomputed (no reference in memory while training), or "
        "train.offload: none",
        methods=("full",), topic="objective",
    ),
    Rule(
        "reference-model-adapters", ("dpo.reference_model", "method"),
        lambda c: c.objective == "dpo" and c.reference_model and c.method not in (None, "full"),
        lambda c: f"method: {c.method} compares the policy with its own base (the adapters switched off), not with "
        "another model; remove dpo.reference_model, or use method: full to compare with that checkpoint",
        methods=("lora", "qlora", "prefix", "adapter", "prompt"), topic="objective",
    ),
    Rule(
        "reference-model-objective", ("dpo.reference_model", "train.objective"),
        lambda c: c.reference_model and c.objective != "dpo",
        lambda c: f"{c.objective} has no reference policy, so the model would never be read; remove "
        "dpo.reference_model, or set train.objective: dpo",
        topic="objective",
    ),
)

GRPO_RULES: tuple[Rule, ...] = (
    Rule(
        "grpo-data", ("train.objective", "data.format"),
        lambda c: c.objective == "grpo" and c.data_format is not None and c.data_format not in ("instruction", "chat"),
        lambda c: f"grpo samples completions of prompts, which data.format: {c.data_format} rows do not have; set "
        "data.format: instruction (the output is the reference answer) or chat (the last assistant message is)",
        topic="objective",
    ),
    Rule(
        "grpo-packing", ("data.packing", "train.objective"),
        lambda c: c.objective == "grpo" and c.packing,
        lambda c: "grpo scores each sampled completion on its own row, which packing would mix (and its rows are "
        "made while training, not packed before); set data.packing: false",
        topic="objective",
    ),
    Rule(
        "grpo-streaming", ("data.streaming", "train.objective"),
        lambda c: c.streaming and c.objective == "grpo",
        lambda c: "grpo draws whole groups of prompts from data.train, read whole before training, which a stream "
        "never holds; set data.streaming: false",
        topic="data",
    ),
    Rule(
        "grpo-reference-offload", ("grpo.beta", "train.offload"),
        lambda c: c.objective == "grpo" and c.reference == "model" and c.method == "full" and c.offload in OFFLOADS,
        lambda c: f"grpo.beta above 0 keeps a frozen copy of the weights on the GPUs, beside the state "
        f"train.offload: {c.offload} moves to the host; set grpo.beta: 0 (no reference), or train.offload: none",
        methods=("full",), topic="objective",
    ),
)

TABLE = TABLE + PREFERENCE_RULES + GRPO_RULES


def _pp(c: Cell) -> int:
    return c.pp or 1


# Pipeline parallelism (finetune/train/parallel/pipeline.py): stage models of full fine-tuning and LoRA, over a
# (pp, dp, tp) mesh with FSDP2 (or nothing) over dp, driven by torch.distributed.pipelining's schedules.
PIPELINE_RULES: tuple[Rule, ...] = (
    Rule(
        "pp-single", ("distributed.pp", "distributed.strategy"),
        lambda c: c.pipelined and c.strategy == "single",
        lambda c: f"{_pp(c)} runs the model as {_pp(c)} stages on as many processes, but distributed.strategy is "
        "single (one process); use auto, ddp, zero2 or fsdp, or distributed.pp: 1",
    ),
    Rule(
        "pp-replicated", ("distributed.strategy", "distributed.pp"),
        lambda c: c.pipelined and (c.strategy == "zero1" or (c.strategy == "ddp" and (c.dp or 0) > 1)),
        lambda c: f"{c.strategy} cannot run over the data-parallel groups of distributed.pp: {_pp(c)} (the pipeline "
        "schedule drives the stages' gradient reduction through FSDP2); use zero2, fsdp or auto (or ddp with one "
        "data-parallel replica)",
    ),
    Rule(
        "pp-hsdp", ("distributed.pp", "distributed.strategy"),
        lambda c: c.pipelined and c.strategy == "hsdp",
        lambda c: f"{_pp(c)} with hsdp is not supported (finetune builds a pp x dp x tp mesh, not a replicate x "
        "shard one per stage); use fsdp with pipeline stages, or distributed.pp: 1",
    ),
    Rule(
        "pp-interleaved-sharded", ("distributed.pp_schedule", "distributed.strategy"),
        lambda c: c.pipelined and c.pp_schedule == "interleaved-1f1b" and c.strategy in SHARDED,
        lambda c: f"interleaved-1f1b runs several stages of one model per process, which {c.strategy}'s FSDP2 "
        "units cannot each reduce; use 1f1b or gpipe with it, or ddp with one data-parallel replica",
    ),
    Rule(
        "pp-method", ("distributed.pp", "method"),
        lambda c: c.pipelined and c.method in ("qlora", "prefix", "adapter", "prompt"),
        lambda c: f"{_pp(c)} with method {c.method} is not supported: pipeline stages run full fine-tuning and "
        "LoRA only; use method lora, or distributed.pp: 1",
        methods=("qlora", "prefix", "adapter", "prompt"),
    ),
    Rule(
        "pp-lora-options", ("distributed.pp", "lora.use_dora"),
        lambda c: c.pipelined and c.lora_family and (c.use_dora or c.lora_init in ("pissa", "olora")),
        lambda c: f"{_pp(c)} with {'lora.use_dora' if c.use_dora else 'lora.init: ' + c.lora_init} is not "
        "supported (each stage would save its own part of the adapter's conversion); use plain LoRA "
        "(use_dora: false, init: default), or distributed.pp: 1",
        methods=("lora", "qlora"),
    ),
    Rule(
        "pp-compile", ("distributed.pp", "train.compile"),
        lambda c: c.pipelined and c.compile,
        lambda c: f"{_pp(c)} with train.compile: true is not supported (pipeline stages run eager blocks); set "
        "train.compile: false, or distributed.pp: 1",
        topic="compile",
    ),
    Rule(
        "pp-8bit-optimizer", ("distributed.pp", "train.optimizer"),
        lambda c: c.pipelined and c.optimizer in EIGHT_BIT_OPTIMIZERS,
        lambda c: f"{_pp(c)} with train.optimizer: {c.optimizer} is not supported (pipeline stages run torch's "
        "AdamW); set train.optimizer: adamw, or distributed.pp: 1",
        topic="optimizer",
    ),
    Rule(
        "pp-offload", ("train.offload", "distributed.pp"),
        lambda c: c.pipelined and c.offload in OFFLOADS,
        lambda c: f"{c.offload} with distributed.pp: {_pp(c)} is not supported (the stages' state stays on their "
        "GPUs); set train.offload: none, or distributed.pp: 1",
        topic="offload",
    ),
    Rule(
        "pp-packing", ("data.packing", "distributed.pp"),
        lambda c: c.pipelined and c.packing,
        lambda c: f"packed rows' document masks do not cross the stages of distributed.pp: {_pp(c)}; set "
        "data.packing: false, or distributed.pp: 1",
        topic="data",
    ),
    Rule(
        "pp-objective", ("train.objective", "distributed.pp"),
        lambda c: c.pipelined and (c.preference or c.objective == "grpo"),
        lambda c: (
            "grpo samples its completions with a KV cache, which pipeline stages do not keep"
            if c.objective == "grpo" else f"{c.objective} scores pairs of rows against a reference, which pipeline "
            "stages do not run"
        ) + "; set train.objective: sft, or distributed.pp: 1",
        topic="objective",
    ),
)

TABLE = TABLE + PIPELINE_RULES


def _ep(c: Cell) -> int:
    return c.ep


# Expert parallelism (finetune/train/parallel/expert_parallel.py): a mixture's routed experts split over ep ranks that
# ep borrows from FSDP2's shard dimension, tokens dispatched by all-to-all, on one node's fsdp/zero2 mesh.
EXPERT_PARALLEL_RULES: tuple[Rule, ...] = (
    Rule(
        "ep-dense", ("distributed.ep", "model.path"),
        lambda c: c.expert_parallel and c.experts is False,
        lambda c: f"{_ep(c)} splits a mixture's routed experts over {_ep(c)} ranks, but this model has no experts; "
        "set distributed.ep: 1",
    ),
    Rule(
        "ep-strategy", ("distributed.ep", "distributed.strategy"),
        lambda c: c.expert_parallel and c.strategy in ("single", "ddp", "zero1"),
        lambda c: f"{_ep(c)} borrows its ranks from the shard dimension of zero2/fsdp, but distributed.strategy is "
        f"{c.strategy}; use zero2, fsdp or auto, or distributed.ep: 1",
    ),
    Rule(
        "ep-hsdp", ("distributed.ep", "distributed.strategy"),
        lambda c: c.expert_parallel and c.strategy == "hsdp",
        lambda c: f"{_ep(c)} with hsdp is not supported (finetune splits the experts over one node's fsdp ranks, "
        "not over replicas across nodes); use fsdp, or distributed.ep: 1",
    ),
    Rule(
        "ep-shard-ranks", ("distributed.ep", "distributed.nproc"),
        lambda c: c.expert_parallel and c.dp is not None and c.strategy in SHARDED and c.dp % c.ep != 0,
        lambda c: f"{_ep(c)} does not divide the {c.dp} data-parallel processes it borrows its ranks from; use an "
        f"ep that divides {c.dp}",
    ),
    Rule(
        "ep-experts", ("distributed.ep", "model.path"),
        lambda c: c.expert_parallel and c.num_experts is not None and c.num_experts % c.ep != 0,
        lambda c: f"{_ep(c)} does not divide the model's {c.num_experts} routed experts (each ep rank holds as "
        "many); use an ep that divides them",
    ),
    Rule(
        "ep-tp", ("distributed.ep", "distributed.tp"),
        lambda c: c.expert_parallel and c.split,
        lambda c: f"{_ep(c)} with distributed.tp: {_tp(c)} is not supported (the experts' all-to-all runs on the "
        "data-parallel ranks of an fsdp mesh without tensor parallelism); set distributed.tp: 1, or distributed.ep: 1",
    ),
    Rule(
        "ep-pp", ("distributed.ep", "distributed.pp"),
        lambda c: c.expert_parallel and c.pipelined,
        lambda c: f"{_ep(c)} with distributed.pp: {_pp(c)} is not supported (pipeline stages run Llama-family "
        "decoders, not a mixture's); set distributed.pp: 1, or distributed.ep: 1",
    ),
    Rule(
        "ep-qlora", ("distributed.ep", "method"),
        lambda c: c.expert_parallel and c.method == "qlora",
        lambda c: f"{_ep(c)} with method qlora is not supported (the experts' NF4 codes and quantization states are "
        "not split by expert over ep ranks); use method lora, or distributed.ep: 1",
        methods=("qlora",),
    ),
    Rule(
        "ep-dora", ("distributed.ep", "lora.use_dora"),
        lambda c: c.expert_parallel and c.lora_family and c.use_dora,
        lambda c: f"{_ep(c)} with lora.use_dora is not supported (DoRA's magnitudes need each whole weight on "
        "one rank); set lora.use_dora: false, or distributed.ep: 1",
        methods=("lora", "qlora"),
    ),
    Rule(
        "ep-compile", ("distributed.ep", "train.compile"),
        lambda c: c.expert_parallel and c.compile,
        lambda c: f"{_ep(c)} with train.compile: true is not supported (the dispatch reads each step's routed "
        "counts on the host, which breaks a block's graph); set train.compile: false, or distributed.ep: 1",
        topic="compile",
    ),
    Rule(
        "ep-offload", ("train.offload", "distributed.ep"),
        lambda c: c.expert_parallel and c.offload in OFFLOADS,
        lambda c: f"{c.offload} with distributed.ep: {_ep(c)} is not supported (FSDP2's CPU offload over the experts' "
        "ep DTensors is not run by finetune); set train.offload: none, or distributed.ep: 1",
        topic="offload",
    ),
    Rule(
        "ep-objective", ("train.objective", "distributed.ep"),
        lambda c: c.expert_parallel and c.objective != "sft",
        lambda c: (f"{c.objective} runs a reference forward beside the policy's" if c.preference
                   else f"{c.objective} samples its completions in the training loop")
        + f", which finetune does not dispatch over distributed.ep: {_ep(c)}; set train.objective: sft, or "
        "distributed.ep: 1",
        topic="objective",
    ),
)

TABLE = TABLE + EXPERT_PARALLEL_RULES


def refusals(cell: Cell) -> list[Refusal]:
    """Every row of :data:`TABLE` that refuses ``cell``, in table order."""
    return [Refusal(rule, rule.keys[0], rule.says(cell)) for rule in TABLE if rule.refuses(cell)]


def first_refusal(cell: Cell) -> Refusal | None:
    """The first row that refuses ``cell`` (None: it trains)."""
    found = refusals(cell)
    return found[0] if found else None


def check(cell: Cell) -> None:
    """Raise :class:`~finetune.errors.UserError` with the first refusal's sentence (nothing when it trains)."""
    from finetune.errors import UserError

    found = first_refusal(cell)
    if found is not None:
        raise UserError(str(found))


# ------------------------------------------------------------------------------------------------------
# Pipeline rules that need the model's config or the layout's numbers: validate (with the model's config),
# the planner (finetune/plan/setting.py) and the trainer (finetune/train/parallel/pipeline.py) refuse with these.
# ------------------------------------------------------------------------------------------------------
#: the interleaved schedule's name (several stages per rank)
INTERLEAVED = "interleaved-1f1b"


def split_problem(layers: list[int] | tuple[int, ...], stages: int, num_layers: int, pp: int, v: int) -> str | None:
    """The sentence refusing a pinned ``distributed.pp_layers`` (None: it is a valid split)."""
    if len(layers) != stages or sum(layers) != num_layers:
        return (
            f"distributed.pp_layers: {list(layers)} has {len(layers)} stages of {sum(layers)} layers; pp {pp} x "
            f"{v} stage{'s' if v > 1 else ''} per rank needs {stages} numbers summing to the model's "
            f"{num_layers} decoder layers (or leave it unset for a balanced split)"
        )
    return None


def pipeline_problem(
    *, pp: int, tp: int, world: int, what: str, schedule: str, v: int, num_layers: int,
    pinned_v: int | None = None,
) -> str | None:
    """The one sentence refusing a pinned pipeline before anything is traced (None: it can run); the micro-batch
    rules, which depend on the walk's micro-batch, are :func:`microbatch_problem`'s."""
    if world % (pp * tp):
        return (
            f"distributed.pp: {pp} x distributed.tp {tp} = {pp * tp} does not divide the {world} {what}; use a pp "
            f"that divides {world // tp if world % tp == 0 else world}"
        )
    if schedule == INTERLEAVED and v < 2:
        return (
            "distributed.pp_stages_per_rank: interleaved-1f1b runs 2 or more stages on each rank; set it to 2 or "
            "more (or leave it unset)"
        )
    if schedule != INTERLEAVED and pinned_v is not None and pinned_v > 1:
        return (
            f"distributed.pp_stages_per_rank: {pinned_v} stages per rank need distributed.pp_schedule: "
            f"interleaved-1f1b ({schedule} runs one stage per rank); set the schedule or leave it unset"
        )
    if pp * v > num_layers:
        return (
            f"distributed.pp: {pp} ranks x {v} stage{'s' if v > 1 else ''} each need at least {pp * v} decoder "
            f"layers and the model has {num_layers}; use a pp of at most {max(1, num_layers // v)}"
        )
    return None


#: model types whose decoder the trainer's pipeline stages run (finetune/train/parallel/pipeline.py): Llama's family
STAGE_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def stage_problem(config: Any) -> str | None:
    """The sentence refusing to cut ``config``'s model into pipeline stages (None: it can be), as the trainer
    refuses it: a decoder the stages do not reproduce, a head tied to the input embeddings (the first and the
    last stage cannot share one weight), sliding-window attention layers."""
    kind = getattr(config, "model_type", type(config).__name__)
    if kind not in STAGE_MODEL_TYPES:
        return (
            f"distributed.pp: pipeline stages run the decoders of {', '.join(STAGE_MODEL_TYPES)} models, not "
            f"{kind}; set distributed.pp: 1 and shard the model with fsdp instead"
        )
    if getattr(config, "tie_word_embeddings", False):
        return (
            f"distributed.pp: {kind} ties its output head to its input embeddings, which the first and the last "
            "pipeline stage cannot share; set distributed.pp: 1 and shard the model with fsdp instead"
        )
    if getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in (getattr(config, "layer_types", None) or [])
    ):
        return (
            f"distributed.pp: {kind} has sliding-window attention layers, which pipeline stages do not mask; "
            "set distributed.pp: 1"
        )
    return None


# ------------------------------------------------------------------------------------------------------
# The support matrix (README), rendered from the table
# ------------------------------------------------------------------------------------------------------

#: The matrix's method rows: a label and the cell settings that make it.
MATRIX_METHODS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("full", {"method": "full"}),
    ("lora", {"method": "lora"}),
    ("lora + DoRA", {"method": "lora", "use_dora": True}),
    ("lora + rsLoRA", {"method": "lora", "use_rslora": True}),
    ("lora + PiSSA/OLoRA", {"method": "lora", "lora_init": "pissa"}),
    ("qlora 4-bit", {"method": "qlora"}),
    ("qlora 8-bit", {"method": "qlora", "quant_bits": 8}),
    ("lora on a mixture's experts", {"method": "lora", "experts": True, "expert_lora": True}),
    ("qlora 4-bit on a mixture's experts", {"method": "qlora", "experts": True, "expert_lora": True}),
    ("prefix", {"method": "prefix"}),
    ("prefix, init: text", {"method": "prefix", "prefix_init": "text", "prefix_init_text": "Answer."}),
    ("adapter", {"method": "adapter"}),
    ("prompt", {"method": "prompt"}),
    ("prompt, init: text", {"method": "prompt", "prompt_init": "text", "prompt_init_text": "Answer."}),
)
#: The matrix's columns: a label and the cell settings (processes as a 2-process run).
MATRIX_COLUMNS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("single", {"strategy": "single", "processes": 1}),
    ("ddp", {"strategy": "ddp", "processes": 2}),
    ("zero1", {"strategy": "zero1", "processes": 2}),
    ("zero2", {"strategy": "zero2", "processes": 2}),
    ("fsdp", {"strategy": "fsdp", "processes": 2}),
    ("tp 2 (+fsdp)", {"strategy": "fsdp", "processes": 4, "tp": 2}),
    ("hsdp (2 nodes)", {"strategy": "hsdp", "processes": 4, "nodes": 2}),
)


def support_matrix() -> list[tuple[str, list[Refusal | None]]]:
    """For each matrix method row, the first refusal in each column (None: it trains)."""
    return [
        (label, [first_refusal(Cell(**{**m, **col})) for _, col in MATRIX_COLUMNS])
        for label, m in MATRIX_METHODS
    ]


def support_matrix_markdown() -> str:
    """the guide's support matrix: method x strategy x tensor parallelism, then the table's other rows, each
    with its sentence. Every mark comes from :data:`TABLE`."""
    rows = support_matrix()
    notes: dict[str, int] = {}
    lines = [
        "| method | " + " | ".join(label for label, _ in MATRIX_COLUMNS) + " |",
        "|---|" + "---|" * len(MATRIX_COLUMNS),
    ]
    for label, cells in rows:
        marks = []
        for found in cells:
            if found is None:
                marks.append("yes")
            else:
                n = notes.setdefault(found.rule.name, len(notes) + 1)
                marks.append(f"no ({n})")
        lines.append(f"| {label} | " + " | ".join(marks) + " |")
    by_name = {r.name: r for r in TABLE}
    lines.append("")
    for name, n in notes.items():
        lines.append(f"{n}. `{' + '.join(by_name[name].keys)}`: {_generic(by_name[name])}")
    others = [r for r in TABLE if r.name not in notes]
    if others:
        lines += ["", "Every other refusal of the table (`finetune validate` prints the sentence with your values):", ""]
        for rule in others:
            lines.append(f"- `{' + '.join(rule.keys)}` ({rule.topic}): {_generic(rule)}")
    return "\n".join(lines) + "\n"


def _generic(rule: Rule) -> str:
    """A rule's sentence on a representative cell it refuses (for the docs)."""
    for _, m in MATRIX_METHODS:
        for _, col in MATRIX_COLUMNS:
            for extra in _EXTRAS:
                cell = Cell(**{**m, **col, **extra})
                if rule.refuses(cell):
                    return rule.sentence(cell)
    raise AssertionError(f"capability rule {rule.name} refuses no cell of the documentation grid")


# dimensions beyond the matrix's rows and columns, to find a cell each other rule refuses
_EXTRAS: tuple[dict[str, Any], ...] = (
    {},
    {"experts": True, "expert_lora": True, "use_dora": True},
    {"experts": True, "expert_lora": True, "lora_init": "pissa"},
    {"experts": True, "quant_bits": 8},
    {"compile": True},
    {"optimizer": "adamw8bit"},
    {"offload": "optimizer"},
    {"offload": "parameters"},
    {"offload": "parameters", "optimizer": "paged_adamw8bit"},
    {"use_dora": True},
    {"use_rslora": True},
    {"prefix_init": "text"},
    {"prefix_init": "text", "prefix_init_text": "Answer.", "prefix_projection": True},
    {"prompt_init": "text"},
    {"checkpointing": True},
    {"packing": True},
    {"precision": "bf16", "quant_compute_dtype": "fp16"},
    {"lora_init": "pissa", "use_dora": True},
    {"lora_dtype": "bf16"},
    {"lora_dtype": "fp16"},
    {"lora_dtype": "bf16", "precision": "fp16"},
    {"processes": 1},
    {"strategy": "single", "processes": 2},
    {"strategy": "ddp", "processes": 4, "tp": 2},
    {"strategy": "zero1", "processes": 2, "tp": 2},
    {"objective": "dpo", "data_format": "instruction"},
    {"objective": "sft", "data_format": "preference"},
    {"objective": "dpo", "packing": True},
    {"objective": "dpo", "offload": "optimizer"},
    {"objective": "dpo", "reference_model": True},
    {"objective": "simpo", "reference_model": True},
    {"objective": "grpo", "data_format": "preference"},
    {"objective": "grpo", "packing": True},
    {"objective": "grpo", "reference": "model", "offload": "optimizer"},
    {"nodes": 1},  # the hsdp column on one node
    {"tp": 2},
    {"pp": 2},
    {"pp": 2, "strategy": "single"},
    {"pp": 2, "strategy": "ddp", "processes": 4},
    {"pp": 2, "pp_schedule": "interleaved-1f1b"},
    {"pp": 2, "use_dora": True},
    {"pp": 2, "compile": True},
    {"pp": 2, "optimizer": "adamw8bit"},
    {"pp": 2, "offload": "optimizer"},
    {"pp": 2, "packing": True},
    {"pp": 2, "objective": "dpo", "data_format": "preference"},
    {"ep": 2, "experts": False},
    {"ep": 2, "experts": True, "strategy": "ddp"},
    {"ep": 2, "experts": True, "strategy": "hsdp", "processes": 4, "nodes": 2},
    {"ep": 4, "experts": True, "processes": 2},
    {"ep": 2, "experts": True, "num_experts": 3},
    {"ep": 2, "experts": True, "tp": 2},
    {"ep": 2, "experts": True, "pp": 2},
    {"ep": 2, "experts": True},
    {"ep": 2, "experts": True, "use_dora": True},
    {"ep": 2, "experts": True, "compile": True},
    {"ep": 2, "experts": True, "offload": "optimizer"},
    {"ep": 2, "experts": True, "objective": "dpo", "data_format": "preference"},
    {"pp": 2, "objective": "grpo", "data_format": "instruction"},
    {"ep": 2, "experts": True, "objective": "grpo", "data_format": "instruction"},
    {"mixture": True, "objective": "dpo", "data_format": "preference"},
    {"streaming": True, "max_steps": False},
    {"streaming": True, "packing": True},
    {"streaming": True, "eval_fraction": True},
    {"streaming": True, "objective": "dpo", "data_format": "preference"},
    {"streaming": True, "objective": "grpo", "data_format": "instruction"},
)


if __name__ == "__main__":  # python -m finetune.recipe.capabilities: the guide's support matrix
    print(support_matrix_markdown(), end="")
