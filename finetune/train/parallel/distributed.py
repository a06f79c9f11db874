"""Who this process is: rank, world size, device, its parallel layout; process-group setup and small collectives.

Two process groups join every rank of a multi-process run:

- the training group (nccl on GPUs, gloo on CPU) for the step's collectives, whose timeout is
  ``distributed.timeout``: a collective that waits longer stops the run (NCCL's watchdog aborts the process);
- the wait group (gloo, created beside it), whose timeout is ``distributed.wait_timeout``, for the phases
  where one rank works alone while the others wait: local rank 0 tokenising the data, rank 0 finishing a
  checkpoint (fsync of every file, rename, prune) and writing the final model. A rank waiting there sits in
  a gloo collective on the CPU, which NCCL's watchdog never sees, however long rank 0 takes.

With ``train.offload`` on GPUs the training group is ``cuda:nccl,cpu:gloo`` (:func:`process_group_backend`):
FSDP2's ``CPUOffloadPolicy`` keeps the sharded gradients and optimizer state as DTensors on the CPU, and what
reduces them outside FSDP's own reduce-scatter (the gradient norm's ``full_tensor()`` in clipping, the loss
scaler's unscaling, a full state dict gathered for the final save, DoRA's and PiSSA's initialisation) issues
collectives of CPU tensors on the mesh's groups, which NCCL refuses. Every group made from the default one (the
device mesh's among them) inherits both backends; CUDA tensors still go through NCCL. FSDP2 needs a process
group even for one process, so an offloading process alone gets a group of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from finetune.errors import UserError
from finetune.recipe.schema import DEFAULT_TIMEOUT_S, DEFAULT_WAIT_TIMEOUT_S
from finetune.spec import ExecSpec
from finetune.train.parallel.layout import ParallelLayout

#: The wait group of this process (None before a multi-process DistContext exists, and after it closes).
_WAIT_GROUP: Any = None


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job (a single process is rank 0 of 1) and the run's parallel layout.

    ``layout`` (:class:`~finetune.train.parallel.layout.ParallelLayout`): the degrees, this rank's coordinates and the
    device mesh; every rank a data-parallel replica until the plan is read, then the plan's
    (:meth:`laid_out`). A context never changes once built.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    layout: ParallelLayout = None  # type: ignore[assignment]  # replicas of the world when not given

    def __post_init__(self) -> None:
        if self.layout is None:
            object.__setattr__(
                self, "layout", ParallelLayout.replicas(self.world_size, self.rank, self.device.type)
            )
        assert (self.layout.world_size, self.layout.rank) == (self.world_size, self.rank), "the layout is this rank's"

    def laid_out(self, spec: ExecSpec) -> DistContext:
        """This process on the parallel layout of ``spec`` (the same process groups)."""
        assert spec.world_size == self.world_size, (
            f"the plan runs {spec.world_size} processes, the launcher started {self.world_size}"
        )
        layout = ParallelLayout.of(spec, rank=self.rank, world_size=self.world_size, device_type=self.device.type)
        return replace(self, layout=layout)

    @property
    def is_main(self) -> bool:
        """Rank 0 prints progress and writes outputs."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    @classmethod
    def from_env(
        cls, timeout: float = DEFAULT_TIMEOUT_S, wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S, *,
        offload: bool = False,
    ) -> DistContext:
        """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and join the process groups.

        ``timeout``: seconds a collective of the training group may wait (``distributed.timeout``);
        ``wait_timeout``: seconds a rank may wait in the wait group for one rank's long phase
        (``distributed.wait_timeout``); ``offload``: the run keeps state in host memory (``train.offload``):
        the training group gets gloo for CPU tensors beside NCCL, and a single process a group of its own.
        """
        global _WAIT_GROUP
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        else:
            device = torch.device("cpu")
        if (world > 1 or offload) and not dist.is_initialized():
            # one process without torchrun's rendezvous (no MASTER_ADDR): a store in this process
            alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if world == 1 and (
                "MASTER_ADDR" not in os.environ) else {}
            dist.init_process_group(
                backend=process_group_backend(device, offload=offload),
                device_id=device if device.type == "cuda" else None,
                timeout=timedelta(seconds=timeout), **(alone or _restart_store(rank, world)),
            )
            if world > 1:  # every rank creates it, in the same order, right after the training group
                _WAIT_GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_timeout))
        return cls(rank, world, local, device)

    def all_reduce_sum(self, value: float | torch.Tensor, *, on_device: bool = False) -> torch.Tensor:
        """Sum a scalar (or a small vector) over all ranks: a float64 tensor on the CPU, or with ``on_device``
        left where the collective ran (the GPU under nccl), so that reading it is the caller's one host sync."""
        t = torch.as_tensor(value, dtype=torch.float64).detach().clone()
        if not self.distributed:
            return t
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        t = t.to(dev)
        dist.all_reduce(t)
        return t if on_device else t.cpu()

    def data_sum(self, value: float | torch.Tensor, *, on_device: bool = False) -> torch.Tensor:
        """Sum a per-replica value (tokens, summed losses) over the data-parallel replicas (``on_device``: as
        :meth:`all_reduce_sum`).

        Every rank that reads a replica's batch slice holds the value (its TP and pipeline neighbours:
        ``layout.batch_copies`` of them), so the sum over every rank counts it that many times.
        """
        total = self.all_reduce_sum(value, on_device=on_device)
        copies = self.layout.batch_copies
        return total / copies if copies > 1 else total

    def from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the rank of this rank's pipeline group that runs the last stage holds it (a collective of the
        layout's pp group; the last stage is on its last pp rank: stages are placed in a loop)."""
        t = t.contiguous()
        dist.broadcast(t, group=self.layout.pp_group, group_src=self.layout.pp - 1)
        return t

    def barrier(self) -> None:
        """Wait for every rank (no-op for one process)."""
        if self.distributed:
            dist.barrier()

    def wait_barrier(self) -> None:
        """Wait for every rank where one rank may work for hours (the wait group; no-op for one process)."""
        wait_barrier()

    def close(self) -> None:
        """Leave the process groups."""
        global _WAIT_GROUP
        if dist.is_initialized():
            dist.destroy_process_group()
        _WAIT_GROUP = None


