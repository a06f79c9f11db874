"""Every GPU the MFU table knows is recognised from the name torch reports for it, with its dense bf16 (fp16 where
there is no bf16) datasheet peak; names the table does not hold give no peak rather than a wrong one."""

from __future__ import annotations

import pytest

from finetune.plan.hardware import GPU_TYPES, HOST_LINK_GBPS, PEAK_TFLOPS, GiB, gpu_type_of, peak_flops

# (torch.cuda.get_device_name(), total memory in GiB, gpu_type, dense 16-bit tensor peak in TFLOPS)
DEVICES = [
    ("NVIDIA H100 80GB HBM3", 80, "h100", 989.4),
    ("NVIDIA H100 PCIe", 80, "h100-pcie", 756.5),
    ("NVIDIA H100 NVL", 94, "h100-nvl", 835.5),
    ("NVIDIA H200", 141, "h200", 989.4),
    ("NVIDIA H200 NVL", 141, "h200-nvl", 835.5),
    ("NVIDIA H800", 80, "h800", 989.4),
    ("NVIDIA H800 PCIe", 80, "h800-pcie", 756.5),
    ("NVIDIA H20", 96, "h20", 148.0),
    ("NVIDIA A100-SXM4-80GB", 80, "a100", 312.0),
    ("NVIDIA A100-SXM4-40GB", 40, "a100-40gb", 312.0),
    ("NVIDIA A100 80GB PCIe", 80, "a100", 312.0),
    ("NVIDIA A100-PCIE-40GB", 40, "a100-40gb", 312.0),
    ("NVIDIA A800-SXM4-80GB", 80, "a800", 312.0),
    ("NVIDIA A800 40GB PCIe", 40, "a800-40gb", 312.0),
    ("NVIDIA B200", 179, "b200", 2250.0),
    ("NVIDIA B100", 179, "b100", 1750.0),
    ("NVIDIA GB200", 185, "gb200", 2500.0),
    ("NVIDIA L40S", 45, "l40s", 362.05),
    ("NVIDIA L40", 45, "l40", 181.05),
    ("NVIDIA L4", 22, "l4", 121.0),
    ("NVIDIA A10", 22, "a10", 125.0),
    ("NVIDIA A10G", 22, "a10g", 125.0),
    ("NVIDIA RTX A6000", 48, "a6000", 154.8),
    ("NVIDIA RTX 6000 Ada Generation", 48, "rtx6000ada", 364.2),
    ("NVIDIA GeForce RTX 4090", 24, "rtx4090", 165.2),
    ("NVIDIA GeForce RTX 3090", 24, "rtx3090", 71.0),
    ("Tesla V100-SXM2-32GB", 32, "v100", 125.0),
    ("Tesla V100-SXM2-16GB", 16, "v100-16gb", 125.0),
    ("Tesla T4", 15, "t4", 65.0),
    ("AMD Instinct MI300X", 192, "mi300x", 1307.4),
    ("AMD Instinct MI250X", 64, "mi250x", 191.5),
]


@pytest.mark.parametrize(("device_name", "gib", "gpu_type", "tflops"), DEVICES)
def test_each_device_name_gives_its_gpu_type_and_dense_peak(
    device_name: str, gib: int, gpu_type: str, tflops: float
) -> None:
    assert gpu_type_of(device_name, gib * GiB) == gpu_type
    dtype = "bf16" if GPU_TYPES[gpu_type][1] else "fp16"  # V100 and T4 have fp16 tensor cores only
    assert peak_flops(gpu_type, dtype) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize(
    "device_name",
    ["Quadro RTX 8000", "Quadro RTX 6000", "NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 3090 Ti",
     "AMD Instinct MI250", "NVIDIA GeForce GTX 1080 Ti"],
)
def test_a_device_the_table_does_not_hold_has_no_peak(device_name: str) -> None:
    """Near names with other peaks (the RTX 4090 D, the 3090 Ti, the MI250, Turing's RTX 6000) are not taken
    for the cards they resemble."""
    assert gpu_type_of(device_name, 24 * GiB) is None


def test_every_gpu_type_has_a_peak_and_a_host_link() -> None:
    assert set(PEAK_TFLOPS) == set(GPU_TYPES) == set(HOST_LINK_GBPS)
    assert {kind for _, _, kind, _ in DEVICES} == set(GPU_TYPES)


def test_a_gpu_run_without_a_known_peak_says_how_to_name_one(tmp_path) -> None:
    """The summary's throughput line on a GPU the table does not hold: no MFU, the device, and the gpu_type
    values that give one."""
    from rich.console import Console

    from finetune.plan.types import Candidate
    from finetune.spec import Method, Precision, Strategy
    from finetune.train.metrics.console import Reporter
    from finetune.train.state import RunResult

    chosen = Candidate(method=Method("full"), strategy=Strategy("single"), precision=Precision("bf16"),
                       micro_batch_size=1, grad_accum_steps=1, activation_checkpointing=False, nproc=1)
    result = RunResult(steps=4, final_loss=1.5, eval=None, output_dir=tmp_path, seconds=2.0, tokens_per_s=8000.0,
                       utilisation=None)
    reporter = Reporter(True)
    reporter.console = Console(record=True, width=1000)
    reporter.summary(result, chosen, 0, gpu=True)
    line = next(x for x in reporter.console.export_text().splitlines() if x.startswith("throughput:"))
    assert line == (
        "throughput: 8,000 tokens/s (training steps after the first) | MFU: n/a (no peak FLOPS known for this GPU; "
        f"set hardware.gpu_type to one of {', '.join(GPU_TYPES)})"
    )
