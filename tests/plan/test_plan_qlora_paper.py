"""The QLoRA paper's headline: LLaMA-65B fine-tuned on one 48 GB GPU (QLoRA r64 on every linear layer, NF4 with
double quantization, activation checkpointing). With AdamW's fp32 state the plan does not fit; the walk goes on
to smaller or moved optimizer state and chooses a configuration that fits. Config only: no weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from finetune.cli import app

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "llama-65b-qlora-48gb.yaml"
GiB = 1024**3


def _plan(tmp_path: Path, **train: str) -> dict:
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["data"]["train"] = str(RECIPE.parent / recipe["data"]["train"])
    recipe["train"].update(train)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = CliRunner().invoke(app, ["plan", str(path), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_llama_65b_qlora_fits_one_48gb_gpu_with_8bit_optimizer_state(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    chosen, walk = plan["chosen"], plan["walk"]
    assert plan["model"]["parameters"] == pytest.approx(65.29e9, rel=1e-3)
    assert chosen["method"] == "qlora" and chosen["strategy"] == "single" and chosen["fits"]
    assert chosen["optimizer"] == "adamw8bit" and chosen["offload"] == "none"
    assert chosen["memory"]["total"] <= 48 * GiB
    plain = next(c for c in plan["candidates"] if c["optimizer"] == "adamw")
    assert not plain["fits"] and plain["memory"]["total"] > 48 * GiB  # AdamW's fp32 moments do not fit
    # 8-bit moments: 2 bytes per trainable value instead of 8 (plus blockwise scales)
    saved = plain["memory"]["optimizer"] - chosen["memory"]["optimizer"]
    assert saved == pytest.approx(6 / 8 * plain["memory"]["optimizer"], rel=0.02)
    assert any(s.startswith("No configuration fits with the optimizer state as planned: trying 8-bit AdamW")
               for s in walk), walk
    assert any(s.startswith("QLoRA with 8-bit AdamW under one process needs") and ": fits" in s for s in walk)
    kinds = [s["kind"] for s in plan["steps"]]
    assert kinds.index("SmallerState") < kinds.index("Pinned")


@pytest.mark.slow  # two more plans of the 65B model
def test_llama_65b_paged_state_leaves_the_forward_and_backward_room(tmp_path: Path) -> None:
    """Paged 8-bit state is evicted to the host while the forward and backward need the room: the peak is
    the larger of those without the state and of the optimizer step with it."""
    eight = _plan(tmp_path, optimizer="adamw8bit")["chosen"]
    paged = _plan(tmp_path, optimizer="paged_adamw8bit")["chosen"]
    assert paged["fits"] and paged["optimizer"] == "paged_adamw8bit"
    assert paged["memory"]["total"] < eight["memory"]["total"]
