"""The whole job, not only the training step: loading, checkpoints and the final save.

For a configuration (an execution spec on ``world`` ranks, ``per_node`` of them on a node) and the model's
inventory, with P the parameters' stored bytes, L the largest parameter's stored bytes, S the number of
shards (``world`` under zero2/fsdp, one node's ranks under hsdp, else 1), g the ranks on a node and B the
loader's buffer (:func:`load_buffer`: the larger of the largest parameter drawn whole, as ``model.init:
random`` draws it, and the rank's slice of the largest tensor in the checkpoint's own dtype, as the
pretrained load reads it; a quantizing load reads whole tensors):

    load peak per GPU       P/S + L      each rank's shards, plus one tensor being read and cast
    host, loading           g x B        (GPU) each rank stages one tensor's slice on its way to the device;
                            g x (P/S + B) on CPU, where the model itself lives in host memory
    host, training          g x R        (CPU) the training step's own memory per rank (R, the plan's total);
                            nothing beyond the processes on a GPU, where the step lives on the device
    host, checkpoint save   g x L/S      (GPU) DCP copies each rank's shards to host one tensor at a time;
                            on CPU the state is already there (g x M: each rank's parameters, gradients and
                            optimizer state) and the write adds one tensor's shard per rank
    host, final save        L            (GPU) rank 0 copies one gathered tensor to host at a time;
                            g x (M + L) on CPU, where every rank's all-gather lands in host memory
    checkpoint on disk      finetune.units.checkpoint_bytes (weights kept + AdamW's two moments)
    final model on disk     P (full fine-tuning, as stored) or the fp32 adapters

With ``train.offload`` on a GPU (FSDP2's CPU offload) each rank's shards of the parameters, gradients and
optimizer state live in host memory from loading to the end (finetune.plan.memory.offloaded_bytes, O per
rank): g x O more per node while a checkpoint or the final model is saved, and g x P/S more while loading
(the shards are materialised on the host). On CPU they are the training step's memory, counted there.

plus :data:`HOST_PER_PROCESS` per process on a node for the interpreter, torch, the data and the CUDA context
(:data:`HOST_PER_PROCESS_CPU` for a process training on the CPU). Before sharded loading every rank first held
the whole model (P per rank) and rank 0 gathered the weights and AdamW's state (about P + 2 x trainable x 4
bytes) for every checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from finetune.plan.types import JobFacts
from finetune.spec import DTYPE_BYTES, ExecSpec

#: Host memory of one training process beyond the model: interpreter, torch, tokenizer, data, CUDA context.
HOST_PER_PROCESS = 2 * 1024**3
#: The same for a process training on the CPU (no CUDA context): the peak RssAnon of each rank of the tiny
#: model's LoRA run under fsdp on 2 processes, 404 MiB while loading and 414 MiB for the whole run
#: (scripts/bench_load_memory.py, docs/benchmarks.md), where the model's part is under 8 MiB.
HOST_PER_PROCESS_CPU = 416 * 1024**2


@dataclass
class JobFigures:
    """Memory and disk of a configuration's whole job (bytes)."""

    load_peak_per_gpu: int
    host_loading_per_node: int
    host_checkpoint_per_node: int
    host_final_save_per_node: int
    checkpoint_bytes: int
    final_model_bytes: int
    host_offload_per_node: int = 0  # train.offload on a GPU: the node's ranks' offloaded state (in the phases)
    host_training_per_node: int = 0  # the processes, and on CPU each rank's training step

    @property
    def host_peak_per_node(self) -> int:
        """The largest of the host phases."""
        return max(
            self.host_loading_per_node,
            self.host_training_per_node,
            self.host_checkpoint_per_node,
            self.host_final_save_per_node,
        )

    def to_dict(self) -> JobFacts:
        """JSON form, with the host peak."""
        return cast(JobFacts, {**asdict(self), "host_peak_per_node": self.host_peak_per_node})


#: The host phases of a job's figures (keys of :meth:`JobFigures.to_dict`) and how a sentence names them.
HOST_PHASES = (
    ("host_loading_per_node", "loading"),
    ("host_training_per_node", "training"),
    ("host_checkpoint_per_node", "checkpoint save"),
    ("host_final_save_per_node", "final save"),
)


def host_peak_phase(job: Mapping[str, Any]) -> tuple[str, int]:
    """The host phase needing the most memory per node, and its bytes (``job``: :meth:`JobFigures.to_dict`)."""
    key, name = max(HOST_PHASES, key=lambda kv: int(job[kv[0]]))
    return name, int(job[key])


