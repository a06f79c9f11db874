"""Memory before and during a run: a preflight that refuses a plan this rank cannot hold, and an
out-of-memory error that says where it happened, what the plan expected, and what to run instead.

Preflight: before anything is loaded, every rank compares the memory it can still get (CUDA:
``torch.cuda.mem_get_info``'s free bytes; CPU: psutil's available RAM shared by this node's processes, and the
address space ``RLIMIT_AS`` leaves) with the plan's total per process. A rank that cannot hold it stops the run
in seconds: one sentence per failing rank, with the configuration the planner picks for that much memory.

Out of memory: the trainer names its phase (load, forward, backward, optimizer, evaluation, save) and step in
its :class:`RunPhase`; an allocation failure anywhere in a run (``torch.OutOfMemoryError``, a failed CPU
allocation, cuBLAS's, cuDNN's or NCCL's out-of-memory errors: :func:`is_oom`) becomes :class:`OutOfMemory`: the
phase, the step, the plan's breakdown beside what was allocated, and the plan's next configuration that needs
less, as a command line. With ``--debug-memory`` on CUDA, the allocator's history (with Python stacks) is
recorded from the start and dumped as a snapshot file (``torch.cuda.memory._dump_snapshot``; open it at
pytorch.org/memory_viz) named there.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.units import fmt_bytes

#: Exit status of a run stopped by the preflight or by running out of memory.
OOM_EXIT = 3


class OutOfMemory(UserError):
    """The run does not fit in this rank's memory (before it started, or while it ran)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=OOM_EXIT)


@dataclass
class RunPhase:
    """Where a run is: its phase (load, forward, backward, optimizer, evaluation, save) and optimizer step
    (1-based; 0 while loading). The trainer moves it; the out-of-memory message reads it."""

    phase: str = "load"
    step: int = 0

    def at(self, phase: str, step: int | None = None) -> None:
        """Record the phase (and the optimizer step) the run is entering."""
        self.phase = phase
        if step is not None:
            self.step = step


#: Texts of allocation failures that reach Python as a RuntimeError (or a subclass: torch.AcceleratorError,
#: torch.distributed.DistBackendError) rather than torch.OutOfMemoryError, as each library writes them.
OOM_TEXTS: tuple[str, ...] = (
    "CUDA out of memory",  # torch's CUDA caching allocator (torch.OutOfMemoryError's own text)
    "HIP out of memory",  # the same on ROCm
    "CUDA error: out of memory",  # C10_CUDA_CHECK on cudaErrorMemoryAllocation (a context, a library's workspace)
    "DefaultCPUAllocator: can't allocate memory",  # torch's CPU allocator
    "DefaultCPUAllocator: not enough memory",  # the same on Windows
    # cuBLAS through TORCH_CUDABLAS_CHECK: "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    "CUBLAS_STATUS_ALLOC_FAILED",
    # cuDNN through AT_CUDNN_CHECK ("cuDNN error: ..."): cuDNN 8's status, then cuDNN 9's two
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
)

#: NCCL's own allocation failures, in the "Last error:" part of torch's "NCCL error in: ..." DistBackendError
#: (ncclUnhandledCudaError or ncclSystemError): alloc.h's "Failed to CUDA calloc|malloc|host alloc N bytes" and
#: "Failed to malloc N bytes", and checks.h's "Cuda failure 'out of memory'" ("Cuda failure 2 'out of memory'"
#: before NCCL 2.19).
NCCL_OOM_TEXTS: tuple[str, ...] = (
    "Failed to CUDA calloc", "Failed to CUDA malloc", "Failed to CUDA host alloc", "Failed to malloc",
    "'out of memory'",
)


def is_oom(err: BaseException) -> bool:
    """Whether ``err``, or an exception it was raised from or while handling, is an allocation failure: CUDA's
    or the CPU's, cuBLAS's, cuDNN's or NCCL's (:data:`OOM_TEXTS`, :data:`NCCL_OOM_TEXTS`).

    bitsandbytes allocates its tensors through torch (a failure is torch's OutOfMemoryError); its paged buffers
    (``cudaMallocManaged``) end the process from C when they fail, which no exception reports. NCCL's failures
    inside its watchdog abort the process the same way."""
    import torch

    seen: set[int] = set()
    at: BaseException | None = err
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if isinstance(at, torch.OutOfMemoryError | MemoryError):
            return True
        if isinstance(at, RuntimeError):
            text = str(at)
            if any(t in text for t in OOM_TEXTS):
                return True
            if "NCCL" in text and any(t in text for t in NCCL_OOM_TEXTS):
                return True
        at = at.__cause__ or at.__context__
    return False


