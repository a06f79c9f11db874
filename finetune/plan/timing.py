"""Predicted seconds of one optimizer step of a candidate, and of the whole job.

    step = compute + communication (what is not hidden) + offload + bubble

compute
    the model FLOPs of one rank's step / (the device's peak FLOP/s x an assumed utilisation).
    FLOPs per token are finetune/plan/flops.py's: forward 2N, input gradients 2N, weight gradients 2N of the
    trained matmuls, plus attention's score and value matmuls, with the decoder layers split over the ``tp``
    ranks of a tensor-parallel group (a TP rank computes 1/tp of every layer, and the head whole, as TP
    replicates it). Activation checkpointing runs the layers' forward once more. LoRA, QLoRA, prefix tuning
    and bottleneck adapters compute no weight gradients for the frozen base and no input gradients for the
    first layer's input projections (about 4N instead of 6N); QLoRA's dequantization of its 4-bit weights
    (memory-bound work outside the matmuls) is not counted. A rank's tokens per step are micro-batch x
    ``seq_len`` x gradient accumulation: rows are assumed full (``data.max_seq_len`` tokens, as packing makes
    them); a run of shorter unpacked rows, padded to each micro-batch's longest, computes less.
    GPUs: the datasheet peak of the GPU (hardware.PEAK_TFLOPS) in the compute dtype (bf16 or fp16 under mixed
    precision, plain fp32 otherwise: TF32 stays off), at :data:`GPU_UTILISATION`. CPUs: one core's measured
    matmul rate x the threads a process gets (hardware.cpu_process_flops), at :data:`CPU_UTILISATION`.

communication
    the strategy's collectives (``comm_bytes_per_step``: the part inside a node over the intra-node link, NVLink on
    a GPU machine of several nodes, and the part across nodes over the hardware's bandwidth; HSDP has both, a
    flat strategy on several nodes only the latter) less what they hide
    behind: exposed = max(0, comm - overlap x window). DDP and ZeRO-1 synchronise gradients on the last
    micro-batch of a step only, all-reducing gradient buckets while its backward runs (window: its backward);
    ZeRO-2 and FSDP prefetch the next unit's all-gather during forward and backward and reduce-scatter
    during backward, in every micro-batch (window: every micro-batch; HSDP's all-reduce across nodes follows
    the last micro-batch's reduce-scatters, window: that micro-batch). ``overlap`` is :data:`GPU_OVERLAP` (NCCL
    runs on its own streams and SMs) or :data:`CPU_OVERLAP` (gloo's collectives run on the cores that
    compute). Tensor parallelism's all-reduces (``tp_comm_bytes_per_step`` over the link inside a node) sit
    between matmuls that need their result: all exposed. So do the experts' all-to-alls under
    ``distributed.ep`` (``ep_comm_bytes_per_step``, inside a node): the experts wait for their routed rows.

offload
    ``offload_bytes_per_step`` over the GPU's host link (hardware.HOST_LINK_GBPS), plus, when optimizer state
    lives in host memory, the host's optimizer step: the rank's trainable values x the bytes AdamW reads and
    writes per value (:data:`HOST_OPTIMIZER_BYTES`) over the host's memory bandwidth
    (:data:`HOST_MEMORY_BANDWIDTH`), which the node's ranks share. Nothing of it is assumed hidden. Zero on a
    CPU, whose "device" memory is the host's.

pipeline (distributed.pp)
    a pp rank computes its stages' share of the model: compute is the costliest rank's (its decoder layers, the
    head on the last rank), for every micro-batch of the step. The bubble is the pipeline's idle fraction ``f``
    of the step, (pp - 1) / (m + pp - 1) for gpipe and 1f1b and (pp - 1) / (v m + pp - 1) for interleaved-1f1b
    with ``v`` stages per rank and ``m`` micro-batches (finetune/plan/pipeline.py): bubble = compute x f / (1 - f).
    The point-to-point traffic (``pp_comm_bytes_per_step``: each micro-batch's activations forward and their
    gradients backward, once per stage a rank runs) crosses the link between nodes when a stage boundary does,
    else the link inside the node; it hides behind the compute as the strategy's collectives do (``overlap``),
    except one activation and one gradient per boundary on the pipeline's fill and drain.

Not counted: the optimizer step on the device (memory-bound, once per step), data loading, the loss and
Python's overhead; :data:`CPU_UTILISATION` absorbs them on CPUs, where it was measured.
"""

from __future__ import annotations

from typing import Any

from finetune.plan.flops import flops_shape
from finetune.plan.hardware import INTERCONNECTS, Hardware, cpu_process_flops, host_link_bandwidth, peak_flops
from finetune.plan.pipeline import boundaries_across_nodes, bubble_fraction, rank_stages
from finetune.plan.types import Candidate, StepTime
from finetune.spec import Precision, Strategy

