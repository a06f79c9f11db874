"""Careless and hostile runs through the real CLI on the tiny model: two runs into one output.dir, a planted
checkpoint, a resume from an older checkpoint, a run whose every step is NaN. Each refusal is exit 2 (3 for the
NaN limit) with one sentence; what existed is unchanged (SHA-256 of every file before and after); no planted code
runs. One 4-step run (checkpoints at 2 and 4) is shared by the tests: while it runs, a second run into its
output.dir is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.train.checkpoint import checkpointer as ck
from finetune.train.checkpoint.lock import LOCK_NAME
from tests.support import RECIPES, clean_env, tiny_recipe, write_recipe

pytestmark = pytest.mark.slow


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def _recipe(tmp: Path, out: Path, name: str, **sections: dict) -> Path:
    data = tmp / "train32.jsonl"
    if not data.exists():
        data.write_text("\n".join((RECIPES / "data/reverse/train.jsonl").read_text().splitlines()[:32]) + "\n")
    r = tiny_recipe(out, data={"train": str(data), "eval": None, "max_seq_len": 48},
                    output={"dir": str(out), "log_every": 1, "save_every": 2, "keep": 3})
    for k, v in sections.items():
        r.setdefault(k, {}).update(v)
    return write_recipe(tmp / f"{name}.yaml", r)


def _run(recipe: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune", "run", str(recipe), *args], capture_output=True,
                          text=True, timeout=600, env=clean_env(OMP_NUM_THREADS="1", **env))


def _errors(res: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("error")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The shared run; while it waits after its first step, a second run into its output.dir is refused."""
    tmp = tmp_path_factory.mktemp("hostile")
    out = tmp / "run"
    recipe = _recipe(tmp, out, "first")
    release = tmp / "release"  # the first run waits after its step 1 until this exists
    first = subprocess.Popen(
        [sys.executable, "-m", "finetune", "run", str(recipe)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=clean_env(OMP_NUM_THREADS="1", FINETUNE_TEST_HOLD_UNTIL=str(release)),
    )
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").is_file():  # the first run holds the lock and trains
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read() if first.stdout else ""
        time.sleep(0.2)
    t0 = time.perf_counter()
    try:
        second = _run(recipe, "--overwrite")  # would remove the first run's checkpoints and metrics
    finally:
        release.touch()
    second_s = time.perf_counter() - t0
    stdout, _ = first.communicate(timeout=600)
    assert first.returncode == 0, stdout[-3000:]
    return {"tmp": tmp, "out": out, "recipe": recipe, "second": second, "first_pid": first.pid, "second_s": second_s}


def test_a_second_run_into_a_held_output_dir_is_refused(finished: dict) -> None:
    res, out = finished["second"], finished["out"]
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    [error] = _errors(res)
    assert error.startswith(
        f"error: output.dir: {out} is in use by another run (pid {finished['first_pid']} on {socket.gethostname()} "
        "(this host), since "
    ) and error.endswith("wait for it to finish or stop it, or choose another output.dir"), error
    assert "Traceback" not in res.stderr
    # the first run was not disturbed: every checkpoint and step, and a lock emptied at its exit
    assert [s for s, _ in ck.list_checkpoints(out)] == [2, 4]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert (out / "model.safetensors").is_file() and not list(out.glob(".tmp-final-*"))
    assert (out / LOCK_NAME).read_text() == ""


def test_a_planted_checkpoint_metadata_runs_nothing(finished: dict) -> None:
    tmp = finished["tmp"]
    out = tmp / "planted"
    shutil.copytree(finished["out"], out)
    marker = tmp / "planted-marker"

    class Payload:
        def __reduce__(self) -> tuple:
            return os.system, (f"touch {marker}",)

    metadata = out / "checkpoints" / "step-2" / ck.STATE_DIR / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload()))
    before = _hashes(out)
    res = _run(_recipe(tmp, out, "planted"), "--resume", str(out / "checkpoints" / "step-2"))
    assert res.returncode == 2, res.stderr[-2000:]
    [error] = _errors(res)
    assert error == (
        f"error: --resume: {metadata} names posix.system, which no checkpoint's metadata holds: it was not written by "
        "finetune (or was changed since), and loading it could run code; nothing of it was loaded. Choose a "
        "checkpoint this run wrote"
    )
    assert not marker.exists() and _hashes(out) == before


def test_a_resume_from_an_older_checkpoint_moves_the_newer_ones_aside(finished: dict) -> None:
    tmp = finished["tmp"]
    out = tmp / "older"
    shutil.copytree(finished["out"], out)
    before = _hashes(out)
    res = _run(_recipe(tmp, out, "older"), "--resume", str(out / "checkpoints" / "step-2"))
    assert res.returncode == 0, res.stderr[-3000:]
    [aside] = list((out / "checkpoints").glob(f"{ck.SET_ASIDE_PREFIX}2-*"))
    assert (
        f"resumed from {out / 'checkpoints' / 'step-2'} at step 2 of 4 (epoch 0, batch 2); the newer checkpoint "
        f"step-4 was moved aside to {aside}, with the metrics.jsonl of that run (delete the folder when it is no "
        "longer needed)"
    ) in res.stdout
    moved = _hashes(aside)
    for name, digest in before.items():  # the abandoned step-4 and the metrics it continued, byte for byte
        if name.startswith("checkpoints/step-4/"):
            assert moved[name.removeprefix("checkpoints/")] == digest, name
    assert moved["metrics.jsonl"] == before["metrics.jsonl"]
    assert [s for s, _ in ck.list_checkpoints(out)] == [2, 4]  # step 4 again, from the resumed run


def test_every_step_nan_stops_at_the_skip_limit_without_saving_or_uploading(finished: dict) -> None:
    tmp = finished["tmp"]
    out = tmp / "nan"
    recipe = _recipe(tmp, out, "nan", train={"on_nonfinite": "skip", "max_consecutive_skips": 3, "max_steps": 6},
                     output={"save_every": 0, "push_to_hub": "acme/never"})
    res = _run(recipe, FINETUNE_TEST_NAN_AT_STEP="1,2,3,4,5,6", HF_ENDPOINT="http://127.0.0.1:9", HF_TOKEN="hf_x")
    assert res.returncode == 3, res.stderr[-3000:]
    [error] = _errors(res)
    assert error == (
        "error: step 3: 3 steps in a row had a non-finite loss or gradient norm (now nan and nan), "
        "train.max_consecutive_skips; training stopped without saving the model (no checkpoint was saved); lower "
        "train.lr, check the data, or raise train.max_consecutive_skips"
    )
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints").exists()
    assert "uploaded" not in res.stdout and "Hub" not in error
