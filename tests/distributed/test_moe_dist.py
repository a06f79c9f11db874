"""A mixture of experts under FSDP on 2 processes (gloo) trains as one process does: the same losses, gradient
norms, load-balancing loss and experts' load per step (the load-balancing term is added per target token, as the
loss is normalised, and the routing counts are summed over the ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.commands.run import LaunchOptions, launch
from tests.support import LOSS_RTOL, RECIPES, arch_model_dir, finetune_run, max_rel, step_rows, write_recipe

pytestmark = pytest.mark.dist

STEPS = 4


def moe_recipe(model_dir: Path, out: Path, strategy: str) -> dict:
    """fp32 full fine-tuning, global batch 8 in micro-batches of 2 (accumulation 4 on 1 process, 2 on 2), a
    load-balancing coefficient large enough to move the weights."""
    return {
        "model": {"path": str(model_dir), "init": "random"},
        "method": "full",
        "data": {"train": str(RECIPES / "data/reverse/train.jsonl"), "max_seq_len": 48},
        "train": {"max_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3, "seed": 0,
                  "router_aux_loss_coef": 0.05},
        "precision": "fp32",
        "distributed": {"strategy": strategy},
        "eval": {"every": 0},
        "output": {"dir": str(out), "log_every": 1},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("moe-dist")
    model_dir = arch_model_dir(root / "qwen3_moe", "qwen3_moe")
    single = root / "single"
    assert launch(str(write_recipe(root / "single.yaml", moe_recipe(model_dir, single, "single"))), [],
                  LaunchOptions(nproc=1)) == 0
    fsdp = root / "fsdp"
    proc = finetune_run(write_recipe(root / "fsdp.yaml", moe_recipe(model_dir, fsdp, "fsdp")), "--nproc", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {"single": step_rows(single), "fsdp": step_rows(fsdp)}


def test_fsdp_mixture_of_experts_matches_one_process(runs):
    one, two = runs["single"], runs["fsdp"]
    assert len(one) == len(two) == STEPS
    for key in ("loss", "grad_norm", "aux_loss", "expert_load"):
        assert max_rel([r[key] for r in two], [r[key] for r in one]) < LOSS_RTOL, key
    # the load-balancing term trained the router: its loss moved from its first value
    assert one[-1]["aux_loss"] != one[0]["aux_loss"]
