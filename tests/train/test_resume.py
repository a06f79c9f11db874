"""Exact resume on one CPU process, through the real CLI where a signal is involved.

The reference is one uninterrupted 8-step run of the tiny model (48 samples, global batch 8: 6 steps per
epoch, so the runs cross an epoch boundary). Every other run stops somewhere (a resume from a saved checkpoint,
SIGKILL during a step, SIGKILL during a checkpoint write, SIGTERM, Ctrl-C) and is continued with --resume; its
per-step losses and final weights must equal the reference's exactly (fp32 on CPU is deterministic).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from finetune.cli import app
from finetune.commands.run import LaunchOptions, launch
from finetune.train.checkpoint import checkpointer as ck
from tests.fault_hooks import CHECKPOINT_SLEEP
from tests.support import RECIPES, TINY_MODEL, tiny_recipe, write_recipe

STEPS = 8

pytestmark = pytest.mark.slow  # trainings through the CLI, killed and resumed


def _recipe(tmp: Path, out: Path, **output: object) -> Path:
    data = tmp / "train48.jsonl"
    if not data.exists():
        rows = (RECIPES / "data/reverse/train.jsonl").read_text().splitlines()[:48]
        data.write_text("\n".join(rows) + "\n")
    r = tiny_recipe(
        out,
        data={"train": str(data), "eval": None, "max_seq_len": 48},
        train={"max_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 4, "lr": 2e-3, "warmup_steps": 2},
        output={"dir": str(out), "log_every": 1, **output},
    )
    return write_recipe(tmp / f"{out.name}.yaml", r)


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """A run directory's final weights, or a checkpoint's (read from its sharded state)."""
    if (path / ck.META).is_file():
        return ck.read_weights(path)
    return load_file(str(path / "model.safetensors"))


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run (checkpoints at 4 and 8)."""
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "ref"
    t0 = time.perf_counter()
    assert launch(str(_recipe(tmp, out, save_every=4, keep=3)), []) == 0
    seconds = time.perf_counter() - t0
    losses = _losses(out)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    return {"out": out, "losses": losses, "weights": _weights(out), "seconds": seconds}


def _spawn(recipe: Path, *args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "finetune", "run", str(recipe), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env},
    )


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended before the test could interrupt it:\n{proc.stdout.read()}"
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_resume_from_step_4_matches_the_uninterrupted_run(reference: dict, tmp_path: Path) -> None:
    ckpt = reference["out"] / "checkpoints" / "step-4"
    meta = ck.read_meta(ckpt)
    assert meta["step"] == 4 and meta["position"]["epoch"] == 0 and meta["position"]["step_in_epoch"] == 4
    assert meta["history"] == [loss for _, loss in reference["losses"][:4]]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "meta.json", "plan.json", "recipe.yaml", "state", "trainer.pt"
    ]
    out = tmp_path / "resumed"
    assert launch(str(_recipe(tmp_path, out)), [], LaunchOptions(resume=str(ckpt))) == 0
    assert _losses(out) == reference["losses"][4:]  # identical floats, steps 5..8 (across the epoch end)
    _assert_same_weights(_weights(out), reference["weights"])


def _max_step(out: Path) -> int:
    m = out / "metrics.jsonl"
    rows = [json.loads(x) for x in m.read_text().splitlines() if x.endswith("}")] if m.exists() else []
    return max((r["step"] for r in rows), default=0)


