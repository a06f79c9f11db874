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
5. The largest micro-batch that fits (under a pipeline, the one with the shortest predicted step), and gradient
   accumulation that keeps the recipe's global batch.
Where several strategies fit at the same step, the predicted time per step breaks the tie.
Everything the recipe pins is respected and checked. Every step is recorded as a typed
:mod:`finetune.plan.walk` step with the numbers that decided it; the request and hardware are never changed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

from finetune.errors import UserError
from finetune.model.methods import method_type
from finetune.plan import walk as w
from finetune.plan.candidates import evaluate, evaluation_passes, plan_evaluation, rollout_phase, step_seconds
from finetune.plan.hardware import INTERCONNECTS, Hardware, detect_hardware
from finetune.plan.memory import FRAGMENTATION, overhead_parts
from finetune.plan.pipeline import microbatch_problem, pipeline_note
from finetune.plan.request import Request, request_from_recipe
from finetune.plan.setting import Setting, settle
from finetune.plan.shapes import lora_targets, moe_summary
from finetune.plan.types import (
    Candidate,
    Config,
    HardwareFacts,
    JobFacts,
    MemoryBreakdown,
    ModelFacts,
    Plan,
    Status,
)
from finetune.recipe.schema import LoadedRecipe
from finetune.spec import ExecSpec, Method, Precision, Strategy

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






def plan_for_run(loaded: LoadedRecipe, *, nproc: int, nnodes: int, device: str) -> Plan:
    """The plan the trainer executes for ``nproc`` x ``nnodes`` processes on ``device`` ("cuda" or "cpu")."""
    req = replace(request_from_recipe(loaded), for_run=True)
    hw = replace(detect_hardware(device=device, gpus=nproc, nodes=nnodes, nproc=nproc), gpus_per_node=nproc)
    return make_plan(req, hw)


def chosen_stage_memory(
    loaded: LoadedRecipe, plan: Plan, *, device: str, first_step: bool = False, seq_len: int | None = None
) -> list[MemoryBreakdown]:
    """Every pp rank's predicted peak of ``plan.chosen`` as :func:`chosen_memory` predicts the worst one's
    (one entry without a pipeline)."""
    c = _chosen_candidate(loaded, plan, device=device, first_step=first_step, seq_len=seq_len)
    return list(c.stage_memory) or [c.memory]


def chosen_memory(
    loaded: LoadedRecipe, plan: Plan, *, device: str, first_step: bool = False, seq_len: int | None = None
) -> MemoryBreakdown:
    """Predicted peak of ``plan.chosen`` (the first optimizer step's with ``first_step``: AdamW's state does
    not exist yet during its forward and backward), at ``seq_len`` tokens per row instead of
    ``data.max_seq_len`` when given: the trainer pads each micro-batch to its longest row, so a run on short
    rows is compared with the prediction at the width that ran."""
    return _chosen_candidate(loaded, plan, device=device, first_step=first_step, seq_len=seq_len).memory


def _rollout_step(s: Setting, c: Candidate) -> w.RolloutPlanned:
    """grpo's rollouts on ``c``: the plan's rollout memory, and their share of the step's predicted seconds
    (``time.rollout``: finetune/plan/rollout.py's rollout_seconds)."""
    rows = c.micro_batch_size * c.grad_accum_steps
    seconds = c.time.rollout if c.time is not None and c.time.rollout else None
    return w.RolloutPlanned(rows, s.req.completion_len, c.memory.rollout, seconds)


def chosen_phase_memory(loaded: LoadedRecipe, plan: Plan, *, device: str) -> dict[str, int]:
    """Predicted tensors of ``plan.chosen`` in the phases around the steps, each at its own peak (without the
    runtime overhead, as a run's measurement counts them): ``evaluation`` (the eval loss) and ``generation`` at
    the planned eval batch, and ``checkpoint``, the states a save finds (parameters and optimizer state; the
    gradients are gone, and the save copies to host memory one tensor at a time); for grpo ``rollout``, the
    first step's sampling and scoring (finetune/plan/candidates.py's rollout_phase: the parameters and
    buffers, no gradients nor optimizer state yet)."""
    c = plan.chosen
    s = _chosen_setting(loaded, plan, device=device)
    phases = dict(evaluation_passes(s, c)) if c.eval_batch_size else {}
    phases["checkpoint"] = c.memory.params + c.memory.optimizer
    if s.req.completion_len:  # grpo
        phases["rollout"] = rollout_phase(s, c)
    return phases


