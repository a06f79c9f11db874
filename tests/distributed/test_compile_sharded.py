"""train.compile on the sharded load path (zero2/fsdp on 2 gloo processes: built on meta, sharded, then
materialised): every decoder block is compiled, and training matches the same run without compile."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support import RECIPES, micro_model_dir, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 3
HEADER = "compile: 2 decoder blocks compiled (torch.compile)"


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama's tokenizer with a 2-block, 64-wide config (random weights from the seed)."""
    return micro_model_dir(
        tmp_path_factory.mktemp("micro-llama"),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )


def _recipe(model_dir: Path, out: Path, strategy: str, compiled: bool) -> dict:
    return {
        "model": {"path": str(model_dir), "init": "random"},
        "method": "full",
        "data": {"train": str(RECIPES / "data/reverse/train.jsonl"), "max_seq_len": 48},
        "train": {
            "max_steps": STEPS,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "lr": 1e-3,
            "seed": 0,
            "compile": compiled,
        },
        "precision": "fp32",
        "distributed": {"strategy": strategy},
        "output": {"dir": str(out), "log_every": 1},
    }


def _run(recipe: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(recipe), "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=900,
        env=full_env,
    )


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory, micro: Path) -> list[float]:
    """The losses of the run without compile (fsdp; zero2 computes the same steps), shared by both strategies."""
    tmp = tmp_path_factory.mktemp("compile-eager")
    out = tmp / "eager"
    proc = _run(write_recipe(tmp / "eager.yaml", _recipe(micro, out, "fsdp", False)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "compile:" not in proc.stdout
    return _losses(out)


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_compiled_sharded_run_matches_eager(tmp_path: Path, micro: Path, eager: list[float], strategy: str) -> None:
    """The 2-process run with train.compile against the same run without it: every step's loss within 1e-4 (as
    tests/train/test_compile.py); the plan loads the model sharded (built on meta, sharded, then materialised),
    the header says both decoder blocks were compiled, and dynamo really traced a decoder block's forward."""
    from finetune.plan.flowchart import plan_for_run
    from finetune.recipe.schema import load_recipe
    from finetune.train.model.load import loads_sharded

    out = tmp_path / f"{strategy}-compiled"
    recipe = write_recipe(tmp_path / f"{out.name}.yaml", _recipe(micro, out, strategy, True))
    plan = plan_for_run(load_recipe(str(recipe)), nproc=2, nnodes=1, device="cpu")
    assert plan.execution is not None and plan.execution.compile and loads_sharded(plan.execution, 2)
    # dynamo's INFO log names every frame it traces (rank 0's stderr reaches the launcher's)
    proc = _run(recipe, TORCH_LOGS="dynamo")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    compiled = _losses(out)
    assert len(compiled) == len(eager) == STEPS
    for e, c in zip(eager, compiled, strict=True):
        assert c == pytest.approx(e, abs=1e-4)
    assert HEADER in proc.stdout
    traced = re.findall(r"torchdynamo start tracing (\S+) (\S+):", proc.stderr)
    assert traced, "no frame was compiled: the run was eager"
    assert any("modeling_" in path for _, path in traced), traced  # a decoder block's forward


def _worker(rank: int, store: str, recipe: str, plan_dict: dict, result: str) -> None:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from finetune.plan.types import Plan
    from finetune.recipe.schema import load_recipe
    from finetune.train.model.load import loads_sharded
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.parallelize import decoder_blocks, is_compiled, is_sharded, unwrap
    from finetune.train.trainer import Trainer

    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        plan = Plan.from_dict(plan_dict)
        assert plan.execution is not None and plan.execution.compile
        assert loads_sharded(plan.execution, 2), "fsdp on 2 processes takes the sharded load path"
        trainer = Trainer(load_recipe(recipe), plan, DistContext(rank, 2, rank, torch.device("cpu")))
        trainer.setup()
        model = trainer.model
        blocks = decoder_blocks(unwrap(model))
        out = {
            "sharded": is_sharded(model),
            "blocks": len(blocks),
            "compiled": [is_compiled(b) for b in blocks],
            "block_types": sorted({type(b).__name__ for b in blocks}),
        }
        counters.clear()
        ids = torch.arange(2 * 16).reshape(2, 16) % 200 + 3
        with torch.no_grad():
            out["loss"] = float(model(input_ids=ids, labels=ids).loss)
        out["frames_compiled"] = counters["frames"]["ok"]
        out["graphs"] = counters["stats"]["unique_graphs"]
        torch.save(out, f"{result}.{rank}")
    finally:
        dist.destroy_process_group()


def test_trainer_compiles_every_block_on_the_sharded_load_path(tmp_path: Path, micro: Path) -> None:
    """Through the trainer's own setup on 2 gloo processes (fsdp: built on meta, sharded, materialised):
    every decoder block has torch.compile applied, and a forward traces graphs with dynamo."""
    from finetune.plan.flowchart import plan_for_run
    from finetune.recipe.schema import load_recipe

    recipe = write_recipe(tmp_path / "r.yaml", _recipe(micro, tmp_path / "out", "fsdp", True))
    plan = plan_for_run(load_recipe(str(recipe)), nproc=2, nnodes=1, device="cpu")
    result = str(tmp_path / "result")
    mp.spawn(_worker, args=(tempfile.mktemp(dir=tmp_path), str(recipe), plan.to_dict(), result), nprocs=2)
    for rank in range(2):
        got = torch.load(f"{result}.{rank}", weights_only=False)
        assert got["sharded"] and got["blocks"] == 2, got
        assert got["compiled"] == [True, True], f"rank {rank}: blocks not compiled on the sharded path: {got}"
        assert got["frames_compiled"] > 0 and got["graphs"] > 0, (
            f"rank {rank}: dynamo compiled nothing: {got}"
        )
        assert torch.isfinite(torch.tensor(got["loss"]))