def failed_allocation(err: str) -> str:
    """What the allocator's message ``err`` says failed, for the out-of-memory sentence: " (an allocation of
    6.0 MiB in NCCL)", " (in cuBLAS)", or "" when it says neither size nor library."""
    import re

    library = next(
        (name for name, marks in (("NCCL", ("NCCL",)), ("cuBLAS", ("CUBLAS_STATUS",)), ("cuDNN", ("CUDNN_STATUS",)))
         if any(m in err for m in marks)),
        None,
    )
    size = ""
    tried = (
        re.search(r"tried to allocate (\d+) bytes", err)
        or re.search(r"Failed to (?:CUDA calloc|CUDA malloc|CUDA host alloc|malloc)(?: async)? (\d+) bytes", err)
        or re.search(r"Tried to allocate ([0-9.]+ [KMGT]iB)", err)
    )
    if tried:
        got = tried.group(1)
        size = f"an allocation of {fmt_bytes(int(got)) if got.isdigit() else got}"
    where = f"in {library}" if library else ""
    said = " ".join(p for p in (size, where) if p)
    return f" ({said})" if said else ""


def obtainable_bytes(device: Any, local_world_size: int = 1) -> tuple[int, str]:
    """(bytes this process can still allocate, where the figure comes from)."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"free on {torch.cuda.get_device_name(device)} (cuda:{device.index or 0})"
    import resource

    import psutil

    avail = psutil.virtual_memory().available // max(1, local_world_size)
    source = "available RAM" + (f" / {local_world_size} processes" if local_world_size > 1 else "")
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        left = max(0, soft - psutil.Process().memory_info().vms)
        if left < avail:
            avail, source = left, "address space left under this process's RLIMIT_AS (ulimit -v)"
    return int(avail), source


def needed_bytes(plan: Any, device: Any) -> int:
    """What the plan needs on this rank before the first step: its total, less the CUDA context that
    ``mem_get_info`` already had to create (the plan's overhead counts it)."""
    total = int(plan.chosen.memory.total)
    if device.type == "cuda":
        from finetune.plan.memory import CUDA_CONTEXT_BYTES

        total -= CUDA_CONTEXT_BYTES
    return total


def preflight(loaded: Any, plan: Any, ctx: Any) -> None:
    """Stop before loading anything when a rank cannot hold the plan (every rank calls; a collective)."""
    import os

    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    have, source = obtainable_bytes(ctx.device, local if ctx.device.type == "cpu" else 1)
    need = needed_bytes(plan, ctx.device)
    short = need > have
    sentences = [_refusal(ctx.rank, need, have, source)] if short else []
    if ctx.distributed:  # every rank's refusal, as JSON (never unpickled)
        from finetune.train.parallel.distributed import all_gather_json

        sentences = [str(s) for part in all_gather_json(sentences) for s in part]
    if not sentences:
        return
    cmd = next_config_command(loaded, plan, min(have, need - 1), ctx.device.type)
    raise OutOfMemory(" ".join(sentences) + " " + cmd)


def _refusal(rank: int, need: int, have: int, source: str) -> str:
    return (
        f"rank {rank}: the plan needs {fmt_bytes(need)} per process but only {fmt_bytes(have)} is {source}, "
        "so it would run out of memory; stopped before loading anything."
    )


def next_config(loaded: Any, plan: Any, budget: int, device: str) -> tuple[Any | None, list[str]]:
    """The planner's choice for ``budget`` bytes per process, releasing pins in turn (micro-batch and
    checkpointing, then strategy, then method and precision, then the optimizer state's size and place, as
    the flowchart orders them), and the ``--set`` overrides that select it."""
    from finetune.plan.flowchart import make_plan
    from finetune.plan.hardware import detect_hardware
    from finetune.plan.request import request_from_recipe

    c = plan.chosen
    base = replace(request_from_recipe(loaded), for_run=True)
    freer = replace(base, micro_batch_size=None, checkpointing=None, optimizer=c.optimizer, offload=c.offload)
    released = replace(freer, strategy="auto", method="auto")
    attempts = [freer, replace(freer, strategy="auto"), released,
                replace(released, optimizer=base.optimizer, offload=base.offload)]
    for req in attempts:
        if c.world_size == 1 and req.strategy == "auto":
            req = replace(req, strategy="single")
        hw = replace(
            detect_hardware(device=device, gpus=c.nproc, nodes=c.nnodes, nproc=c.nproc, gpu_memory=max(budget, 1)),
            gpus_per_node=c.nproc,
        )
        try:
            alt = make_plan(req, hw).chosen
        except UserError:
            continue
        if alt.fits and alt.memory.total <= budget:
            return alt, _overrides(c, alt)
    return None, []


def _overrides(old: Any, new: Any) -> list[str]:
    out = []
    if new.method != old.method:
        out.append(f"method={new.method}")
    if new.strategy != old.strategy:
        out.append(f"distributed.strategy={new.strategy}")
    if new.precision != old.precision:
        out.append(f"precision={new.precision}")
    if new.micro_batch_size != old.micro_batch_size:
        out.append(f"train.micro_batch_size={new.micro_batch_size}")
    if new.activation_checkpointing != old.activation_checkpointing:
        out.append(f"train.activation_checkpointing={str(new.activation_checkpointing).lower()}")
    if new.optimizer != old.optimizer:
        out.append(f"train.optimizer={new.optimizer}")
    if new.offload != old.offload:
        out.append(f"train.offload={new.offload}")
    return out


def next_config_command(loaded: Any, plan: Any, budget: int, device: str) -> str:
    """A sentence with the command line of :func:`next_config`, or what to do when nothing fits."""
    try:
        alt, sets = next_config(loaded, plan, budget, device)
    except Exception:  # the planner itself can fail for lack of memory; the refusal still stands
        alt, sets = None, []
    if alt is None or not sets:
        return (
            f"No configuration of the plan fits in {fmt_bytes(budget)} per process: free memory, use more "
            "processes (--nproc), or shorten data.max_seq_len."
        )
    recipe = str(loaded.path) if loaded.path else "RECIPE.yaml"
    args = ["finetune", "run", recipe, *(a for o in loaded.overrides for a in ("--set", o))]
    args += [a for s in sets for a in ("--set", s)]
    return (
        f"The plan's next configuration that fits in {fmt_bytes(budget)} needs {fmt_bytes(alt.memory.total)}: "
        f"{alt.method}, {alt.strategy}, micro-batch {alt.micro_batch_size} x accumulation {alt.grad_accum_steps}, "
        f"activation checkpointing {'on' if alt.activation_checkpointing else 'off'}; run: {shlex.join(args)}"
    )


#: ``torch.cuda.memory._record_memory_history``'s arguments under ``--debug-memory``: every allocation and free
#: with its Python stack only (C++ frames make a snapshot many times slower to write), the newest 200,000.
DEBUG_MEMORY_HISTORY: dict[str, Any] = {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 200_000}


def start_debug_memory(enabled: bool, device: Any) -> None:
    """``--debug-memory``: record the CUDA allocator's history (the Python stack of every allocation) from now on."""
    if enabled and device.type == "cuda":
        import torch

        torch.cuda.memory._record_memory_history(**DEBUG_MEMORY_HISTORY)


def dump_debug_memory(enabled: bool, device: Any, out_dir: Path, rank: int) -> Path | None:
    """Write the recorded allocator history as a snapshot file; return its path (None off CUDA or disabled)."""
    if not (enabled and device.type == "cuda"):
        return None
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"memory-snapshot-rank{rank}.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    return path


def allocated_now(device: Any) -> str:
    """What this process held when the allocation failed."""
    if device.type == "cuda":
        import torch

        stats = torch.cuda.memory_stats(device)
        free, total = torch.cuda.mem_get_info(device)
        return (
            f"allocated {fmt_bytes(stats.get('allocated_bytes.all.current', 0))} "
            f"(peak {fmt_bytes(stats.get('allocated_bytes.all.peak', 0))}), reserved "
            f"{fmt_bytes(stats.get('reserved_bytes.all.current', 0))}, {fmt_bytes(free)} free of {fmt_bytes(total)}"
        )
    import psutil

    mi = psutil.Process().memory_info()
    return f"process resident {fmt_bytes(mi.rss)}, address space {fmt_bytes(mi.vms)}"


def oom_message(
    err: str,
    loaded: Any,
    plan: Any,
    device: Any,
    rank: int,
    snapshot: Path | None,
    where: RunPhase,
    allocated: str,
) -> str:
    """The phase and step (``where``, when the allocation failed), the plan's breakdown beside what was
    allocated (``allocated``, taken then), and what to run instead. ``err`` is the allocator's message."""
    phase, step = where.phase, where.step
    when = f"in the {phase} phase of step {step}" if phase != "load" else "while loading the model and data"
    asked = failed_allocation(err)
    m = plan.chosen.memory
    breakdown = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in m.to_dict().items() if v and k != "total")
    text = (
        f"rank {rank} ran out of memory {when}{asked}: "
        f"{allocated}; the plan predicted {fmt_bytes(m.total)} per process ({breakdown})."
    )
    if snapshot is not None:
        text += f" Memory snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)."
    budget = max(1, int(m.total * 0.8))  # the plan was too optimistic here: ask for a clearly smaller one
    return text + " " + next_config_command(loaded, plan, budget, device.type)