def job_figures(
    inv: Any,
    spec: ExecSpec,
    world: int,
    per_node: int,
    device: str,
    *,
    weights_itemsize: int = 4,
    step: Any = None,
) -> JobFigures:
    """The figures of the module docstring for ``spec`` on ``world`` ranks (``per_node`` on a node).

    ``weights_itemsize``: bytes per value in the model's checkpoint files (:func:`weights_itemsize`);
    ``step``: the configuration's memory per rank (a ``MemoryBreakdown``), which on a CPU device is host memory
    (R and M of the module docstring; without it they count nothing).
    """
    from finetune.units import checkpoint_bytes

    sb = inv.storage(spec)
    largest = max((inv.base_bytes(spec, t) for t in inv.base), default=0)
    shards = world if spec.strategy.shards_params and world > 1 else 1
    if spec.strategy.hybrid:  # hsdp: each node's ranks hold one replica between them
        shards = max(1, world // spec.nodes)
    g = per_node
    resident = sb.param_bytes // shards + largest
    buffer = load_buffer(inv, spec, shards, weights_itemsize)
    if device == "cpu":
        base = g * HOST_PER_PROCESS_CPU
        states = 0 if step is None else step.params + step.grads + step.optimizer
        loading = base + g * (sb.param_bytes // shards + buffer)
        training = base + g * (0 if step is None else step.total)
        ckpt = base + g * (states + largest // shards)
        final = base + g * (states + largest)
    else:
        base = g * HOST_PER_PROCESS
        loading = base + g * buffer
        training = base
        ckpt = base + g * (largest // shards)
        final = base + largest
    offload = g * offloaded_per_rank(inv, spec, world, device)
    if offload:  # resident from materialisation to the end of the job
        loading += g * -(-sb.param_bytes // shards)
        training += offload
        ckpt += offload
        final += offload
    saved = sb.param_bytes if not spec.method.adapters else sb.trainable * sb.param_dtype_bytes
    moments = sb.param_dtype_bytes if spec.optimizer == "adamw" else DTYPE_BYTES["fp32"]
    return JobFigures(
        load_peak_per_gpu=resident,
        host_loading_per_node=loading,
        host_checkpoint_per_node=ckpt,
        host_final_save_per_node=final,
        checkpoint_bytes=checkpoint_bytes(saved, sb.trainable, moments),
        final_model_bytes=saved,
        host_offload_per_node=offload,
        host_training_per_node=training,
    )


def load_buffer(inv: Any, spec: ExecSpec, shards: int, weights_itemsize: int) -> int:
    """Host bytes one rank's loader holds beside its shards: the larger of the largest base parameter drawn
    whole in its stored dtype (``model.init: random`` draws one tensor at a time) and the rank's slice of the
    largest tensor as the checkpoint stores it (the pretrained load reads one slice at a time, in the file's
    dtype, and casts it into the shard; a quantizing load reads the whole tensor)."""
    stored = max((inv.base_bytes(spec, t) for t in inv.base), default=0)
    numel = inv.largest_base_numel()
    read = 1 if spec.quant is not None else shards
    return max(stored, -(-numel // read) * weights_itemsize)


def weights_itemsize(config: Any) -> int:
    """Bytes per value of a model's checkpoint files as its config records their dtype (``dtype``, formerly
    ``torch_dtype``); 4 (fp32, what ``from_pretrained`` assumes) when it records none."""
    dtype = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}.get(name, 4)


def offloaded_per_rank(inv: Any, spec: ExecSpec, world: int, device: str) -> int:
    """Host bytes one rank keeps for ``spec.offload`` on a GPU machine (0 without offload, or on a CPU device,
    where the state is the training step's own memory): finetune.plan.memory.offloaded_bytes over the
    strategy's data-parallel ranks, with the spec's optimizer."""
    if spec.offload == "none" or device == "cpu":
        return 0
    from finetune.plan.memory import Setup, offloaded_bytes

    dp = max(1, world // max(1, spec.tp))
    return offloaded_bytes(inv, Setup(spec, 1, 1, dp, device, spec.optimizer))


def host_memory_problem(
    job: Mapping[str, Any], limit: int, *, source: str, spec: ExecSpec, processes: int
) -> str | None:
    """The sentence refusing a run whose host memory per node (``job``) exceeds ``limit`` bytes, or None.

    ``source`` names where the limit came from (a flag, or MemAvailable); ``processes`` are this node's.
    """
    from finetune.units import fmt_bytes

    phase, need = host_peak_phase(job)
    if need <= limit:
        return None
    fixes = []
    if processes > 1 or spec.strategy.shards_params:  # fewer processes per node: less of everything per node
        fixes.append("more nodes (--nnodes) with fewer processes each")
    if not spec.strategy.shards_params:
        fixes.append("distributed.strategy: fsdp (each process holds its shard of the model)")
    if not spec.method.adapters:
        fixes.append("method: lora or qlora (a frozen 16- or 4-bit base; checkpoints hold the adapters only)")
    remedies = ", or ".join(fixes)
    return (
        f"host memory: {spec.method} under {spec.strategy} with {processes} process(es) per node needs "
        f"{fmt_bytes(need)} of host memory per node ({phase}) but this node has {fmt_bytes(limit)} ({source}); "
        f"use {remedies}, or pass --ignore-host-memory to run anyway"
    )


def available_host_memory() -> int:
    """This node's memory available to a new run: MemAvailable of /proc/meminfo (the kernel's estimate of
    what can be allocated without swapping), or psutil's equivalent where there is no /proc."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)


def this_machine_memory() -> int:
    """This machine's physical memory (the default of ``finetune plan --host-memory``)."""
    import psutil

    return int(psutil.virtual_memory().total)
