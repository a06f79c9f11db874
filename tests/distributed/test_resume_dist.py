"""Exact resume on gloo, through the real CLI: an elastic restart after a worker is killed (ddp: losses and
weights within 1e-6 of the uninterrupted run), a resume from an fsdp x2 checkpoint on the same and on other
world sizes and strategies (within 1e-5), and a stream on 2 processes killed mid-stream and resumed (the same
losses exactly)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.train.checkpoint import checkpointer as ck
from tests.support import RECIPES, tiny_recipe, write_recipe

pytestmark = pytest.mark.dist

STEPS = 8


def _recipe(
    tmp: Path, name: str, strategy: str, *, nproc: int = 2, steps: int = STEPS, global_batch: int = 8,
    save_every: int = 4, **output: object,
) -> Path:
    """The tiny model on 48 reversal samples, checkpoints every ``save_every`` steps (``output`` adds keys)."""
    data = tmp / "train48.jsonl"
    if not data.exists():
        rows = (RECIPES / "data/reverse/train.jsonl").read_text().splitlines()[:48]
        data.write_text("\n".join(rows) + "\n")
    out = tmp / name
    r = tiny_recipe(
        out,
        data={"train": str(data), "eval": None, "max_seq_len": 48},
        train={"max_steps": steps, "global_batch_size": global_batch, "micro_batch_size": 2, "lr": 2e-3,
               "warmup_steps": 2},
        distributed={"strategy": strategy, "nproc": nproc},
        output={"dir": str(out), "log_every": 1, "save_every": save_every, "keep": 3, **output},
    )
    return write_recipe(tmp / f"{name}.yaml", r)


def _run(recipe: Path, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(recipe), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _run_here(recipe: Path, resume: Path) -> str:
    """One process resuming ``resume``: the launch() `finetune run RECIPE --resume` calls, in this process (no
    interpreter start); what it printed."""
    from finetune.commands.run import LaunchOptions, launch

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = launch(str(recipe), [], LaunchOptions(nproc=1, resume=str(resume)))
    assert code == 0, printed.getvalue()[-3000:]
    return printed.getvalue()


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _assert_close(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    for (s, a), (_, b) in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (s, a, b)


def _assert_weights_close(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-6, atol=1e-6)


def test_ddp_elastic_restart_resumes_from_the_newest_checkpoint(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    _run(_recipe(tmp_path, "ref", "ddp"))
    elastic = tmp_path / "elastic"
    # Rank 1 SIGKILLs itself in step 6 of the first attempt; torchrun restarts both workers, which resume
    # from checkpoint 4 by themselves (no --resume given).
    out = _run(
        _recipe(tmp_path, "elastic", "ddp"), "--max-restarts", "1", env={"FINETUNE_TEST_KILL_AT_STEP": "1:6"}
    )
    assert "resumed from" in out and "step-4 at step 4 of 8" in out
    _assert_close(_losses(elastic), _losses(ref))  # every step once: the restart truncated metrics to step 4
    _assert_weights_close(elastic, ref)


def test_fsdp_full_disk_during_a_save_is_one_sentence_and_the_previous_checkpoint_resumes(tmp_path: Path) -> None:
    """Rank 0's write of checkpoint step-8 fails with ENOSPC (after every rank wrote its shards): every rank
    agrees on the one sentence (exit status 2, as one process), the half-written directory is never chosen,
    and --resume continues from step-4, computing the steps 5-8 the failed run computed."""
    out = tmp_path / "full"
    recipe = _recipe(tmp_path, "full", "fsdp")
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(recipe)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "FINETUNE_TEST_DISK_FULL_AT_STEP": "8"},
    )
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    root = ck.checkpoints_dir(out)
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert re.fullmatch(
        rf"error: rank [01] failed: output\.dir: writing checkpoint step-8 in {re.escape(str(root))} failed: No "
        r"space left on device \(meta\.json\); the previous checkpoint step-4 is intact; free space in "
        r"output\.dir \(or lower output\.keep\) and continue with --resume",
        errors[0],
    ), errors[0]
    assert [s for s, _ in ck.list_checkpoints(out)] == [4]
    uninterrupted = _losses(out)  # steps 1-8 ran; only the last save failed
    assert [s for s, _ in uninterrupted] == list(range(1, STEPS + 1))
    said = _run(recipe, "--resume")
    # the same world and strategy (fsdp x2): the shards load as saved, nothing is resharded
    assert "step-4 at step 4 of 8" in said and "resharded" not in said, said
    _assert_close(_losses(out), uninterrupted)  # metrics cut back to step 4, then steps 5-8 again
    assert [s for s, _ in ck.list_checkpoints(out)] == [4, 8] and (out / "model.safetensors").is_file()


def _matrix_recipe(tmp: Path, name: str, strategy: str, nproc: int) -> Path:
    """10 steps, global batch 12 (divisible by 1, 2 and 3 processes x micro-batch 2), checkpoint at step 5;
    the final model in safetensors files of at most 2 MiB (the tiny model has 12 MiB of fp32 weights)."""
    return _recipe(
        tmp, name, strategy, nproc=nproc, steps=10, global_batch=12, save_every=5, max_shard_size="2MiB"
    )


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("model*.safetensors")):
        weights.update(load_file(str(f)))
    return weights


def _check_streamed_final_model(out: Path) -> None:
    """Several shards + an index naming every weight; from_pretrained gives the logits of the trained model
    (the weights the last checkpoint's DCP shards hold) within 1e-5."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.storage.safetensors_stream import SAFE_INDEX
    from tests.support import TINY_MODEL

    index = json.loads((out / SAFE_INDEX).read_text())
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    assert len(files) >= 4 and set(index["weight_map"].values()) == set(files)
    assert all(p.stat().st_size <= 2 * 2**20 + 64 * 1024 for p in out.glob("model*.safetensors"))
    trained = ck.read_weights(out / "checkpoints" / "step-10")
    assert set(index["weight_map"]) == set(trained)
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), dtype=torch.float32)
    reference.load_state_dict(trained)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (loaded(ids).logits - reference(ids).logits).abs().max().item() <= 1e-5


