"""Who this process is: rank, world size, device; process-group setup and small collectives."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    """This process's place in the job (a single process is rank 0 of 1)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tp: int = 1  # tensor-parallel degree (the execution spec's): tp consecutive ranks compute one replica

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the ranks of one TP group read the same batch slice."""
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas (processes / tp)."""
        return self.world_size // self.tp

    @property
    def is_main(self) -> bool:
        """Rank 0 prints progress and writes outputs."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> DistContext:
        """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and join the process group."""
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        else:
            device = torch.device("cpu")
        if world > 1 and not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend=backend, device_id=device if device.type == "cuda" else None, **_restart_store(rank, world)
            )
        return cls(rank, world, local, device)

    def all_reduce_sum(self, value: float | torch.Tensor) -> torch.Tensor:
        """Sum a scalar over all ranks (a float64 tensor on CPU for gloo, on the device for nccl)."""
        t = torch.as_tensor(value, dtype=torch.float64).detach().clone()
        if not self.distributed:
            return t
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        t = t.to(dev)
        dist.all_reduce(t)
        return t.cpu()

    def data_sum(self, value: float | torch.Tensor) -> torch.Tensor:
        """Sum a per-replica value (tokens, summed losses) over the data-parallel replicas.

        The ranks of a TP group hold the same value, so the sum over every rank counts it ``tp`` times.
        """
        total = self.all_reduce_sum(value)
        return total / self.tp if self.tp > 1 else total

    def barrier(self) -> None:
        """Wait for every rank (no-op for one process)."""
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()


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
