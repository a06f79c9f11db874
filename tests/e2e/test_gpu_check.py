"""scripts/gpu_check.sh --dry-run: every section's CPU path in one worker process, at most 8 files under $OUT
(summary.json with every section's record and the budget planned for, logs.tar.gz with the logs), and a
section that fails (raises, dies, or hangs past its limit) does not stop the next ones. The dry run takes the
harness on gloo, two-step CLI runs of micro models, the plan of the compiled recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from scripts.gpu_check.registry import BUDGET_S, BY_NAME, SECTIONS, planned_s
from tests.support import ROOT

#: Sections whose dry run may be skipped, and the reason's start (a feature this build may lack).
MAY_SKIP = {"moe_lora": "not in this build", "moe_experts": "not in this build"}


def gpu_check(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`bash scripts/gpu_check.sh ARGS` with OUT and the scratch folder in ``tmp_path``."""
    out = tmp_path / "out"
    full_env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_WORK": str(tmp_path / "work"),
                **env}
    full_env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=1800)
    return proc, out


def files_under(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.is_file()]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path, dict]:
    tmp = tmp_path_factory.mktemp("gpu_check")
    started = time.perf_counter()
    proc, out = gpu_check(tmp, "--dry-run")
    print(f"dry run: {time.perf_counter() - started:.1f} s")
    summary = json.loads((out / "summary.json").read_text())
    return proc, out, {r["section"]: r for r in summary["sections"]} | {"": summary}


@pytest.mark.slow
def test_dry_run_leaves_a_summary_of_every_section_within_eight_files(dry_run) -> None:
    proc, out, got = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = files_under(out)
    assert len(files) <= 8 and {p.name for p in files} == {"summary.json", "logs.tar.gz"}, files
    summary = got[""]
    assert summary["mode"] == "dry-run" and summary["ok"] is True
    assert summary["budget_s"] == BUDGET_S <= 480 and summary["planned_s"] <= summary["budget_s"]
    assert [r["section"] for r in summary["sections"]] == [s.name for s in SECTIONS] and len(SECTIONS) >= 8
    for s in SECTIONS:
        data = got[s.name]
        if data["status"] == "skipped":
            assert data["reason"].startswith(MAY_SKIP[s.name]), (s.name, data["reason"])
        else:
            assert data["status"] == "ok", (s.name, data["reason"], data.get("log_tail"))
            assert data["mode"] == "dry-run" and all(c["ok"] for c in data["checks"]), (s.name, data["checks"])
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"logs/{s.name}.log" for s in SECTIONS} <= names and {f"sections/{s.name}.json" for s in SECTIONS} <= names
    assert "every section ok or skipped" in proc.stdout


