"""The plan of a mixture's experts under QLoRA: Qwen3-30B-A3B on one 24 GiB GPU, its experts in NF4 per expert."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def _plan(tmp: Path, model: str, method: str, gpu_memory: str = "24GiB") -> dict:
    env = dict(os.environ, FINETUNE_CACHE=str(tmp / "cache"), HF_HUB_OFFLINE="1")  # the catalog's entry
    done = subprocess.run(
        [sys.executable, "-m", "finetune", "plan", "--model", model, "--method", method, "--gpus", "1",
         "--gpu-memory", gpu_memory, "--json"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow  # two CLI subprocesses tracing a 48-layer model's config
def test_qwen3_30b_a3b_qlora_fits_one_24gib_gpu_with_nf4_experts(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "qwen3-30b-a3b", "qlora")
    info = plan["model"]
    base = info["param_bytes"] - 4 * info["trainable"]  # the adapters train in fp32
    assert plan["chosen"]["fits"] and plan["chosen"]["method"] == "qlora"
    assert base <= 18 * GiB, base / GiB
    experts = info["experts"]
    assert experts["tensors"] == experts["quantized"] == experts["adapted"] == 96
    assert experts["values"] / info["parameters"] > 0.9
    # each expert's codes and constants: about 0.52 bytes per expert weight
    assert 0.515 < experts["stored_bytes"] / experts["values"] < 0.52
    lora = _plan(tmp_path, "qwen3-30b-a3b", "lora")["model"]
    assert lora["param_bytes"] - 4 * lora["trainable"] > 55 * GiB  # the same experts in bf16


@pytest.mark.slow  # a CLI subprocess tracing a 48-layer model's config
def test_llama_4_scout_qlora_fits_one_80gib_gpu_with_its_16_experts_in_nf4(tmp_path: Path) -> None:
    """Llama 4 Scout from the catalog (its hub id, offline): the published 17B active of 109B, the 16 experts of
    each of the 48 layers adapted and stored in NF4, and QLoRA fits one 80 GiB GPU."""
    plan = _plan(tmp_path, "meta-llama/Llama-4-Scout-17B-16E-Instruct", "qlora", "80GiB")
    info = plan["model"]
    assert abs(info["active_parameters"] / 1e9 - 17.0) <= 0.02 * 17.0, info["active_parameters"]
    assert plan["chosen"]["fits"] and plan["chosen"]["method"] == "qlora"
    experts = info["experts"]
    assert experts["tensors"] == experts["quantized"] == experts["adapted"] == 96  # gate_up and down x 48 layers
    assert 0.515 < experts["stored_bytes"] / experts["values"] < 0.52  # NF4 codes and constants per expert