def process_group_backend(device: torch.device, *, offload: bool = False) -> str:
    """The training group's backend string: gloo on CPU; on CUDA nccl, and with ``offload``
    ``cuda:nccl,cpu:gloo`` (torch routes each collective by its tensors' device), since the offloaded state's
    collectives run on CPU tensors (module docstring). Without offload no CPU tensor meets the training
    group, and a gloo backend in every group would cost a connection to every peer for nothing."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if offload else "nccl"


def _several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def wait_group() -> Any:
    """The wait group (gloo, ``distributed.wait_timeout``) of this process; None without one (then
    torch.distributed's default group serves)."""
    return _WAIT_GROUP


def wait_barrier() -> None:
    """Barrier over the wait group, after (or before) one rank's long phase; no-op without other ranks.

    gloo's barrier on a CPU group: the waiting ranks hold no collective of the training group, so a long
    phase of one rank (tokenising, fsync of a checkpoint) never meets its timeout nor NCCL's watchdog. A
    process group made without :meth:`DistContext.from_env` (no wait group) waits in its default group.
    """
    if _several_ranks():
        dist.barrier(group=_WAIT_GROUP)


def wait_broadcast(value: Any) -> Any:
    """Rank 0's ``value`` (a JSON value) on every rank through the wait group (``value`` itself without other
    ranks)."""
    if not _several_ranks():
        return value
    return all_gather_json(value if dist.get_rank() == 0 else None)[0]


def all_gather_json(value: Any) -> list[Any]:
    """Every rank's ``value`` (a JSON value), in rank order, on every rank, through the wait group.

    What another process sends travels as UTF-8 JSON in byte tensors and is parsed as JSON: never unpickled (an
    object collective unpickles what arrives, which would run code a peer, or anyone reaching the network,
    chose). Without other ranks: ``[value]``.
    """
    import json

    if not _several_ranks():
        return [value]
    world = dist.get_world_size()
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=_WAIT_GROUP)
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded, group=_WAIT_GROUP)
    return [json.loads(bytes(t[: int(n)].numpy()).decode()) for t, n in zip(gathered, sizes, strict=True)]


def raise_agreed(error: str | None) -> None:
    """Raise the first failing rank's one-sentence ``error`` as a :class:`~finetune.errors.UserError` on every
    rank, or return when no rank failed (every rank calls it; ``error`` None where this rank did not fail).

    A rank whose own code failed (a user's reward function, say) would otherwise raise alone while the others
    enter the next collective and wait there for ``distributed.timeout``: the ranks agree first, through the
    wait group, and stop together with the same sentence."""
    first = next((e for e in all_gather_json(error) if e is not None), None)
    if first is not None:
        raise UserError(str(first))


def _restart_store(rank: int, world: int) -> dict[str, Any]:
    """After a torchrun restart, a store namespace of this attempt for the process group ({} otherwise).

    torchrun's workers share the agent's store, which lives across restarts: the process group's keys of the
    previous attempt (each rank's address) are still in it, so a restarted rank could read a dead peer's
    address before the new peer overwrites it and fail with "connection refused". A prefix per attempt
    keeps the attempts apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world, is_master=False
    )
    return {"store": dist.PrefixStore(f"finetune-attempt-{attempt}/", store), "rank": rank, "world_size": world}


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_process(local_world_size: int) -> int:
    """Torch threads for each of ``local_world_size`` processes sharing this node's cores (at least 1).

    torchrun's default of one thread per process leaves a CPU run using one core per process, however many
    cores the machine has.
    """
    return max(1, available_cores() // max(1, local_world_size))