def test_fsdp_checkpoint_resumes_on_other_world_sizes_and_strategies(tmp_path: Path) -> None:
    """Saved by fsdp x2 at step 5 of 10; resumed as fsdp x3 (a larger world), ddp x2, zero1 x2 and one process
    (a smaller one): steps 6..10 give the uninterrupted run's losses and final weights within 1e-5 (fp32). The
    reference's final model is streamed into size-capped shards that from_pretrained loads. (The same world
    and strategy, fsdp x2 resumed as fsdp x2, is the full-disk test's resume above, within 1e-6.)"""
    ref = tmp_path / "ref"
    _run(_matrix_recipe(tmp_path, "ref", "fsdp", 2))
    _check_streamed_final_model(ref)
    ckpt = ref / "checkpoints" / "step-5"
    meta = ck.read_meta(ckpt)
    assert meta["identity"]["world_size"] == 2 and meta["identity"]["strategy"] == "fsdp"
    assert sorted(p.name for p in (ckpt / "state").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    want, want_w = _losses(ref)[5:], _final_weights(ref)
    diffs = {}
    for name, strategy, nproc in (
        ("fsdp3", "fsdp", 3), ("ddp2", "ddp", 2), ("zero1", "zero1", 2), ("single", "single", 1)
    ):
        recipe = _matrix_recipe(tmp_path, name, strategy, nproc)
        out = _run_here(recipe, ckpt) if nproc == 1 else _run(recipe, "--resume", str(ckpt))
        assert "resumed from" in out and "step-5 at step 5 of 10" in out
        assert f"resharded from fsdp x2 to {strategy} x{nproc}" in out, out
        got, got_w = _losses(tmp_path / name), _final_weights(tmp_path / name)
        assert [s for s, _ in got] == list(range(6, 11)) and got_w.keys() == want_w.keys()
        diffs[name] = (
            max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)),
            max((got_w[k] - want_w[k]).abs().max().item() for k in want_w),
        )
    print("resume matrix (max |loss diff|, max |weight diff|):", diffs)
    for name, (loss_diff, weight_diff) in diffs.items():
        assert loss_diff <= 1e-5 and weight_diff <= 1e-5, (name, loss_diff, weight_diff)
    # ZeRO-1's ranks each wrote the AdamW state of their share: together, every parameter's.
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(tmp_path / "zero1/checkpoints/step-10/state")).read_metadata().state_dict_metadata
    assert {k.removeprefix("optimizer.state.").removesuffix(".exp_avg") for k in keys if k.endswith(".exp_avg")} == set(
        want_w
    )


def test_a_stream_on_two_processes_killed_mid_stream_resumes_to_the_uninterrupted_losses(tmp_path: Path) -> None:
    """data.streaming on 2 ddp processes (each reads the whole stream and keeps its half of every global batch):
    rank 1 SIGKILLed in step 5, after checkpoint 3, stops the run; `--resume latest` on 2 processes reads the
    buffer back from the checkpoint's offsets, and steps 4..6 are the uninterrupted 2-process run's exactly."""
    data = tmp_path / "train40.jsonl"
    data.write_text("\n".join((RECIPES / "data/reverse/train.jsonl").read_text().splitlines()[:40]) + "\n")

    def recipe(name: str) -> Path:
        r = tiny_recipe(
            tmp_path / name,
            data={"train": str(data), "eval": None, "max_seq_len": 48, "streaming": True, "shuffle_buffer": 16},
            train={"max_steps": 6, "global_batch_size": 8, "micro_batch_size": 2, "lr": 2e-3, "warmup_steps": 2},
            distributed={"strategy": "ddp", "nproc": 2},
            output={"dir": str(tmp_path / name), "log_every": 1, "save_every": 3},
        )
        return write_recipe(tmp_path / f"{name}.yaml", r)

    _run(recipe("whole"))
    whole = _losses(tmp_path / "whole")
    assert [s for s, _ in whole] == list(range(1, 7))
    killed = recipe("killed")
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(killed)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "FINETUNE_TEST_KILL_AT_STEP": "1:5"},
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert ck.latest_checkpoint(tmp_path / "killed").name == "step-3"
    assert ck.read_meta(tmp_path / "killed" / "checkpoints" / "step-3")["position"]["stream"]["made"] == 3
    _run(killed, "--resume", "latest")
    assert _losses(tmp_path / "killed") == whole  # identical floats; steps 4..6 computed by the resumed run