def test_sigkill_sigterm_and_a_killed_write_then_resume(reference: dict, tmp_path: Path) -> None:
    """One run, stopped three ways through the real CLI, then finished: the result is the uninterrupted run's.

    A: SIGKILL during a step (checkpoint 3 complete) -> B: bare `--resume`, SIGTERM (saves step k, prints the
    resume command, exit 143) -> C: `--resume latest`, SIGKILL in the middle of writing the next checkpoint ->
    D: `--resume latest` finishes.
    """
    out = tmp_path / "stopped"
    recipe = _recipe(tmp_path, out, save_every=3)
    slow = {"FINETUNE_TEST_STEP_SLEEP": "0.15"}

    a = _spawn(recipe, env=slow)
    _wait_for(lambda: _max_step(out) >= 4, a)  # checkpoint 3 is complete, 6 not yet
    a.kill()
    a.wait()
    assert ck.latest_checkpoint(out).name == "step-3"

    b_started = time.time()
    b = _spawn(recipe, "--resume", env=slow)
    metrics = out / "metrics.jsonl"
    _wait_for(lambda: metrics.stat().st_mtime > b_started and _max_step(out) >= 5, b)
    b.send_signal(signal.SIGTERM)
    stdout, _ = b.communicate(timeout=300)
    assert b.returncode == 143, stdout
    k = ck.read_meta(ck.latest_checkpoint(out))["step"]
    assert 5 <= k < STEPS
    assert "resumed from" in stdout and "step-3 at step 3 of 8" in stdout
    assert "SIGTERM received: finishing this step and saving a checkpoint" in stdout
    assert f"checkpoint saved: {out}/checkpoints/step-{k} (step {k} of {STEPS})" in stdout
    assert f"resume with: finetune run {recipe} --resume" in stdout

    next_save = 6 if k < 6 else STEPS
    c = _spawn(recipe, "--resume", "latest", env={CHECKPOINT_SLEEP: f"{next_save}:60"})  # that write stalls
    root = ck.checkpoints_dir(out)
    _wait_for(lambda: any((p / "trainer.pt").exists() for p in root.glob(f".tmp-step-{next_save}-*")), c)
    c.kill()
    c.wait()
    partial = next(root.glob(f".tmp-step-{next_save}-*"))
    assert (partial / "state" / ".metadata").exists() and not (partial / "meta.json").exists()
    assert ck.list_checkpoints(out)[-1][0] == k  # the partial write is not a checkpoint
    assert ck.resolve_resume("latest", out).name == f"step-{k}"

    assert launch(str(recipe), [], LaunchOptions(resume="latest")) == 0
    assert not partial.exists()  # leftovers are removed by the next save
    assert _losses(out) == reference["losses"]  # metrics.jsonl continued at each resume: every step once
    _assert_same_weights(_weights(out), reference["weights"])


