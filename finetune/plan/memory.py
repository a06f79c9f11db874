"""Per-rank memory of one candidate (method x strategy x precision x micro-batch x checkpointing).

Model states follow what the trainer builds (see finetune/train):
  single  one process: parameters, gradients, AdamW state (exp_avg, exp_avg_sq) of the trainable values.
  ddp     DistributedDataParallel with gradient_as_bucket_view: the gradients are views into its all-reduce
          buckets, which exist from the start, so the gradients count in full from the first forward on.
          The optimizer's zero_grad(set_to_none=True) detaches the views after every step: under gradient
          accumulation the non-final micro-batches (no_sync) accumulate into tensors of their own, a second
          copy of the gradients beside the buckets until the last micro-batch's backward copies them in.
  zero1   ddp with ZeroRedundancyOptimizer: optimizer state sharded by parameter over the ranks.
  zero2   FSDP2 fully_shard per decoder layer and on the root, reshard_after_forward=False: parameters,
          gradients and optimizer state sharded, but every unit stays all-gathered from its forward to its
          backward, so a full unsharded copy (in the compute dtype) is alive at the peak.
  fsdp    the same with reshard_after_forward=True: only the unit being computed and the one prefetched
          are all-gathered, plus the root unit (embeddings, final norm, lm_head), which FSDP2 never reshards.
  hsdp    fsdp over a (nodes, GPUs per node) mesh: parameters, gradients and optimizer state are sharded over
          the GPUs of one node only (each node holds a replica); the all-gathers and reduce-scatters stay inside
          the node, and each rank's gradient shard is all-reduced with its replicas on the other nodes
          (:func:`hybrid_traffic`).
FSDP2's mixed precision (param_dtype 16-bit, reduce_dtype fp32) replaces autocast, so its traced
activations leave out autocast's weight copies; DDP and single processes keep them.

The peak of a step is the larger of the forward/backward peak (traced, see activations.py) and the
optimizer step (parameters + gradients + state + AdamW's temporaries: none for the fused kernel the trainer
uses on CPU and CUDA, which updates each tensor in place; two of the largest tensor for the per-parameter loop
of tensor-parallel runs; bitsandbytes' 8-bit optimizers update in place too).

train.offload (zero2: optimizer, fsdp: parameters) is FSDP2's CPU offload: on a GPU the shards of the
parameters, gradients and optimizer state leave the device (offloaded_bytes: the host's share; job.py counts
it per node; offload_bytes_per_step: the link's traffic) and the device keeps the gathered units, the
reduce-scatter buffers and one unit's shard staged for its all-gather. On a CPU device the host is the device:
the policy's copies are no-ops and the prediction is the one without offload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.plan.activations import TRACE_LAYERS, ActivationProfile, TraceResult, WindowPeaks
from finetune.plan.expert_parallel import is_expert_tensor
from finetune.plan.shapes import Inventory, Tensor, quantized_bytes, quantized_under
from finetune.plan.types import MemoryBreakdown
from finetune.spec import DTYPE_BYTES, ExecSpec, Strategy

GiB = 1024**3
FOR_LOOP_ADAM_TEMPORARIES = 3  # AdamW's per-parameter loop: ~3 temporaries of the largest tensor (measured)
CUDA_CONTEXT_BYTES = int(0.75 * GiB)  # CUDA context, cuBLAS/cuDNN workspaces and loaded kernels, outside the allocator
FRAGMENTATION = 0.05  # caching-allocator slack, as a fraction of tensor memory


def overhead_parts(overhead: int, tensors: int) -> tuple[int, int]:
    """A breakdown's runtime ``overhead`` over ``tensors`` bytes of tensors as its two terms: (the caching
    allocator's slack, reserved beyond the tensors: :data:`FRAGMENTATION` of them; what the device holds outside
    the allocator: the CUDA context, cuBLAS/cuDNN workspaces and NCCL's buffers, :data:`CUDA_CONTEXT_BYTES` and
    :func:`nccl_bytes`). A run measures the first as ``max_memory_reserved - max_memory_allocated`` and the
    second as the device's used memory less the reserved; (0, 0) off CUDA."""
    if overhead <= 0:
        return 0, 0
    slack = min(overhead, int(FRAGMENTATION * tensors))
    return slack, overhead - slack


def runtime_overhead(tensors: int, s: Setup) -> int:
    """What a rank needs beyond ``tensors`` bytes of tensors: on CUDA the allocator's slack, the CUDA context and
    the NCCL buffers of its communicators (``s.nccl_bytes``); nothing off CUDA."""
    if s.device != "cuda":
        return 0
    return CUDA_CONTEXT_BYTES + s.nccl_bytes + int(FRAGMENTATION * tensors)