def _chosen_setting(loaded: LoadedRecipe, plan: Plan, *, device: str, seq_len: int | None = None) -> Setting:
    c = plan.chosen
    req = replace(request_from_recipe(loaded), for_run=True)
    if seq_len is not None:
        req = replace(req, seq_len=seq_len)
    hw = detect_hardware(device=device, gpus=c.nproc, nodes=c.nnodes, nproc=c.nproc)
    s = replace(settle(req, hw), precision=str(c.precision), global_batch=c.micro_batch_size * c.grad_accum_steps * c.dp)
    if c.pp > 1 and c.pp_layers:  # the plan's own split (the walk may have balanced it by memory)
        s = replace(s, pp=c.pp, pp_layers=tuple(c.pp_layers))
    return s


def _chosen_candidate(
    loaded: LoadedRecipe, plan: Plan, *, device: str, first_step: bool = False, seq_len: int | None = None
) -> Candidate:
    c = plan.chosen
    s = _chosen_setting(loaded, plan, device=device, seq_len=seq_len)
    return evaluate(s, c.config, first_step=first_step)






















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
    job: JobFacts

    @property
    def walk(self) -> list[str]:
        """The walk in sentences."""
        return [step.render() for step in self.steps]

    def plan(self) -> Plan:
        """The :class:`Plan` (the trainer's contract) of this decision."""
        s, chosen = self.setting, self.chosen
        sb = s.inv.storage(self.execution)  # the whole model: what is built (before TP splits it) and saved
        model: ModelFacts = {
            "source": s.req.source, "model_type": s.inv.model_type, "layers": s.inv.num_layers,
            "parameters": s.inv.n_params, "trainable": sb.trainable, "seq_len": s.req.seq_len,
            "global_batch_size": s.global_batch, "packed": s.req.packed,
            "checkpoint_bytes": _checkpoint_size(chosen.method, sb, self.execution.optimizer),
            "param_bytes": sb.param_bytes, "param_bytes_by_dtype": s.inv.bytes_by_dtype(self.execution),
            # the attention the architecture needs when it has no sdpa (gpt-oss's sinks): eager, said in the run header
            "attention_for_architecture": not s.inv.sdpa and self.execution.attention == "eager",
        }
        experts = expert_counts(s.inv, self.execution)
        if experts:
            model["experts"] = experts
        if s.inv.moe is not None:
            model.update(moe_summary(s.inv, self.execution))
        hw = cast(HardwareFacts, {**s.hw.to_dict(), "world": s.world})
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

    def refused(self, config: Config, *, say: bool = True) -> bool:
        """Whether the capability table refuses ``config``; the first time a sentence rules out a candidate the
        walk considers, it is said (and the refused candidate kept with why)."""
        text = self.s.refusal(config)
        if text is None:
            return False
        if say and text not in self.said:
            self.said.add(text)
            self.log.append(w.RuledOut(config.method, config.strategy, config.tp, text))
            self.tried.append(_refused(self.s, config, text))
        return True

    def attempt(
        self, config: Config, strategies: list[str], clause: bool, *, with_method: bool = True, setting: str = "",
        say: bool = True,
    ) -> Candidate | None:
        """``config`` under each of ``strategies`` in order (its tp, checkpointing and state fixed). The first
        that fits is the answer, unless a later one that also fits is predicted faster by more than
        :data:`TIME_MARGIN` (every strategy after the first fit is evaluated for that); the sentence lists
        the attempts up to the first fit."""
        method, mbs = config.method, config.micro_batch_size
        attempts: list[w.Attempt] = []
        fitting: list[Candidate] = []
        for strategy in strategies:
            tried = config.with_(strategy=strategy)
            if self.refused(tried, say=not fitting):
                continue
            c = self.host_checked(evaluate(self.s, tried))
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
        first, best = fitting[0], min(fitting, key=step_seconds)
        if best is not first and step_seconds(best) < (1 - TIME_MARGIN) * step_seconds(first):
            self.log.append(w.FasterChoice(_label(best), step_seconds(best), _label(first), step_seconds(first)))
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