#: Model FLOPs utilisation assumed on GPUs: what tuned data-parallel training of a 1-70B model in bf16 reaches
#: (published MFU of FSDP/Megatron-style runs: 35-55%; 40% is the middle of Hugging Face-model training).
GPU_UTILISATION = 0.4
#: Fraction of the measured matmul rate (one core's x the process's threads) a CPU training step achieves:
#: its matmuls are thinner than the calibration's and the elementwise work (norms, activations, softmax, the
#: loss, AdamW, LoRA's dropout and scaling) runs at memory speed. The tiny quickstart model's full, LoRA and
#: 2-process FSDP steps ran at 0.40-0.63 of it (scripts/time_accuracy.py, docs/benchmarks.md).
CPU_UTILISATION = 0.5
#: Fraction of the overlap window that hides collectives on GPUs (NCCL kernels beside the compute).
GPU_OVERLAP = 1.0
#: ... on CPUs: gloo runs its collectives on the cores that compute, so nothing is hidden.
CPU_OVERLAP = 0.0
#: The GPU whose peaks are assumed when the plan's GPU is not known (the assumed 80 GiB bf16 GPU).
ASSUMED_GPU = "a100"
#: Bytes of host memory AdamW reads and writes per trainable value in one step: fp32 parameter, gradient and
#: two moments read (16), parameter and moments written (12); 8-bit moments: 4 + 4 + 1 + 1 read, 4 + 1 + 1
#: written.
HOST_OPTIMIZER_BYTES = {"adamw": 28, "adamw8bit": 16, "paged_adamw8bit": 16}
#: Effective host memory bandwidth of a vectorised CPU AdamW on one node (bytes/s): about a quarter of a
#: two-socket server's DDR bandwidth, which the node's ranks share.
HOST_MEMORY_BANDWIDTH = 50e9


def compute_dtype(precision: Precision | str) -> str:
    """The dtype matmuls run in under ``precision``: bf16 or fp16 under mixed or pure 16-bit, else fp32."""
    value = Precision(precision).value
    return "fp32" if value == "fp32" else value[:4]


def device_peak(hw: Hardware, precision: Precision | str, nproc: int = 1) -> tuple[float, float]:
    """(peak FLOP/s of one rank's device in ``precision``'s compute dtype, the utilisation assumed of it).

    A GPU: its datasheet peak (:data:`ASSUMED_GPU`'s when the GPU is not known; its fp32 peak when it has none
    in that dtype) at :data:`GPU_UTILISATION`. A CPU: one core's measured rate x the threads each of the
    node's ``nproc`` processes gets, at :data:`CPU_UTILISATION`.
    """
    dtype = compute_dtype(precision)
    if hw.device != "cuda":
        return cpu_process_flops(nproc, dtype), CPU_UTILISATION
    gpu = hw.gpu_type or ASSUMED_GPU
    peak = peak_flops(gpu, dtype) or peak_flops(gpu, "fp32") or peak_flops(ASSUMED_GPU, dtype)
    assert peak is not None, f"no peak for {gpu} {dtype}"
    return peak, GPU_UTILISATION


