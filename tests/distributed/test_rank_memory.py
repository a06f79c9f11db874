"""Two gloo processes measure their own memory and rank 0 compares the plan with the worst of them; the logged
tokens/s of the same run, evaluating after every step, counts training time only.

The ranks see different micro-batches and, under ZeRO-1 over prefix tuning (a single trained tensor), rank 0
alone holds the optimizer state: their measurements differ, each the rank's own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import step_rows, tiny_recipe, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.dist]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("rank-memory")
    out = tmp / "out"
    recipe = tiny_recipe(
        out, method="prefix", prefix={"num_virtual_tokens": 4}, distributed={"strategy": "zero1", "nproc": 2},
        train={"max_steps": 2, "global_batch_size": 4, "micro_batch_size": 2},
        eval={"at_start": False, "every": 1, "max_samples": 4, "max_new_tokens": 4},
    )
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(write_recipe(tmp / "r.yaml", recipe)), "--measure-memory"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "1000"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_every_rank_is_measured_and_the_plan_is_compared_with_the_worst(run: tuple[Path, str]) -> None:
    out, stdout = run
    mem = json.loads((out / "memory.json").read_text())
    ranks = mem["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["measured_peak"] > 0 for r in ranks), ranks
    assert ranks[0]["measured_peak"] != ranks[1]["measured_peak"], ranks  # each rank's own figure
    worst = max(ranks, key=lambda r: r["measured_peak"])
    assert (mem["worst_rank"], mem["measured_peak"]) == (worst["rank"], worst["measured_peak"])
    assert mem["error"] == pytest.approx((mem["predicted"] - worst["measured_peak"]) / worst["measured_peak"])
    line = re.search(r"memory: predicted .*? measured (.+?) on rank (\d), the most of 2 ranks", stdout)
    assert line is not None and int(line.group(2)) == worst["rank"], stdout


def test_an_evaluation_after_every_step_leaves_the_logged_tokens_per_second_alone(run: tuple[Path, str]) -> None:
    """Each row's tokens/s is its tokens over the seconds of its step alone, though every step was followed by
    an evaluation (a wall-clock window would have counted the evaluation's seconds too)."""
    out, _ = run
    rows = step_rows(out)
    assert len(rows) == 2 and "eval_loss" in rows[0]  # the evaluation after the last step has its own row
    tokens = [0] + [r["tokens"] for r in rows]
    for before, row in zip(tokens[:-1], rows, strict=True):
        assert row["train_seconds"] > 0, row  # the evaluation's memory report after step 1 is not taken from step 2
        assert row["tokens_per_s"] == pytest.approx((row["tokens"] - before) / row["train_seconds"], rel=1e-9), row