def _refused(s: Setting, config: Config, why: str) -> Candidate:
    optimizer = config.optimizer or (s.req.optimizer if s.req.optimizer != "auto" else "adamw")
    offload = config.offload or (s.req.offload if s.req.offload != "auto" else "none")
    return Candidate(
        method=Method(config.method), strategy=Strategy(config.strategy), precision=Precision(s.precision),
        micro_batch_size=1, grad_accum_steps=1, activation_checkpointing=config.activation_checkpointing,
        nproc=s.hw.gpus_per_node, nnodes=s.hw.nodes, status=Status.REFUSED, why=why, tp=config.tp,
        optimizer=optimizer, offload=offload, pp=config.pp,
    )


def _label(c: Candidate) -> str:
    return c.label


def _host_peak(s: Setting, c: Candidate) -> tuple[int, str]:
    """The whole job's host memory per node of ``c`` and the phase that peaks."""
    from finetune.plan.job import host_peak_phase, job_figures, weights_itemsize

    world = 1 if c.strategy == "single" else s.world
    spec = s.exec_spec(c.method, c.strategy, c.activation_checkpointing, world, c.tp, c.optimizer, c.offload, pp=c.pp)
    per_node = 1 if c.strategy == "single" else s.hw.gpus_per_node
    job = job_figures(
        s.inv, spec, world, per_node, s.hw.device, weights_itemsize=weights_itemsize(s.req.config), step=c.memory
    )
    return job.host_peak_per_node, host_peak_phase(job.to_dict())[0]


def _strategies(s: Setting) -> list[str]:
    if s.req.strategy != "auto":
        return [s.req.strategy]
    return ["single"] if s.world == 1 else ["ddp", "zero2", "fsdp", *_hybrid(s)]


def _hybrid(s: Setting) -> list[str]:
    """hsdp on several nodes (after fsdp: it holds more per GPU, and is chosen when predicted faster)."""
    return ["hsdp"] if s.hw.nodes > 1 else []


def _tp_strategies(s: Setting, tp: int, pp: int = 1) -> list[str]:
    """Strategies over the data-parallel replicas of a TP or PP run (none to choose with one replica)."""
    if s.req.strategy != "auto":
        return [s.req.strategy]
    return ["ddp"] if s.world // (tp * pp) == 1 else ["zero2", "fsdp"]


def _table_strategies(s: Setting) -> list[str]:
    if s.world == 1:
        return ["single"] if s.req.strategy in ("auto", "single") else [s.req.strategy]
    return ["ddp", "zero1", "zero2", "fsdp", *_hybrid(s)]


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
    strategies = _strategies(s) if s.tp == 1 and s.pp == 1 else _tp_strategies(s, s.tp, s.pp)
    for ac in acs:
        if offload == "parameters":
            strategies = [x for x in strategies if x in ("zero2", "fsdp")]
        config = Config(method, "", mbs1, ac, s.tp, s.pp, optimizer, offload)
        found = wk.attempt(config, strategies, ac and len(acs) > 1, setting=setting, say=say)
        if found is not None:
            return found
    return None


def _try_tensor_parallel(wk: _Walk, method: str, mbs1: int, acs: list[bool]) -> Candidate | None:
    """The smallest TP degree (inside a node) under which ``method`` fits at micro-batch ``mbs1``."""
    s = wk.s
    if not s.tp_auto or all(
        wk.refused(Config(method, x, mbs1, acs[0], tp=2), say=False) for x in _tp_strategies(s, 2)
    ):
        return None
    fsdp = [c for c in wk.tried if c.method == method and c.strategy == "fsdp" and c.tp == 1 and c.memory.total]
    wk.log.append(w.TryTensorParallel(
        method, mbs1, min(c.memory.total for c in fsdp) if fsdp else None, s.tp_auto, s.req.seq_len,
        s.req.config.hidden_size,
    ))
    for tp in s.tp_auto:
        for ac in acs:
            config = Config(method, "", mbs1, ac, tp)
            found = wk.attempt(config, _tp_strategies(s, tp), ac and len(acs) > 1, with_method=False)
            if found is not None:
                return found
    return None


