"""The whole job, not only the training step: loading, checkpoints and the final save.

For a configuration (an execution spec on ``world`` ranks, ``per_node`` of them on a node) and the model's
inventory, with P the parameters' stored bytes, L the largest parameter's stored bytes, S the number of
shards (``world`` under zero2/fsdp, else 1) and g the ranks on a node:

    load peak per GPU       P/S + L      each rank's shards, plus one tensor being read and cast
    host, loading           g x L        (GPU) each rank stages one tensor on its way to the device;
                            g x (P/S + L) on CPU, where the model itself lives in host memory
    host, checkpoint save   g x L/S      (GPU) DCP copies each rank's shards to host one tensor at a time;
                            on CPU the state is already there and the write adds one tensor's shard per rank
    host, final save        L            (GPU) rank 0 copies one gathered tensor to host at a time;
                            g x L on CPU, where every rank's all-gather lands in host memory
    checkpoint on disk      finetune.units.checkpoint_bytes (weights kept + AdamW's two moments)
    final model on disk     P (full fine-tuning, as stored) or the fp32 adapters

With ``train.offload`` on a GPU (FSDP2's CPU offload) each rank's shards of the parameters, gradients and
optimizer state live in host memory from loading to the end (finetune.plan.memory.offloaded_bytes, O per
rank): g x O more per node while a checkpoint or the final model is saved, and g x P/S more while loading
(the shards are materialised on the host). On CPU they are the training step's memory, counted there.

plus :data:`HOST_PER_PROCESS` per process on a node for the interpreter, torch and the data (a GPU run's CUDA
context too). Before sharded loading every rank first held the whole model (P per rank) and rank 0 gathered
the weights and AdamW's state (about P + 2 x trainable x 4 bytes) for every checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from finetune.spec import DTYPE_BYTES, ExecSpec

#: Host memory of one training process beyond the model: interpreter, torch, tokenizer, data, CUDA context.
HOST_PER_PROCESS = 2 * 1024**3


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

    @property
    def host_peak_per_node(self) -> int:
        """The largest of the three host phases."""
        return max(self.host_loading_per_node, self.host_checkpoint_per_node, self.host_final_save_per_node)

    def to_dict(self) -> dict[str, int]:
        """JSON form, with the host peak."""
        return {**asdict(self), "host_peak_per_node": self.host_peak_per_node}


#: The host phases of a job's figures (keys of :meth:`JobFigures.to_dict`) and how a sentence names them.
HOST_PHASES = (
    ("host_loading_per_node", "loading"),
    ("host_checkpoint_per_node", "checkpoint save"),
    ("host_final_save_per_node", "final save"),
)


def host_peak_phase(job: Mapping[str, int]) -> tuple[str, int]:
    """The host phase needing the most memory per node, and its bytes (``job``: :meth:`JobFigures.to_dict`)."""
    key, name = max(HOST_PHASES, key=lambda kv: int(job[kv[0]]))
    return name, int(job[key])


def job_figures(inv: Any, spec: ExecSpec, world: int, per_node: int, device: str) -> JobFigures:
    """The figures of the module docstring for ``spec`` on ``world`` ranks (``per_node`` on a node)."""
    from finetune.units import checkpoint_bytes

    sb = inv.storage(spec)
    largest = max((inv.base_bytes(spec, t) for t in inv.base), default=0)
    shards = world if spec.strategy.shards_params and world > 1 else 1
    if spec.strategy.hybrid:  # hsdp: each node's ranks hold one replica between them
        shards = max(1, world // spec.nodes)
    g = per_node
    resident = sb.param_bytes // shards + largest
    base = g * HOST_PER_PROCESS
    if device == "cpu":
        loading = base + g * resident
        ckpt = base + g * (largest // shards)
        final = base + g * largest
    else:
        loading = base + g * largest
        ckpt = base + g * (largest // shards)
        final = base + largest
    offload = g * offloaded_per_rank(inv, spec, world, device)
    if offload:  # resident from materialisation to the end of the job
        loading += g * -(-sb.param_bytes // shards)
        ckpt += offload
        final += offload
    saved = sb.param_bytes if not spec.method.adapters else sb.trainable * DTYPE_BYTES["fp32"]
    return JobFigures(
        load_peak_per_gpu=resident,
        host_loading_per_node=loading,
        host_checkpoint_per_node=ckpt,
        host_final_save_per_node=final,
        checkpoint_bytes=checkpoint_bytes(saved, sb.trainable),
        final_model_bytes=saved,
        host_offload_per_node=offload,
    )


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
    job: Mapping[str, int], limit: int, *, source: str, spec: ExecSpec, processes: int
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