def test_ctrl_c_saves_and_prints_the_resume_command(
    reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ctrl-c"
    recipe = _recipe(tmp_path, out)  # save_every 0: only Ctrl-C's and the final save
    monkeypatch.setenv("FINETUNE_TEST_STEP_SLEEP", "0.15")

    def press_ctrl_c() -> None:
        end = time.monotonic() + 240
        while _max_step(out) < 3 and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # what the terminal sends this process on Ctrl-C

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    assert launch(str(recipe), []) == 130
    stdout = capfd.readouterr().out
    step = ck.read_meta(ck.latest_checkpoint(out))["step"]
    assert 3 <= step < STEPS
    assert (
        "SIGINT received: finishing this step and saving a checkpoint; press Ctrl-C again to quit without saving"
        in stdout
    )
    assert f"checkpoint saved: {out}/checkpoints/step-{step} (step {step} of {STEPS})" in stdout
    assert f"resume with: finetune run {recipe} --resume" in stdout
    # The save holds the uninterrupted run's state at that step (resuming a signal's save is proven by the
    # chain test's last part).
    assert ck.read_meta(ck.latest_checkpoint(out))["history"] == [x for _, x in reference["losses"][:step]]
    if step == 4:
        _assert_same_weights(_weights(ck.latest_checkpoint(out)), _weights(reference["out"] / "checkpoints/step-4"))


def test_nonfinite_stop_names_the_step_and_last_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "nan-stop"
    recipe = _recipe(tmp_path, out, save_every=2)
    monkeypatch.setenv("FINETUNE_TEST_NAN_AT_STEP", "3")
    res = CliRunner().invoke(app, ["run", str(recipe), "--set", "train.max_steps=4"])
    assert res.exit_code == 3, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert errors == [
        f"error: step 3: the loss is nan and the gradient norm nan, training stopped (train.on_nonfinite: stop); "
        f"last good checkpoint: {out}/checkpoints/step-2 (resume with `finetune run {recipe} --set "
        "train.max_steps=4 --resume`); lower train.lr, or set train.on_nonfinite: skip"
    ]
    assert [s for s, _ in ck.list_checkpoints(out)] == [2]


def test_nonfinite_skip_leaves_the_weights_unchanged_and_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "nan-skip"
    recipe = _recipe(tmp_path, out, save_every=1, keep=10)
    monkeypatch.setenv("FINETUNE_TEST_NAN_AT_STEP", "3")
    res = CliRunner().invoke(app, ["run", str(recipe), "--set", "train.on_nonfinite=skip", "--set", "train.max_steps=4"])
    assert res.exit_code == 0, res.output
    losses = dict(_losses(out))
    assert losses[3] != losses[3] and all(losses[s] == losses[s] for s in (1, 2, 4))  # NaN only at 3
    root = ck.checkpoints_dir(out)
    _assert_same_weights(_weights(root / "step-2"), _weights(root / "step-3"))  # no update at step 3
    assert not torch.equal(_weights(root / "step-3")["lm_head.weight"], _weights(root / "step-4")["lm_head.weight"])
    assert ck.read_meta(root / "step-4")["skipped_steps"] == 1
    assert "1 steps skipped" in res.output


def test_preflight_errors_are_one_line_exit_2(reference: dict, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    other_model = tmp_path / "other-model"
    shutil.copytree(TINY_MODEL, other_model)
    step4 = reference["out"] / "checkpoints/step-4"
    runner = CliRunner()
    cases = [
        (["--resume", str(step4), "--set", "precision=bf16"],
         "was saved with the precision fp32 but this run has bf16; set precision back to fp32"),
        (["--resume", str(step4), "--set", f"model.path={other_model}"],
         f"was saved with the model {TINY_MODEL} but this run has {other_model}; set model.path back"),
        (["--set", f"output.dir={blocker}/run"], f"output.dir: cannot create {blocker}/run"),
        (["--resume", str(reference["out"] / "checkpoints/step-4"), "--set", "train.global_batch_size=4"],
         "was saved with the global batch size 8 but this run has 4; set train.global_batch_size back to 8"),
        (["--resume", str(reference["out"] / "checkpoints/step-4"), "--set", "method=lora"],
         "was saved with the method full but this run has lora"),
        (["--resume", "latest"], "--resume: no complete checkpoint in"),
        (["--set", "output.keep=1000000000"], "free but the checkpoints need about"),
    ]
    recipe = _recipe(tmp_path, tmp_path / "pre")
    for args, message in cases:
        res = runner.invoke(app, ["run", str(recipe), *args])
        lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
        assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], (args, res.output)
    assert not ck.list_checkpoints(tmp_path / "pre")  # nothing was trained


def test_fresh_run_over_an_earlier_run_is_refused_unless_overwrite(tmp_path: Path) -> None:
    """A fresh run into a finished run's output.dir is refused (it would clear that run's checkpoints and
    append to its metrics.jsonl, beside the old step-0 evaluation); --overwrite starts clean."""
    out = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tiny_recipe(out, train={"max_steps": 2}, eval={"max_samples": 4, "max_new_tokens": 2, "batch_size": 4}),
    )
    runner = CliRunner()
    res = runner.invoke(app, ["run", str(recipe)])
    assert res.exit_code == 0, res.output
    metrics = (out / "metrics.jsonl").read_text()
    checkpoints = [p.name for _, p in ck.list_checkpoints(out)]
    assert checkpoints  # the final checkpoint: what a silent fresh start would delete

    res = runner.invoke(app, ["run", str(recipe)])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (
        f"error: output.dir: {out} holds a finished run (newest checkpoint {checkpoints[-1]}); continue it "
        "with --resume, replace it with --overwrite, or choose another output.dir"
    )
    assert (out / "metrics.jsonl").read_text() == metrics
    assert [p.name for _, p in ck.list_checkpoints(out)] == checkpoints

    res = runner.invoke(app, ["run", str(recipe), "--overwrite"])
    assert res.exit_code == 0, res.output
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 2]  # one evaluation before training, two steps, the final evaluation: a clean file

    res = runner.invoke(app, ["run", str(recipe), "--overwrite", "--resume", "latest"])
    assert res.exit_code == 2 and "error: --overwrite starts over and --resume continues" in res.output