def _try_pipeline(wk: _Walk, method: str, mbs1: int, acs: list[bool]) -> Candidate | None:
    """``distributed.pp: auto``: the fewest pipeline stages (across nodes), then the smallest TP degree (inside a
    node), under which ``method`` fits at micro-batch ``mbs1``, the strategy over the remaining data-parallel
    ranks; checkpointing only when a layout does not fit without it."""
    s = wk.s
    if not s.pp_auto:
        return None
    tps = (s.tp,) if s.tp > 1 else (1, *s.tp_auto)
    sized = [c for c in wk.tried if c.method == method and c.memory.total and c.status is not Status.REFUSED]
    wk.log.append(w.TryPipeline(
        method, mbs1, min(c.memory.total for c in sized) if sized else None, s.pp_auto, tps, s.pp_schedule,
        s.inv.num_layers,
    ))
    attempts: list[w.PipelineAttempt] = []
    found: Candidate | None = None
    for pp in s.pp_auto:
        for tp in tps:
            if s.world % (pp * tp):
                continue
            dp = s.world // (pp * tp)
            problem = microbatch_problem(s.pp_schedule, pp, max(1, s.global_batch // (mbs1 * dp)))
            if problem:
                attempts.append(w.PipelineAttempt(pp, tp, dp, "", False, 0, False, problem.split("; ")[0]))
                continue
            tried: list[Candidate] = []
            for ac in acs:
                config = Config(method, "", mbs1, ac, tp, pp)
                found = wk.attempt(config, _tp_strategies(s, tp, pp), False, say=False)
                tried += [c for c in wk.tried[-2:] if c.pp == pp and c.tp == tp and c.activation_checkpointing == ac]
                if found is not None:
                    break
            # the layout's smallest traced total (a states-only figure is a lower bound: last resort)
            best = found or min(tried, key=lambda c: (c.status is Status.STATES_OVER, c.memory.total), default=None)
            if best is not None:
                attempts.append(w.PipelineAttempt(
                    pp, tp, dp, best.label, best.activation_checkpointing, best.memory.total, best.fits,
                    states_only=best.status is Status.STATES_OVER,
                ))
            if found is not None:
                break
        if found is not None:
            break
    closest, in_flight_n = None, 0
    traced = [c for c in wk.tried if c.pp > 1 and c.stage_memory and c.status is Status.OVER]
    if found is None and traced:
        from finetune.plan.pipeline import in_flight

        near = min(traced, key=lambda c: c.memory.total)
        rank = max(range(near.pp), key=lambda r: near.stage_memory[r].total)
        m = near.stage_memory[rank]
        closest = (rank, m.params + m.grads + m.optimizer, m.activations, m.buffers, m.overhead)
        in_flight_n = in_flight(near.pp_schedule, near.pp, max(1, len(near.pp_layers) // near.pp),
                                near.grad_accum_steps, rank)
    wk.log.append(w.PipelineTried(tuple(attempts), s.capacity, closest, in_flight_n))
    if found is None:  # the layouts are said above; what follows (the advice) weighs the others
        wk.tried = [c for c in wk.tried if c.pp == 1]
    return found


def _pipeline_layout(s: Setting, c: Candidate) -> w.PipelineLayout:
    """The step that says how the chosen pipeline runs (finetune/plan/pipeline.py's figures)."""
    from finetune.plan.pipeline import boundaries_across_nodes, bubble_fraction, in_flight

    v = max(1, len(c.pp_layers) // c.pp)
    by_memory = s.pp_layers is None and tuple(c.pp_layers) != s.pp_split(c.pp, c.tp)
    settings: list[str] = []
    if s.pp == 1:  # the walk chose the pipeline: what the recipe sets to run it
        settings += [f"distributed.pp: {c.pp}", *([f"distributed.tp: {c.tp}"] if c.tp > 1 else [])]
        settings += [f"distributed.strategy: {c.strategy}"]
        if by_memory:
            settings.append(f"distributed.pp_layers: {list(c.pp_layers)}")
        if s.req.packed:
            settings.append("data.packing: false")
    crossing = boundaries_across_nodes(c.pp, s.world, s.hw.gpus_per_node)
    link = s.hw.interconnect if crossing else ("nvlink (inside a node)" if s.hw.device == "cuda" else s.hw.interconnect)
    bandwidth = s.hw.bandwidth if crossing else s.intra_node_bandwidth
    return w.PipelineLayout(
        pp=c.pp, tp=c.tp, dp=c.dp, schedule=c.pp_schedule, layers=tuple(c.pp_layers),
        microbatches=c.grad_accum_steps,
        in_flight=tuple(in_flight(c.pp_schedule, c.pp, v, c.grad_accum_steps, r) for r in range(c.pp)),
        stage_totals=tuple(m.total for m in c.stage_memory),
        bubble_fraction=bubble_fraction(c.pp_schedule, c.pp, v, c.grad_accum_steps),
        p2p_bytes=c.pp_comm_bytes_per_step, p2p_seconds=c.pp_comm_bytes_per_step / bandwidth, link=link,
        crossing=crossing, by_memory=by_memory, settings=tuple(settings),
    )


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
        found = (_try_method(wk, method, mbs1, acs) or _try_tensor_parallel(wk, method, mbs1, acs)
                 or _try_pipeline(wk, method, mbs1, acs))
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
        smaller = best.config.with_(optimizer=optimizer, offload=offload)
        same = best if wk.refused(smaller, say=False) else evaluate(s, smaller)
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
    """Step 5: the largest micro-batch that fits (a divisor of each rank's share of the global batch); under a
    pipeline, the one whose predicted step is the shortest (smaller ones make more micro-batches, a smaller
    bubble)."""
    s = wk.s
    per_rank = s.global_batch // c.dp
    if s.req.micro_batch_size is not None:
        return c
    fitting = [c]  # the micro-batches that fit, smallest first
    for b in sorted(b for b in range(2, per_rank + 1) if per_rank % b == 0):
        if c.pp > 1 and microbatch_problem(c.pp_schedule, c.pp, per_rank // b):
            break  # fewer micro-batches than the schedule needs (more would only come from smaller ones)
        cand = evaluate(s, c.config.with_(micro_batch_size=b))
        if not cand.fits:
            break
        fitting.append(cand)
    best = fitting[-1]
    if c.pp > 1 and all(f.time is not None for f in fitting):
        # a pipeline's bubble shrinks with more, smaller micro-batches: the fastest step, the larger on a tie
        fastest = min(reversed(fitting), key=lambda f: f.time.step if f.time else 0.0)
        if fastest is not best and best.time is not None and fastest.time is not None:
            wk.log.append(w.PipelineMicroBatch(
                s.req.seq_len, fastest.micro_batch_size, fastest.activation_checkpointing, fastest.memory.total,
                fastest.grad_accum_steps, s.global_batch, fastest.time.step, fastest.time.bubble,
                best.micro_batch_size, best.time.step, best.time.bubble,
            ))
            return fastest
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
    def room(m: MemoryBreakdown) -> float:  # bytes left for activations; the overhead's slack shrinks with them
        slack, fixed = overhead_parts(m.overhead, m.total - m.overhead)  # fixed: the CUDA context, NCCL's buffers
        frag = FRAGMENTATION if slack else 0.0
        return (s.capacity - fixed) / (1 + frag) - (m.total - m.overhead - m.activations)

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
        found = evaluate(s.at_seq_len(t), c.config)
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
    if smallest in ("zero1", "zero2", "fsdp", "hsdp") or s.world == 1:  # sharded strategies shrink with the world
        strat = smallest if smallest != "single" else "fsdp"
        ac = Method(method).recomputable if s.req.checkpointing is None else s.req.checkpointing
        for k in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            if k <= s.world:
                continue
            c = evaluate(s.on_gpus(k), Config(method, strat, 1, ac, optimizer=best.optimizer, offload=best.offload))
            if c.fits:
                advice.append(f"{w.method_name(method)} under {w.strategy_name(strat)} would fit on {k} GPUs "
                              f"({w.fmt_bytes(c.memory.total)} per GPU).")
                break
    if s.req.method not in ("auto", "qlora"):
        q = evaluate(s, Config("qlora", best.strategy, 1, best.activation_checkpointing))
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
            s.req.sequence_parallel,
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

        out.append(w.Communication(chosen.method, s.hw.interconnect, link_of(ddp), link_of(z2), link_of(fs),
                                   z2.grad_accum_steps))
    hs = by.get(Strategy.HSDP)
    if hs is not None:
        out.append(w.HybridCommunication(
            chosen.method, s.hw.nodes, s.hw.gpus_per_node, "nvlink" if s.hw.device == "cuda" else s.hw.interconnect,
            s.hw.interconnect, w.Link(hs.comm_intra_node_bytes_per_step, hs.comm_intra_node_seconds_per_step),
            w.Link(hs.comm_inter_node_bytes_per_step, hs.comm_inter_node_seconds_per_step),
            w.Link(fs.comm_bytes_per_step, fs.comm_seconds_per_step or 0.0) if fs is not None else None,
        ))
    return out


def _table(s: Setting, traced: frozenset[tuple[str, bool, int]]) -> list[Candidate]:
    """Every method x strategy (x TP degree) at micro-batch 1, for the table (refused cells left out)."""
    mbs1 = s.req.micro_batch_size or 1
    ac = bool(s.req.checkpointing)
    configs: list[Config] = []
    for method in _methods(s):
        if s.tp == 1:
            configs += [Config(method, strategy, mbs1, ac) for strategy in _table_strategies(s)]
        for tp in [s.tp] if s.tp > 1 else s.tp_auto:
            if s.pp > 1:
                break
            configs += [Config(method, strategy, mbs1, ac, tp) for strategy in _tp_strategies(s, tp)]
        if s.pp > 1:  # the pinned pipeline
            configs += [Config(method, strategy, mbs1, ac, s.tp, s.pp) for strategy in _tp_strategies(s, s.tp, s.pp)]
    return [evaluate(s, c, traced=traced) for c in configs if not s.refusal(c)]


def _check_host_memory(s: Setting, rows: list[Candidate]) -> tuple[list[Candidate], JobFacts, list[w.Step]]:
    """The whole job's figures (finetune/plan/job.py) of the chosen row (first); rows whose host memory per
    node exceeds ``hw.host_memory`` do not fit, with the reason in the walk."""
    from finetune.plan.job import host_peak_phase, job_figures, weights_itemsize

    out: list[Candidate] = []
    steps: list[w.Step] = []
    chosen_job = JobFacts()
    for i, c in enumerate(rows):
        world = 1 if c.strategy == "single" else s.world
        spec = s.exec_spec(
            c.method, c.strategy, c.activation_checkpointing, world, c.tp, c.optimizer, c.offload, pp=c.pp
        )
        per_node = 1 if c.strategy == "single" else s.hw.gpus_per_node
        job = job_figures(
            s.inv, spec, world, per_node, s.hw.device, weights_itemsize=weights_itemsize(s.req.config), step=c.memory
        )
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


def expert_counts(inv: Any, spec: ExecSpec) -> dict[str, int]:
    """A mixture's fused expert weights under ``spec`` (empty for a model without them): how many tensors
    (over all layers) and values they hold, how many the method adapts (LoRA's per-expert A/B) and stores in
    NF4 (QLoRA 4-bit), and the bytes they are stored in."""
    from finetune.plan.shapes import quantized_under

    fused = [t for t in inv.base if t.experts]
    if not fused:
        return {}
    def times(t: Any) -> int:
        return inv.copies(t)

    adapted = sum(times(t) for t in inv.adapters if ".experts.lora_A." in t.name) if spec.method.adapters else 0
    return {
        "tensors": sum(times(t) for t in fused),
        "values": sum(t.numel * times(t) for t in fused),
        "adapted": adapted,
        "quantized": sum(times(t) for t in fused if quantized_under(spec, t)),
        "stored_bytes": sum(inv.base_bytes(spec, t) * times(t) for t in fused),
    }


def _adapter_storage(s: Setting, c: Candidate) -> w.AdapterStorage:
    """What LoRA's adapters cost in their dtype (lora.dtype) and would in the other (the plan says both)."""
    from finetune.plan.memory import optimizer_state_bytes

    spec = s.exec_spec(c.method, c.strategy, c.activation_checkpointing, 1 if c.strategy == "single" else s.world,
                       c.tp, c.optimizer, c.offload, pp=c.pp)
    sb = s.inv.storage(spec)

    def cost(value_bytes: int) -> int:
        return 2 * sb.trainable * value_bytes + optimizer_state_bytes(s.inv, True, spec.optimizer, value_bytes)

    other = 2 if spec.trainable_bytes == 4 else 4
    return w.AdapterStorage(spec.trainable_dtype, sb.trainable, cost(spec.trainable_bytes), cost(other),
                            spec.compute_dtype)


def _checkpoint_size(method: str, sb: Any, optimizer: str) -> int:
    """Bytes of one checkpoint of ``method``: the saved weights (all of them for full fine-tuning, the
    adapters as stored otherwise) and the optimizer's two moments per trainable parameter (what the trainer
    writes: AdamW's in the trained values' dtype, the 8-bit optimizers' in fp32)."""
    from finetune.units import checkpoint_bytes

    weights = method_type(method)().saved_weight_bytes(sb.param_bytes, sb.trainable, sb.param_dtype_bytes)
    return checkpoint_bytes(weights, sb.trainable, sb.param_dtype_bytes if optimizer == "adamw" else 4)


def _key(c: Candidate) -> tuple[Any, ...]:
    return (c.method, c.strategy, c.micro_batch_size, c.activation_checkpointing, c.tp, c.optimizer, c.offload, c.pp)


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
    if chosen.pp > 1:
        _check_microbatches(chosen, log)
        if chosen.stage_memory:
            log.append(_pipeline_layout(s, chosen))
    if chosen.fits:
        chosen, step = plan_evaluation(s, chosen)
        log.append(step)
    if s.req.completion_len and chosen.fits:  # grpo
        log.append(_rollout_step(s, chosen))
    if chosen.time is not None and chosen.fits:
        t = chosen.time
        log.append(w.Timing(t.step, t.compute, t.communication, t.offload, t.utilisation, t.peak_flops / 1e12,
                            t.steps, t.job, t.bubble, t.bubble / (t.compute + t.bubble) if t.bubble else 0.0))
    if chosen.method in ("lora", "qlora"):
        log.append(_adapter_storage(s, chosen))
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
        pp=rows[0].pp, pp_layers=rows[0].pp_layers or None,
    )
    return Decision(
        setting=s, chosen=rows[0], rows=tuple(rows), tried=tuple(wk.tried), steps=tuple(log), execution=execution,
        job=job,
    )


def _check_microbatches(c: Candidate, log: list[w.Step]) -> None:
    """The pipeline's micro-batches (gradient accumulation steps) against its schedule: an error when the
    schedule cannot run them, a note when GPipe mostly idles (finetune/plan/pipeline.py)."""
    problem = microbatch_problem(c.pp_schedule, c.pp, c.grad_accum_steps)
    if problem:
        raise UserError(problem)
    note = pipeline_note(c.pp_schedule, c.pp, c.grad_accum_steps)
    if note:
        log.append(w.Note(note))


def make_plan(req: Request, hw: Hardware) -> Plan:
    """Walk the flowchart for ``req`` on ``hw``; every step is recorded in ``Plan.walk``."""
    return decide(req, hw).plan()
