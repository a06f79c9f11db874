"""The execution spec: how every kind of tensor of a run is stored, computed, checkpointed and sharded.

The planner decides a configuration (method, strategy, precision, activation checkpointing, processes);
:func:`execution_spec` turns it, with the recipe's storage settings (``model.dtype``, ``quantization``), into
one :class:`ExecSpec`. The planner's inventory and traces (``finetune/plan``) and the trainer
(``finetune/train``) both read that object: nothing downstream re-derives a dtype or a wrapping rule from
the recipe, so the plan and the run cannot disagree on how a tensor is stored.

Strategy, method and precision are enums with properties, so code asks ``spec.strategy.uses_fsdp``
instead of comparing strings. They are ``str`` subclasses: ``Strategy.FSDP == "fsdp"`` and JSON keeps the
plain names.

Pure Python (no torch): dtypes are the recipe's names (fp32, bf16, fp16; uint8/int8 for quantized codes).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class _Name(str, Enum):
    """A recipe value with behaviour: prints and formats as its plain name."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __hash__(self) -> int:  # as the plain name's, so either finds the other in a dict or set
        return hash(self.value)


class Method(_Name):
    """What is trained."""

    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"
    PREFIX = "prefix"
    ADAPTER = "adapter"
    PROMPT = "prompt"

    # What the name itself says (the rest of what a method decides is its class's, finetune/model/methods.py):
    # the title, what is injected (None: every weight is trained), a quantized base, and whether activation
    # checkpointing keeps its behaviour (not for prefix tuning: transformers drops the KV cache, which holds
    # the trained prefix, in checkpointed decoder layers).
    @property
    def title(self) -> str:  # type: ignore[override]  # the enum's display name, not str.title()
        """The name people use."""
        return _METHOD_FACTS[self.value][0]

    @property
    def adapter_kind(self) -> str | None:
        """What is injected into the frozen base: lora, prefix, bottleneck or prompt (None: full fine-tuning)."""
        return _METHOD_FACTS[self.value][1]

    @property
    def adapters(self) -> bool:
        """Adapters on a frozen base (the base gets no gradients or optimizer state)."""
        return self.adapter_kind is not None

    @property
    def quantized(self) -> bool:
        """The frozen base's linear weights are quantized (bitsandbytes)."""
        return _METHOD_FACTS[self.value][2]

    @property
    def recomputable(self) -> bool:
        """Activation checkpointing keeps its behaviour."""
        return _METHOD_FACTS[self.value][3]


#: Per method name: title, injected kind, quantized base, recomputable.
_METHOD_FACTS: dict[str, tuple[str, str | None, bool, bool]] = {
    "full": ("full fine-tuning", None, False, True),
    "lora": ("LoRA", "lora", False, True),
    "qlora": ("QLoRA", "lora", True, True),
    "prefix": ("prefix tuning", "prefix", False, False),
    "adapter": ("bottleneck adapters", "bottleneck", False, True),
    "prompt": ("prompt tuning", "prompt", False, True),
}


class Strategy(_Name):
    """How the ranks share the work (torch.distributed)."""

    SINGLE = "single"
    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    FSDP = "fsdp"
    HSDP = "hsdp"

    @property
    def distributed(self) -> bool:
        """Needs a process group (every strategy but one process)."""
        return self is not Strategy.SINGLE

    @property
    def uses_fsdp(self) -> bool:
        """Wrapped by FSDP2 ``fully_shard`` (ZeRO-2, ZeRO-3 and hybrid ZeRO-3): its mixed-precision policy
        replaces autocast."""
        return self in (Strategy.ZERO2, Strategy.FSDP, Strategy.HSDP)

    @property
    def replicates(self) -> bool:
        """Every rank holds the whole model (one process, DDP, ZeRO-1)."""
        return not self.uses_fsdp

    @property
    def shards_params(self) -> bool:
        """Parameters, gradients and optimizer state are sharded at rest (FSDP2)."""
        return self.uses_fsdp

    @property
    def shards_optimizer(self) -> bool:
        """AdamW's state is split over the ranks (ZeRO-1 and up)."""
        return self in (Strategy.ZERO1, Strategy.ZERO2, Strategy.FSDP, Strategy.HSDP)

    @property
    def reshards_after_forward(self) -> bool:
        """Each unit's parameters are freed after its forward and gathered again for backward (ZeRO-3)."""
        return self in (Strategy.FSDP, Strategy.HSDP)

    @property
    def hybrid(self) -> bool:
        """Sharded inside each node and replicated across nodes (HSDP: a 2-D ("replicate", "shard") mesh)."""
        return self is Strategy.HSDP

    @property
    def title(self) -> str:  # type: ignore[override]  # the enum's display name, not str.title()
        """The name people use."""
        return {
            "single": "one process", "ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "FSDP", "hsdp": "HSDP",
        }[self.value]


