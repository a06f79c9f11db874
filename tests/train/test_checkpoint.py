"""Checkpoint files without training: finding the newest complete one, atomic leftovers, the resume checks,
the disk-space preflight, RNG states through weights_only loading, metrics truncation, the --resume flag."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from finetune.cli import bare_resume
from finetune.errors import UserError
from finetune.train.checkpoint import checkpointer as ck
from finetune.units import checkpoint_bytes


def _fake_checkpoint(out: Path, name: str, meta: dict | None) -> Path:
    d = ck.checkpoints_dir(out) / name
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x" * 10)
    if meta is not None:
        (d / ck.META).write_text(json.dumps(meta))
    return d


def test_incomplete_checkpoints_are_never_chosen(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert ck.latest_checkpoint(out) is None
    _fake_checkpoint(out, "step-3", {"step": 3})
    _fake_checkpoint(out, "step-20", {"step": 20})  # numeric order, not text order: 20 > 3
    _fake_checkpoint(out, ".tmp-step-30-123", {"step": 30})  # renamed into place only when complete
    no_meta = _fake_checkpoint(out, "step-40", None)  # cut short before meta.json
    _fake_checkpoint(out, "step-x", {"step": 50})
    assert [s for s, _ in ck.list_checkpoints(out)] == [3, 20]
    assert ck.resolve_resume("latest", out).name == "step-20"
    assert ck.resolve_resume(str(out), out).name == "step-20"  # a run directory means its newest
    with pytest.raises(UserError, match="is not a complete checkpoint"):
        ck.resolve_resume(str(no_meta), out)
    with pytest.raises(UserError, match="does not exist"):
        ck.resolve_resume(str(out / "checkpoints" / "step-99"), out)
    with pytest.raises(UserError, match="no complete checkpoint in"):
        ck.resolve_resume("latest", tmp_path / "empty")


def test_prune_keeps_the_newest_and_removes_leftovers(tmp_path: Path) -> None:
    out = tmp_path / "run"
    for s in (2, 4, 6, 8):
        _fake_checkpoint(out, f"step-{s}", {"step": s})
    leftover = _fake_checkpoint(out, ".tmp-step-10-99", None)
    removed = ck.prune(out, keep=2)
    assert sorted(p.name for p in removed) == ["step-2", "step-4"]
    assert [s for s, _ in ck.list_checkpoints(out)] == [6, 8]
    aside = ck.set_aside_newer(out, 6)
    assert aside is not None and [p.name for _, p in ck.list_checkpoints_in(aside)] == ["step-8"]
    assert [s for s, _ in ck.list_checkpoints(out)] == [6] and ck.latest_checkpoint(out).name == "step-6"
    assert ck.clear_checkpoints(out) == 1 and not leftover.exists() and (aside / "step-8" / ck.META).is_file()


def test_fresh_start_refuses_an_unfinished_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _fake_checkpoint(out, "step-4", {"step": 4, "final": False})
    with pytest.raises(UserError, match=r"holds an unfinished run \(newest checkpoint step-4\); continue it with --resume"):
        ck.check_fresh_start(out)
    _fake_checkpoint(out, "step-10", {"step": 10, "final": True})
    with pytest.raises(UserError, match=r"holds a finished run \(newest checkpoint step-10\); .* --overwrite"):
        ck.check_fresh_start(out)  # starting over would destroy it: --overwrite says so
    (out / "model.safetensors").write_text("")
    (out / "notes.txt").write_text("mine")
    ck.clear_run(out)
    ck.check_fresh_start(out)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "notes.txt"]  # only what a run writes


def test_resume_must_match_method_model_and_precision_not_world_size(tmp_path: Path) -> None:
    ident = {"method": "full", "model": "/m", "precision": "fp32", "world_size": 2, "strategy": "ddp",
             "global_batch_size": 8, "seed": 0}
    d = _fake_checkpoint(tmp_path, "step-5", {"identity": ident})
    ck.check_resume_matches(d, dict(ident))
    ck.check_resume_matches(d, {**ident, "world_size": 3, "strategy": "fsdp"})  # resharded on load
    with pytest.raises(UserError) as err:
        ck.check_resume_matches(d, {**ident, "precision": "bf16"})
    assert str(err.value) == (
        f"--resume: {d} was saved with the precision fp32 but this run has bf16; set precision back to fp32 "
        "or start a new run in another output.dir"
    )
    with pytest.raises(UserError, match="saved with the method full but this run has lora; set method back"):
        ck.check_resume_matches(d, {**ident, "method": "lora"})
    with pytest.raises(UserError, match=r"saved with the model /m but this run has /n; set model\.path back to /m"):
        ck.check_resume_matches(d, {**ident, "model": "/n"})


def test_free_disk_preflight(tmp_path: Path) -> None:
    assert checkpoint_bytes(4 * 1000, 1000) == 4000 + 8000 + 64 * 1024  # fp32 weights + 2 fp32 moments
    ck.check_free_disk(tmp_path, 1024, keep=2)
    with pytest.raises(UserError, match=r"free but the checkpoints need about .* \(3 x .*: output.keep=2 plus one"):
        ck.check_free_disk(tmp_path, 2**60, keep=2)
    with pytest.raises(UserError, match=r"\(1 x .*plus one being written, less the 5 already there\)"):
        ck.check_free_disk(tmp_path, 2**60, keep=2, existing=5)


def test_rng_states_round_trip_through_weights_only_load(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.save({"rng": [ck.rng_state()]}, tmp_path / "trainer.pt")
    want = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    loaded = torch.load(tmp_path / "trainer.pt", weights_only=True)  # plain tensors, tuples, numbers only
    ck.set_rng_state(loaded["rng"][0])
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])


def test_truncate_metrics_keeps_rows_up_to_the_resumed_step(tmp_path: Path) -> None:
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    ck.truncate_metrics(m, 5)
    assert [json.loads(x)["step"] for x in m.read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_bare_resume_means_latest(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("x: 1\n")
    assert bare_resume(["run", "r.yaml", "--resume"]) == ["run", "r.yaml", "--resume=latest"]
    assert bare_resume(["run", "r.yaml", "--resume", "--nproc", "2"])[2] == "--resume=latest"
    assert bare_resume(["run", "--resume", "my.yaml"]) == ["run", "--resume=latest", "my.yaml"]
    assert bare_resume(["run", "--resume", str(recipe)])[1] == "--resume=latest"  # an existing file: the recipe
    assert bare_resume(["run", "r.yaml", "--resume", "runs/x/checkpoints/step-4"])[2:] == [
        "--resume", "runs/x/checkpoints/step-4"
    ]


def test_no_code_runs_when_loading_files() -> None:
    """Every torch.load in the package is weights_only=True; YAML is read with safe_load only."""
    import re

    pkg = Path(ck.__file__).resolve().parent.parent
    offenders = []
    for py in pkg.rglob("*.py"):
        text = py.read_text()
        for m in re.finditer(r"torch\.load\((?:[^()]|\([^()]*\))*\)", text):
            if "weights_only=True" not in m.group(0):
                offenders.append(f"{py.name}: {m.group(0)}")
        offenders += [f"{py.name}: yaml.load" for _ in re.finditer(r"yaml\.(?:load|unsafe_load)\(", text)]
    assert offenders == []
    source = Path(ck.__file__).read_text()
    assert 'torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=True)' in source
    # DCP's own planner unpickles non-tensor values with weights_only=False: ours overrides it.
    assert "torch.load(value, weights_only=True)" in source and "planner=_SafeLoadPlanner()" in source
    # DCP's own reader unpickles .metadata with pickle.load: ours admits only its metadata classes.
    assert "storage_reader=safe_reader(path)" in source and "def find_class" in source