@pytest.mark.slow
def test_dry_run_figures(dry_run) -> None:
    _, _, got = dry_run
    pre = got["preconditions"]["figures"]
    assert pre["gpu_mapping_of_h200"]["gpu_type"] == "h200" and pre["gpu_mapping_of_h200"]["peak_flops"]["bf16"] > 5e14
    assert pre["floors_met"] is True and pre["detected"]["kv_cache_name"] in ("cache", "past_key_values")

    harness = got["harness"]["figures"]
    assert harness["backend"] == "gloo" and harness["process_group"]["cpu_all_reduce"] == "ok"
    assert harness["offload"]["shards_on"] == ["cpu"] and harness["offload"]["max_rel_loss_diff"] < 0.02
    assert harness["full_bf16"]["fused"] is True and harness["full_bf16"]["max_rel_loss_diff"] < 0.02
    assert harness["checkpointer"]["weights_max_diff"] == 0.0 and harness["checkpointer"]["moments_max_diff"] == 0.0
    assert harness["checkpointer"]["next_loss"] == harness["checkpointer"]["next_loss_after_load"]
    assert harness["qlora"]["sharded_load_loss"] == harness["qlora"]["whole_load_loss"]
    assert harness["fp16"]["weights_moved_max"] > 0 and harness["fp16"]["steps"][0]["scale"] == 65536.0

    assert got["optimizer8bit"]["figures"]["load"]["state_max_diff"] == 0.0
    assert got["optimizer8bit"]["figures"]["load"]["state_tensors"] > 0
    assert got["hsdp"]["figures"]["layout"]["mesh_shape"] == [1, 1]
    qlora8 = got["qlora8"]["figures"]
    assert qlora8["layer"]["linear8bit_layers"] > 0 and abs(qlora8["plan_error"]) <= 0.10
    stages = got["pipeline"]["figures"]["stages"]
    assert stages["grads_compared"] == stages["whole_grads"] > 0 and stages["loss_rel_diff"] <= 1e-5

    (run,) = got["memory"]["figures"]["runs"].values()
    assert run["exit_code"] == 0 and run["memory"]["measured_peak"] > 0 and run["final_eval"] is not None
    attention = got["attention"]["figures"]
    assert set(attention["results"]) == {"sdpa", "sdpa_packed", "flex_packed"}
    assert attention["flex_vs_sdpa_packed"]["loss_rel_diff"] <= 1e-4
    if got["moe_experts"]["status"] == "ok":
        assert got["moe_experts"]["figures"]["loss_max_rel_diff"] <= 1e-4
    if got["moe_lora"]["status"] == "ok":
        assert got["moe_lora"]["figures"]["run"]["saved_expert_tensors"] > 0
    assert got["compile"]["figures"]["plan"]["compile"] is True
    dpo = got["dpo"]["figures"]["run"]
    assert len(dpo["losses"]) == 2 and {"rewards/accuracy", "rewards/margin"} <= set(dpo["logged"])
    assert got["chat_eval"]["figures"]["chat"]["exit_code"] == 0
    assert got["throughput"]["figures"]["run"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_a_failing_section_does_not_stop_the_others(tmp_path: Path) -> None:
    """One section raises, one dies, one hangs past its limit (killed, with its children); the last still runs
    in a new worker, and the summary records all four."""
    proc, out = gpu_check(
        tmp_path, "--dry-run", "--only", "preconditions,harness,hsdp,pipeline",
        GPU_CHECK_FAIL="preconditions,harness:exit,hsdp:hang", GPU_CHECK_LIMITS="hsdp=3",
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["section"]: r for r in summary["sections"]}
    assert [r["status"] for r in summary["sections"]] == ["failed", "failed", "timed out", "ok"]
    assert "GPU_CHECK_FAIL=preconditions" in rows["preconditions"]["reason"]
    assert "RuntimeError" in rows["preconditions"]["error"]
    assert rows["harness"]["exit_code"] == 3 and "exited with code 3" in rows["harness"]["reason"]
    assert rows["hsdp"]["limit_s"] == 3 and "stopped at its limit" in rows["hsdp"]["reason"]
    assert summary["ok"] is False and len(files_under(out)) <= 8
    assert "some section failed or timed out" in proc.stdout


def test_the_plan_fits_the_budget_and_a_section_past_it_is_skipped(tmp_path: Path, monkeypatch) -> None:
    """The GPU estimates add up to less than the budget; a worker whose budget has run out records each
    section as skipped with the seconds left, without running it."""
    from scripts.gpu_check.__main__ import worker
    from scripts.gpu_check.report import section_record

    assert planned_s() <= BUDGET_S <= 480
    monkeypatch.setenv("GPU_CHECK_STARTED", str(time.time() - BUDGET_S + 30))  # 30 s of the budget left
    monkeypatch.setenv("GPU_CHECK_FAIL", "compile:exit")  # would end this process if it ran
    worker(["memory", "compile"], tmp_path, dry_run=False)  # estimates 70 s and 60 s: neither fits
    for name in ("memory", "compile"):
        data = section_record(tmp_path, BY_NAME[name])
        assert data is not None and data["status"] == "skipped", data
        assert data["reason"].startswith("not started: ") and f"of the {BUDGET_S} s budget left" in data["reason"]
        assert f"needs ~{BY_NAME[name].estimate_s} s" in data["reason"]