class Precision(_Name):
    """The run's precision setting."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    BF16_PURE = "bf16-pure"

    @property
    def mixed(self) -> bool:
        """16-bit compute over fp32 master weights."""
        return self in (Precision.BF16, Precision.FP16)

    @property
    def compute(self) -> str:
        """dtype name the matmuls run in."""
        return "bf16" if self is Precision.BF16_PURE else self.value

    @property
    def master(self) -> str:
        """dtype name of trained weights (and so of their gradients and AdamW state)."""
        return "bf16" if self is Precision.BF16_PURE else "fp32"


#: Bytes per value of each dtype name the spec uses.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "uint8": 1, "int8": 1}


@dataclass(frozen=True)
class QuantSpec:
    """How the frozen base's linear weights are quantized (bitsandbytes)."""

    bits: int  # 4 (NF4/FP4) or 8 (LLM.int8)
    quant_type: str  # nf4 | fp4 (4-bit)
    double_quant: bool  # 4-bit: quantize the quantization constants too
    compute_dtype: str  # the dtype a quantized weight is dequantized to for its matmul
    storage_dtype: str  # the dtype the packed codes are stored in

    @property
    def shardable(self) -> bool:
        """Packed 4-bit codes stored in a float dtype, so FSDP2 can shard them like any parameter."""
        return self.storage_dtype not in ("uint8", "int8")


