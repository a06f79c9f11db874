"""Host memory of a sharded run (fsdp, 2 gloo processes) with a model of a few hundred MB, against the same
run of a tiny model: no rank ever holds the whole model.

Loading: each rank's peak RssAnon exceeds the tiny run's by at most half the model (its shard) plus the
largest tensor (the one slice being read), never the whole model; the same for ``model.init: random``
(drawn one module at a time). Checkpoint save and final save: rank 0 peaks no higher than rank 1 plus one
tensor (no rank gathers the whole model or the optimizer state).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import RECIPES, micro_model_dir, tiny_recipe, write_recipe

pytestmark = [pytest.mark.dist, pytest.mark.memory]

HOOKS = Path(__file__).resolve().parents[1] / "hostmem_hooks.py"
#: ~67M parameters: 268 MB in fp32 (134 MB on disk in bf16); the largest tensors are the 16000 x 768 embedding
#: and head (49 MB each in fp32).
BIG = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "head_dim": 64,
    "vocab_size": 16000,
}


def make_model(d: Path, sizes: dict[str, int]) -> tuple[int, int]:
    """A pretrained-style model directory (tiny-llama's tokenizer, seeded weights saved in bf16 as published
    checkpoints are); returns (model bytes, largest tensor bytes) in fp32, the dtype full fine-tuning stores."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    micro_model_dir(d, **sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(d)
    sizes_ = [p.numel() * 4 for p in model.parameters()]
    return sum(sizes_), max(sizes_)


def measured_run(
    tmp: Path, name: str, model_dir: Path, extra_env: dict[str, str] | None = None, init: str = "pretrained",
    save_every: int = 1,
) -> dict[int, dict]:
    """fsdp x2, one step, a checkpoint (``save_every`` 0: none) and the final save; the per-rank phase peaks of
    hostmem_hooks."""
    out = tmp / "runs" / name  # apart from the model directories (tmp / "big", tmp / "tiny")
    r = tiny_recipe(
        out,
        model={"path": str(model_dir), "init": init},
        data={"train": str(RECIPES / "data/reverse/train.jsonl"), "eval": None, "max_seq_len": 48},
        train={"max_steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-4},
        distributed={"strategy": "fsdp", "nproc": 2},
        output={"dir": str(out), "save_every": save_every, "keep": 1},
    )
    probe = tmp / f"{name}-mem"
    env = {
        **os.environ,
        "FINETUNE_HOOKS": f"{HOOKS}:HostMemoryHooks",
        "FINETUNE_HOSTMEM_DIR": str(probe),
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(write_recipe(tmp / f"{name}.yaml", r))],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {rank: json.loads((probe / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def test_no_rank_holds_the_whole_model(tmp_path: Path) -> None:
    model_bytes, largest = make_model(tmp_path / "big", BIG)
    assert model_bytes > 250e6
    make_model(tmp_path / "tiny", {})
    big = measured_run(tmp_path, "big", tmp_path / "big")
    tiny = measured_run(tmp_path, "tiny", tmp_path / "tiny")
    # model.init: random, drawn one module at a time (finetune/train/model/seeded.py): the same bound while loading
    # (only its load phase is measured against the bound: no checkpoint).
    seeded = measured_run(tmp_path, "big-random", tmp_path / "big", init="random", save_every=0)
    mib = 2**20
    report = {
        rank: {
            phase: round((big[rank][phase]["peak"] - tiny[rank][phase]["peak"]) / mib, 1)
            for phase in big[rank] if phase != "environment"  # the allocator variables, not a phase
        }
        for rank in (0, 1)
    }
    print(
        f"model {model_bytes / mib:.0f} MiB, largest tensor {largest / mib:.0f} MiB; peak over the tiny run (MiB):",
        report,
    )
    slack = 32 * mib  # allocator and interpreter noise between two runs
    planned = _planned_load_peak(tmp_path / "big")
    assert planned == model_bytes // 2 + largest  # the planner's formula: its shard + one tensor
    for rank in (0, 1):
        load = big[rank]["load"]["peak"] - tiny[rank]["load"]["peak"]
        assert load <= planned + slack, (rank, load / mib)
        load = seeded[rank]["load"]["peak"] - tiny[rank]["load"]["peak"]
        print(f"rank {rank}: random init's load peak over the tiny run {load / mib:.1f} MiB")
        assert load <= planned + slack, ("random init", rank, load / mib)
    for phase in ("checkpoint", "final"):
        extra0 = big[0][phase]["peak"] - big[0][phase]["start"]
        extra1 = big[1][phase]["peak"] - big[1][phase]["start"]
        assert extra0 <= extra1 + largest + slack, (phase, extra0 / mib, extra1 / mib)
        assert extra0 < model_bytes / 2, (phase, extra0 / mib)


def _planned_load_peak(model_dir: Path) -> int:
    """`finetune plan`'s load peak per process for this model under fsdp on 2 CPU processes (fp32)."""
    from transformers import AutoConfig

    from finetune.plan.job import job_figures
    from finetune.plan.shapes import build_inventory
    from finetune.spec import execution_spec

    inv = build_inventory(AutoConfig.from_pretrained(model_dir), str(model_dir), None)
    spec = execution_spec("full", "fsdp", "fp32", checkpointing=False, world_size=2)
    return job_figures(inv, spec, 2, 2, "cpu").load_peak_per_gpu
