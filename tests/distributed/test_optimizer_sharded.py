"""bitsandbytes' 8-bit AdamW under ZeRO-2 and FSDP (DTensor parameters), through the real CLI on gloo.

Two processes train a 2-block Llama (hidden 64) for a few steps with ``adamw8bit`` and ``paged_adamw8bit``
under zero2 and fsdp, full fine-tuning and LoRA; their losses equal the single-process ``adamw8bit`` run's,
and an fsdp run resumed from its checkpoint computes the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.commands.run import LaunchOptions, launch
from finetune.train.checkpoint import checkpointer as ck
from tests.support import RECIPES, micro_model_dir, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 4
# The tolerance of the other parity tests (tests/distributed/test_distributed.py). It holds for the 8-bit moments too:
# every shard of this model starts on a 256-value block boundary, so each rank's blocks are the single
# process's blocks and the quantization is the same (measured: at most 1.5e-8 relative).
LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 blocks, 64 wide: the MLP and q/o matrices (>= 4096 values) get 8-bit moments, k/v and the norms fp32."""
    return micro_model_dir(
        tmp_path_factory.mktemp("micro-llama"), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    )


def _recipe(model: Path, out: Path, method: str, strategy: str, optimizer: str, save_every: int = 0) -> dict:
    """fp32, global batch 8 in micro-batches of 2, eval off; LoRA of rank 64 so that its q adapters
    (64 x 64) have 8-bit moments and its v adapters fp32 ones."""
    return {
        "model": {"path": str(model), "init": "random"},
        "method": method,
        "lora": {"r": 64, "alpha": 128, "target_modules": ["q_proj", "o_proj"]},
        "data": {"train": str(RECIPES / "data/reverse/train.jsonl"), "max_seq_len": 48},
        "train": {"max_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3,
                  "warmup_steps": 1, "max_grad_norm": 1.0, "seed": 0, "optimizer": optimizer},
        "precision": "fp32",
        "distributed": {"strategy": strategy},
        "output": {"dir": str(out), "log_every": 1, **({"save_every": save_every} if save_every else {})},
    }


def _cli(recipe: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(recipe), *args],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


class Runs:
    """Each run once per module: the single-process reference in this process, the others through the CLI."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model, self.done = root, model, {}

    def get(self, method: str, strategy: str, optimizer: str = "adamw8bit", save_every: int = 0) -> Path:
        key = f"{method}-{strategy}-{optimizer}"
        if key not in self.done:
            out = self.root / key
            recipe = write_recipe(
                self.root / f"{key}.yaml", _recipe(self.model, out, method, strategy, optimizer, save_every)
            )
            if strategy == "single":
                assert launch(str(recipe), [], LaunchOptions(nproc=1)) == 0
            else:
                _cli(recipe, "--nproc", "2")
            self.done[key] = out
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Runs:
    return Runs(tmp_path_factory.mktemp("sharded-8bit"), model_dir)


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize(
    ("strategy", "optimizer"), [("zero2", "adamw8bit"), ("fsdp", "adamw8bit"), ("zero2", "paged_adamw8bit")]
)
def test_eight_bit_adamw_on_shards_matches_one_process(runs: Runs, method: str, strategy: str, optimizer: str) -> None:
    """2 processes (parameters sharded by FSDP2) give the single process's losses; paged_adamw8bit is
    adamw8bit on CPU. The fsdp full run also checkpoints (the resume test below starts from it)."""
    single = _losses(runs.get(method, "single"))
    got = _losses(runs.get(method, strategy, optimizer, save_every=2 if (method, strategy) == ("full", "fsdp") else 0))
    assert len(got) == STEPS and all(x == x and abs(x) != float("inf") for x in got)
    assert _max_rel(got, single) <= LOSS_RTOL, (got, single)
    assert got[-1] < got[0]


def test_eight_bit_state_resumes_under_fsdp(runs: Runs, tmp_path: Path) -> None:
    """The fsdp run resumed from its step-2 checkpoint (the 8-bit moments saved as fp32 DTensors, quantized
    back into each rank's blocks on load, each block's absmax recovered) computes the uninterrupted run's
    steps 3 and 4 (measured: 2.9e-8 relative; re-quantizing without recovering the absmax gave 1.05e-5)."""
    ref = runs.get("full", "fsdp", "adamw8bit", save_every=2)
    out = tmp_path / "resumed"
    shutil.copytree(ref, out)
    assert [s for s, _ in ck.list_checkpoints(out)] == [2, 4]
    shutil.rmtree(dict(ck.list_checkpoints(out))[4])
    recipe = write_recipe(tmp_path / "r.yaml", _recipe(runs.model, out, "full", "fsdp", "adamw8bit", save_every=2))
    proc = _cli(recipe, "--nproc", "2", "--resume")
    assert "resumed from" in proc.stdout + proc.stderr
    got, want = _losses(out), _losses(ref)
    assert len(got) == STEPS and _max_rel(got, want) <= 1e-6, (got, want)
