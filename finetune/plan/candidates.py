"""One configuration's figures: per-GPU memory (finetune/plan/memory.py), communication, host traffic and
predicted time, as a :class:`~finetune.plan.types.Candidate` with its status; and the evaluation's peak on it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from finetune.plan import walk as w
from finetune.plan.activations import TraceSpec
from finetune.plan.expert_parallel import all_to_all_bytes, dispatch_buffer_bytes, is_expert_tensor
from finetune.plan.memory import (
    Setup,
    boundary_bytes_per_row,
    candidate_memory,
    hybrid_traffic,
    nccl_bytes,
    pipeline_stages,
    stage_memory,
    unsharded_bytes,
)
from finetune.plan.pipeline import boundaries_across_nodes, memory_balanced_split
from finetune.plan.rollout import rollout_bytes, rollout_parts, rollout_seconds
from finetune.plan.setting import Setting
from finetune.plan.shapes import Inventory
from finetune.plan.tensor_parallel import tp_comm_bytes, tp_config
from finetune.plan.types import Candidate, Config, MemoryBreakdown, Status
from finetune.spec import DTYPE_BYTES, Method, Precision, Strategy, adapter_spec


# -- one candidate --------------------------------------------------------------------------------------------
def evaluate(
    s: Setting, config: Config, *, first_step: bool = False, traced: frozenset[tuple[str, bool, int]] | None = None,
) -> Candidate:
    """One configuration's per-GPU memory, communication and time. ``traced``: trace activations only for
    the (method, checkpointing, tp) the walk traced (the table's other rows are marked not traced). With
    ``pp`` pipeline ranks the memory is the worst rank's (every rank's in ``stage_memory``)."""
    method, strategy, mbs, ac = config.method, config.strategy, config.micro_batch_size, config.activation_checkpointing
    tp, pp, optimizer, offload = config.tp, config.pp, config.optimizer, config.offload
    world = 1 if strategy == "single" else s.world
    if spec_pp(strategy, pp) > 1:  # stages take unpacked rows (finetune/plan/pipeline.py)
        s = s.for_pipeline()
    dp = world // (tp * pp)
    accum = max(1, s.global_batch // (mbs * dp))
    spec = s.exec_spec(method, strategy, ac, world, tp, optimizer, offload, pp=spec_pp(strategy, pp))
    inv = s.inventory(tp)
    setup = Setup(spec, mbs, accum, dp, s.hw.device, spec.optimizer, nccl_bytes(spec, s.hw))
    stages: list[MemoryBreakdown] = []
    if spec.pipeline:
        mem, comm, stages = _pipeline_memory(s, inv, None, setup)
    else:
        mem, comm = candidate_memory(inv, None, setup)
    if mem.total > s.capacity:
        status = Status.STATES_OVER
    elif traced is not None and (method, ac, tp) not in traced:
        status = Status.NOT_TRACED
    else:
        if spec.pipeline:
            figures = _pipeline_memory(s, inv, s.profile(spec), setup, first_step)
            if figures[0].total > s.capacity:
                setup, figures = _memory_balanced(s, inv, setup, first_step, figures)
                spec = setup.spec
            mem, comm, stages = figures
        else:
            mem, comm = candidate_memory(inv, s.profile(spec), setup, first_step)
        if spec.grpo:
            mem = replace(mem, rollout=rollout_bytes(
                s.req.config, rows=mbs * accum, micro_batch_size=mbs, prompt_len=s.req.seq_len,
                completion_len=s.req.completion_len, compute_bytes=spec.compute_bytes,
                old_logps=s.req.num_iterations > 1, ref_logps=spec.reference != "none", activations=mem.activations,
                generation=_rollout_generation(s, spec, mbs * accum), tp=tp,
            ))
        status = Status.FITS if mem.total <= s.capacity else Status.OVER
    # a pipeline rank's TP collectives are its own layers' (and its ends'): the busiest rank's
    ranks: list[tuple[int | None, bool, bool]] = [(None, True, True)]  # the whole model
    if spec.pipeline:
        ranks = [(r.layers, r.first, r.last) for r in pipeline_stages(spec.pp_layers, spec.pp, spec.pp_schedule, accum)]
    tp_comm = max(
        tp_comm_bytes(
            s.req.config, tp, seq_len=s.req.seq_len, micro_batch_size=mbs, grad_accum_steps=accum,
            compute_bytes=spec.compute_bytes, checkpointing=ac,
            sequence_parallel=spec.sequence_parallel, head_trained=not spec.method.adapters,
            layers=layers, first=first, last=last,
        )
        for layers, first, last in ranks
    )
    intra, inter = _links(s, inv, setup, comm)
    intra_secs, inter_secs = intra / s.intra_node_bandwidth, inter / s.hw.bandwidth
    pp_comm = pp_bytes_per_step(s, spec, mbs, accum)
    ep_comm, dispatch, experts_rank = _expert_parallel(s, inv, spec, mbs, accum, ac)
    if dispatch:  # one layer's dispatch at a time, beside the strategy's buffers
        mem = replace(mem, buffers=mem.buffers + dispatch)
        if status is Status.FITS and mem.total > s.capacity:
            status = Status.OVER
    secs = (intra_secs + inter_secs + (tp_comm + ep_comm) / s.intra_node_bandwidth
            + pp_seconds(s, spec, pp_comm))
    c = Candidate(
        method=Method(method), strategy=Strategy(strategy), precision=Precision(s.precision),
        micro_batch_size=mbs, grad_accum_steps=accum, activation_checkpointing=ac, nproc=s.hw.gpus_per_node,
        nnodes=s.hw.nodes, memory=mem, comm_bytes_per_step=comm, comm_seconds_per_step=secs, status=status,
        comm_intra_node_bytes_per_step=intra, comm_inter_node_bytes_per_step=inter,
        comm_intra_node_seconds_per_step=intra_secs, comm_inter_node_seconds_per_step=inter_secs,
        tp=tp, tp_comm_bytes_per_step=tp_comm, optimizer=spec.optimizer, offload=spec.offload,
        offload_bytes_per_step=_offload_bytes(inv, setup), pp=spec.pp, pp_schedule=spec.pp_schedule,
        pp_layers=spec.pp_layers, stage_memory=stages, pp_comm_bytes_per_step=pp_comm,
        ep=spec.ep, ep_comm_bytes_per_step=ep_comm, ep_dispatch_bytes=dispatch, expert_bytes_per_rank=experts_rank,
    )
    return replace(c, time=_time(s, c))


def _expert_parallel(
    s: Setting, inv: Inventory, spec: Any, mbs: int, accum: int, ac: bool
) -> tuple[int, int, int]:
    """(all-to-all bytes a rank sends per step, one layer's dispatch buffers, the routed experts' weights a rank
    computes with) of a mixture of experts (finetune/plan/expert_parallel.py); zeros for a dense model."""
    if inv.moe is None:
        return 0, 0, 0
    tokens = mbs * s.req.seq_len
    cb = spec.compute_bytes
    experts = unsharded_bytes(inv, spec, experts=True) if spec.strategy.uses_fsdp else (
        sum(t.numel * inv.copies(t) * DTYPE_BYTES[spec.tensor_dtype(t.name, False)]
            for t in inv.base if is_expert_tensor(t))
    )
    return (
        all_to_all_bytes(inv.moe, spec.ep, tokens, accum, cb, ac),
        dispatch_buffer_bytes(inv.moe, spec.ep, tokens, cb),
        experts,
    )


def spec_pp(strategy: str, pp: int) -> int:
    """The pipeline degree an execution spec gets (a single process has none)."""
    return 1 if strategy == "single" else pp


def _pipeline_memory(
    s: Setting, inv: Inventory, profile: Any, setup: Setup, first_step: bool = False,
) -> tuple[MemoryBreakdown, int, list[MemoryBreakdown]]:
    """Every pp rank's peak (finetune/plan/memory.py: stage_memory), the worst of them, and the most bytes a
    rank sends to its data-parallel peers per step."""
    spec = setup.spec
    stages = pipeline_stages(spec.pp_layers, spec.pp, spec.pp_schedule, setup.grad_accum_steps)
    row = boundary_bytes_per_row(spec, s.req.seq_len, s.req.config.hidden_size)
    tied = bool(getattr(s.req.config, "tie_word_embeddings", False))
    figures = [stage_memory(inv, profile, setup, st, row, tied, first_step) for st in stages]
    worst = max(figures, key=lambda f: f[0].total)
    return worst[0], max(f[1] for f in figures), [f[0] for f in figures]


def _memory_balanced(
    s: Setting, inv: Inventory, setup: Setup, first_step: bool, figures: tuple[MemoryBreakdown, int, list[MemoryBreakdown]],
) -> tuple[Setup, tuple[MemoryBreakdown, int, list[MemoryBreakdown]]]:
    """``setup`` with its layers split by memory instead of by cost, and its figures, when that lowers the worst
    stage of the split by cost (``figures``, which does not fit) (finetune/plan/pipeline.py: memory_balanced_split;
    one stage per rank, and never a split the recipe pins). Each rank's peak is taken as linear in its layers,
    from its figures at its layers and one more."""
    spec = setup.spec
    if s.pp_layers is not None or spec.pp_stages_per_rank > 1:
        return setup, figures
    profile = s.profile(spec)
    row = boundary_bytes_per_row(spec, s.req.seq_len, s.req.config.hidden_size)
    tied = bool(getattr(s.req.config, "tie_word_embeddings", False))
    fixed, slope = [], []
    stages = pipeline_stages(spec.pp_layers, spec.pp, spec.pp_schedule, setup.grad_accum_steps)
    for st, now in zip(stages, figures[2], strict=True):
        more = replace(st, layers=st.layers + 1, depth=st.depth + 1)
        step = stage_memory(inv, profile, setup, more, row, tied, first_step)[0].total - now.total
        slope.append(float(step))
        fixed.append(float(now.total - step * st.layers))
    split = memory_balanced_split(fixed, slope, sum(spec.pp_layers))
    if split == spec.pp_layers:
        return setup, figures
    balanced = replace(setup, spec=replace(spec, pp_layers=split))
    better = _pipeline_memory(s, inv, profile, balanced, first_step)
    return (balanced, better) if better[0].total < figures[0].total else (setup, figures)


def pp_bytes_per_step(s: Setting, spec: Any, mbs: int, accum: int) -> int:
    """Bytes a pp rank sends to its pipeline neighbours per step: every micro-batch's activations forward and
    their gradients backward, once per stage it runs (finetune/plan/pipeline.py)."""
    if not spec.pipeline:
        return 0
    row = boundary_bytes_per_row(spec, s.req.seq_len, s.req.config.hidden_size)
    return 2 * spec.pp_stages_per_rank * accum * mbs * row


def pp_seconds(s: Setting, spec: Any, nbytes: int) -> float:
    """Seconds ``nbytes`` of point-to-point traffic take: over the link between nodes when a stage boundary
    crosses one, else inside the node."""
    if not nbytes:
        return 0.0
    crossing = boundaries_across_nodes(spec.pp, s.world, s.hw.gpus_per_node)
    return nbytes / (s.hw.bandwidth if crossing else s.intra_node_bandwidth)


def _links(s: Setting, inv: Inventory, setup: Setup, comm: int) -> tuple[int, int]:
    """A rank's data-parallel bytes per step (``comm``) split into (inside a node, across nodes): on one node
    all inside; hsdp's all-gathers and reduce-scatters inside, its all-reduce across
    (finetune/plan/memory.py: hybrid_traffic); any other strategy's rings span every node, so all of it
    crosses the slowest link."""
    if setup.spec.strategy.hybrid:
        return hybrid_traffic(inv, setup)
    if s.hw.nodes == 1:
        return comm, 0
    return 0, comm


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
        adapter = adapter_spec(str(c.method), s.lora, s.req.prefix, s.req.adapter, s.req.prompt)
    t = step_time(c, s.req.config, s.hw, seq_len=s.req.seq_len, adapter=adapter, steps=s.req.steps)
    if s.req.completion_len:  # grpo: sampling and scoring the step's completions
        inv = s.inventory(c.tp)
        params = sum(x.numel * inv.copies(x) for x in inv.base)
        passes = int(s.req.num_iterations > 1) + int(s.req.reference != "none")  # old policy's, reference's
        t = replace(t, rollout=rollout_seconds(
            params, rows=c.micro_batch_size * c.grad_accum_steps, prompt_len=s.req.seq_len,
            completion_len=s.req.completion_len, scoring_passes=passes, num_iterations=s.req.num_iterations,
            rate=t.peak_flops * t.utilisation,
        ))
    return t


def step_seconds(c: Candidate) -> float:
    """Predicted seconds per step of ``c`` (0 when the time model does not apply)."""
    return c.time.step if c.time is not None else 0.0


def evaluation_passes(s: Setting, c: Candidate) -> dict[str, int]:
    """The tensors of ``c``'s evaluation at its planned batch (``c.eval_batch_size``), per pass at its peak:
    ``evaluation`` (the eval loss) and ``generation`` (finetune/plan/evaluation.py: eval_phases)."""
    from finetune.plan.evaluation import eval_phases

    inv, config, spec, strategy, setup = _evaluation_inputs(s, c)
    return eval_phases(inv, config, spec, strategy, setup, max(1, c.eval_batch_size), s.req.eval_max_new_tokens)[2]


def _rollout_generation(s: Setting, spec: Any, rows: int) -> int:
    """The traced peak of the KV-cache generation of ``rows`` prompts of ``data.max_seq_len`` tokens sampling
    grpo.max_completion_length tokens (the evaluation's traces, finetune/plan/evaluation.py)."""
    from finetune.plan.evaluation import eval_peak

    trace = replace(
        TraceSpec.of(spec, seq_len=s.req.seq_len, packed=False, attn_implementation=s.req.attn_implementation,
                     device=s.hw.device),
        checkpointing=False,  # no backward: generation's trace is the evaluation's
    )
    config = tp_config(s.req.config, spec.tp)
    return eval_peak(config, trace, s.inventory(spec.tp).num_layers, rows, s.req.completion_len).generation


def rollout_phase(s: Setting, c: Candidate) -> int:
    """The tensors of grpo's first rollout on ``c`` at its peak (without the runtime overhead, as a run's
    measurement counts them): the parameters (a frozen reference copy's included) and the strategy's buffers,
    the kept log-probabilities and the larger of the generation's and the scoring's transients
    (finetune/plan/rollout.py); no gradients nor optimizer state exist before the first step."""
    world = 1 if c.strategy == "single" else s.world
    spec = s.exec_spec(c.method, c.strategy, c.activation_checkpointing, world, c.tp, c.optimizer, c.offload, pp=c.pp)
    rows = c.micro_batch_size * c.grad_accum_steps
    kept, transient = rollout_parts(
        s.req.config, rows=rows, micro_batch_size=c.micro_batch_size, prompt_len=s.req.seq_len,
        completion_len=s.req.completion_len, compute_bytes=spec.compute_bytes, old_logps=s.req.num_iterations > 1,
        ref_logps=spec.reference != "none", generation=_rollout_generation(s, spec, rows), tp=c.tp,
    )
    return c.memory.params + c.memory.buffers + kept + transient


def _evaluation_inputs(s: Setting, c: Candidate) -> tuple[Any, Any, TraceSpec, str, Setup]:
    """What an evaluation of ``c`` is planned from: one TP rank's inventory (the peak stage's under a pipeline)
    and config, the trace, the strategy it runs as and the setup."""
    world = 1 if c.strategy == "single" else s.world
    execution = s.exec_spec(c.method, c.strategy, False, world, c.tp, c.optimizer, c.offload, pp=c.pp)
    spec = TraceSpec.of(execution, seq_len=s.req.seq_len, packed=False, attn_implementation=s.req.attn_implementation,
                        device=s.hw.device)
    setup = Setup(execution, c.micro_batch_size, c.grad_accum_steps, c.dp, s.hw.device, execution.optimizer,
                  nccl_bytes(execution, s.hw))
    # one TP rank's model; a single TP replica has no data-parallel wrapper (no DDP buckets)
    inv, config = s.inventory(c.tp), tp_config(s.req.config, c.tp)
    strategy = "single" if (c.tp > 1 or c.pp > 1) and c.dp == 1 else str(c.strategy)
    if c.pp > 1 and c.stage_memory:  # the rank that peaks in training holds its stages' layers (and ends) only
        from finetune.plan.pipeline import stage_inventory

        st = pipeline_stages(c.pp_layers, c.pp, c.pp_schedule, c.grad_accum_steps)[
            max(range(c.pp), key=lambda r: c.stage_memory[r].total)
        ]
        inv = stage_inventory(inv, st.layers, st.first, st.last, bool(getattr(s.req.config, "tie_word_embeddings", False)))
    return inv, config, spec, strategy, setup


def plan_evaluation(s: Setting, c: Candidate) -> tuple[Candidate, w.EvaluationPlanned]:
    """The evaluation's peak at eval.batch_size (or the largest batch that fits, for auto) on ``c``: the
    candidate with its evaluation figures, and the step that says them."""
    from finetune.plan.evaluation import MAX_AUTO_EVAL_BATCH, eval_memory

    inv, config, spec, strategy, setup = _evaluation_inputs(s, c)

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
