"""Section preconditions: can the rest run here, and on what? Reported, never failed: a version below
pyproject's floor or a wheel for another Python is a note in the record, and the sections that need what is
missing say so themselves.

- Python against the wheels carried in ``.whl/`` (a ``cp312`` wheel needs Python 3.12);
- the installed torch, transformers, peft, bitsandbytes, datasets, pydantic against pyproject's floors, where
  each was imported from (the carried wheels in /tmp/site, or the machine's image), and what
  ``finetune.versions`` detects in them (DDP's buffer keyword, the KV cache's name);
- torch's CUDA build, the device, NCCL's version;
- bitsandbytes' native library: the CUDA one must load (its class is ``CudaBNBNativeLibrary``), and a 4-bit
  quantize/dequantize round trip must run on the device (checks: the QLoRA sections depend on them);
- the device name -> ``gpu_type`` -> peak FLOP/s through the tool's own functions
  (``finetune.plan.hardware.gpu_type_of``, ``peak_flops``, ``detect_hardware``): MFU is only reported for a
  GPU the table knows.

On CPU (``--dry-run``) the same, with no device: the mapping is exercised on the H200's name instead.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re
import sys
from pathlib import Path
from typing import Any

from scripts.gpu_check.jobs import ROOT
from scripts.gpu_check.report import Check

PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "datasets", "pydantic", "safetensors", "accelerate",
            "pyarrow", "huggingface_hub", "lm_eval")
#: What an H200 reports (torch.cuda.get_device_name, total memory): the mapping's dry-run input.
H200 = ("NVIDIA H200", 143771 * 2**20)


def minimums() -> dict[str, str]:
    """pyproject's ``name>=version`` dependencies."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    found = re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9][^",;\s]*)"', deps.group(1) if deps else "")
    return {name.lower(): version for name, version in found}


def wheels() -> list[dict[str, Any]]:
    """The wheels in ``.whl/`` and whether their Python tag fits this interpreter."""
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    out = []
    for w in sorted((ROOT / ".whl").glob("*.whl")):
        tags = w.name[:-4].split("-")
        python_tag = tags[-3] if len(tags) >= 5 else "?"
        fits = python_tag.startswith("py3") or here in python_tag or python_tag == f"py{here[2:]}"
        out.append({"wheel": w.name, "python_tag": python_tag, "fits": fits})
    return out


def _version_ok(installed: str | None, minimum: str | None) -> bool | None:
    if installed is None:
        return False
    if minimum is None:
        return None
    from packaging.version import Version

    return Version(installed.split("+")[0]) >= Version(minimum)