def test_fresh_run_over_metrics_without_checkpoints_is_refused(tmp_path: Path) -> None:
    """A run killed before its first checkpoint leaves metrics.jsonl only: nothing to resume, so --overwrite."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "eval_loss": 5.0}\n')
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(out, train={"max_steps": 1}))
    res = CliRunner().invoke(app, ["run", str(recipe)])
    assert res.exit_code == 2
    assert res.output.strip() == (
        f"error: output.dir: {out} holds the metrics.jsonl of an earlier run (no checkpoint to resume); "
        "replace it with --overwrite, or choose another output.dir"
    )


def _copy_checkpoint(src: Path, out: Path) -> Path:
    dst = ck.checkpoints_dir(out) / src.name
    shutil.copytree(src, dst)
    return dst


def test_incomplete_and_foreign_checkpoints_are_one_line_errors(reference: dict, tmp_path: Path) -> None:
    """A checkpoint missing its shards, or holding another model's tensors, is refused in one sentence."""
    runner = CliRunner()
    out = tmp_path / "bad"
    recipe = _recipe(tmp_path, out)
    broken = _copy_checkpoint(reference["out"] / "checkpoints/step-4", out)
    shutil.rmtree(broken / "state")
    res = runner.invoke(app, ["run", str(recipe), "--resume", str(broken)])
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert res.exit_code == 2 and errors == [
        f"error: --resume: {broken} is incomplete (its state/ or trainer.pt is missing); choose another"
    ], res.output
    # Another model's tensors under this run's identity (files copied between runs): a smaller model whose
    # checkpoint meta.json names this run's model.
    shutil.rmtree(broken)
    foreign = _copy_checkpoint(reference["out"] / "checkpoints/step-4", out)
    small = tmp_path / "small-model"
    shutil.copytree(TINY_MODEL, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "hidden_size": 128, "intermediate_size": 256}))
    meta = ck.read_meta(foreign)
    meta["identity"]["model"] = str(small)
    (foreign / ck.META).write_text(json.dumps(meta))
    res = runner.invoke(app, ["run", str(recipe), "--resume", str(foreign), "--set", f"model.path={small}"])
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1, res.output
    assert errors[0].startswith(f"error: --resume: {foreign} cannot be loaded into this run (")
    assert errors[0].endswith("it is damaged or was saved by another run or model: choose another checkpoint of this run")


def test_checkpoint_of_another_run_is_one_sentence_and_then_resumes(
    reference: dict, tmp_path: Path
) -> None:
    """Resuming a checkpoint with another seed (refused from its identity before launching) or on other
    training data (refused by the data fingerprint when the position is restored, after the model is built):
    one sentence each, nothing trained; the same checkpoint then resumes and gives the reference's steps."""
    step4 = reference["out"] / "checkpoints/step-4"
    out = tmp_path / "again"
    recipe = _recipe(tmp_path, out)
    other = tmp_path / "other48.jsonl"
    rows = (RECIPES / "data/reverse/train.jsonl").read_text().splitlines()[48:96]
    other.write_text("".join(f"{ln}\n" for ln in rows))
    cases = [
        (
            ["--set", "train.seed=1"],
            f"error: --resume: {step4} was saved with the seed 0 but this run has 1; set train.seed back to 0 "
            "or start a new run in another output.dir",
        ),
        (
            ["--set", f"data.train={other}"],
            "error: --resume: the training data, data settings, train.seed or train.global_batch_size differ from "
            "the checkpoint's, so the data order cannot be resumed exactly; resume with the same recipe",
        ),
    ]
    runner = CliRunner()
    for args, message in cases:
        res = runner.invoke(app, ["run", str(recipe), "--resume", str(step4), *args])
        errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
        assert res.exit_code == 2 and errors == [message], res.output
        assert not ck.list_checkpoints(out) and not _losses_or_none(out)
    assert launch(str(recipe), [], LaunchOptions(resume=str(step4))) == 0
    assert _losses(out) == reference["losses"][4:]
    _assert_same_weights(_weights(out), reference["weights"])


def _losses_or_none(out: Path) -> list[tuple[int, float]]:
    return _losses(out) if (out / "metrics.jsonl").is_file() else []


def test_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_resumes(
    reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "full-disk"
    recipe = _recipe(tmp_path, out, save_every=2)
    monkeypatch.setenv("FINETUNE_TEST_DISK_FULL_AT_STEP", "4")
    res = CliRunner().invoke(app, ["run", str(recipe)])
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    root = ck.checkpoints_dir(out)
    assert res.exit_code == 2 and errors == [
        f"error: output.dir: writing checkpoint step-4 in {root} failed: No space left on device (meta.json); the "
        "previous checkpoint step-2 is intact; free space in output.dir (or lower output.keep) and continue with "
        "--resume"
    ], res.output
    assert [s for s, _ in ck.list_checkpoints(out)] == [2]
    monkeypatch.delenv("FINETUNE_TEST_DISK_FULL_AT_STEP")
    assert launch(str(recipe), [], LaunchOptions(resume="latest")) == 0
    assert _losses(out) == reference["losses"]
    _assert_same_weights(_weights(out), reference["weights"])
