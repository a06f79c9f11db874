"""What a GPU rank holds beyond its tensors: NCCL's buffers, one set per communicator its layout creates, and
the pinned host memory of train.offload, each block rounded up to a power of two by torch's host allocator."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from finetune.plan.hardware import NCCL_COMMUNICATOR_BYTES, Hardware
from finetune.plan.memory import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION,
    Setup,
    candidate_memory,
    communicators,
    nccl_bytes,
    offloaded_bytes,
    optimizer_state_bytes,
)
from finetune.plan.shapes import build_inventory
from finetune.spec import execution_spec
from tests.support import TINY_MODEL

GiB = 2**30
NVLS, NVLINK, PCIE, NET = (NCCL_COMMUNICATOR_BYTES[k] for k in ("nvls", "nvlink", "pcie", "network"))


def gpus(n: int, nodes: int = 1, kind: str | None = "h100", link: str | None = None) -> Hardware:
    link = link or ("nvlink" if nodes == 1 else "infiniband")
    return Hardware("cuda", n, nodes, 80 * GiB, True, "GPU", link, 300e9, gpu_type=kind)


def spec(strategy: str, world: int, **kw: object):
    return execution_spec("full", strategy, "bf16", checkpointing=False, world_size=world, **kw)


@pytest.mark.parametrize(
    ("layout", "hw", "groups", "expected"),
    [
        ("one process", gpus(1), [], 0),
        ("ddp over 8 GPUs", gpus(8), [("world", 8, True)], NVLS),
        ("zero1 over 8 GPUs", gpus(8), [("world", 8, True)], NVLS),
        ("fsdp over 2 nodes of 8", gpus(8, 2), [("world", 16, True)], NVLS),  # FSDP2's 1-D mesh: the training group
        ("hsdp over 2 nodes of 8", gpus(8, 2),
         [("world", 16, True), ("replicate", 2, False), ("shard", 8, True)], 2 * NVLS + NET),
        ("tp 2 x fsdp 4 on 8 GPUs", gpus(8),
         [("world", 8, True), ("tp", 2, True), ("dp", 4, True)], 3 * NVLS),
        ("tp 8 on 8 GPUs", gpus(8), [("world", 8, True), ("tp", 8, True)], 2 * NVLS),
        ("pp 2 x tp 8 over 2 nodes of 8", gpus(8, 2),
         [("world", 16, True), ("tp", 8, True), ("pp", 2, False)], 2 * NVLS + NET),
        ("pp 4 x dp 2 x tp 2 over 2 nodes of 8", gpus(8, 2),
         [("world", 16, True), ("tp", 2, True), ("dp", 2, True), ("pp", 4, True)], 4 * NVLS),
        ("ddp over 8 A100s", gpus(8, kind="a100"), [("world", 8, True)], NVLINK),
        ("ddp over 4 L40S on PCIe", gpus(4, kind="l40s", link="pcie"), [("world", 4, True)], PCIE),
    ],
)
def test_each_layout_holds_one_set_of_nccl_buffers_per_communicator(layout, hw, groups, expected) -> None:
    """The communicators a rank of each layout belongs to (the training group, the device mesh's groups of two or
    more ranks), each at its link's size: NVLink SHARP buffers on Hopper's NVSwitch nodes, NVLink on A100s,
    PCIe, the network for a group of one rank a node."""
    kw: dict = {}
    strategy = layout.split()[0] if layout.split()[0] in ("ddp", "zero1", "fsdp", "hsdp") else "fsdp"
    world = hw.world
    if layout == "one process":
        strategy, world = "single", 1
    if "hsdp" in layout:
        kw["nodes"] = 2
    if "tp" in layout:
        kw["tp"] = int(layout.split("tp ")[1].split()[0])
    if "pp" in layout:
        pp = int(layout.split("pp ")[1].split()[0])
        kw.update(pp=pp, pp_layers=(1,) * pp)
    s = spec(strategy, world, **kw)
    assert communicators(s, hw.gpus_per_node) == groups
    assert nccl_bytes(s, hw) == expected


def test_the_plans_overhead_counts_every_communicators_buffers() -> None:
    """A rank's overhead is the CUDA context, its communicators' NCCL buffers and the allocator's slack: tp 2 x
    fsdp 4 holds two sets more than fsdp over the same 8 GPUs; a CPU rank holds none of it."""
    inv = build_inventory(AutoConfig.from_pretrained(TINY_MODEL), str(TINY_MODEL), None)
    hw = gpus(8)
    for s, sets in ((spec("fsdp", 8), 1), (spec("ddp", 8), 1)):
        mem, _ = candidate_memory(inv, None, Setup(s, 1, 1, 8, "cuda", nccl_bytes=nccl_bytes(s, hw)))
        tensors = mem.total - mem.overhead
        assert mem.overhead == CUDA_CONTEXT_BYTES + sets * NVLS + int(FRAGMENTATION * tensors)
    cpu = spec("fsdp", 8)
    mem, _ = candidate_memory(inv, None, Setup(cpu, 1, 1, 8, "cpu", nccl_bytes=nccl_bytes(cpu, Hardware(
        "cpu", 8, 1, 8 * GiB, True, "cpu", "gloo", 10e9))))
    assert mem.overhead == 0


def test_pinned_host_memory_under_offload_is_each_shards_power_of_two_block() -> None:
    """FSDP2 pins each parameter's padded shard (``pin_memory()``) and copies each gradient shard to the host
    through a non-blocking copy (a pinned tensor); torch's host allocator takes the next power of two for each.
    Expected here from the real parameters' shapes, chunked along dimension 0 as FSDP2 chunks them (rank 0's
    chunk, the largest), bf16 masters being fp32: the host figure of the plan is that sum for the parameters
    and the gradients, plus the unpinned AdamW moments (``zeros_like`` of a pinned tensor is pageable)."""
    cfg = AutoConfig.from_pretrained(TINY_MODEL)
    inv = build_inventory(cfg, str(TINY_MODEL), None)
    n = 2
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    pinned = 0
    for p in model.parameters():
        shard = torch.chunk(p, n, dim=0)[0]
        nbytes = shard.numel() * 4
        pinned += 1 << (nbytes - 1).bit_length()
    s = execution_spec("full", "zero2", "bf16", checkpointing=False, world_size=n, offload="optimizer")
    moments = -(-optimizer_state_bytes(inv, False, "adamw", 4) // n)
    assert offloaded_bytes(inv, Setup(s, 1, 1, n, "cuda")) == 2 * pinned + moments
    unpinned = sum(torch.chunk(p, n, dim=0)[0].numel() * 4 for p in model.parameters())
    assert offloaded_bytes(inv, Setup(s, 1, 1, n, "cpu")) == 2 * unpinned + moments  # no pinning on a CPU device
    assert pinned > unpinned  # the rounding is there to count: 688-row MLP shards are not powers of two
