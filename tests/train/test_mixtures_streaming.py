"""Real runs of the tiny model on a mixture and on a stream: the samples each step trained on come from the
sources in the weights' proportions; a run killed (SIGKILL, through the real CLI) in the middle of a step after
its step-3 checkpoint and continued with --resume gives the uninterrupted run's losses exactly, for a mixture read
whole and for a stream (whose buffer is read back from the checkpoint's offsets). The uninterrupted runs and the
resumes run in-process through the launcher, as `finetune run` does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.commands.run import LaunchOptions, launch
from finetune.train.checkpoint import checkpointer as ck
from tests.support import tiny_recipe, write_jsonl, write_recipe

pytestmark = pytest.mark.slow  # trainings of a few steps


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _sources(tmp: Path, rows: tuple[int, int]) -> list[dict]:
    write_jsonl(tmp / "a.jsonl", [{"text": f"apple {i} apple"} for i in range(rows[0])])
    write_jsonl(tmp / "b.jsonl", [{"text": f"berry {i} berry"} for i in range(rows[1])])
    return [{"path": str(tmp / "a.jsonl"), "weight": 0.75}, {"path": str(tmp / "b.jsonl"), "weight": 0.25}]


def _recipe(tmp: Path, name: str, data: dict, rows: tuple[int, int] = (50, 30), **train: object) -> Path:
    r = tiny_recipe(
        tmp / name,
        data={"train": _sources(tmp, rows), "eval": None, "format": "text", "max_seq_len": 32,
              "cache_dir": str(tmp / "cache"), **data},
        train={"global_batch_size": 16, "micro_batch_size": 16, "lr": 2e-3, **train},
        output={"dir": str(tmp / name), "log_every": 1, "save_every": 3},
    )
    return write_recipe(tmp / f"{name}.yaml", r)


def _killed_in_step_5(recipe: Path, out: Path) -> None:
    """`finetune run RECIPE` SIGKILLed in step 5 (after its backward), checkpoint step-3 complete."""
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(recipe)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "FINETUNE_TEST_KILL_AT_STEP": "0:5"},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert ck.latest_checkpoint(out).name == "step-3"
    assert [s for s, _ in _losses(out)] == [1, 2, 3, 4]  # step 5 died before its row was written


@pytest.fixture(scope="module")
def mixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted mixture run: 8 steps of 16 over the mixture's 80 samples (an epoch is 5 steps)."""
    tmp = tmp_path_factory.mktemp("mixture")
    assert launch(str(_recipe(tmp, "mix", {}, max_steps=8)), []) == 0
    return tmp


def test_a_run_on_a_mixture_trains_on_the_sources_in_the_weights_proportions(mixture: Path) -> None:
    """The first epoch (5 steps of 16) of the mixture's 80 samples: 60 drawn from a (50 rows), 20 from b (30 rows)."""
    rows = [json.loads(x) for x in (mixture / "mix" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][:5]
    a = [r["samples/data.train.0"] for r in rows]
    b = [r["samples/data.train.1"] for r in rows]
    assert [x + y for x, y in zip(a, b, strict=True)] == [16.0] * 5
    assert abs(sum(a) / (sum(a) + sum(b)) - 0.75) <= 0.03 and sum(a) == 60


def test_a_mixture_run_killed_mid_step_resumes_to_the_uninterrupted_losses(mixture: Path, tmp_path: Path) -> None:
    """Killed in step 5, resumed from step 3: steps 4..8 (across the epoch's end, where the mixture's samples are
    shuffled again) give the uninterrupted run's losses exactly."""
    whole = _losses(mixture / "mix")
    assert [s for s, _ in whole] == list(range(1, 9))
    recipe = _recipe(tmp_path, "killed", {}, max_steps=8)
    _killed_in_step_5(recipe, tmp_path / "killed")
    assert launch(str(recipe), [], LaunchOptions(resume="latest")) == 0
    assert _losses(tmp_path / "killed") == whole  # identical floats; steps 4..8 computed by the resumed run


def test_a_streamed_run_killed_mid_stream_resumes_to_the_uninterrupted_losses(tmp_path: Path) -> None:
    """6 steps of 16 samples through a buffer of 24 rows from sources of 20 and 10 rows: both start over before
    step 3's checkpoint; killed in step 5, the resumed run reads the buffer back from the checkpoint's offsets
    and gives steps 4..6 of the uninterrupted run exactly."""
    data = {"streaming": True, "shuffle_buffer": 24}
    assert launch(str(_recipe(tmp_path, "whole", data, (20, 10), max_steps=6)), []) == 0
    whole = _losses(tmp_path / "whole")
    assert [s for s, _ in whole] == list(range(1, 7))
    step3 = tmp_path / "whole" / "checkpoints" / "step-3"
    stream = ck.read_meta(step3)["position"]["stream"]
    assert stream["made"] == 3 and len(stream["buffer"]) == 23 and sum(stream["rows"]) == 3 * 16 + 23
    assert min(c[3] for c in stream["cursors"]) >= 1  # each source in its second pass (or later)
    recipe = _recipe(tmp_path, "killed", data, (20, 10), max_steps=6)
    _killed_in_step_5(recipe, tmp_path / "killed")
    assert launch(str(recipe), [], LaunchOptions(resume="latest")) == 0
    assert _losses(tmp_path / "killed") == whole  # identical floats; steps 4..6 computed by the resumed run
