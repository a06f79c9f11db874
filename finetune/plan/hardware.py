"""The machine a plan is for: GPUs per node, nodes, memory per GPU, bf16 support, interconnect.

By default the visible GPUs; ``--gpus/--gpu-memory/--nodes/--gpu-type/--interconnect`` (or the recipe's
``hardware:`` section) plan for machines you do not have. On CPU the "GPU memory" of a process is the
host's RAM divided by the processes on it.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from finetune.errors import UserError
from finetune.units import parse_bytes

GiB = 1024**3

# name -> (memory in GiB, bf16 support): bf16 needs compute capability >= 8.0 (Ampere and later; CDNA2 and later).
# Memory as the datasheet gives it per device (an MI250X is two devices to torch, 64 GB each).
GPU_TYPES: dict[str, tuple[float, bool]] = {
    "h200": (141, True), "h200-nvl": (141, True), "h100": (80, True), "h100-pcie": (80, True),
    "h100-nvl": (94, True), "h800": (80, True), "h800-pcie": (80, True), "h20": (96, True),
    "a100": (80, True), "a100-40gb": (40, True), "a800": (80, True), "a800-40gb": (40, True),
    "b200": (180, True), "b100": (180, True), "gb200": (186, True),
    "l40s": (48, True), "l40": (48, True), "l4": (24, True), "a10": (24, True), "a10g": (24, True),
    "a6000": (48, True), "rtx6000ada": (48, True), "rtx4090": (24, True), "rtx3090": (24, True),
    "v100": (32, False), "v100-16gb": (16, False), "t4": (16, False),
    "mi300x": (192, True), "mi250x": (64, True),
}

# name -> dense peak TFLOPS (no structured sparsity) per matmul dtype, from the vendor's datasheet or
# architecture whitepaper named beside each (sparse figures halved where only those are printed). bf16/fp16:
# tensor cores with fp32 accumulation (what training uses; GeForce cards run fp16 accumulation twice as fast).
# tf32: tensor cores on fp32 tensors, which torch uses only when torch.backends.cuda.matmul.allow_tf32 is set;
# finetune leaves it off, so an fp32 run is measured against the plain fp32 (CUDA core) peak.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 Tensor Core GPU datasheet and Hopper whitepaper: SXM5, PCIe, NVL (BF16 1,671 sparse)
    "h100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h100-pcie": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "h100-nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # NVIDIA H200 Tensor Core GPU datasheet: SXM (the H100 SXM's GH100 compute), NVL (BF16 1,671 sparse)
    "h200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h200-nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # NVIDIA H800 SXM5 / PCIe datasheets: the H100's tensor throughput (FP64 and NVLink reduced)
    "h800": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h800-pcie": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    # NVIDIA H20 datasheet (BF16 148 dense, TF32 74)
    "h20": {"bf16": 148.0, "fp16": 148.0, "tf32": 74.0, "fp32": 44.0},
    # NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe, 40 and 80 GB alike); the A800 datasheet gives the
    # same compute (NVLink reduced)
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "a100-40gb": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "a800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "a800-40gb": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    # NVIDIA HGX B200 / HGX B100 datasheets (per GPU: BF16 4.5 / 3.5 PFLOPS sparse); GB200 NVL72 datasheet
    # (per superchip of two GPUs: BF16 10 PFLOPS sparse, FP32 180 TFLOPS)
    "b200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    "b100": {"bf16": 1750.0, "fp16": 1750.0, "tf32": 875.0, "fp32": 60.0},
    "gb200": {"bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0, "fp32": 90.0},
    # NVIDIA L40S, L40, L4 datasheets
    "l40s": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "l40": {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "l4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    # NVIDIA A10 datasheet; AWS publishes no A10G datasheet: the A10's (the same GA102 board class) stands in
    "a10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "a10g": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    # NVIDIA RTX A6000 datasheet; Ada Lovelace whitepaper (RTX 6000 Ada, RTX 4090) and GA102 whitepaper
    # (RTX 3090), fp32 accumulation
    "a6000": {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7},
    "rtx6000ada": {"bf16": 364.2, "fp16": 364.2, "tf32": 182.1, "fp32": 91.1},
    "rtx4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "rtx3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    # NVIDIA V100 (SXM2) and T4 datasheets: fp16 tensor cores, no bf16, no tf32
    "v100": {"fp16": 125.0, "fp32": 15.7},
    "v100-16gb": {"fp16": 125.0, "fp32": 15.7},
    "t4": {"fp16": 65.0, "fp32": 8.1},
    # AMD Instinct MI300X datasheet (matrix cores; FP32 matrix 163.4). AMD Instinct MI250X datasheet: 383 BF16
    # and 95.7 FP32 matrix TFLOPS for the module's two dies, each of which torch sees as one device; no TF32
    "mi300x": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "mi250x": {"bf16": 191.5, "fp16": 191.5, "fp32": 47.9},
}

# name -> effective host <-> device bandwidth of one GPU's link, GB/s: what a pinned-memory copy achieves in
# one direction, about 80% of the link's peak. PCIe 5.0 x16 (64 GB/s peak): Hopper, B200/B100, MI300X; PCIe 4.0
# x16 (32 GB/s): Ampere, Ada, MI250X; PCIe 3.0 x16 (16 GB/s): V100, T4. GB200: NVLink-C2C to the Grace CPU
# (900 GB/s both ways for the superchip's two GPUs: 225 GB/s per GPU and direction).
HOST_LINK_GBPS: dict[str, float] = {
    "h200": 50.0, "h200-nvl": 50.0, "h100": 50.0, "h100-pcie": 50.0, "h100-nvl": 50.0, "h800": 50.0,
    "h800-pcie": 50.0, "h20": 50.0, "a100": 25.0, "a100-40gb": 25.0, "a800": 25.0, "a800-40gb": 25.0,
    "b200": 50.0, "b100": 50.0, "gb200": 180.0, "l40s": 25.0, "l40": 25.0, "l4": 25.0, "a10": 25.0,
    "a10g": 25.0, "a6000": 25.0, "rtx6000ada": 25.0, "rtx4090": 25.0, "rtx3090": 25.0, "v100": 12.5,
    "v100-16gb": 12.5, "t4": 12.5, "mi300x": 50.0, "mi250x": 25.0,
}
#: A GPU whose link is not known: PCIe 4.0 x16.
DEFAULT_HOST_LINK = 25e9

# Effective per-GPU bandwidth of a ring collective, bytes/s (approximate, stated in the walk)
INTERCONNECTS: dict[str, float] = {
    "nvlink": 300e9,  # NVLink 4 (H100 SXM), ~half of the 900 GB/s peak in practice
    "pcie": 25e9,  # PCIe 4.0 x16
    "infiniband": 50e9,  # 400 Gb/s NDR per GPU
    "ethernet": 12.5e9,  # 100 Gb/s
}


#: NCCL's buffers for one communicator a rank belongs to, outside torch's allocator, by the link its ranks share
#: (:func:`communicator_link`): on NVSwitch machines of Hopper and Blackwell GPUs NCCL sets up
#: NVLink SHARP (NVLS) buffers, ~1-1.6 GB per communicator (reported on NVIDIA/nccl's tracker: 1.6 GB for one,
#: ~6 GB for three; NeMo and sglang turn NVLS off for this memory); NVLink without NVLS (A100, A800 SXM)
#: ~0.55-0.7 GB (544 MB for a group of 2, 688 MB for more, measured on 4 x A100); PCIe and the network fewer
#: channels and smaller buffers (NCCL_BUFFSIZE, 4 MiB a channel and peer for the simple protocol, LL128's and LL's beside it).
NCCL_COMMUNICATOR_BYTES = {"nvls": int(1.5e9), "nvlink": int(0.7e9), "pcie": int(0.25e9), "network": int(0.25e9)}


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
    gpu_type: str | None = None  # a GPU_TYPES key (given, or recognised from the device name); None: unknown
    # NCCL's buffers per communicator by link (communicator_link's keys): NCCL_COMMUNICATOR_BYTES unless given
    nccl_communicator_bytes: dict[str, int] = field(default_factory=lambda: dict(NCCL_COMMUNICATOR_BYTES))

    @property
    def world(self) -> int:
        """Processes over all nodes."""
        return self.gpus_per_node * self.nodes

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the plan's ``hardware``: what was planned for; the NCCL buffer sizes are the planner's)."""
        d = asdict(self)
        del d["nccl_communicator_bytes"]
        return d


