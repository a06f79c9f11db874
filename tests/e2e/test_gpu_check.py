"""scripts/gpu_check.sh --dry-run: every section writes its JSON with its figures and status, the summary lists
them all, and a section that fails (raises, dies without its JSON, or hangs past its limit) does not stop the
next ones. The dry run takes every section's CPU path: the NCCL harness on gloo, two-step CLI runs of a micro
model, the plan of the compiled recipe; the SmolLM2/TRL comparison is skipped (it needs CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.gpu_check.memory import DRY_CONFIGS, RESUMED
from scripts.gpu_check.registry import SECTIONS
from tests.support import ROOT

pytestmark = pytest.mark.slow

KEYS = {"section", "part", "mode", "status", "reason", "measures", "limit_s", "estimate_s", "seconds", "figures",
        "checks", "log"}
DRY_STATUS = {s.name: "ok" for s in SECTIONS} | {"smollm2": "skipped"}


def gpu_check(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`bash scripts/gpu_check.sh ARGS` with OUT and the scratch folder in ``tmp_path``."""
    out = tmp_path / "out"
    full_env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_WORK": str(tmp_path / "work"),
                **env}
    full_env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=1800)
    return proc, out


def section(out: Path, name: str) -> dict:
    data = json.loads((out / f"{name}.json").read_text())
    assert data.keys() >= KEYS, sorted(KEYS - data.keys())
    return data


def test_dry_run_writes_every_section(tmp_path: Path) -> None:
    proc, out = gpu_check(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    got = {s.name: section(out, s.name) for s in SECTIONS}
    for name, data in got.items():
        log = (out / "logs" / f"{name}.log").read_text()
        assert data["status"] == DRY_STATUS[name], (name, data["reason"], log[-3000:])
        assert data["mode"] == "dry-run" and data["section"] == name
        assert all(c["ok"] for c in data["checks"]), (name, data["checks"])

    pre = got["preconditions"]["figures"]
    assert pre["gpu_mapping_of_h200"]["gpu_type"] == "h200"
    assert pre["gpu_mapping_of_h200"]["peak_flops"]["bf16"] > 5e14
    assert pre["packages"]["torch"]["ok"] is True

    harness = got["harness"]["figures"]
    assert harness["backend"] == "gloo"
    assert harness["full_bf16"]["fused"] is True and harness["full_bf16"]["max_rel_loss_diff"] < 0.02
    assert harness["checkpointer"]["weights_max_diff"] == 0.0 and harness["checkpointer"]["moments_max_diff"] == 0.0
    assert harness["checkpointer"]["next_loss"] == harness["checkpointer"]["next_loss_after_load"]
    assert harness["dcp_default_group"]["weights_max_diff"] == 0.0
    assert harness["qlora"]["codes_are_dtensors"] and harness["qlora"]["linear4bit_layers"] > 0
    assert harness["qlora"]["sharded_load_loss"] == harness["qlora"]["whole_load_loss"]
    assert harness["fp16"]["weights_moved_max"] > 0 and harness["fp16"]["steps"][0]["scale"] == 65536.0

    memory = got["memory"]["figures"]
    assert list(memory["runs"]) == list(DRY_CONFIGS)
    for name, run in memory["runs"].items():
        m = run["memory"]
        assert run["exit_code"] == 0 and run["final_eval"] is not None, name
        assert m["predicted"] > 0 and m["measured_peak"] > 0, name
        assert abs(m["error_at_measured_rows"]) < 0.5, (name, m)  # the planner's CPU figure, checked elsewhere
    assert memory["resume"]["config"] == RESUMED and memory["resume"]["max_rel_diff"] == 0.0

    opt = got["optimizer8bit"]["figures"]
    assert opt["runs"]["adamw8bit"]["plan_optimizer"] == "adamw8bit"
    assert 0.2 < opt["planned_state_ratio"] < 0.5  # two 1-byte moments (+ block scales) instead of two fp32 ones
    assert opt["measured_saving_bytes"] > 0

    compiled = got["compile"]["figures"]
    assert compiled["blocks"] > 8 and compiled["plan"]["compile"] is True
    assert compiled["plan"]["activation_checkpointing"] is True

    attention = got["attention"]["figures"]
    assert attention["flex_attention_vs_sdpa"]["loss_rel_diff"] <= 1e-4
    assert attention["batch"]["documents"] > attention["batch"]["shape"][0]  # packed rows: several documents each

    vocab = got["vocab"]["figures"]
    assert vocab["fp32_logits_bytes"] == 2 * 64 * 128256 * 4
    assert vocab["runs"]["fused"]["memory"]["measured_peak"] > 0

    assert got["smollm2"]["reason"].startswith("needs CUDA")
    assert got["smollm2"]["figures"]["job"]["precision"] == "bf16"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True and summary["mode"] == "dry-run"
    assert [r["section"] for r in summary["sections"]] == [s.name for s in SECTIONS]
    assert "skipped: needs CUDA" in proc.stdout and "every section ok or skipped" in proc.stdout


def test_a_failing_section_does_not_stop_the_others(tmp_path: Path) -> None:
    """One section raises, one dies without writing its JSON, one hangs past its limit; the last still runs.
    One section at a time, as on the GPU."""
    proc, out = gpu_check(
        tmp_path, "--dry-run", "--only", "preconditions,harness,compile,smollm2",
        GPU_CHECK_FAIL="preconditions,harness:exit,compile:hang", GPU_CHECK_LIMITS="compile=3", GPU_CHECK_JOBS="1",
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    raised = section(out, "preconditions")
    assert raised["status"] == "failed" and "GPU_CHECK_FAIL=preconditions" in raised["reason"]
    assert "RuntimeError" in raised["error"]
    died = section(out, "harness")
    assert died["status"] == "failed" and died["exit_code"] == 3
    assert "exited with code 3" in died["reason"]
    hung = section(out, "compile")
    assert hung["status"] == "timed out" and hung["exit_code"] == 124 and hung["limit_s"] == 3
    assert section(out, "smollm2")["status"] == "skipped"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False
    assert [r["status"] for r in summary["sections"]] == ["failed", "failed", "timed out", "skipped"]
    assert "some section failed or timed out" in proc.stdout
