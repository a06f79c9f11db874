"""output.trackers: TensorBoard, offline wandb and a file-store MLflow hold exactly metrics.jsonl's rows.

Each tracker is read back with its own library's reader and compared with metrics.jsonl, after a run that
died at step 7 (a checkpoint at step 4, steps 5 and 6 already logged) was resumed: every step appears once,
in the same tracker run.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import tiny_recipe, write_recipe

pytestmark = pytest.mark.slow

STEPS = 8


def _run(recipe: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    return subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(recipe), *args],
        capture_output=True,
        text=True,
        env={**clean, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=300,
    )


def _metrics(out: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {field: {step: value}} (every numeric field but step)."""
    series: dict[str, dict[int, float]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for k, v in row.items():
            if k != "step" and isinstance(v, int | float):
                assert row["step"] not in series.setdefault(k, {}), (
                    f"metrics.jsonl repeats step {row['step']}"
                )
                series[k][row["step"]] = float(v)
    return series


def _tensorboard(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_records(path: Path) -> list:
    """The records of a wandb run file: wandb's own protobuf ``Record`` in its LevelDB-log framing (wandb 0.2x+
    reads these files in its Go core only; the framing is 7-byte chunk headers in 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending + chunk)
            out.append(rec)
            pending = b""
        elif kind in (2, 3):
            pending += chunk
    return out


def _wandb(out: Path) -> tuple[set[str], dict[str, list[tuple[int, float]]], list[dict]]:
    """(run ids, {key: [(step, value)]} over every session's file in order, the logged config)."""
    ids, series, configs = set(), {}, []
    for f in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
                configs.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.run.config.update}
                )
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                for k, v in items.items():
                    if not k.startswith("_"):
                        series.setdefault(k, []).append((rec.history.step.num, float(v)))
    return ids, series, configs


def _mlflow(out: Path) -> tuple[list, dict[str, list[tuple[int, float]]]]:
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("finetune")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    return runs, {
        k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
        for k in run.data.metrics
    }


def test_trackers_equal_metrics_after_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tiny_recipe(
            out,
            train={"max_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 4, "lr": 2e-3, "seed": 0},
            eval={"every": 4, "max_samples": 8, "max_new_tokens": 4, "batch_size": 8},
            output={
                "dir": str(out),
                "log_every": 1,
                "save_every": 4,
                "trackers": ["tensorboard", "wandb", "mlflow"],
            },
        ),
    )
    died = _run(recipe, "--measure-memory", env={"FINETUNE_FAIL_RANK": "0", "FINETUNE_FAIL_AT_STEP": "7"})
    assert died.returncode != 0 and "injected failure at step 7" in died.stdout + died.stderr
    first_state = json.loads((out / "trackers.json").read_text())
    first = _metrics(out)
    assert sorted(json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines())[-1] == 6

    done = _run(recipe, "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed from" in done.stdout
    expected = _metrics(out)
    assert sorted(expected["loss"]) == list(range(1, STEPS + 1))
    assert sorted(expected["eval_loss"]) == [0, 4, 8]

    # TensorBoard: the interrupted run's steps 5 and 6 are purged, so each step is there once (float32 values).
    tb = _tensorboard(out)
    for key, by_step in expected.items():
        got = tb[key]
        assert [s for s, _ in got] == sorted(by_step), key
        assert all(v == pytest.approx(by_step[s], rel=1e-6, abs=1e-6) for s, v in got), key
    assert tb["memory/measured_bytes"][0][1] > 0 and tb["memory/predicted_bytes"][0][1] > 0

    # wandb and MLflow cannot delete a logged point: steps 5 and 6 keep the interrupted session's values (equal to
    # the resumed ones for everything but the timing, tokens_per_s), later steps are the resumed session's.
    kept = {
        k: {s: (first[k][s] if s <= 6 and s in first.get(k, {}) else v) for s, v in by_step.items()}
        for k, by_step in expected.items()
    }
    for k in ("loss", "grad_norm", "lr"):
        assert all(first[k][s] == expected[k][s] for s in (5, 6)), k

    # wandb: one run id over both sessions; each step once, the values exactly metrics.jsonl's.
    ids, wb, configs = _wandb(out)
    assert ids == {first_state["wandb"]["id"]}
    for key, by_step in kept.items():
        assert sorted(wb[key]) == sorted(by_step.items()), key
    assert configs[0]["recipe"]["train"]["lr"] == 2e-3
    assert configs[0]["plan"]["chosen"]["strategy"] == "single"

    # MLflow: the same run continued; each (key, step) once; the recipe as params.
    runs, ml = _mlflow(out)
    assert runs[0].info.run_id == first_state["mlflow"]["run_id"]
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.params["recipe.train.lr"] == "0.002"
    for key, by_step in kept.items():
        assert ml[key] == sorted(by_step.items()), key


def test_missing_tracker_is_one_sentence(tmp_path: Path) -> None:
    """A named tracker whose package cannot be imported stops the real CLI before training, with the pip command."""
    out = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "r.yaml", tiny_recipe(out, output={"dir": str(out), "trackers": ["wandb"]})
    )
    # sys.modules[name] = None is how Python marks a module as not importable (find_spec then answers None).
    code = "import sys; sys.modules['wandb'] = None; from finetune.cli import main; main()"
    res = subprocess.run(
        [sys.executable, "-c", code, "run", str(recipe)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "error: output.trackers: `wandb` is named but the wandb package is not installed; "
        "pip install 'finetune[wandb]' (or remove it from output.trackers)"
    )
    assert not (out / "metrics.jsonl").exists()
