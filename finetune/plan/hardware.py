"""The machine a plan is for: GPUs per node, nodes, memory per GPU, bf16 support, interconnect.

By default the visible GPUs; ``--gpus/--gpu-memory/--nodes/--gpu-type/--interconnect`` (or the recipe's
``hardware:`` section) plan for machines you do not have. On CPU the "GPU memory" of a process is the
host's RAM divided by the processes on it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from finetune.errors import UserError

GiB = 1024**3

# name -> (memory in GiB, bf16 support): bf16 needs compute capability >= 8.0 (Ampere and later)
GPU_TYPES: dict[str, tuple[float, bool]] = {
    "h200": (141, True), "h100": (80, True), "a100": (80, True), "a100-40gb": (40, True),
    "l40s": (48, True), "a6000": (48, True), "a10g": (24, True), "l4": (24, True), "rtx4090": (24, True),
    "rtx3090": (24, True), "v100": (32, False), "v100-16gb": (16, False), "t4": (16, False),
}

# Effective per-GPU bandwidth of a ring collective, bytes/s (approximate, stated in the walk)
INTERCONNECTS: dict[str, float] = {
    "nvlink": 300e9,  # NVLink 4 (H100 SXM), ~half of the 900 GB/s peak in practice
    "pcie": 25e9,  # PCIe 4.0 x16
    "infiniband": 50e9,  # 400 Gb/s NDR per GPU
    "ethernet": 12.5e9,  # 100 Gb/s
}


@dataclass
class Hardware:
    """Where the plan runs."""

    device: str  # cuda | cpu
    gpus_per_node: int
    nodes: int
    memory_bytes: int  # per GPU (per process on CPU)
    bf16: bool
    name: str
    interconnect: str
    bandwidth: float  # bytes/s, the slowest link a collective crosses
    detected: bool = True
    host_memory: int = 0  # bytes of host memory per node (0: not checked)

    @property
    def world(self) -> int:
        """Processes over all nodes."""
        return self.gpus_per_node * self.nodes

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


def parse_bytes(text: str | int | float) -> int:
    """'80GiB', '80GB', '24 G', '512MiB', 85899345920 -> bytes (GB and G are read as GiB, as GPUs are sold)."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"cannot read `{text}` as a memory size; write e.g. 80GiB or 24GB")
    value, unit = float(m.group(1)), m.group(2).upper()
    return int(value * {"": 1, "K": 1024, "M": 1024**2, "G": GiB, "T": 1024**4}[unit])


def bandwidth_of(interconnect: str) -> float:
    """Bytes/s of a named interconnect, or of a number with GB/s (e.g. '200GB/s')."""
    key = interconnect.strip().lower()
    if key in INTERCONNECTS:
        return INTERCONNECTS[key]
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*gb/?s?", key)
    if m:
        return float(m.group(1)) * 1e9
    raise UserError(
        f"unknown interconnect `{interconnect}`; use one of {', '.join(INTERCONNECTS)} or a bandwidth like 200GB/s"
    )


def detect_hardware(
    *,
    device: str | None = None,
    gpus: int | None = None,
    gpu_memory: str | int | None = None,
    nodes: int | None = None,
    gpu_type: str | None = None,
    interconnect: str | None = None,
    nproc: int | None = None,
) -> Hardware:
    """The hardware to plan for: explicit values first, then what this machine has.

    ``device="cpu"`` plans a CPU run (memory = host RAM / processes); otherwise the visible GPUs, or, when
    there are none and nothing is given, one 80 GiB bf16 GPU (said so in the walk).
    """
    nodes = nodes or 1
    if device == "cpu":
        import psutil

        per_node = nproc or gpus or 1
        mem = parse_bytes(gpu_memory) if gpu_memory else psutil.virtual_memory().total // per_node
        return Hardware("cpu", per_node, nodes, mem, True, "cpu", "gloo", 10e9, True)
    name, bf16, mem_b, detected = "gpu", True, None, False
    visible = 0
    if gpus is None or gpu_memory is None or gpu_type is None:
        visible, props = _visible_gpus()
        if visible and props is not None:
            name, mem_b, bf16, detected = props
    if gpu_type:
        key = gpu_type.strip().lower()
        if key not in GPU_TYPES:
            raise UserError(f"unknown --gpu-type `{gpu_type}`; known: {', '.join(GPU_TYPES)}")
        gib, bf16 = GPU_TYPES[key]
        name, mem_b = key, int(gib * GiB)
    if gpu_memory is not None:
        mem_b = parse_bytes(gpu_memory)
    if mem_b is None:
        mem_b, name = 80 * GiB, "80GiB GPU (assumed: none visible)"
    count = gpus or nproc or visible or 1
    if interconnect is None:
        interconnect = "nvlink" if nodes == 1 else "infiniband"
    return Hardware("cuda", count, nodes, mem_b, bf16, name, interconnect, bandwidth_of(interconnect), detected)


def _visible_gpus() -> tuple[int, tuple[str, int, bool, bool] | None]:
    try:
        import torch

        if not torch.cuda.is_available():
            return 0, None
        p = torch.cuda.get_device_properties(0)
        return torch.cuda.device_count(), (p.name, int(p.total_memory), p.major >= 8, True)
    except Exception:  # no driver, no GPU: plan for an assumed one
        return 0, None
