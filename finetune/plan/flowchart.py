"""The lecture's flowchart as a function: precision -> strategy -> method -> micro-batch -> accumulation.

1. Precision: bf16 mixed precision where the GPU has it, else fp16 with loss scaling; fp32 on CPU.
2. Full fine-tuning at micro-batch 1 under DDP, else ZeRO-2 (free: same communication), else FSDP
   (shards the parameters too; all-gathers them again in backward).
3. If FSDP alone does not fit at micro-batch 1 (``distributed.tp: auto``): tensor parallelism inside a node,
   the smallest degree that fits, with ZeRO-2/FSDP over the data-parallel replicas (a 2-D mesh).
   If full fine-tuning fits under none of them: LoRA, then QLoRA, each under the cheapest strategy that fits.
   Activation checkpointing is tried only when a method fits under no strategy without it.
4. The largest micro-batch that fits, and gradient accumulation that keeps the recipe's global batch.
Everything the recipe pins is respected and checked. Every step is a sentence with the numbers that decided it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from finetune.capabilities import Cell, check, first_refusal
from finetune.errors import UserError
from finetune.methods import method_type
from finetune.plan.activations import ActivationProfile, TraceSpec, activation_profile
from finetune.plan.hardware import GPU_TYPES, Hardware, detect_hardware
from finetune.plan.memory import CUDA_CONTEXT_BYTES, FRAGMENTATION, Setup, candidate_memory
from finetune.plan.shapes import Inventory, build_inventory, lora_targets
from finetune.plan.tensor_parallel import degrees, tp_comm_bytes, tp_config, tp_problem
from finetune.plan.types import Candidate, Plan
from finetune.recipe import LoadedRecipe
from finetune.spec import ExecSpec, Method, Precision, Strategy, adapter_spec, execution_spec
from finetune.units import fmt_bytes

STRATEGY_NAMES = {"single": "one process", "ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "FSDP"}
METHOD_NAMES = {m.value: m.title for m in Method}
PRECISION_NAMES = {
    "bf16": "bf16 mixed precision (fp32 master weights, no loss scaler)",
    "fp16": "fp16 mixed precision (fp32 master weights, dynamic loss scaling)",
    "fp32": "fp32",
    "bf16-pure": "pure bf16 (weights, gradients and AdamW state in bf16)",
}


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
    )


def plan_for_run(loaded: LoadedRecipe, *, nproc: int, nnodes: int, device: str) -> Plan:
    """The plan the trainer executes for ``nproc`` x ``nnodes`` processes on ``device`` ("cuda" or "cpu")."""
    req = replace(request_from_recipe(loaded), for_run=True)
    hw = detect_hardware(device=device, gpus=nproc, nodes=nnodes, nproc=nproc)
    hw.gpus_per_node = nproc
    return make_plan(req, hw)


def _supports_sdpa(config: Any, flag: str = "_supports_sdpa") -> bool:
    """Whether transformers can build this architecture with SDPA attention (``flag``: another kernel's)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return bool(getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], flag, True))
    except KeyError:
        return True


def first_step_memory(loaded: LoadedRecipe, plan: Plan, *, device: str) -> Any:
    """Predicted peak of the FIRST optimizer step of ``plan.chosen`` (AdamW's state does not exist yet
    during its forward and backward), to compare with a probe that measures only that step."""
    return chosen_memory(loaded, plan, device=device, first_step=True)


def chosen_memory(
    loaded: LoadedRecipe, plan: Plan, *, device: str, first_step: bool = False, seq_len: int | None = None
) -> Any:
    """Predicted peak of ``plan.chosen`` (the first optimizer step's with ``first_step``), at ``seq_len``
    tokens per row instead of ``data.max_seq_len`` when given: the trainer pads each micro-batch to its
    longest row, so a run on short rows is compared with the prediction at the width that ran."""
    c = plan.chosen
    req = replace(request_from_recipe(loaded), for_run=True)
    if seq_len is not None:
        req = replace(req, seq_len=seq_len)
    hw = detect_hardware(device=device, gpus=c.nproc, nodes=c.nnodes, nproc=c.nproc)
    p = _Planner(req, hw)
    p.precision = c.precision
    p.global_batch = c.micro_batch_size * c.grad_accum_steps * c.dp  # the ranks of a TP group share a slice
    return p.evaluate(
        c.method, c.strategy, c.micro_batch_size, c.activation_checkpointing, first_step=first_step, tp=c.tp
    ).memory


class _Planner:
    def __init__(self, req: Request, hw: Hardware) -> None:
        self.req, self.hw = req, hw
        self.walk: list[str] = []
        self.walk_refusals: set[str] = set()
        if req.strategy == "single" and hw.world > 1 and not req.for_run:  # a run: the launcher decides
            self.say(f"distributed.strategy is single: planning for one process, not {hw.world}.")
            hw.gpus_per_node, hw.nodes = 1, 1
        self.world = hw.world
        self.lora = req.lora
        if self.lora is None:
            from finetune.recipe import LoraConfig

            self.lora = LoraConfig()
        # What the recipe pins, checked against the capability table before anything is traced. A preview on
        # one GPU leaves the process count open (a sharded strategy is planned as it would run on more).
        self.cell = Cell.of(
            method=req.method, strategy=req.strategy, processes=self.world if req.for_run or self.world > 1 else None,
            tp=req.tp,
            precision=req.precision, optimizer=req.optimizer, offload=req.offload, compile=req.compile,
            attention=req.attn_implementation, packing=req.packed, checkpointing=req.checkpointing,
            lora=self.lora, prefix=req.prefix, quantization=req.quantization,
        )
        check(self.cell)
        # full, LoRA and QLoRA (the auto ladder) share LoRA's adapters; a pinned full run never reads lora:
        self.adapter = adapter_spec("lora" if req.method == "auto" else req.method, self.lora, req.prefix, req.adapter)
        self.inv: Inventory = build_inventory(req.config, req.source, self.adapter)
        self.resolve_tp()
        if req.attn_implementation == "sdpa" and not _supports_sdpa(req.config):
            self.req = replace(req, attn_implementation="eager")
            self.say(
                f"{type(req.config).__name__.replace('Config', '')} has no sdpa attention in transformers: planned "
                "with eager attention (set model.attn_implementation: eager in the recipe to train it)."
            )
        if req.attn_implementation == "flex_attention" and not _supports_sdpa(req.config, "_supports_flex_attn"):
            raise UserError(
                f"model.attn_implementation: {type(req.config).__name__.replace('Config', '')} has no flex attention "
                "in transformers; use sdpa (packed rows then carry a T x T mask)"
            )
        self.profiles: dict[tuple[int, TraceSpec], ActivationProfile] = {}

    # -- pieces -------------------------------------------------------------------------------------------
    def exec_spec(self, method: str, strategy: str, ac: bool, world: int | None = None, tp: int = 1) -> ExecSpec:
        """How ``method`` under ``strategy`` stores and computes each tensor (what the trainer will build)."""
        return execution_spec(
            method, strategy, self.precision, checkpointing=ac, world_size=world or self.world,
            model_dtype=self.req.model_dtype, quantization=self.req.quantization, lora=self.lora,
            prefix=self.req.prefix, adapter=self.req.adapter, tp=tp, compile=self.req.compile,
            optimizer=self.req.optimizer, offload=self.req.offload,
        )

    def inventory(self, tp: int) -> Inventory:
        """One TP rank's parameters (the whole model's at tp 1)."""
        if tp == 1:
            return self.inv
        return build_inventory(tp_config(self.req.config, tp), self.req.source, self.adapter)

    def profile(self, spec: ExecSpec) -> ActivationProfile:
        trace = TraceSpec.of(
            spec, seq_len=self.req.seq_len, packed=self.req.packed,
            attn_implementation=self.req.attn_implementation, device=self.hw.device,
        )
        key = (spec.tp, trace)
        if key not in self.profiles:  # one TP rank's activations: the block traced at its sharded shapes
            self.profiles[key] = activation_profile(tp_config(self.req.config, spec.tp), trace)
        return self.profiles[key]

    def evaluate(
        self, method: str, strategy: str, mbs: int, ac: bool, table_only: bool = False, first_step: bool = False,
        tp: int = 1,
    ) -> Candidate:
        world = 1 if strategy == "single" else self.world
        dp = world // tp
        accum = max(1, self.global_batch // (mbs * dp))
        spec = self.exec_spec(method, strategy, ac, world, tp)
        inv = self.inventory(tp)
        setup = Setup(spec, mbs, accum, dp, self.hw.device, spec.optimizer)
        states, comm = candidate_memory(inv, None, setup)
        note = ""
        if states.total > self.hw.memory_bytes:
            mem = states
            note = "model states alone exceed the memory (activations not traced)"
        elif table_only and not any(
            t == tp and k.method == method and k.checkpointing == ac for t, k in self.profiles
        ):
            mem = states
            note = "activations not traced (the walk did not need this method)"
        else:
            mem, comm = candidate_memory(inv, self.profile(spec), setup, first_step)
        tp_comm = tp_comm_bytes(
            self.req.config, tp, seq_len=self.req.seq_len, micro_batch_size=mbs, grad_accum_steps=accum,
            compute_bytes=spec.compute_bytes, checkpointing=ac,
        )
        secs = (comm / self.hw.bandwidth if comm else 0.0) + tp_comm / self.intra_node_bandwidth
        return Candidate(
            method=Method(method), strategy=Strategy(strategy), precision=Precision(self.precision),
            micro_batch_size=mbs, grad_accum_steps=accum, activation_checkpointing=ac, nproc=self.hw.gpus_per_node,
            nnodes=self.hw.nodes, memory=mem, comm_bytes_per_step=comm, comm_seconds_per_step=secs,
            fits=mem.total <= self.hw.memory_bytes and not note.startswith("activations not traced"), note=note,
            tp=tp, tp_comm_bytes_per_step=tp_comm, optimizer=spec.optimizer, offload=spec.offload,
        )

    @property
    def intra_node_bandwidth(self) -> float:
        """Bytes/s of the link inside a node, which TP's all-reduces use (NVLink when several nodes are given)."""
        from finetune.plan.hardware import INTERCONNECTS

        if self.hw.nodes == 1 or self.hw.device != "cuda":
            return self.hw.bandwidth
        return INTERCONNECTS["nvlink"]

    # -- tensor parallelism -------------------------------------------------------------------------------
    def resolve_tp(self) -> None:
        """``self.tp``: the pinned degree (checked, one sentence with the numbers when it cannot run), and
        ``self.tp_auto``: the degrees the walk may try when FSDP alone does not fit."""
        req, per_node = self.req, self.hw.gpus_per_node
        self.tp, self.tp_auto = 1, []
        if req.tp == "auto":
            if req.strategy in ("auto", "zero2", "fsdp") and self.world > 1:
                self.tp_auto = degrees(req.config, per_node)
            return
        tp = int(req.tp)
        if tp == 1:
            return
        what = "processes" if self.hw.device == "cpu" or req.for_run else "GPUs"
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
        dp = self.world // tp
        check(self.cell.with_(processes=self.world))  # ddp/zero1 cannot replicate TP over several replicas
        self.tp = tp
        cfg = req.config
        self.say(
            f"Tensor parallelism: tp {tp} as the recipe pins: each block's linears split over {tp} {what} of a node "
            f"({cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV heads, {cfg.intermediate_size} MLP "
            f"features -> {cfg.num_attention_heads // tp}, {cfg.num_key_value_heads // tp}, "
            f"{cfg.intermediate_size // tp} per rank), {dp} data-parallel replica(s)."
        )

    def tp_strategies(self, tp: int) -> list[str]:
        """Strategies over the data-parallel replicas of a TP run (none to choose with one replica)."""
        if self.req.strategy != "auto":
            return [self.req.strategy]
        return ["ddp"] if self.world // tp == 1 else ["zero2", "fsdp"]

    def try_tensor_parallel(self, method: str, mbs1: int, acs: list[bool], tried: list[Candidate]) -> Candidate | None:
        """The smallest TP degree (inside a node) under which ``method`` fits at micro-batch ``mbs1``."""
        if not self.tp_auto or all(self.refused(method, s, 2, say=False) for s in self.tp_strategies(2)):
            return None
        fsdp = [c for c in tried if c.method == method and c.strategy == "fsdp" and c.tp == 1]
        need = f" ({fmt_bytes(min(c.memory.total for c in fsdp))} at best)" if fsdp else ""
        self.say(
            f"{Method(method).title[0].upper() + Method(method).title[1:]} does not fit under FSDP alone at "
            f"micro-batch {mbs1}{need}: trying tensor parallelism inside a node, tp {', '.join(map(str, self.tp_auto))} "
            f"(never across nodes: its 4 all-reduces per block of micro-batch x {self.req.seq_len} x "
            f"{self.req.config.hidden_size} values need the intra-node link)."
        )
        cap = fmt_bytes(self.hw.memory_bytes)
        for tp in self.tp_auto:
            for ac in acs:
                parts = []
                for strategy in self.tp_strategies(tp):
                    if self.refused(method, strategy, tp, ac):
                        continue
                    c = self.evaluate(method, strategy, mbs1, ac, tp=tp)
                    tried.append(c)
                    text = self.describe(c, with_method=False)
                    if c.fits:
                        parts.append(f"{text}: fits (micro-batch {mbs1}, {self.req.seq_len} tokens)")
                        self.say(self.sentence(parts, ac and len(acs) > 1))
                        return c
                    parts.append(f"{text} > {cap}")
                self.say(self.sentence(parts, ac and len(acs) > 1))
        return None

    def say(self, text: str) -> None:
        self.walk.append(text)

    def refused(
        self, method: str, strategy: str, tp: int = 1, ac: bool | None = None, *, say: bool = True
    ) -> str | None:
        """The capability table's sentence when ``method`` under ``strategy`` x ``tp`` cannot run with the
        recipe's other settings (None: it can). With ``say``, said once in the walk the first time it rules out
        a candidate the walk considers (the table's extra rows and TP degrees it only probes stay silent)."""
        cell = self.cell.with_(
            method=method, strategy=strategy, tp=tp, processes=1 if strategy == "single" else self.cell.processes,
            checkpointing=self.cell.checkpointing if ac is None else ac,
            precision=getattr(self, "precision", None) or self.cell.precision,  # as resolved by the walk
        )
        found = first_refusal(cell)
        if found is None:
            return None
        text = str(found)
        if say and text not in self.walk_refusals:
            self.walk_refusals.add(text)
            self.say(f"{METHOD_NAMES[method][0].upper() + METHOD_NAMES[method][1:]} under {STRATEGY_NAMES[strategy]}"
                     f"{f' x tp {tp}' if tp > 1 else ''} is ruled out: {text}.")
        return text

    # -- the walk -----------------------------------------------------------------------------------------
    def resolve_precision(self) -> None:
        req, hw = self.req, self.hw
        if req.precision != "auto":
            self.precision = req.precision
            extra = ""
            if hw.device == "cuda" and req.precision.startswith("bf16") and not hw.bf16:
                extra = f" (pinned, but {hw.name} has no bf16 support: expect it to fail or run slowly)"
            self.say(f"Precision: {PRECISION_NAMES[self.precision]}, as the recipe pins{extra}.")
        elif hw.device == "cpu":
            self.precision = "fp32"
            self.say("Precision: fp32 (a CPU run).")
        elif hw.bf16:
            self.precision = "bf16"
            why = f"{hw.name} supports bf16" if hw.detected or hw.name in GPU_TYPES else "assumed a bf16 GPU (--gpu-type v100/t4 for older ones)"
            self.say(f"Precision: {PRECISION_NAMES['bf16']}: {why}.")
        else:
            self.precision = "fp16"
            self.say(f"Precision: {PRECISION_NAMES['fp16']}: {hw.name} has no bf16 (compute capability < 8.0).")

    def resolve_batch(self) -> None:
        g, w = self.req.global_batch_size, self.world // self.tp  # the ranks of a TP group share a batch slice
        if g % w:
            if self.req.for_run:
                raise UserError(
                    f"train.global_batch_size ({g}) must be a multiple of the number of processes ({w}); "
                    f"use e.g. {w * max(1, round(g / w))}"
                )
            new = w * (-(-g // w))
            self.say(f"The global batch {g} is not a multiple of {w} processes: planning for {new}.")
            g = new
        self.global_batch = g
        mbs = self.req.micro_batch_size
        if mbs is not None and g % (mbs * w):
            raise UserError(
                f"train.global_batch_size ({g}) must be divisible by micro_batch_size x "
                f"{'data-parallel replicas' if self.tp > 1 else 'processes'} ({mbs} x {w} = {mbs * w})"
            )

    def strategies(self) -> list[str]:
        if self.req.strategy != "auto":
            return [self.req.strategy]
        return ["single"] if self.world == 1 else ["ddp", "zero2", "fsdp"]

    def table_strategies(self) -> list[str]:
        if self.world == 1:
            return ["single"] if self.req.strategy in ("auto", "single") else [self.req.strategy]
        return ["ddp", "zero1", "zero2", "fsdp"]

    def methods(self) -> list[str]:
        return ["full", "lora", "qlora"] if self.req.method == "auto" else [self.req.method]

    def describe(self, c: Candidate, with_method: bool = True) -> str:
        head = f"{METHOD_NAMES[c.method]} under {c.label}" if with_method else c.label
        if c.note.startswith("model states alone"):
            return f"{head} needs {fmt_bytes(c.memory.total)} per GPU for the model states alone"
        return f"{head} needs {fmt_bytes(c.memory.total)} per GPU"

    @staticmethod
    def sentence(parts: list[str], checkpointing: bool) -> str:
        text = "; ".join(parts) + "."
        if checkpointing:
            return "With activation checkpointing, " + text
        return text[0].upper() + text[1:]

    def choose_method_and_strategy(self) -> tuple[Candidate | None, list[Candidate]]:
        mbs1 = self.req.micro_batch_size or 1
        acs = [False, True] if self.req.checkpointing is None else [self.req.checkpointing]
        if self.req.method != "auto" and not Method(self.req.method).recomputable:
            acs = [False]  # prefix tuning: checkpointed layers would drop the prefix (see Method.recomputable)
        cap = fmt_bytes(self.hw.memory_bytes)
        tried: list[Candidate] = []
        methods = self.methods()
        for mi, method in enumerate(methods):
            for ac in acs:
                parts = []
                for strategy in self.strategies() if self.tp == 1 else self.tp_strategies(self.tp):
                    if self.refused(method, strategy, self.tp, ac):
                        continue
                    c = self.evaluate(method, strategy, mbs1, ac, tp=self.tp)
                    tried.append(c)
                    text = self.describe(c, with_method=not parts)
                    if c.fits:
                        parts.append(f"{text}: fits (micro-batch {mbs1}, {self.req.seq_len} tokens)")
                        self.say(self.sentence(parts, ac and len(acs) > 1))
                        return c, tried
                    parts.append(f"{text} > {cap}")
                self.say(self.sentence(parts, ac and len(acs) > 1))
            found = self.try_tensor_parallel(method, mbs1, acs, tried)
            if found is not None:
                return found, tried
            if mi + 1 < len(methods):
                nxt = methods[mi + 1]
                sb = self.inv.storage(self.exec_spec(nxt, "single", False))
                targets = lora_targets(self.lora, self.req.config.model_type)
                targets = targets if isinstance(targets, str) else ", ".join(targets)
                base = ""
                if Method(nxt).quantized:  # 4-bit NF4 on the ladder; 8-bit only when quantization.bits pins it
                    q = self.exec_spec(nxt, "single", False).quant
                    assert q is not None
                    base = f"{q.quant_type.upper()} 4-bit" if q.bits == 4 else "LLM.int8 8-bit"
                    base = f" {base}"
                self.say(
                    f"{METHOD_NAMES[method][0].upper() + METHOD_NAMES[method][1:]} does not fit at micro-batch "
                    f"{mbs1} under any strategy: trying {METHOD_NAMES[nxt]} ({sb.trainable / 1e6:.1f}M trainable "
                    f"parameters, r={self.lora.r} on {targets},{base} base weights {fmt_bytes(sb.param_bytes)})."
                )
        return None, tried

    def largest_micro_batch(self, c: Candidate) -> Candidate:
        per_rank = self.global_batch // c.dp
        if self.req.micro_batch_size is not None:
            return c
        best = c
        for b in sorted(b for b in range(2, per_rank + 1) if per_rank % b == 0):
            cand = self.evaluate(c.method, c.strategy, b, c.activation_checkpointing, tp=c.tp)
            if not cand.fits:
                break
            best = cand
        ac = "on" if best.activation_checkpointing else "off"
        self.say(
            f"Largest micro-batch that fits at {self.req.seq_len} tokens: {best.micro_batch_size} "
            f"(activation checkpointing {ac}, {fmt_bytes(best.memory.total)} per GPU); gradient accumulation "
            f"{best.grad_accum_steps} keeps the global batch at {self.global_batch}."
        )
        return best

    def explain_comm(self, chosen: Candidate, table: list[Candidate]) -> None:
        if self.world == 1:
            return
        self.explain_tp_comm(chosen)
        by = {c.strategy: c for c in table if c.method == chosen.method and c.micro_batch_size == 1 and c.tp == 1}
        ddp, z2, fs = by.get("ddp"), by.get("zero2"), by.get("fsdp")
        if not (ddp and z2 and fs):
            return
        link = self.hw.interconnect

        def gb(c: Candidate) -> str:
            return f"{c.comm_bytes_per_step / 1e9:.2f} GB, {c.comm_seconds_per_step:.2f} s over {link}"

        if z2.comm_bytes_per_step <= 1.05 * ddp.comm_bytes_per_step:
            zero2 = (f"ZeRO-2 reduce-scatters gradients and all-gathers parameters, no more than that all-reduce "
                     f"(an all-reduce is a reduce-scatter plus an all-gather), so its memory saving is free ({gb(z2)})")
        else:
            zero2 = (f"ZeRO-2 sends more here ({gb(z2)}): FSDP2 all-gathers the frozen base weights too, while "
                     "DDP only all-reduces the small trainable gradients")
        self.say(
            f"Communication per GPU per step ({METHOD_NAMES[chosen.method]}): DDP all-reduces the gradients "
            f"({gb(ddp)}); {zero2}; FSDP all-gathers the parameters again in backward "
            f"({gb(fs)}, {fs.comm_bytes_per_step / max(1, z2.comm_bytes_per_step):.2f}x ZeRO-2)."
        )

    def explain_tp_comm(self, chosen: Candidate) -> None:
        if chosen.tp == 1:
            return
        link = self.hw.interconnect if self.hw.nodes == 1 else "nvlink (inside a node)"
        per_block = 6 if chosen.activation_checkpointing else 4
        self.say(
            f"Tensor parallelism (tp {chosen.tp}) all-reduces each block's attention and MLP outputs in forward and "
            f"their input gradients in backward ({per_block} per block per micro-batch"
            f"{', 2 of them for the recomputed forward' if chosen.activation_checkpointing else ''}, each "
            f"{chosen.micro_batch_size} x {self.req.seq_len} x {self.req.config.hidden_size} values): "
            f"{chosen.tp_comm_bytes_per_step / 1e9:.2f} GB per GPU per step, "
            f"{chosen.tp_comm_bytes_per_step / self.intra_node_bandwidth:.2f} s over {link}."
        )

    def at_seq_len(self, c: Candidate, seq: int) -> Candidate:
        """``c`` evaluated (traced) at ``seq`` tokens per sample instead of the request's."""
        req, profiles = self.req, self.profiles
        self.req, self.profiles = replace(req, seq_len=seq), {}
        try:
            return self.evaluate(c.method, c.strategy, c.micro_batch_size, c.activation_checkpointing, tp=c.tp)
        finally:
            self.req, self.profiles = req, profiles

    def shorter_sequences(self, tried: list[Candidate]) -> tuple[int, Candidate] | None:
        """The longest sequence length (a multiple of 64) at which one of ``tried`` fits, found by tracing.

        The candidate is the one whose other memory leaves activations the most room (not necessarily the
        smallest: at long sequences QLoRA's fp32 activations outgrow full fine-tuning's). Memory is not
        linear in the length (autocast weight copies do not grow; packed rows under sdpa carry a T x T mask),
        so the length is searched on traced totals: secant steps from the two longest, then false position
        inside the bracket, at most eight traces.
        """
        def room(m: Any) -> float:  # bytes left for activations; the overhead shrinks with them
            ctx, frag = (CUDA_CONTEXT_BYTES, FRAGMENTATION) if m.overhead else (0, 0.0)
            return (self.hw.memory_bytes - ctx) / (1 + frag) - (m.total - m.overhead - m.activations)

        cap, seq_len = self.hw.memory_bytes, self.req.seq_len
        options = [c for c in tried if c.memory.activations > 0 and room(c.memory) > 0]
        if not options or seq_len < 128:
            return None
        c = max(options, key=lambda o: room(o.memory) / o.memory.activations)
        over = [(seq_len, c.memory.total - cap)]  # (length, bytes over the cap), longest first
        best: tuple[int, Candidate, float] | None = None  # the longest length that fits
        t = max(64, seq_len // 2 // 64 * 64)
        for _ in range(8):
            found = self.at_seq_len(c, t)
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

    def nothing_fits(self, tried: list[Candidate]) -> Candidate:
        best = min(tried, key=lambda c: c.memory.total)
        cap = fmt_bytes(self.hw.memory_bytes)
        at_least = "at least " if best.note.startswith("model states alone") else ""
        advice = [f"Nothing fits in {cap} per GPU: the smallest option, {METHOD_NAMES[best.method]} under "
                  f"{STRATEGY_NAMES[best.strategy]} at micro-batch {best.micro_batch_size}, needs "
                  f"{at_least}{fmt_bytes(best.memory.total)}."]
        # more GPUs (sharded strategies only shrink with the world size)
        smallest = "fsdp" if self.req.strategy == "auto" else self.req.strategy
        method = best.method if self.req.method != "auto" else "qlora"
        if smallest in ("zero1", "zero2", "fsdp") or self.world == 1:
            strat = smallest if smallest != "single" else "fsdp"
            for k in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
                if k <= self.world:
                    continue
                saved = self.world, self.hw.gpus_per_node
                self.world, self.hw.gpus_per_node = k, k // self.hw.nodes or 1
                try:
                    ac = Method(method).recomputable if self.req.checkpointing is None else self.req.checkpointing
                    c = self.evaluate(method, strat, 1, ac)
                finally:
                    self.world, self.hw.gpus_per_node = saved
                if c.fits:
                    advice.append(f"{METHOD_NAMES[method]} under {STRATEGY_NAMES[strat]} would fit on {k} GPUs "
                                  f"({fmt_bytes(c.memory.total)} per GPU).")
                    break
        if self.req.method not in ("auto", "qlora"):
            q = self.evaluate("qlora", best.strategy, 1, best.activation_checkpointing)
            advice.append(f"QLoRA would need {fmt_bytes(q.memory.total)} per GPU ({'fits' if q.fits else 'still too much'}).")
        shorter = self.shorter_sequences(tried)
        if shorter is not None:
            seq, c = shorter
            ckpt = ", activation checkpointing on" if c.activation_checkpointing else ""
            advice.append(f"Shorter sequences would fit: {seq} tokens instead of {self.req.seq_len} "
                          f"({METHOD_NAMES[c.method]} under {STRATEGY_NAMES[c.strategy]}{ckpt}: "
                          f"{fmt_bytes(c.memory.total)} per GPU).")
        self.say(" ".join(advice))
        return best

    def run(self) -> Plan:
        self.resolve_precision()
        self.resolve_batch()
        chosen, tried = self.choose_method_and_strategy()
        if chosen is None:
            chosen = self.nothing_fits(tried)
        else:
            chosen = self.largest_micro_batch(chosen)
            pinned = self.pinned_keys()
            if pinned:
                self.say(f"Pinned by the recipe and checked: {', '.join(pinned)}.")
        if chosen.fits:
            self.plan_evaluation(chosen)
        table = self.table()
        self.explain_comm(chosen, table)
        def key(c: Candidate) -> tuple:
            return (c.method, c.strategy, c.micro_batch_size, c.activation_checkpointing, c.tp)

        rows = [chosen] + [c for c in table if key(c) != key(chosen)]
        execution = self.exec_spec(
            chosen.method, chosen.strategy, chosen.activation_checkpointing,
            1 if chosen.strategy == "single" else self.world, chosen.tp,
        )
        sb = self.inv.storage(execution)  # the whole model: what is built (before TP splits it) and saved
        model = {
            "source": self.req.source, "model_type": self.inv.model_type, "layers": self.inv.num_layers,
            "parameters": self.inv.n_params, "trainable": sb.trainable, "seq_len": self.req.seq_len,
            "global_batch_size": self.global_batch, "packed": self.req.packed,
            "checkpoint_bytes": self.checkpoint_size(chosen.method, sb),
        }
        hw = self.hw.to_dict()
        hw["world"] = self.world
        model["param_bytes"] = sb.param_bytes
        model["param_bytes_by_dtype"] = self.inv.bytes_by_dtype(execution)
        job = self.check_host_memory(rows)
        return Plan(
            chosen=chosen, candidates=rows, walk=self.walk, hardware=hw, model=model, execution=execution, job=job
        )

    def check_host_memory(self, rows: list[Candidate]) -> dict[str, Any]:
        """The whole job's figures (finetune/plan/job.py) of the chosen row (first); rows whose host memory per
        node exceeds ``hw.host_memory`` are marked as not fitting, with the reason in the walk."""
        from finetune.plan.job import host_peak_phase, job_figures

        chosen_job: dict[str, Any] = {}
        for i, c in enumerate(rows):
            world = 1 if c.strategy == "single" else self.world
            spec = self.exec_spec(c.method, c.strategy, c.activation_checkpointing, world, getattr(c, "tp", 1))
            per_node = 1 if c.strategy == "single" else self.hw.gpus_per_node
            job = job_figures(self.inv, spec, world, per_node, self.hw.device)
            if i == 0:
                chosen_job = job.to_dict()
            limit = self.hw.host_memory
            if limit and job.host_peak_per_node > limit and (c.fits or i == 0):
                c.fits = False
                phase = host_peak_phase(job.to_dict())[0]
                self.say(
                    f"{METHOD_NAMES[c.method]} under {STRATEGY_NAMES[c.strategy]} needs "
                    f"{fmt_bytes(job.host_peak_per_node)} of host memory per node ({phase}) but a node has "
                    f"{fmt_bytes(limit)} (--host-memory): it does not fit."
                )
        return chosen_job

    def plan_evaluation(self, c: Candidate) -> None:
        """The evaluation's peak at eval.batch_size (or the largest batch that fits, for auto) on ``c``."""
        from finetune.plan.evaluation import MAX_AUTO_EVAL_BATCH, eval_memory

        world = 1 if c.strategy == "single" else self.world
        execution = self.exec_spec(c.method, c.strategy, False, world, c.tp)
        spec = TraceSpec.of(
            execution, seq_len=self.req.seq_len, packed=False, attn_implementation=self.req.attn_implementation,
        )
        setup = Setup(execution, c.micro_batch_size, c.grad_accum_steps, c.dp, self.hw.device, execution.optimizer)
        cap = self.hw.memory_bytes
        # one TP rank's model; a single TP replica has no data-parallel wrapper (no DDP buckets)
        inv, config = self.inventory(c.tp), tp_config(self.req.config, c.tp)
        strategy = "single" if c.tp > 1 and c.dp == 1 else str(c.strategy)

        def at(batch: int) -> tuple[int, Any]:
            return eval_memory(inv, config, spec, strategy, setup, batch, self.req.eval_max_new_tokens)

        pinned = self.req.eval_batch_size
        if pinned is not None:
            total, peak = at(pinned)
        else:  # arithmetic on four cached traces: trying every batch costs nothing
            batch = next((b for b in range(MAX_AUTO_EVAL_BATCH, 0, -1) if at(b)[0] <= cap), 1)
            total, peak = at(batch)
        c.eval_batch_size, c.eval_memory = peak.batch_size, total
        how = "eval.batch_size" if pinned is not None else "eval.batch_size auto, the largest that fits"
        text = (
            f"Evaluation at {self.req.seq_len} tokens ({how}: {peak.batch_size}): {fmt_bytes(total)} per GPU "
            f"(loss forward {fmt_bytes(peak.loss)}, generating {self.req.eval_max_new_tokens} tokens with a KV cache "
            f"{fmt_bytes(peak.generation)}, beside the model states)"
        )
        if total > cap:
            fix = "set eval.batch_size: auto" if pinned is not None and at(1)[0] <= cap else (
                "lower eval.max_new_tokens or data.max_seq_len")
            text += f" > {fmt_bytes(cap)}: the run would fail at its first evaluation; {fix}"
        self.say(text + ".")

    def pinned_keys(self) -> list[str]:
        """The recipe keys the walk took as given instead of choosing them (named as in the recipe)."""
        r = self.req
        given = (
            ("method", r.method != "auto"),
            ("distributed.strategy", r.strategy != "auto"),
            ("precision", r.precision != "auto"),
            ("train.micro_batch_size", r.micro_batch_size is not None),
            ("train.activation_checkpointing", r.checkpointing is not None),
        )
        return [key for key, pinned in given if pinned]

    def checkpoint_size(self, method: str, sb: Any) -> int:
        """Bytes of one checkpoint of ``method``: the saved weights (all of them for full fine-tuning, the
        fp32 adapters otherwise) and AdamW's two moments per trainable parameter (what the trainer writes)."""
        from finetune.units import checkpoint_bytes

        weights = method_type(method)().saved_weight_bytes(sb.param_bytes, sb.trainable)
        return checkpoint_bytes(weights, sb.trainable)

    def table(self) -> list[Candidate]:
        out = []
        mbs1 = self.req.micro_batch_size or 1
        ac = bool(self.req.checkpointing)
        for method in self.methods():
            if self.tp == 1:
                for strategy in self.table_strategies():
                    if not self.refused(method, strategy, 1, ac, say=False):
                        out.append(self.evaluate(method, strategy, mbs1, ac, table_only=True))
            for tp in [self.tp] if self.tp > 1 else self.tp_auto:
                for strategy in self.tp_strategies(tp):
                    if not self.refused(method, strategy, tp, ac, say=False):
                        out.append(self.evaluate(method, strategy, mbs1, ac, table_only=True, tp=tp))
        return out


def make_plan(req: Request, hw: Hardware) -> Plan:
    """Walk the flowchart for ``req`` on ``hw``; every step is recorded in ``Plan.walk``."""
    return _Planner(req, hw).run()