def packages(mins: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each package's installed version, pyproject's minimum, and where it lives."""
    out: dict[str, dict[str, Any]] = {}
    for name in PACKAGES:
        try:
            version: str | None = md.version(name)
        except md.PackageNotFoundError:
            version = None
        spec = importlib.util.find_spec(name) if version else None
        where = str(Path(spec.origin).parent.parent) if spec and spec.origin else None
        out[name] = {"version": version, "minimum": mins.get(name), "ok": _version_ok(version, mins.get(name)),
                     "from": where}
    return out


def bitsandbytes_native(device: str) -> dict[str, Any]:
    """Which native library bitsandbytes loaded, and a 4-bit round trip on ``device``."""
    import torch

    info: dict[str, Any] = {}
    try:
        import bitsandbytes as bnb
        from bitsandbytes import cextension

        lib = cextension.lib
        info["library_class"] = type(lib).__name__
        info["compiled_with_cuda"] = bool(getattr(lib, "compiled_with_cuda", False))
        info["backend"] = getattr(cextension, "BNB_BACKEND", None)
        dll = getattr(lib, "_lib", None)
        info["library"] = Path(getattr(dll, "_name", "") or "").name or None
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(256, 256, generator=gen).to(device=device, dtype=torch.bfloat16)
        codes, state = bnb.functional.quantize_4bit(w, quant_type="nf4")
        back = bnb.functional.dequantize_4bit(codes, state)
        info["nf4_round_trip_rel_error"] = round(float((back.float() - w.float()).norm() / w.float().norm()), 5)
    except Exception as exc:  # a missing or broken binary is what this section reports
        info["error"] = f"{type(exc).__name__}: {exc}"[:400]
    return info


def _nccl_version(torch: Any) -> str | None:
    """NCCL's version as torch reports it (a tuple, or an int in older builds), None without NCCL."""
    try:
        v = torch.cuda.nccl.version()
    except Exception:
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def gpu_mapping(name: str, memory: int | None) -> dict[str, Any]:
    """The tool's own mapping of a device name to its gpu_type and dense peak FLOP/s per dtype."""
    hardware = importlib.import_module("finetune.plan.hardware")
    gpu_type = hardware.gpu_type_of(name, memory)
    peaks = {dtype: hardware.peak_flops(gpu_type, dtype) for dtype in ("bf16", "fp16", "tf32", "fp32")}
    return {"device_name": name, "memory_bytes": memory, "gpu_type": gpu_type, "peak_flops": peaks}


def run(check: Check) -> None:
    """The section (see the module's docstring)."""
    mins = minimums()
    check.figure("python", sys.version.split()[0])
    carried = check.figure("wheels", wheels())
    pkgs = check.figure("packages", packages(mins))
    import torch

    check.figure(
        "torch_build",
        {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
         "device_count": torch.cuda.device_count()},
    )
    from finetune import versions

    check.figure("detected", versions.report())
    unmet = [f"{n} {p['version']} < {p['minimum']}" for n, p in pkgs.items() if p["ok"] is False and n in mins]
    check.figure("floors_met", not unmet)
    if unmet:
        check.note(f"below pyproject's floors: {', '.join(unmet)}")
    misfit = [w["wheel"] for w in carried if not w["fits"]]
    if misfit and not check.dry_run:  # the dry run installs no wheels: they are for the lent machine's Python
        check.note(f"carried wheels for another Python: {', '.join(misfit)}")
    if check.dry_run:
        mapped = check.figure("gpu_mapping_of_h200", gpu_mapping(*H200))
        check.expect("the H200's name maps to a gpu_type with a bf16 peak",
                     mapped["gpu_type"] is not None and mapped["peak_flops"]["bf16"] is not None, mapped["gpu_type"])
        check.figure("bitsandbytes", bitsandbytes_native("cpu"))
        det = check.figures["detected"]
        check.figure("headline", f"torch {det['torch']}, transformers {det['transformers']} (KV cache "
                                 f"`{det['kv_cache_name']}`); floors {'met' if not unmet else 'not met'}; "
                                 f"H200 -> {mapped['gpu_type']}")
        return
    if not torch.cuda.is_available():
        check.note("torch sees no CUDA device: every section takes its GPU path and fails on that")
        check.figure("headline", f"no CUDA device; torch {torch.__version__}")
        return
    props = torch.cuda.get_device_properties(0)
    check.figure(
        "device",
        {"name": props.name, "total_memory": int(props.total_memory), "capability": f"{props.major}.{props.minor}",
         "multiprocessors": props.multi_processor_count, "bf16": torch.cuda.is_bf16_supported(),
         "nccl": _nccl_version(torch)},
    )
    mapped = check.figure("gpu_mapping", gpu_mapping(props.name, int(props.total_memory)))
    hardware = importlib.import_module("finetune.plan.hardware")
    detected = hardware.detect_hardware().to_dict()
    check.figure("detect_hardware", detected)
    bnb = check.figure("bitsandbytes", bitsandbytes_native("cuda"))
    if str(bnb.get("error", "")).startswith("ModuleNotFoundError"):
        check.note("bitsandbytes is not installed (scripts/gpu_wheels.sh carries it): QLoRA and 8-bit fail")
    else:
        check.expect("bitsandbytes loaded its CUDA binary", bnb.get("compiled_with_cuda") is True,
                     bnb.get("library") or bnb.get("error"))
        check.expect("bitsandbytes' NF4 round trip on the GPU", bnb.get("nf4_round_trip_rel_error", 1.0) < 0.15,
                     bnb.get("nf4_round_trip_rel_error"))
    check.expect("the device maps to a gpu_type", mapped["gpu_type"] is not None, props.name)
    check.expect("that gpu_type has a bf16 peak (MFU)", mapped["peak_flops"]["bf16"] is not None)
    check.expect("detect_hardware agrees", detected.get("gpu_type") == mapped["gpu_type"], detected.get("gpu_type"))
    peak = mapped["peak_flops"]["bf16"]
    check.figure(
        "headline",
        f"{props.name} -> {mapped['gpu_type']}, {peak / 1e12:.0f} TFLOP/s bf16; torch {torch.__version__}"
        if peak else f"{props.name} -> {mapped['gpu_type']} (no peak); torch {torch.__version__}",
    )