#: GPUs whose SXM boards sit on NVSwitch with NVLink SHARP, for which NCCL sets up NVLS buffers per communicator
NVLS_GPUS = frozenset({"h100", "h200", "h800", "b200", "b100", "gb200"})
#: GPUs with NVLink between the GPUs of a node but no NVLS
NVLINK_GPUS = frozenset({"a100", "a100-40gb", "a800", "a800-40gb"})


def communicator_link(hw: Hardware, inside_node: bool) -> str:
    """The link an NCCL communicator's buffers are sized for (a key of :data:`NCCL_COMMUNICATOR_BYTES`):
    ``network`` for a group with one rank per node; inside a node ``nvls`` (an NVSwitch Hopper or Blackwell
    node, or an unnamed GPU on NVLink: the largest, as a plan errs high), ``nvlink`` (A100-class NVLink) or ``pcie``. The GPUs of a node of several are taken to share
    NVLink, as the time estimate takes them (``interconnect`` names the link between nodes there)."""
    if not inside_node:
        return "network"
    nvlink = hw.nodes > 1 or hw.interconnect.strip().lower() == "nvlink"
    if not nvlink or hw.gpus_per_node < 2:
        return "pcie"
    if hw.gpu_type in NVLINK_GPUS:
        return "nvlink"
    if hw.gpu_type is None or hw.gpu_type in NVLS_GPUS:
        return "nvls"
    return "pcie"


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
    kind = gpu_type.strip().lower() if gpu_type else (gpu_type_of(name, mem_b) if detected else None)
    return Hardware(
        "cuda", count, nodes, mem_b, bf16, name, interconnect, bandwidth_of(interconnect), detected, gpu_type=kind
    )