def communicators(spec: ExecSpec, gpus_per_node: int) -> list[tuple[str, int, bool]]:
    """The NCCL communicators one rank of ``spec``'s layout belongs to: (name, ranks, whether two or more of its
    ranks share this rank's node). The training group of every rank (``world``; the wait group beside it is gloo,
    no device memory), and the groups the device mesh adds (torch reuses the training group for a 1-D mesh of
    every rank): hsdp's ``replicate`` (one rank a node) and ``shard`` (a node's ranks); under tensor or pipeline
    parallelism the (pp, dp, tp) mesh's ``tp`` (neighbouring ranks), ``dp`` (every tp-th rank) and ``pp`` (every
    (dp x tp)-th rank: the schedule's batched sends and receives run on it), each a communicator of its own
    even where it spans every rank. A group of one rank has no peers and no buffers."""
    world = spec.world_size
    if world <= 1:
        return []
    per_node = max(1, min(gpus_per_node, world))
    out = [("world", world, per_node > 1)]
    if spec.strategy.hybrid and not (spec.tensor_parallel or spec.pipeline):
        shard = world // spec.nodes
        out += [("replicate", spec.nodes, False), ("shard", shard, shard > 1 and per_node > 1)]
        return [c for c in out if c[1] > 1]
    if not (spec.tensor_parallel or spec.pipeline):
        return out
    tp, dp, pp = spec.tp, spec.dp, spec.pp
    out += [
        ("tp", tp, per_node > 1),
        ("dp", dp, per_node // max(1, tp) > 1),
        ("pp", pp, per_node // max(1, tp * dp) > 1),
    ]
    return [c for c in out if c[1] > 1]


def nccl_bytes(spec: ExecSpec, hw: Any) -> int:
    """NCCL's buffers one rank of ``spec`` holds on ``hw`` (a :class:`~finetune.plan.hardware.Hardware`): every
    communicator of :func:`communicators` at the hardware's ``nccl_communicator_bytes`` for its link
    (:data:`finetune.plan.hardware.NCCL_COMMUNICATOR_BYTES` unless given); 0 off CUDA."""
    from finetune.plan.hardware import communicator_link

    if hw.device != "cuda":
        return 0
    return sum(
        hw.nccl_communicator_bytes[communicator_link(hw, inside)]
        for _, _, inside in communicators(spec, hw.gpus_per_node)
    )


@dataclass(frozen=True)
class Setup:
    """Everything but the strategy's wrapping that decides memory: the execution spec and the batch."""

    spec: ExecSpec
    micro_batch_size: int
    grad_accum_steps: int
    world: int  # data-parallel ranks the strategy shards or replicates over (processes / tp)
    device: str = "cuda"  # cuda | cpu
    optimizer: str = "adamw"  # adamw | adamw8bit | paged_adamw8bit
    nccl_bytes: int = 0  # NCCL's buffers of the layout's communicators on this hardware (:func:`nccl_bytes`)


# bitsandbytes' 8-bit optimizers: tensors of at least this many values keep each moment as uint8 with one
# fp32 scale per block and a 256-entry fp32 code book; smaller ones keep fp32 moments.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256


def optimizer_state_bytes(inv: Inventory, adapters: bool, optimizer: str, value_bytes: int) -> int:
    """Bytes of the optimizer's state for the whole model (before sharding): AdamW's two moments in the
    trainable values' dtype, or bitsandbytes' 8-bit moments."""
    tensors = inv.adapters if adapters else inv.base
    total = 0
    for t in tensors:
        if optimizer == "adamw":
            per = 2 * t.numel * value_bytes
        elif t.numel >= BNB_MIN_8BIT_SIZE:
            per = 2 * (t.numel + 4 * -(-t.numel // BNB_BLOCK) + 4 * 256)
        else:
            per = 2 * t.numel * 4
        total += per * inv.copies(t)
    return total


def unsharded_bytes(
    inv: Inventory, spec: ExecSpec, block_only: bool = False, root_only: bool = False, experts: bool | None = None,
) -> int:
    """Bytes of parameters once all-gathered by FSDP2 (in the policy's compute dtype; quantized codes stay);
    under expert parallelism a rank gathers its ``1/ep`` of the routed experts (finetune/plan/expert_parallel.py).
    ``experts``: only the routed experts' tensors (True), only the others (False), or all (None)."""
    cb = DTYPE_BYTES[spec.gathered_dtype] if spec.fsdp_param_dtype else None
    total = 0

    def kept(t: Any) -> bool:
        if (block_only and not inv.in_unit(t)) or (root_only and t.in_block):
            return False
        return experts is None or is_expert_tensor(t) == experts

    def share(t: Any, nbytes: int) -> int:
        return nbytes // spec.ep if spec.ep > 1 and is_expert_tensor(t) else nbytes

    for t in inv.base:
        if not kept(t):
            continue
        if quantized_under(spec, t):
            per = quantized_bytes(t, spec.quant)  # type: ignore[arg-type]  # quantized_under checked it
        else:
            per = t.numel * (cb or DTYPE_BYTES[spec.tensor_dtype(t.name, False)])
        total += share(t, per) * (1 if block_only else inv.copies(t))
    for t in inv.adapters if spec.method.adapters else []:
        if not kept(t):
            continue
        total += share(t, t.numel * (cb or spec.trainable_bytes)) * (1 if block_only else inv.copies(t))
    return total


def reference_bytes(inv: Inventory, spec: ExecSpec) -> int:
    """Bytes of dpo's frozen reference copy (``reference: model`` under full fine-tuning) before sharding: every
    base weight in the frozen dtype (finetune/train/model/reference.py); 0 for every other objective and reference."""
    if spec.reference != "model":
        return 0
    per = DTYPE_BYTES[spec.reference_dtype]
    ref = inv.reference or inv  # dpo.reference_model: counted from its own config
    return sum(t.numel * per * ref.copies(t) for t in ref.base)


def offloads_to_host(s: Setup) -> bool:
    """Whether ``train.offload`` takes state off the device: FSDP2's CPU offload on a GPU. On a CPU device the
    host is the device: the policy's copies are no-ops and every state stays in the memory it was counted in."""
    return s.spec.offload != "none" and s.device != "cpu"


def pinned_block(nbytes: int) -> int:
    """Bytes torch's pinned host allocator (the CachingHostAllocator behind ``pin_memory()`` and non-blocking
    copies to the host) takes for a tensor of ``nbytes``: the block rounded up to a power of two."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def offloaded_bytes(inv: Inventory, s: Setup) -> int:
    """Host bytes one rank keeps under ``train.offload`` (FSDP2's CPUOffloadPolicy, optimizer and parameters
    alike): its shard of every parameter as stored and of the gradients, and of the optimizer state. 0 without
    offload. A shard is FSDP2's chunk of dimension 0, padded to ``ceil(dim0 / n)`` rows (rank 0's, the largest).
    On a GPU machine FSDP2 pins each parameter's padded shard (``pin_memory()``) and copies each gradient shard
    to the host with a non-blocking copy into a pinned tensor, so each is one block of the pinned allocator,
    rounded up to a power of two (:func:`pinned_block`); the optimizer's moments are ``zeros_like`` those
    parameters, ordinary pageable memory. On a CPU device these bytes are the process's own memory, which
    :func:`candidate_memory` counts as it does without offload."""
    spec = s.spec
    if spec.offload == "none":
        return 0
    n = max(1, s.world)
    pin = s.device != "cpu"

    def shard(t: Tensor, value_bytes: int) -> int:
        rows = t.dim0 or t.rows
        values = -(-rows // n) * (t.numel // rows) if rows > 1 else -(-t.numel // n)
        per = values * value_bytes
        return (pinned_block(per) if pin else per) * inv.copies(t)

    params = grads = 0
    for t in inv.base:
        if quantized_under(spec, t):  # codes and their constants, split evenly
            per = -(-inv.base_bytes(spec, t) // n)
            params += (pinned_block(per) if pin else per) * inv.copies(t)
        else:
            params += shard(t, DTYPE_BYTES[spec.tensor_dtype(t.name, False)])
        if not spec.method.adapters:
            grads += shard(t, spec.trainable_bytes)
    for t in inv.adapters if spec.method.adapters else []:
        params += shard(t, spec.trainable_bytes)
        grads += shard(t, spec.trainable_bytes)
    sb = inv.storage(spec)
    opt = -(-optimizer_state_bytes(inv, spec.method.adapters, s.optimizer, sb.param_dtype_bytes) // n)
    return params + grads + opt


def offload_bytes_per_step(inv: Inventory, s: Setup) -> int:
    """Bytes one rank moves over the host link per optimizer step under ``train.offload`` (0 without it, and 0
    on a CPU device, where there is no link).

    FSDP2's CPU offload copies each unit's parameter shard (as stored: the fp32 master under mixed precision)
    to the device before every all-gather: every unit once per micro-batch for the forward, and under fsdp
    (``parameters``) the decoder blocks again for the backward; each gradient shard comes back once per
    optimizer step, after the last micro-batch's reduce-scatter (in the reduce dtype). The optimizer updates
    the host shards in place, so nothing else crosses.
    """
    spec = s.spec
    if not offloads_to_host(s):
        return 0
    n = max(1, s.world)
    sb = inv.storage(spec)
    reduce_bytes = DTYPE_BYTES[spec.reduce_dtype] if spec.reduce_dtype else sb.param_dtype_bytes
    per_micro = sb.param_bytes + (sb.block_param_bytes * inv.num_layers if spec.reshard_after_forward else 0)
    down = s.grad_accum_steps * -(-per_micro // n)
    up = -(-sb.trainable * reduce_bytes // n)
    return down + up


def shard_ranks(s: Setup) -> int:
    """Ranks the strategy splits the model states over: the data-parallel ranks, or under hsdp those of one
    node (``s.world`` over ``spec.nodes`` replicas)."""
    n = max(1, s.world) if s.spec.strategy.distributed else 1
    return max(1, n // s.spec.nodes) if s.spec.strategy.hybrid else n


def hybrid_traffic(inv: Inventory, s: Setup) -> tuple[int, int]:
    """Bytes one rank sends per optimizer step under hsdp: (inside its node, across nodes).

    Inside the node, as fsdp over the node's ``n`` GPUs, for every micro-batch: the reduce-scatter of the
    gradients (in the reduce dtype) and the all-gathers of every unit for forward and again for backward (the
    root once), each a ring moving ``(n - 1) / n`` of the data. Across nodes, once per step (after the last
    micro-batch): the ring all-reduce of the rank's gradient shard with its ``R`` replicas, ``2 (R - 1) / R``
    of ``1 / n`` of the gradients.
    """
    spec = s.spec
    sb = inv.storage(spec)
    n, replicas = shard_ranks(s), max(1, spec.nodes)
    reduce_bytes = DTYPE_BYTES[spec.reduce_dtype] if spec.reduce_dtype else sb.param_dtype_bytes
    grads = sb.trainable * reduce_bytes
    all_gathered = unsharded_bytes(inv, spec)
    root = unsharded_bytes(inv, spec, root_only=True)
    gathers = all_gathered + (all_gathered - root) if spec.reshard_after_forward else all_gathered
    intra = int((n - 1) / n * (grads + gathers)) * max(1, s.grad_accum_steps)
    inter = int(2 * (replicas - 1) / replicas * -(-grads // n))
    return intra, inter


@dataclass
class _States:
    """One rank's model states under the strategy, with the strategy's buffers and its communication."""

    params: int
    grads: int
    opt: int
    buffers: dict[str, int]  # alive in each window of the forward/backward (see activations.WINDOWS)
    buffers_step: int  # ... and during the optimizer step
    comm: int  # bytes each rank sends per optimizer step
    sharded: bool  # FSDP2 (zero2/fsdp)
    ddp: bool  # a DDP wrapper (not over a single TP replica)
    largest: int  # bytes of the largest trainable tensor


def candidate_memory(
    inv: Inventory,
    profile: ActivationProfile | None,
    s: Setup,
    first_step: bool = False,
) -> tuple[MemoryBreakdown, int]:
    """Predicted per-rank bytes by category, and bytes each rank sends per optimizer step.

    ``profile`` is the traced micro-step: with autocast for single/DDP/ZeRO-1 under mixed precision, with
    16-bit compute weights and no autocast for ZeRO-2/FSDP (what FSDP2's MixedPrecisionPolicy runs).
    Without one (activations not traced) only the model states are filled in. Under tensor parallelism
    ``inv`` and ``profile`` are one TP rank's (finetune/plan/tensor_parallel.py: the block at heads / tp,
    kv_heads / tp, intermediate / tp), and the strategy shards that over ``s.world`` data-parallel ranks;
    TP's own all-reduces are counted by the planner, not here. The prediction is for a steady-state step;
    ``first_step=True`` predicts the very first one, whose forward and backward run before AdamW has
    allocated its state (what a probe around step 0 measures).

    The peak is the larger of the forward/backward's (:func:`_forward_backward_peak`) and the optimizer
    step's (:func:`_step_peak`); the breakdown is the one at that moment.
    """
    st = _model_states(inv, s)
    fb = _forward_backward_peak(inv, profile, s, st, first_step)
    step = _step_peak(s, st)
    if profile is None:  # model states alone: activations not traced
        parts = (st.params, st.grads, st.opt, 0, st.buffers["head"])
    else:
        parts = fb if sum(fb) >= sum(step) else step
    tensor_total = sum(parts)
    overhead = runtime_overhead(tensor_total, s)
    mem = MemoryBreakdown(
        params=parts[0], grads=parts[1], optimizer=parts[2], activations=parts[3], buffers=parts[4], overhead=overhead
    )
    return mem, st.comm


def _model_states(inv: Inventory, s: Setup) -> _States:
    """Parameters, gradients and optimizer state one rank keeps under the strategy, its buffers and traffic."""
    spec = s.spec
    sb = inv.storage(spec)
    n = shard_ranks(s)
    gbytes = sb.param_dtype_bytes
    grads_full = sb.trainable * gbytes
    opt_full = optimizer_state_bytes(inv, spec.method.adapters, s.optimizer, gbytes)
    largest = sb.largest_trainable * gbytes
    reduce_bytes = DTYPE_BYTES[spec.reduce_dtype] if spec.reduce_dtype else gbytes
    f = (n - 1) / n
    sharded = spec.strategy.uses_fsdp
    ddp = not sharded and spec.strategy.distributed and n > 1  # no DDP wrapper over a single TP replica
    buffers: dict[str, int] = {"head": 0, "first": 0, "last": 0}
    if not sharded:
        opt = opt_full if spec.strategy is not Strategy.ZERO1 else max(opt_full // n, 2 * largest)
        if ddp and s.grad_accum_steps > 1:  # no_sync's gradients beside the buckets (module docstring)
            buffers = dict.fromkeys(buffers, grads_full)
        params = sb.param_bytes + reference_bytes(inv, spec)  # dpo's frozen copy: replicated as the policy is
        return _States(params, grads_full, opt, buffers, 0, int(2 * f * sb.trainable * gbytes), sharded, ddp, largest)
    params, grads, opt = -(-sb.param_bytes // n), -(-grads_full // n), -(-opt_full // n)
    params += -(-reference_bytes(inv, spec) // n)  # dpo's frozen copy: sharded as the policy is
    all_gathered = unsharded_bytes(inv, spec)
    unit = unsharded_bytes(inv, spec, block_only=True)
    root = unsharded_bytes(inv, spec, root_only=True)
    reduce_scatter = sb.block_trainable * reduce_bytes  # a unit's gradients, copied for reduce-scatter
    if spec.ep > 1:  # a unit's routed experts' gradients are this rank's 1/ep of them
        expert_grads = sum(t.numel for t in (inv.adapters if spec.method.adapters else inv.base)
                           if inv.in_unit(t) and is_expert_tensor(t))
        reduce_scatter -= expert_grads * reduce_bytes * (spec.ep - 1) // spec.ep
    if not spec.reshard_after_forward:  # ZeRO-2: every unit stays gathered from its forward until its backward is done
        buffers = {"head": all_gathered, "first": all_gathered + reduce_scatter, "last": root + unit + reduce_scatter}
        gathers = all_gathered
    else:  # the root stays gathered; one unit computes while the next is prefetched
        buffers = {"head": root, "first": root + 2 * unit + reduce_scatter, "last": root + unit + reduce_scatter}
        gathers = all_gathered + (all_gathered - root)
    if s.grad_accum_steps > 1 and not spec.sync_every_micro_batch:
        # a pipeline's schedule keeps every unit gathered after its backward and its gradients unsharded, in the
        # reduce dtype, until the last micro-batch's, and reduce-scatters only then (stage_memory's docstring)
        buffers = dict.fromkeys(buffers, all_gathered)
    # every micro-batch all-gathers its units and reduce-scatters its gradients (ExecSpec.sync_every_micro_batch)
    per_step = max(1, s.grad_accum_steps) if spec.sync_every_micro_batch else 1
    comm = int(f * (sb.trainable * reduce_bytes + gathers)) * per_step
    if spec.ep > 1:  # the experts' share gathered and reduced over the dp/ep ranks ep leaves, 1/ep of their bytes
        comm = _expert_parallel_comm(inv, s, n, reduce_bytes, per_step)
    if spec.strategy.hybrid:  # inside the node as above (n is the node's GPUs), plus the all-reduce across nodes
        comm = sum(hybrid_traffic(inv, s))
    if offloads_to_host(s):  # FSDP2's CPU offload: the shards live on the host (offloaded_bytes)
        params = grads = opt = 0
        staged = -(-sb.block_param_bytes // n)  # a unit's shard copied to the device for its all-gather
        buffers = {k: v + staged for k, v in buffers.items()}
    return _States(params, grads, opt, buffers, 0, comm, sharded, ddp, largest)


def _expert_parallel_comm(inv: Inventory, s: Setup, n: int, reduce_bytes: int, per_step: int) -> int:
    """FSDP2's bytes per step under expert parallelism: the dense weights over all ``n`` shard ranks, each rank's
    ``1/ep`` of the routed experts over the ``n/ep`` ranks that shard them (the all-to-alls are counted apart)."""
    spec = s.spec
    trained = inv.adapters if spec.method.adapters else inv.base
    expert_values = sum(t.numel * inv.copies(t) for t in trained if is_expert_tensor(t))
    dense_values = sum(t.numel * inv.copies(t) for t in trained) - expert_values
    total = 0
    for experts, ranks, values in ((False, n, dense_values), (True, max(1, n // spec.ep), expert_values // spec.ep)):
        gathered = unsharded_bytes(inv, spec, experts=experts)
        root = unsharded_bytes(inv, spec, root_only=True, experts=experts)
        gathers = gathered + (gathered - root) if spec.reshard_after_forward else gathered
        total += int((ranks - 1) / ranks * (values * reduce_bytes + gathers))
    return total * per_step


def _forward_backward_peak(
    inv: Inventory, profile: ActivationProfile | None, s: Setup, st: _States, first_step: bool
) -> tuple[int, int, int, int, int]:
    """(params, gradients, optimizer state, activations and temporaries, buffers) at the forward/backward's
    worst moment, over the traced windows."""
    spec = s.spec
    # the first step's forward and backward run before AdamW allocates its state; a paged optimizer's state is
    # evicted to the host while the forward and backward need the room, and paged back in for the step
    paged = s.optimizer == "paged_adamw8bit" and s.device == "cuda"
    opt_fb = 0 if first_step or paged else st.opt
    if profile is None:
        return st.params, st.grads, opt_fb, 0, st.buffers["head"]
    sb = inv.storage(spec)
    n = shard_ranks(s)
    layers = inv.num_layers
    windows = profile.at(layers, s.micro_batch_size)
    # one layer's gradients in the traced dtype (any micro-batch's: at() has traced this one)
    layer_grads = profile.point(min(s.micro_batch_size, 2)).layer_grads

    def at_peak(name: str, w: WindowPeaks) -> tuple[int, int, int]:
        acts = w.grads_and_acts - w.grads_at_peak
        if not st.sharded and (s.grad_accum_steps > 1 or st.ddp):
            # later micro-batches, DDP's buckets: every gradient exists from the start
            return st.grads, max(w.acts, acts) + st.largest, st.buffers[name]
        if not st.sharded:  # gradients appear during backward (set to None after every step)
            return w.grads_at_peak, acts, st.buffers[name]
        # FSDP2: the root's and the current unit's gradients stay unsharded; finished units' are 1/n
        done = (layers - 1) * layer_grads if name == "last" else 0
        if s.grad_accum_steps > 1:
            if not spec.sync_every_micro_batch:  # a pipeline's stage: every unit's gradient unsharded, reduce dtype
                unsharded = sb.trainable * (DTYPE_BYTES[spec.reduce_dtype] if spec.reduce_dtype else sb.param_dtype_bytes)
                return unsharded, max(w.acts, acts) + st.largest, st.buffers[name]
            # reduce-scattered after every micro-batch (ExecSpec.sync_every_micro_batch): a later micro-batch's
            # unsharded gradients come and go as in the first, beside every unit's sharded ones, into which each
            # unit's reduce-scatter adds (none on the device under offload: they live on the host)
            return st.grads + w.grads_at_peak - done, acts, st.buffers[name]
        finished = (layers - 1) * sb.block_trainable * sb.param_dtype_bytes // n if name == "last" else 0
        if offloads_to_host(s):  # finished units' gradient shards were copied to the host
            finished = 0
        return w.grads_at_peak - done + finished, acts, st.buffers[name]

    fb_grads, fb_acts, buffers_fb = max((at_peak(k, w) for k, w in windows.items()), key=sum)
    if spec.quant is not None:  # bitsandbytes dequantizes one quantized weight at a time into the compute dtype
        fb_acts += inv.largest_base_numel(quantizable_only=True) * DTYPE_BYTES[spec.quant.compute_dtype]
    return st.params, fb_grads, opt_fb, fb_acts, buffers_fb


def _step_peak(s: Setup, st: _States) -> tuple[int, int, int, int, int]:
    """(params, gradients, optimizer state, the update's temporaries, buffers) during the optimizer step."""
    if s.optimizer == "adamw" and (s.spec.tensor_parallel or s.spec.expert_parallel):  # per-parameter loop
        # (train/optimizer.py: parameters on several meshes)
        step_temps = FOR_LOOP_ADAM_TEMPORARIES * st.largest
    else:
        step_temps = 0  # fused AdamW and bitsandbytes' 8-bit AdamW update each tensor in place
    return st.params, st.grads, st.opt, step_temps, st.buffers_step


def zero1_accounting_note(trainable: int, world: int, compute_dtype: str = "bf16") -> str:
    """One sentence: how this planner's ZeRO-1 model states differ from the ZeRO paper's P_os accounting
    (Rajbhandari et al. 2020, mixed-precision Adam, K = 12), with both figures for ``trainable`` parameters
    over ``world`` data-parallel ranks.

    The paper keeps fp16 parameters and gradients replicated (2 + 2 bytes per parameter) and partitions the
    fp32 master weights with Adam's two moments (12 / N bytes). The trainer keeps the fp32 parameters
    replicated, as the weights it trains, and autocasts them to ``compute_dtype``; their fp32 gradients live
    in DDP's buckets on every rank, and ZeroRedundancyOptimizer shards only the moments (8 / N bytes).
    """
    from finetune.units import fmt_bytes

    n = max(1, world)
    ours = 4 + 4 + 8 / n
    paper = 2 + 2 + 12 / n
    return (
        f"ZeRO-1 here holds {ours:.2f} bytes per parameter ({fmt_bytes(trainable * ours)} for "
        f"{trainable / 1e9:.2f}B parameters on {n} GPUs) where the ZeRO paper's P_os counts {paper:.2f} "
        f"({fmt_bytes(trainable * paper)}): the paper replicates fp16 parameters and gradients (2 + 2 bytes) and "
        f"partitions the fp32 master weights together with Adam's moments (12 / {n} bytes), while this trainer "
        f"replicates the fp32 parameters it trains (4 bytes, autocast computes in {compute_dtype}) and their "
        f"fp32 gradients in DDP's buckets (4 bytes), and ZeroRedundancyOptimizer shards only the two moments "
        f"(8 / {n} bytes)."
    )


# -- pipeline stages --------------------------------------------------------------------------------------------
class StageProfile(ActivationProfile):
    """One pp rank's activations as an :class:`ActivationProfile` of the whole model's traces (nothing is
    traced per stage): the window peaks of one micro-batch through ``depth`` decoder layers (the rank's current
    stage), the head's window only where the rank runs the last stage, plus what the other micro-batches the
    schedule keeps in flight retain (``in_flight - 1`` of them, :meth:`held_per_micro_batch` each).

    The traced profile is linear in depth (finetune/plan/activations.py): the per-layer term is a decoder
    layer's retained activations, the rest is once per model. The ``first`` and ``last`` windows are the
    backward of the layers (their once-per-model part is the layer's backward transient and the stage's input),
    which every stage has; the ``head`` window (logits, loss) only the last stage has.

    A held micro-batch keeps what torch.distributed.pipelining's stage keeps until its backward: the graph of
    the stage's forward (its layers' retained activations, its own position embeddings: every stage computes
    them), its output in the stage's forward cache (the last layer's output, already in the layers' term), and
    its input: the embeddings' output on the first stage, a receive buffer elsewhere (counted with the
    receive buffers, :func:`stage_memory`). ``held_last``: the held micro-batches are the last stage's, which
    also keep what the final norm, the head and the loss retain (one stage per rank; an interleaved rank's last
    stage runs each micro-batch's backward right after its forward, so it holds none beside the current one).
    Without it, the held micro-batches are counted as ``first`` says (every one as the first stage's, or as a
    middle stage's)."""

    def __init__(
        self, base: ActivationProfile, depth: int, in_flight: int, head: bool, first: bool, boundary_per_row: int,
        held_last: bool | None = None,
    ) -> None:
        super().__init__(base.points, base._trace)
        self.base, self.depth, self.in_flight = base, depth, in_flight
        self.head, self.first, self.boundary_per_row = head, first, boundary_per_row
        self.held_last = head if held_last is None else held_last

    def point(self, batch: int) -> TraceResult:
        """The whole model's trace at ``batch`` (the per-layer gradients are the same)."""
        return self.base.point(batch)

    def _traced(self, name: str, batch: int) -> int:
        """A trace's figure ``name`` at micro-batch ``batch`` (1 and 2 traced, larger ones on the line through
        the traces at 2 and 4, as :meth:`ActivationProfile.at` extrapolates)."""
        if batch <= 2:
            return int(getattr(self.base.point(batch), name))
        two, four = getattr(self.base.point(2), name), getattr(self.base.point(4), name)
        return max(0, int(two + (batch - 2) * (four - two) / 2))

    def layer_acts(self, batch: int) -> int:
        """Retained activations of one decoder layer for one micro-batch of ``batch`` rows."""
        two, three = self.base.at(TRACE_LAYERS, batch), self.base.at(TRACE_LAYERS + 1, batch)
        return max(0, three["first"].acts - two["first"].acts)

    def held_per_micro_batch(self, batch: int) -> int:
        """Bytes one micro-batch of ``batch`` rows keeps on this rank from its forward to its backward, beyond its
        receive buffer: ``depth`` layers' retained activations and the stage's position embeddings (what the
        trace keeps beside the embeddings' output as the first layer starts); on the first stage the embeddings'
        output (``boundary_per_row`` a row), on the last what the final norm, the head and the loss retain."""
        outside = self._traced("position_acts", batch)
        if self.first:
            outside += self.boundary_per_row * batch
        if self.held_last:
            outside += self._traced("head_acts", batch)
        return self.depth * self.layer_acts(batch) + outside

    def held(self, batch: int) -> int:
        """Bytes the other micro-batches in flight keep on this rank."""
        return max(0, self.in_flight - 1) * self.held_per_micro_batch(batch)

    def at(self, layers: int, batch: int) -> dict[str, WindowPeaks]:
        """The rank's window peaks at micro-batch ``batch`` (``layers`` is ignored: the rank's stage depth
        applies)."""
        extra = self.held(batch)
        out = {}
        for name, w in self.base.at(self.depth, batch).items():
            if name == "head" and not self.head:
                continue
            out[name] = WindowPeaks(w.grads_and_acts + extra, w.grads_at_peak, w.acts + extra, w.acts_no_copies + extra)
        return out


@dataclass(frozen=True)
class Stage:
    """What one pp rank runs: its decoder layers (all its stages'), whether it runs the first and the last
    stage, the layers of one of its stages (the depth of one micro-batch's pass), the micro-batches its
    schedule keeps in flight at its first backward (the most) and at a later one (when the stage's gradients
    exist: finetune/plan/pipeline.py, in_flight_with_gradients), and its stages (more than one: interleaved)."""

    rank: int
    layers: int
    depth: int
    first: bool
    last: bool
    in_flight: int
    in_flight_with_gradients: int
    stages: int = 1


def pipeline_stages(split: tuple[int, ...], pp: int, schedule: str, microbatches: int) -> list[Stage]:
    """The :class:`Stage` of every pp rank for ``split`` (decoder layers per (virtual) stage) under
    ``schedule`` with ``microbatches`` micro-batches per step."""
    from finetune.plan.pipeline import in_flight, in_flight_with_gradients, rank_stages

    v = max(1, len(split) // pp)
    out = []
    for r in range(pp):
        mine = rank_stages(r, pp, v)
        layers = sum(split[i] for i in mine)
        out.append(Stage(
            rank=r, layers=layers, depth=max(split[i] for i in mine), first=0 in mine, last=len(split) - 1 in mine,
            in_flight=in_flight(schedule, pp, v, microbatches, r),
            in_flight_with_gradients=in_flight_with_gradients(schedule, pp, v, microbatches, r), stages=v,
        ))
    return out


def boundary_bytes_per_row(spec: ExecSpec, seq_len: int, hidden: int) -> int:
    """Bytes of one row's activations crossing a stage boundary (and of their gradient coming back): seq_len x
    hidden in the residual stream's dtype (FSDP2's compute dtype, else the stored weights' under autocast),
    split over the tp ranks when sequence parallelism shards the residual stream."""
    per = DTYPE_BYTES[spec.fsdp_param_dtype or spec.base_dtype(False)]
    tokens = seq_len // spec.tp if getattr(spec, "sequence_parallel", False) and spec.tp > 1 else seq_len
    return tokens * hidden * per


def stage_memory(
    inv: Inventory, profile: ActivationProfile | None, s: Setup, stage: Stage, boundary_per_row: int,
    tied: bool = False, first_step: bool = False,
) -> tuple[MemoryBreakdown, int]:
    """One pp rank's predicted peak by category and the bytes it sends per step to its data-parallel peers:
    :func:`candidate_memory` of the rank's own parameters (finetune/plan/pipeline.py: stage_inventory, sharded
    over the data-parallel ranks by the strategy) with :class:`StageProfile`'s activations, plus the
    point-to-point buffers torch.distributed.pipelining's stages allocate for every micro-batch of a step:
    one received activation on every stage but the first, one received gradient on every stage but the last
    (the current micro-batch's are already in the traced window).

    The peak is the larger of two backwards (finetune/plan/pipeline.py's module docstring): a later one, with
    every gradient of the stage allocated (gradient accumulation's counting) beside
    ``stage.in_flight_with_gradients`` micro-batches; and the rank's first, with ``stage.in_flight`` micro-batches
    and the gradients the traced window has allocated by its peak (none of an earlier micro-batch: the optimizer
    sets them to None after every step). FSDP2's stages alike: the schedule keeps their units gathered and their
    gradients unsharded from the first backward on (ExecSpec.sync_every_micro_batch), so the later backward
    holds every unit's gathered parameters and unsharded gradient."""
    from finetune.plan.pipeline import stage_inventory

    sub = stage_inventory(inv, stage.layers, stage.first, stage.last, tied)
    if profile is None:
        mem, comm = candidate_memory(sub, None, s, first_step)
    else:
        held_last = stage.last and stage.stages == 1

        def prof(in_flight: int) -> StageProfile:
            return StageProfile(profile, stage.depth, in_flight, stage.last, stage.first, boundary_per_row, held_last)

        plain_gradients = s.grad_accum_steps > 1 and not s.spec.sync_every_micro_batch
        later = stage.in_flight_with_gradients if plain_gradients else stage.in_flight
        mem, comm = candidate_memory(sub, prof(later), s, first_step)
        if plain_gradients:
            from dataclasses import replace

            first, _ = candidate_memory(sub, prof(stage.in_flight), replace(s, grad_accum_steps=1), first_step)
            if first.total > mem.total:
                mem = first
    ends = (0 if stage.first else 1) + (0 if stage.last else 1)
    p2p = ends * max(0, s.grad_accum_steps - 1) * boundary_per_row * s.micro_batch_size
    if p2p:
        mem.buffers += p2p
        mem.overhead = runtime_overhead(mem.total - mem.overhead, s)
    return mem, comm
