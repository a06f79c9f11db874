"""Pieces of the training loop: schedules, clipping, weight-decay groups, mixed precision."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from finetune.commands.run import prepare
from finetune.plan.flowchart import plan_for_run
from finetune.train.gradients import clip_gradients
from finetune.train.optimizer import param_groups
from finetune.train.schedule import lr_lambda
from finetune.train.trainer import train_rank
from tests.support import tiny_recipe, write_recipe


def test_warmup_then_cosine_linear_constant() -> None:
    cos = lr_lambda("cosine", warmup=4, total=14, min_ratio=0.1)
    assert [cos(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert cos(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(14) == pytest.approx(0.1) and cos(100) == pytest.approx(0.1)
    lin = lr_lambda("linear", warmup=0, total=10, min_ratio=0.0)
    assert [lin(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    const = lr_lambda("constant", warmup=2, total=10, min_ratio=0.0)
    assert [const(s) for s in (0, 1, 2, 9)] == pytest.approx([0.5, 1.0, 1.0, 1.0])


def test_clip_returns_the_norm_before_clipping_and_clips_to_max() -> None:
    lin = torch.nn.Linear(4, 3)
    lin.weight.grad = torch.full((3, 4), 2.0)
    lin.bias.grad = torch.full((3,), 2.0)
    params = list(lin.parameters())
    opt = torch.optim.AdamW(params)
    norm = clip_gradients(params, opt, None, max_norm=1.0)
    assert norm == pytest.approx(2.0 * math.sqrt(15))
    after = torch.sqrt(sum((p.grad**2).sum() for p in params))
    assert float(after) == pytest.approx(1.0, rel=1e-5)


def test_no_weight_decay_on_norms_and_biases() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3


def _run(tmp_path: Path, name: str, **sections) -> object:
    recipe = tiny_recipe(tmp_path / name, **sections)
    recipe["data"].pop("eval")
    loaded = prepare(str(write_recipe(tmp_path / f"{name}.yaml", recipe)), [])
    return train_rank(loaded, plan_for_run(loaded, nproc=1, nnodes=1, device="cpu"))


@pytest.mark.slow  # two trainings
def test_bf16_mixed_precision_keeps_fp32_master_weights_and_tracks_fp32(tmp_path: Path) -> None:
    fp32 = _run(tmp_path, "fp32", train={"max_steps": 3})
    bf16 = _run(tmp_path, "bf16", precision="bf16", train={"max_steps": 3})
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    # bf16 matmuls round to 8 bits of mantissa: close to fp32, but not equal
    assert bf16.losses == pytest.approx(fp32.losses, rel=2e-2)
    assert bf16.losses != fp32.losses
    assert bf16.losses[-1] < bf16.losses[0]