#: (GPU_TYPES key, pattern on the lower-cased device name), most specific first: the first match names the GPU.
#: An A100/A800 or V100 is then told apart by its memory (:func:`gpu_type_of`).
_DEVICE_NAMES: tuple[tuple[str, str], ...] = (
    ("gb200", r"\bgb200\b"), ("b200", r"\bb200\b"), ("b100", r"\bb100\b"),
    ("h200-nvl", r"\bh200 nvl\b"), ("h200", r"\bh200\b"),
    ("h100-nvl", r"\bh100 nvl\b"), ("h100-pcie", r"\bh100\b.*\bpcie\b"), ("h100", r"\bh100\b"),
    ("h800-pcie", r"\bh800\b.*\bpcie\b"), ("h800", r"\bh800\b"), ("h20", r"\bh20\b"),
    ("a100", r"\ba100\b"), ("a800", r"\ba800\b"),
    ("l40s", r"\bl40s\b"), ("l40", r"\bl40\b"), ("l4", r"\bl4\b"),
    ("a10g", r"\ba10g\b"), ("a10", r"\ba10\b"),
    ("rtx6000ada", r"\brtx 6000 ada\b"), ("a6000", r"\ba6000\b"),
    ("rtx4090", r"\b4090\b(?! ?(ti|d)\b)"), ("rtx3090", r"\b3090\b(?! ?ti\b)"),
    ("v100", r"\bv100\b"), ("t4", r"\bt4\b"),
    ("mi300x", r"\bmi300x\b"), ("mi250x", r"\bmi250x\b"),
)


def gpu_type_of(device_name: str, memory_bytes: int | None = None) -> str | None:
    """The GPU_TYPES key of a device name as ``torch.cuda.get_device_name()`` reports it ("NVIDIA H100 80GB
    HBM3" -> "h100", "NVIDIA H100 NVL" -> "h100-nvl", "AMD Instinct MI300X" -> "mi300x"), the memory telling 40
    from 80 GB A100s/A800s and 16 from 32 GB V100s; None when unknown (a GeForce RTX 4090 D or 3090 Ti, whose
    peaks differ from the cards the table holds, included)."""
    name = device_name.lower()
    mem_gib = (memory_bytes or 0) / GiB
    for key, pattern in _DEVICE_NAMES:
        if not re.search(pattern, name):
            continue
        if key in ("a100", "a800") and (0 < mem_gib <= 48 or re.search(r"\b40gb\b", name)):
            return f"{key}-40gb"
        if key == "v100" and (0 < mem_gib <= 20 or re.search(r"\b16gb\b", name)):
            return "v100-16gb"
        return key
    return None