@dataclass(frozen=True)
class AdapterSpec:
    """What is trained on a frozen base, the same for the planner's inventory and traces and the trainer
    (finetune/model/adapters.py injects it). Hashable: it keys the planner's caches."""

    kind: str  # lora | prefix | bottleneck | prompt
    # lora (peft LoraConfig): rank, scale, dropout, targets (None: peft's choice), DoRA, rsLoRA, init
    r: int = 0
    alpha: float = 0.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str | None = None
    use_dora: bool = False
    use_rslora: bool = False
    init: str = "default"
    dtype: str = "fp32"  # lora.dtype: the adapters' storage dtype (their gradients' and AdamW state's too)
    # prefix (peft PrefixTuningConfig): virtual tokens per layer, reparametrisation MLP and its width; prompt
    # (peft PromptTuningConfig): virtual token embeddings before the input
    num_virtual_tokens: int = 0
    projection: bool = False
    projection_hidden: int | None = None
    # init: text (Li & Liang): the text whose keys/values start the prefix (None: peft's random draw)
    prefix_init_text: str | None = None
    # bottleneck (finetune/model/adapters.py): width (None: hidden / reduction_factor), activation, where
    size: int | None = None
    reduction_factor: float = 16.0
    non_linearity: str = "relu"
    placement: str = "both"  # attention | mlp | both
    train_norms: bool = True  # a trained gain on each adapted sublayer's normalised input (Houlsby's LN)
    embeddings: bool = False  # a bottleneck on the token embeddings' output too (before layer 0)
    # prompt, init: text: the text whose token embeddings start the virtual tokens (None: peft's random draw)
    prompt_init_text: str | None = None

    def bottleneck_size(self, hidden: int) -> int:
        """Width of a bottleneck adapter in a model of ``hidden`` features."""
        return self.size if self.size is not None else max(1, int(hidden // self.reduction_factor))

    @classmethod
    def lora(cls, settings: Any = None) -> AdapterSpec:
        """LoRA's shape from the recipe's ``lora`` section (None: its defaults)."""
        if settings is None:
            from finetune.recipe.schema import LoraConfig

            settings = LoraConfig()
        tm = settings.target_modules
        return cls(
            kind="lora", r=int(settings.r), alpha=float(settings.alpha), dropout=float(settings.dropout),
            target_modules=tuple(tm) if isinstance(tm, list) else tm, use_dora=bool(settings.use_dora),
            use_rslora=bool(settings.use_rslora), init=str(settings.init), dtype=str(getattr(settings, "dtype", "fp32")),
        )

    @classmethod
    def prefix(cls, settings: Any = None) -> AdapterSpec:
        """The prefix from the recipe's ``prefix`` section (None: its defaults)."""
        if settings is None:
            from finetune.recipe.schema import PrefixConfig

            settings = PrefixConfig()
        return cls(
            kind="prefix", num_virtual_tokens=int(settings.num_virtual_tokens),
            projection=bool(settings.projection), projection_hidden=settings.projection_hidden,
            prefix_init_text=settings.init_text if settings.init == "text" else None,
        )

    @classmethod
    def prompt(cls, settings: Any = None) -> AdapterSpec:
        """The virtual tokens from the recipe's ``prompt`` section (None: its defaults)."""
        if settings is None:
            from finetune.recipe.schema import PromptConfig

            settings = PromptConfig()
        return cls(
            kind="prompt", num_virtual_tokens=int(settings.num_virtual_tokens),
            prompt_init_text=settings.init_text if settings.init == "text" else None,
        )

    @classmethod
    def bottleneck(cls, settings: Any = None) -> AdapterSpec:
        """The bottleneck modules from the recipe's ``adapter`` section (None: its defaults)."""
        if settings is None:
            from finetune.recipe.schema import AdapterConfig

            settings = AdapterConfig()
        return cls(
            kind="bottleneck", size=settings.size, reduction_factor=float(settings.reduction_factor),
            non_linearity=str(settings.non_linearity), placement=str(settings.placement),
            train_norms=bool(settings.train_norms), embeddings=bool(settings.embeddings),
        )


def adapter_spec(
    method: str, lora: Any = None, prefix: Any = None, adapter: Any = None, prompt: Any = None
) -> AdapterSpec | None:
    """What ``method`` injects, from the recipe's ``lora`` / ``prefix`` / ``adapter`` / ``prompt`` sections (None
    for full fine-tuning; a missing section: its defaults): the constructor of its kind (``AdapterSpec.lora``
    ...)."""
    kind = Method(method).adapter_kind
    if kind is None:
        return None
    settings = {"lora": lora, "prefix": prefix, "bottleneck": adapter, "prompt": prompt}[kind]
    return getattr(AdapterSpec, kind)(settings)


@dataclass(frozen=True)
class ExecSpec:
    """How one configuration stores and computes each kind of tensor (see the module docstring)."""

    method: Method
    strategy: Strategy
    precision: Precision
    world_size: int  # processes of the run (1 for a single process): pp x dp x tp
    compute_dtype: str  # matmul dtype
    trainable_dtype: str  # trained weights: full fine-tuning's masters, or the adapters
    frozen_dtype: str | None  # the frozen base's unquantized weights (None: nothing is frozen)
    quant: QuantSpec | None  # the frozen base's quantized linear weights (qlora)
    autocast: bool  # torch.autocast around forward (single, DDP, ZeRO-1 under mixed precision)
    fsdp_param_dtype: str | None  # FSDP2 MixedPrecisionPolicy: every parameter computed in this dtype
    reduce_dtype: str | None  # ... and gradients reduced in this one
    loss_scaling: bool  # fp16: dynamic loss scaling
    checkpointing: bool  # activation checkpointing of every decoder block, applied once before wrapping
    reshard_after_forward: bool  # FSDP2 units (ZeRO-3); the root never reshards
    adapter: AdapterSpec | None = None  # what is trained on the frozen base (None: full fine-tuning)
    tp: int = 1  # tensor-parallel degree: each decoder block's linears split over tp ranks of one node
    compile: bool = False  # torch.compile each decoder block (train.compile), on every load path
    optimizer: str = "adamw"  # adamw | adamw8bit | paged_adamw8bit (the optimizer state's storage)
    offload: str = "none"  # none | optimizer | parameters: what lives in host memory instead of the device
    nodes: int = 1  # hsdp: the replicas, one per node (each node's ranks shard the model); 1 otherwise
    objective: str = "sft"  # sft | dpo | simpo | orpo (finetune/objectives/preference.py) | grpo (finetune/objectives/grpo.py)
    # dpo's reference policy: none (sft, simpo, orpo), base (an adapter method's base, adapters off), model (a
    # frozen copy of the starting weights, stored in the frozen dtype and sharded like the policy) or precomputed
    reference: str = "none"
    # pipeline parallelism (distributed.pp): the decoder layers split into stages over pp ranks, the outermost
    # dimension of the (pp, dp, tp) mesh; pp_layers: decoder layers of each stage in order (pp x stages per rank
    # of them; () without pipelining); pp_schedule: gpipe | 1f1b | interleaved-1f1b
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_layers: tuple[int, ...] = ()
    # with tp > 1: norms, dropout and the residual stream sharded over the sequence between the blocks' linears,
    # and the head and loss computed on each rank's positions (distributed.sequence_parallel)
    sequence_parallel: bool = False
    # the attention kernel the model is built with: model.attn_implementation (auto resolved: attention_kernel),
    # or eager for an architecture transformers has no sdpa attention for (gpt-oss's attention sinks)
    attention: str = "sdpa"
    # base tensors the architecture keeps in fp32 whatever the dtypes above say (transformers'
    # _keep_in_fp32_modules_strict in a 16-bit base, also _keep_in_fp32_modules in fp16: DeepSeek-V3's router
    # weights and its e_score_correction_bias), as patterns searched in a tensor's name, as transformers does
    fp32_tensors: tuple[str, ...] = ()
    # a mixture of experts' load-balancing loss, added per target token times this (0: none; finetune/model/router.py)
    aux_loss_coef: float = 0.0
    # expert parallelism (distributed.ep): a mixture's routed experts split over ep ranks borrowed from the
    # data-parallel shard dimension, tokens dispatched to them by all-to-all (finetune/train/parallel/expert_parallel.py)
    ep: int = 1

    @property
    def adapter_dora(self) -> bool:
        """The adapters are DoRA's (a magnitude per output row of each adapted weight)."""
        return self.adapter is not None and self.adapter.use_dora

    @property
    def preference(self) -> bool:
        """The objective trains on chosen/rejected pairs (dpo, simpo, orpo)."""
        return self.objective in ("dpo", "simpo", "orpo")

    @property
    def grpo(self) -> bool:
        """The objective learns from sampled completions and their rewards (grpo)."""
        return self.objective == "grpo"

    @property
    def sync_every_micro_batch(self) -> bool:
        """Gradients are reduced after every micro-batch of a step, not only the last: FSDP2's strategies
        (zero2, fsdp, hsdp) reduce-scatter each micro-batch's gradients into the sharded ones (hsdp all-reduces
        across its replicas on the last only), so no unit keeps an unsharded gradient from one micro-batch to
        the next; DDP and ZeRO-1 synchronise on the last micro-batch (docs/architecture.md: "FSDP2 reduces
        every micro-batch"). Not under a pipeline: torch.distributed.pipelining's schedule turns FSDP2's
        gradient sync and resharding after backward off until its last micro-batch, so a stage keeps its
        units gathered and their gradients unsharded through the step."""
        return self.strategy.uses_fsdp and not self.pipeline

    @property
    def reference_dtype(self) -> str:
        """dtype of the frozen reference copy (reference: model): the compute dtype, as frozen weights are."""
        return self.compute_dtype

    @property
    def dp(self) -> int:
        """Data-parallel ranks (``world_size // (pp x tp)``): the strategy shards or replicates over these."""
        return self.world_size // (self.tp * self.pp)

    @property
    def pipeline(self) -> bool:
        """The decoder layers are split into pipeline stages over ``pp`` ranks."""
        return self.pp > 1

    @property
    def pp_stages_per_rank(self) -> int:
        """Pipeline stages each pp rank runs (more than 1: the interleaved schedule's virtual stages)."""
        return max(1, len(self.pp_layers) // self.pp) if self.pipeline else 1

    @property
    def shard_ranks(self) -> int:
        """Ranks one parameter is split over: the data-parallel ranks, or under hsdp those of one node."""
        return self.dp // self.nodes if self.strategy.hybrid else self.dp

    @property
    def tensor_parallel(self) -> bool:
        """The decoder blocks' linear layers are split over ``tp`` ranks (a 2-D ("dp", "tp") mesh)."""
        return self.tp > 1

    @property
    def expert_parallel(self) -> bool:
        """A mixture's routed experts are split over ``ep`` ranks (all-to-all dispatch)."""
        return self.ep > 1

    @property
    def trainable_bytes(self) -> int:
        """Bytes per trained value (its gradient and each AdamW moment have the same dtype)."""
        return DTYPE_BYTES[self.trainable_dtype]

    @property
    def compute_bytes(self) -> int:
        """Bytes per value of a weight as computed (16-bit under mixed precision)."""
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def gathered_dtype(self) -> str:
        """dtype of an FSDP2 unit once all-gathered for compute (its policy's, else the stored one)."""
        return self.fsdp_param_dtype or self.trainable_dtype

    def keeps_fp32(self, name: str) -> bool:
        """Whether the architecture keeps the tensor ``name`` (a transformers name, or peft's name of it: its
        ``base_model.model.`` prefix and a wrapped layer's ``.base_layer``) in fp32 (``fp32_tensors``)."""
        if not self.fp32_tensors:
            return False
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        return any(re.search(p.replace("*", ".*"), plain) for p in self.fp32_tensors)

    def tensor_dtype(self, name: str, quantizable: bool) -> str:
        """Stored dtype of the base parameter ``name``: :meth:`base_dtype`, or fp32 for a tensor the architecture
        keeps in fp32 (never a quantized weight)."""
        if self.fp32_tensors and not (quantizable and self.quant is not None) and self.keeps_fp32(name):
            return "fp32"
        return self.base_dtype(quantizable)

    def base_dtype(self, quantizable: bool) -> str:
        """Stored dtype of a base parameter: the master dtype (full), the quantized codes, or frozen."""
        if not self.method.adapters:
            return self.trainable_dtype
        if quantizable and self.quant is not None:
            return self.quant.storage_dtype
        assert self.frozen_dtype is not None
        return self.frozen_dtype

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the plan's ``execution``), with the derived ``dp``."""
        return {**asdict(self), "dp": self.dp}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExecSpec:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        quant = d.pop("quant", None)
        adapter = d.pop("adapter", None)
        for key in ("pp_layers", "fp32_tensors"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        if adapter and isinstance(adapter.get("target_modules"), list):
            adapter["target_modules"] = tuple(adapter["target_modules"])
        d.pop("dp", None)
        return cls(
            adapter=AdapterSpec(**adapter) if adapter else None,
            method=Method(d.pop("method")),
            strategy=Strategy(d.pop("strategy")),
            precision=Precision(d.pop("precision")),
            quant=QuantSpec(**quant) if quant else None,
            **d,
        )


def execution_spec(
    method: str,
    strategy: str,
    precision: str,
    *,
    checkpointing: bool,
    world_size: int = 1,
    model_dtype: str = "auto",
    quantization: Any = None,
    lora: Any = None,
    prefix: Any = None,
    adapter: Any = None,
    tp: int = 1,
    compile: bool = False,
    optimizer: str = "adamw",
    offload: str = "none",
    nodes: int = 1,
    objective: str = "sft",
    reference: str = "model",
    pp: int = 1,
    pp_schedule: str = "1f1b",
    pp_layers: tuple[int, ...] | list[int] = (),
    sequence_parallel: bool = False,
    attention: str = "sdpa",
    keep_fp32: tuple[tuple[str, ...], tuple[str, ...]] = ((), ()),
    aux_loss_coef: float = 0.0,
    ep: int = 1,
    prompt: Any = None,
) -> ExecSpec:
    """The :class:`ExecSpec` of a configuration, with the recipe's ``model.dtype`` and ``quantization``.

    Storage rules (the trainer builds exactly this, and checks it at run start on every rank):
      full   every weight trained, in the master dtype (fp32; bf16 for bf16-pure).
      lora   frozen base in ``model.dtype`` when pinned, else the compute dtype; adapters in ``lora.dtype`` (fp32
             by default; bf16: the compute dtype), and so their gradients and AdamW state.
      prefix, adapter, prompt   stored as lora: frozen base, the prefix encoder, the bottleneck modules or the
             virtual token embeddings fp32.
      qlora  linear weights quantized: 4-bit codes in uint8, or in the compute dtype under FSDP2 (ZeRO-2 and
             FSDP alike, which then shard them like any parameter); 8-bit in int8. Every other base weight in
             ``quantization.compute_dtype`` (auto: the run's compute dtype); adapters as lora's.
    ``quantization`` is the recipe's section (bits, quant_type, double_quant, compute_dtype) or None;
    ``lora`` / ``prefix`` / ``adapter`` / ``prompt`` the recipe's sections that shape what is trained
    (:func:`adapter_spec`).
    ``tp``: tensor-parallel degree; ``world_size`` counts every process, the strategy applies over the
    ``world_size // tp`` data-parallel ranks. ``optimizer``: the optimizer whose state the run keeps;
    ``offload``: what lives in host memory (``auto`` is ``adamw`` / ``none``: the planner resolves both).
    ``nodes``: the run's nodes, which hsdp replicates over (recorded for hsdp only).
    ``objective``: train.objective; ``reference``: dpo.reference (model | precomputed), which becomes the spec's
    reference kind (:func:`reference_kind`). ``pp``: pipeline ranks, ``pp_layers`` the decoder layers of each
    stage (pp x stages per rank of them), ``pp_schedule`` their schedule; ``world_size`` is pp x dp x tp.
    ``sequence_parallel``: TP's sequence parallelism (kept only with tp > 1). ``attention``: the attention
    kernel the model is built with, resolved (:func:`attention_kernel`). ``keep_fp32``: the architecture's
    (strict, fp16-only) patterns of tensors kept in fp32 (the inventory's): the strict ones apply to a 16-bit base, both to an fp16 one.
    ``aux_loss_coef``: a mixture of experts' load-balancing loss coefficient (0: none; the sft objective only).
    ``ep``: expert-parallel degree (kept only under a sharded strategy, which it borrows ranks from).
    """
    assert attention in ATTENTION_KERNELS, f"attention {attention} is resolved before the spec"
    m, s, p = Method(method), Strategy(strategy), Precision(precision)
    compute = p.compute
    trained = adapter_spec(m, lora, prefix, adapter, prompt)
    # full fine-tuning's masters; LoRA's adapters in lora.dtype; the prefix, bottleneck and prompt modules in fp32
    trainable = p.master if m is Method.FULL else (trained.dtype if trained is not None and trained.r else "fp32")
    frozen: str | None = None
    quant: QuantSpec | None = None
    if m in (Method.LORA, Method.PREFIX, Method.ADAPTER, Method.PROMPT):
        frozen = "bf16" if p is Precision.BF16_PURE else (compute if model_dtype in ("auto", None) else model_dtype)
    elif m is Method.QLORA:
        bits = int(getattr(quantization, "bits", 4))
        qc = getattr(quantization, "compute_dtype", "auto")
        qcompute = compute if qc in ("auto", None) else qc
        frozen = qcompute
        if bits == 8:
            storage = "int8"
        else:
            storage = qcompute if s.uses_fsdp else "uint8"
        quant = QuantSpec(
            bits=bits,
            quant_type=str(getattr(quantization, "quant_type", "nf4")),
            double_quant=bool(getattr(quantization, "double_quant", True)),
            compute_dtype=qcompute,
            storage_dtype=storage,
        )
    mixed_fsdp = p.mixed and s.uses_fsdp
    world = world_size if s.distributed else 1
    tp = max(1, int(tp)) if s.distributed else 1
    pp = max(1, int(pp)) if s.distributed else 1
    assert world % (tp * pp) == 0, f"pp {pp} x tp {tp} does not divide {world} processes"
    layers = tuple(int(n) for n in pp_layers) if pp > 1 else ()
    assert not layers or len(layers) % pp == 0, f"{len(layers)} pipeline stages do not divide over pp {pp}"
    replicas = max(1, int(nodes)) if s.hybrid else 1
    assert world % replicas == 0, f"{replicas} nodes do not divide {world} processes"
    return ExecSpec(
        method=m,
        strategy=s,
        precision=p,
        world_size=world,
        compute_dtype=compute,
        trainable_dtype=trainable,
        frozen_dtype=frozen,
        quant=quant,
        autocast=p.mixed and not s.uses_fsdp,
        fsdp_param_dtype=compute if mixed_fsdp else None,
        reduce_dtype="fp32" if mixed_fsdp else None,
        loss_scaling=p is Precision.FP16,
        checkpointing=bool(checkpointing),
        reshard_after_forward=s.reshards_after_forward,
        adapter=trained,
        tp=tp,
        compile=bool(compile),
        optimizer="adamw" if optimizer in ("auto", None) else optimizer,
        offload="none" if offload in ("auto", None) else offload,
        nodes=replicas,
        objective=objective,
        reference=reference_kind(objective, m, reference),
        pp=pp,
        pp_schedule=pp_schedule if pp > 1 else "1f1b",
        pp_layers=layers,
        sequence_parallel=bool(sequence_parallel) and tp > 1,
        attention=attention,
        fp32_tensors=_fp32_tensors(keep_fp32, frozen if m.adapters else trainable),
        aux_loss_coef=float(aux_loss_coef) if objective == "sft" else 0.0,
        ep=max(1, int(ep)) if s.uses_fsdp else 1,
    )


def _fp32_tensors(keep_fp32: tuple[tuple[str, ...], tuple[str, ...]], base: str | None) -> tuple[str, ...]:
    """The patterns of tensors kept in fp32 in a base stored in ``base``, as transformers applies them when it
    loads a model in that dtype."""
    strict, fp16_only = keep_fp32
    if base == "bf16":
        return tuple(sorted(strict))
    if base == "fp16":
        return tuple(sorted({*strict, *fp16_only}))
    return ()


#: The attention kernels a model is built with (transformers' names); ``auto`` resolves to one of them.
ATTENTION_KERNELS = ("sdpa", "eager", "flex_attention")


def attention_kernel(asked: str, *, packed: bool, device: str, flex: bool = True, sdpa: bool = True) -> str:
    """``model.attn_implementation`` resolved for a run on ``device`` ("cuda" or "cpu"), ``packed`` saying
    whether its rows are packed, ``flex``/``sdpa`` whether the architecture has those kernels in transformers.

    ``auto`` is flex_attention for packed rows on a GPU: transformers turns the rows' restarting positions into a
    block-sparse document mask, while sdpa is handed a (B, 1, T, T) mask, which keeps it off its flash kernel
    (flash attention takes no arbitrary mask) and costs T x T per row. Otherwise sdpa (eager for an architecture
    without it): unpacked rows need no mask, and on CPU torch has no flex backward (finetune/model/flex.py runs flex
    densely through sdpa there, correct but not smaller). A kernel the recipe names is kept.
    """
    if asked != "auto":
        return asked
    if packed and device == "cuda" and flex:
        return "flex_attention"
    return "sdpa" if sdpa else "eager"


def reference_kind(objective: str, method: str | Method, reference: str) -> str:
    """What dpo (or grpo's KL term) compares the policy with: ``none`` (every other objective, and grpo without
    the KL term: ``reference`` none), ``precomputed`` (dpo), ``base`` (an adapter method's base with its adapters
    switched off) or ``model`` (full fine-tuning's frozen copy)."""
    if objective not in ("dpo", "grpo") or reference == "none":  # grpo: none without its KL term
        return "none"
    if reference == "precomputed" and objective == "dpo":  # grpo's completions are new every step
        return "precomputed"
    return "base" if Method(method).adapters else "model"
