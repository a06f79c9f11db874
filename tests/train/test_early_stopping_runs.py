"""Early stopping and SLURM's requeue through the real CLI, on one CPU process.

The recipe makes the expected steps known: a full fine-tune of the tiny model at a learning rate of 0.05
(no warmup, no clipping) improves the random weights at its first step and diverges after it, so the held-out
loss is best at step 1 and worse at every evaluation after; with patience 3 the run stops after step 4 of 8.

The same recipe runs twice: uninterrupted, and as a SLURM job (only SLURM's environment) that SLURM warns
with SIGUSR1 after step 2, which saves and exits 138, then requeued (SLURM_RESTART_COUNT=1, the same command
line as the script of `finetune slurm`: `--resume auto`). The second must match the first: the losses, the
stopping step, the best checkpoint and the final weights exactly, the evaluations within 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.commands.run import LaunchOptions, launch
from finetune.train.checkpoint import checkpointer as ck
from tests.support import max_rel, tiny_recipe, write_recipe

pytestmark = pytest.mark.slow  # trainings through the CLI

PATIENCE, STEPS, SIGNALLED_AT = 3, 8, 2


def _recipe(tmp: Path, out: Path) -> Path:
    r = tiny_recipe(
        out,
        train={"max_steps": STEPS, "lr": 0.05, "warmup_steps": 0, "max_grad_norm": 0,
               "early_stopping": {"patience": PATIENCE}},
        eval={"every": 1, "at_start": False, "max_samples": 8, "max_new_tokens": 2},
        output={"save_every": 1, "keep": 1},
    )
    return write_recipe(tmp / f"{out.name}.yaml", r)


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _run(recipe: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(recipe), "--resume", "auto"],
        capture_output=True, text=True, timeout=600, env={**os.environ, **env},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("early")
    plain, job = tmp / "plain", tmp / "job"
    assert launch(str(_recipe(tmp, plain)), [], LaunchOptions()) == 0
    slurm = {"SLURM_JOB_ID": "9001", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": "0",
             "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_RESTART_COUNT": "0",
             "FINETUNE_TEST_SIGNAL_AT_STEP": f"USR1:{SIGNALLED_AT}"}
    recipe = _recipe(tmp, job)
    warned = _run(recipe, slurm)
    saved = json.loads((ck.checkpoints_dir(job) / f"step-{SIGNALLED_AT}" / ck.META).read_text())
    requeued = _run(recipe, {**slurm, "SLURM_RESTART_COUNT": "1"})
    return {"plain": plain, "job": job, "warned": warned, "saved": saved, "requeued": requeued}


def test_the_run_stops_where_the_metric_says_and_keeps_the_best_checkpoint(runs: dict) -> None:
    out = runs["plain"]
    evals = {r["step"]: r["eval_loss"] for r in _rows(out) if "eval_loss" in r}
    steps = [r["step"] for r in _rows(out) if "loss" in r]
    # the construction: best at step 1, worse at every evaluation after it
    assert all(evals[s] > evals[1] for s in evals if s > 1), evals
    assert steps == list(range(1, 1 + PATIENCE + 1)) == sorted(evals)  # stopped after step 4 of 8
    best = json.loads((ck.checkpoints_dir(out) / ck.BEST).read_text())
    assert best == {"step": 1, "checkpoint": "checkpoints/step-1", "metric": "eval_loss", "value": evals[1],
                    "mode": "min"}
    # output.keep 1 keeps the newest checkpoint, and the best one besides
    assert [s for s, _ in ck.list_checkpoints(out)] == [1, 4]
    meta = json.loads((ck.checkpoints_dir(out) / "step-4" / ck.META).read_text())
    assert meta["final"] and meta["early_stopping"] == {
        "metric": "eval_loss", "best_value": evals[1], "best_step": 1, "bad_evaluations": 3, "stopped_at": 4
    }
    # final_model: best (the default) saves step 1's weights, not step 4's
    final, best_w, last_w = (load_file(str(out / "model.safetensors")), ck.read_weights(ck.checkpoints_dir(out) / "step-1"),
                             ck.read_weights(ck.checkpoints_dir(out) / "step-4"))
    assert all(torch.equal(final[k], best_w[k]) for k in best_w)
    assert any(not torch.equal(final[k], last_w[k]) for k in last_w)


def test_sigusr1_saves_and_the_requeued_job_resumes_to_the_same_run(runs: dict) -> None:
    warned, requeued = runs["warned"], runs["requeued"]
    assert warned.returncode == 138, warned.stdout[-2000:] + warned.stderr[-3000:]
    assert "SIGUSR1 received: finishing this step and saving a checkpoint" in warned.stdout
    assert "(a requeued SLURM job resumes from it by itself)" in warned.stdout
    # the checkpoint SLURM's warning saved holds the count: best at step 1, one evaluation without improvement
    assert runs["saved"]["step"] == SIGNALLED_AT and runs["saved"]["early_stopping"]["best_step"] == 1
    assert runs["saved"]["early_stopping"]["bad_evaluations"] == 1
    assert requeued.returncode == 0, requeued.stdout[-2000:] + requeued.stderr[-3000:]
    assert f"resumed from {runs['job']}/checkpoints/step-{SIGNALLED_AT} at step {SIGNALLED_AT} of {STEPS}" in \
        requeued.stdout
    plain, job = runs["plain"], runs["job"]

    def series(out: Path, key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in _rows(out) if key in r]

    assert series(job, "loss") == series(plain, "loss")  # exactly: fp32 on CPU is deterministic
    # the evaluations at the same steps; their values within 1e-5 (a CPU evaluation's sums may run in another order)
    evals = [series(o, "eval_loss") for o in (job, plain)]
    assert [s for s, _ in evals[0]] == [s for s, _ in evals[1]] == [1, 2, 3, 4]
    assert max_rel([v for _, v in evals[0]], [v for _, v in evals[1]]) < 1e-5
    best, best_plain = (json.loads((ck.checkpoints_dir(o) / ck.BEST).read_text()) for o in (job, plain))
    assert best.pop("value") == pytest.approx(best_plain.pop("value"), rel=1e-5) and best == best_plain
    meta = [json.loads((ck.checkpoints_dir(o) / "step-4" / ck.META).read_text())["early_stopping"] for o in (job, plain)]
    assert meta[0].pop("best_value") == pytest.approx(meta[1].pop("best_value"), rel=1e-5) and meta[0] == meta[1]
    a, b = load_file(str(job / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b)
    best = json.loads((ck.checkpoints_dir(job) / ck.BEST).read_text())["value"]
    assert (
        f"early stopping: stopped after step 4 of {STEPS} (3 evaluation(s) without an improvement); best eval_loss "
        f"{best:.4f} at step 1 (checkpoints/step-1)" in requeued.stdout
    )
    # the summary's final evaluation is the saved (best) model's
    assert f"final eval: loss {best:.4f}" in requeued.stdout


def test_an_improving_run_is_not_stopped_and_its_final_evaluation_can_be_the_best(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """eval.every 2 of 4 steps at a learning rate that improves: the evaluation after step 4 is the final one,
    and the best (patience 1 never runs out)."""
    out = tmp_path / "improving"
    r = tiny_recipe(
        out, train={"max_steps": 4, "lr": 3e-3, "early_stopping": {"patience": 1}},
        eval={"every": 2, "at_start": False, "max_samples": 8, "max_new_tokens": 2},
    )
    assert launch(str(write_recipe(tmp_path / "improving.yaml", r)), [], LaunchOptions()) == 0
    evals = [row["eval_loss"] for row in _rows(out) if "eval_loss" in row]
    assert evals[1] < evals[0]  # the construction: step 4 improves on step 2
    best = json.loads((ck.checkpoints_dir(out) / ck.BEST).read_text())
    assert (best["step"], best["value"]) == (4, evals[1])
    meta = json.loads((ck.checkpoints_dir(out) / "step-4" / ck.META).read_text())
    assert meta["early_stopping"]["bad_evaluations"] == 0 and meta["early_stopping"]["stopped_at"] is None
    assert f"early stopping: not triggered in 4 steps; best eval_loss {evals[1]:.4f} at step 4" in capsys.readouterr().out
    final, last = load_file(str(out / "model.safetensors")), ck.read_weights(ck.checkpoints_dir(out) / "step-4")
    assert all(torch.equal(final[k], last[k]) for k in last)