def peak_flops(gpu_type: str | None, dtype: str) -> float | None:
    """Dense peak FLOP/s of one ``gpu_type`` GPU for matmuls in ``dtype`` (bf16, fp16, tf32, fp32); None when
    the GPU or the dtype on it is unknown."""
    tflops = PEAK_TFLOPS.get((gpu_type or "").lower(), {}).get(dtype)
    return tflops * 1e12 if tflops else None


def host_link_bandwidth(gpu_type: str | None) -> float:
    """Bytes/s one ``gpu_type`` GPU moves to or from host memory (:data:`HOST_LINK_GBPS`; PCIe 4.0 x16's
    25 GB/s when the GPU is not known)."""
    gbps = HOST_LINK_GBPS.get((gpu_type or "").lower())
    return gbps * 1e9 if gbps else DEFAULT_HOST_LINK


#: Matmul FLOP/s of one of this host's cores per dtype, measured once per process (:func:`cpu_core_flops`).
_CPU_FLOPS: dict[str, float] = {}
CPU_CALIBRATION_SIZE = 256  # square matmuls of this size: at full speed on one core, 34 MFLOP each
CPU_CALIBRATION_SECONDS = 0.05  # the repeats of one dtype's measurement stop after this long (at least 2)


def cpu_core_flops(dtype: str = "fp32") -> float:
    """FLOP/s of one core of this host multiplying square ``dtype`` (fp32, bf16, fp16) matrices, measured
    once per process and cached: :data:`CPU_CALIBRATION_SIZE`-sized products on one torch thread, repeated for
    :data:`CPU_CALIBRATION_SECONDS`, the fastest repeat counting (the one least disturbed by other work on
    the host). One thread, because a multi-threaded product on a busy host waits on its slowest thread and
    measures the host's load rather than its arithmetic; :func:`cpu_process_flops` scales to the cores a
    process gets."""
    if dtype not in _CPU_FLOPS:
        _CPU_FLOPS[dtype] = _measure_matmul(dtype)
    return _CPU_FLOPS[dtype]


def cpu_process_flops(nproc: int, dtype: str = "fp32") -> float:
    """Matmul FLOP/s of one of ``nproc`` training processes sharing this host: :func:`cpu_core_flops` x the
    torch threads each gets (``OMP_NUM_THREADS`` when set, else the available cores / ``nproc``, at least 1),
    assuming threads scale linearly; a process with more threads than its share of the cores gets the share."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(env) if env.isdigit() and int(env) > 0 else max(1, cores // max(1, nproc))
    return cpu_core_flops(dtype) * min(threads, cores / max(1, nproc))


def _measure_matmul(dtype: str) -> float:
    import time

    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    n = CPU_CALIBRATION_SIZE
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(torch_dtype)
    b = torch.randn(n, n, generator=gen).to(torch_dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a @ b  # the first product selects the kernel
        best, repeats = float("inf"), 0
        deadline = time.perf_counter() + CPU_CALIBRATION_SECONDS
        while repeats < 2 or time.perf_counter() < deadline:
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
            repeats += 1
    finally:
        torch.set_num_threads(threads)
    return 2.0 * n**3 / max(best, 1e-9)


def _no_gpu_device() -> bool:
    """Whether this machine surely has no CUDA or ROCm device, so that torch (seconds to import) need not be
    asked: Linux without an NVIDIA (/dev/nvidia0...), AMD (/dev/kfd) or WSL (/dev/dxg) device node, or macOS."""
    if sys.platform == "darwin":
        return True
    if sys.platform.startswith("linux"):
        return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))
    return False


def _visible_gpus() -> tuple[int, tuple[str, int, bool, bool] | None]:
    if _no_gpu_device():
        return 0, None
    try:
        import torch

        if not torch.cuda.is_available():
            return 0, None
        p = torch.cuda.get_device_properties(0)
        return torch.cuda.device_count(), (p.name, int(p.total_memory), p.major >= 8, True)
    except Exception:  # no driver, no GPU: plan for an assumed one
        return 0, None