def pipeline_share(c: Candidate, shape: Any, seq_len: int) -> tuple[float, float]:
    """(The costliest pp rank's share of the model's forward FLOPs per token, its share of the decoder layers'
    alone): its layers, and the head when it runs the last stage; (1, 1) without a pipeline."""
    if c.pp <= 1 or not c.pp_layers:
        return 1.0, 1.0
    tp, total = c.tp, sum(c.pp_layers)
    layer = 2.0 * shape.block / tp + 4.0 * shape.keys(seq_len) * shape.attention_channels / tp
    head = 2.0 * shape.outside
    whole = total * layer + head
    v = max(1, len(c.pp_layers) // c.pp)
    best = (0.0, 0.0)
    for r in range(c.pp):
        mine = rank_stages(r, c.pp, v)
        layers = sum(c.pp_layers[i] for i in mine)
        cost = layers * layer + (head if len(c.pp_layers) - 1 in mine else 0.0)
        best = max(best, (cost / whole, layers / total))
    return best


def step_time(
    c: Candidate,
    config: Any,
    hw: Hardware,
    *,
    seq_len: int,
    adapter: Any = None,
    steps: int | None = None,
    utilisation: float | None = None,
) -> StepTime:
    """Predicted seconds of one optimizer step of ``c`` (see the module docstring), and of ``steps`` of them.

    ``config`` is the model's transformers config; ``hw`` the hardware the plan is for; ``seq_len`` the
    tokens of a row (``data.max_seq_len``); ``adapter`` the :class:`~finetune.spec.AdapterSpec` that
    ``c.method`` injects (required for an adapter method; ignored for full fine-tuning); ``steps`` the job's
    optimizer steps (None: unknown, ``StepTime.job`` is then None); ``utilisation`` replaces the assumed
    fraction of the peak (None: :data:`GPU_UTILISATION` or :data:`CPU_UTILISATION`). A pure function of its
    arguments but for the CPU's peak, measured once per process; fast after the first call per model and
    adapter (the FLOPs come from a cached one-layer build).
    """
    assert adapter is not None or not c.method.adapters, f"{c.method} needs its adapter spec"
    shape = flops_shape(config, adapter if c.method.adapters else None)
    tp = c.tp
    per_token = shape.flops(seq_len, tp)
    recompute = shape.block_forward(seq_len, tp) if c.activation_checkpointing else 0.0
    share, layer_share = pipeline_share(c, shape, seq_len)
    peak, assumed = device_peak(hw, c.precision, c.nproc)
    rate = peak * (assumed if utilisation is None else utilisation)
    tokens = c.micro_batch_size * seq_len  # one rank's micro-batch (a TP group's ranks share theirs)
    micro = (per_token.per_token * share + recompute * layer_share) * tokens / rate
    compute = micro * c.grad_accum_steps

    # collectives, less what hides behind the last micro-batch (its backward: input + weight gradients and
    # the recomputed forward; the whole micro-batch under ZeRO-2/FSDP)
    intra = hw.bandwidth if hw.nodes == 1 or hw.device != "cuda" else INTERCONNECTS["nvlink"]
    if c.comm_intra_node_bytes_per_step or c.comm_inter_node_bytes_per_step:  # each part over its own link
        dp_seconds = c.comm_intra_node_bytes_per_step / intra + c.comm_inter_node_bytes_per_step / hw.bandwidth
    else:  # a plan made before the split: everything over the slowest link
        dp_seconds = c.comm_bytes_per_step / hw.bandwidth if c.comm_bytes_per_step else 0.0
    overlap = GPU_OVERLAP if hw.device == "cuda" else CPU_OVERLAP
    if c.strategy.uses_fsdp:  # every micro-batch's all-gathers and reduce-scatter behind its own compute
        if c.strategy.hybrid and c.comm_inter_node_bytes_per_step:  # the all-reduce across nodes: after the last
            across = c.comm_inter_node_bytes_per_step / hw.bandwidth
            exposed = max(0.0, dp_seconds - across - overlap * compute) + max(0.0, across - overlap * micro)
        else:
            exposed = max(0.0, dp_seconds - overlap * compute)
    else:
        if c.strategy is Strategy.SINGLE:
            window = 0.0
        else:
            backward = per_token.input_gradients + per_token.weight_gradients + recompute
            window = micro * backward / (per_token.per_token + recompute)
        exposed = max(0.0, dp_seconds - overlap * window)
    tp_seconds = c.tp_comm_bytes_per_step / intra if c.tp_comm_bytes_per_step else 0.0
    # the experts' all-to-alls sit between the router and the experts that need their rows: all exposed
    ep_seconds = c.ep_comm_bytes_per_step / intra if c.ep_comm_bytes_per_step else 0.0
    communication = exposed + tp_seconds + ep_seconds

    bubble = 0.0
    if c.pp > 1:
        v = max(1, len(c.pp_layers) // c.pp)
        f = bubble_fraction(c.pp_schedule, c.pp, v, c.grad_accum_steps)
        bubble = compute * f / (1 - f)
        link = hw.bandwidth if boundaries_across_nodes(c.pp, c.world_size, c.nproc) else intra
        p2p = c.pp_comm_bytes_per_step / link
        per_boundary = c.pp_comm_bytes_per_step / (2 * v * max(1, c.grad_accum_steps)) / link
        communication += max(0.0, p2p - overlap * compute) + (2 * (c.pp - 1) * per_boundary if overlap else 0.0)

    offload = 0.0
    if hw.device == "cuda":
        offload = c.offload_bytes_per_step / host_link_bandwidth(hw.gpu_type)
        if c.offload != "none":
            in_layers = shape.layers * shape.block_trainable_params
            values = in_layers / tp + (shape.trainable_params - in_layers)
            if c.strategy.shards_optimizer:
                values /= max(1, c.dp)
            per_value = HOST_OPTIMIZER_BYTES.get(c.optimizer, HOST_OPTIMIZER_BYTES["adamw"])
            offload += values * per_value * c.nproc / HOST_MEMORY_BANDWIDTH
    return StepTime(
        compute=compute, communication=communication, offload=offload, bubble=bubble, steps=steps,
        peak_flops=peak, utilisation=rate / peak,
    )
