"""ZeRO-1 with fewer trained tensors than ranks: a rank whose share of the optimizer is empty saves and
resumes with the others (prefix tuning trains one tensor, so rank 1 of 2 holds none)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import tiny_recipe, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.dist]

CMD = [sys.executable, "-m", "finetune"]


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def test_prefix_under_zero1_checkpoints_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    recipe = tiny_recipe(
        out, method="prefix", prefix={"num_virtual_tokens": 4}, distributed={"strategy": "zero1", "nproc": 2},
        train={"max_steps": 3, "global_batch_size": 4, "micro_batch_size": 2},
        eval={"at_start": False}, output={"save_every": 2, "keep": 2},
    )
    recipe["data"].pop("eval")
    path = write_recipe(tmp_path / "r.yaml", recipe)
    whole = subprocess.run([*CMD, "run", str(path)], capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert (out / "checkpoints" / "step-2").is_dir() and (out / "checkpoints" / "step-3").is_dir()
    full = _losses(out)
    assert len(full) == 3
    # resume the step-2 checkpoint: the third step is the uninterrupted run's
    import shutil

    shutil.rmtree(out / "checkpoints" / "step-3")
    resumed = subprocess.run(
        [*CMD, "run", str(path), "--resume", str(out / "checkpoints" / "step-2")],
        capture_output=True, text=True, timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert abs(_losses(out)[-1] - full[-1]) <= 1e-4 * abs(full[-1])
