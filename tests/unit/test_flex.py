"""model.attn_implementation: flex_attention through the real CLI: packed rows train as under sdpa."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support import tiny_recipe, write_recipe


@pytest.mark.slow  # two CLI runs
def test_flex_packed_run_trains_like_sdpa(tmp_path, finetune_cmd):
    """Four packed steps of the tiny model (fp32, CPU) with flex_attention and with sdpa.

    On CPU both runs evaluate the same document mask with the same sdpa kernel (torch 2.13 has no flex backward
    on CPU: finetune.model.flex evaluates flex's BlockMask densely); only how the mask is built differs
    (create_block_mask's mask function vs transformers' sdpa_mask), so the losses agree to float rounding:
    1e-5 relative leaves room for that and none for a mask that lets one document see another (which moves the
    first loss by about 1e-2 on this data).
    """
    losses = {}
    for attn in ("sdpa", "flex_attention"):
        out = tmp_path / attn
        recipe = tiny_recipe(
            out, model={"attn_implementation": attn}, data={"packing": True}, eval={"at_start": False}
        )
        recipe["data"].pop("eval")
        path = write_recipe(tmp_path / f"{attn}.yaml", recipe)
        proc = subprocess.run([*finetune_cmd, "run", str(path)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses[attn] = [r["loss"] for r in rows if "loss" in r]
    flex, sdpa = losses["flex_attention"], losses["sdpa"]
    assert len(flex) == 4 and flex[-1] < flex[0] - 0.5  # it learns
    assert flex[0] == pytest.approx(sdpa[0], rel=1e-5)
    assert flex == pytest.approx(sdpa, rel=1e-4)


def test_flex_is_a_recipe_choice_and_other_kernels_are_refused():
    from finetune.recipe.schema import RecipeError, recipe_from_dict

    r = recipe_from_dict(
        {"model": {"path": "tiny-llama", "attn_implementation": "flex_attention"}, "data": {"train": "x"}}
    )
    assert r.recipe.model.attn_implementation == "flex_attention"
    with pytest.raises(RecipeError, match="attn_implementation"):
        recipe_from_dict(
            {"model": {"path": "tiny-llama", "attn_implementation": "flash"}, "data": {"train": "x"}}
        )


def test_an_architecture_without_flex_attention_gets_one_sentence(tmp_path, monkeypatch):
    import sys

    from typer.testing import CliRunner

    from finetune.cli import app

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from plan_accuracy import model_dir

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    recipe = tiny_recipe(
        tmp_path / "out",
        model={"path": str(model_dir("gpt2", tmp_path)), "attn_implementation": "flex_attention"},
    )
    out = CliRunner().invoke(app, ["plan", str(write_recipe(tmp_path / "gpt2.yaml", recipe))])
    assert out.exit_code == 2, out.output
    assert "model.attn_implementation: GPT2 has no flex attention in transformers; use sdpa" in " ".join(
        out.output.split()
    )
    assert "Traceback" not in out.output


def test_flex_generates_like_sdpa_on_cpu():
    """Evaluation's greedy generation (left padding, KV cache) runs with flex on CPU and gives sdpa's tokens."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from finetune.model import flex
    from tests.support import TINY_MODEL

    flex.install()
    config = LlamaConfig(**json.loads((TINY_MODEL / "config.json").read_text()))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    out = {}
    for attn in ("sdpa", "flex_attention"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
        with torch.no_grad():
            out[attn] = model.generate(
                input_ids=ids,
                attention_mask=(ids != 0).long(),
                max_new_tokens=3,
                do_sample=False,
                pad_token_id=0,
            )
    assert out["flex_attention"].shape == (2, 9)
    assert torch.equal(out["flex_attention"], out["sdpa"])


@pytest.mark.slow  # a CLI run
def test_cpu_flex_plan_counts_the_fallbacks_masks(tmp_path, finetune_cmd):
    """On CPU, flex attention runs finetune.model.flex's fallback: every layer evaluates the document mask densely,
    (B, 1, T, T), and sdpa keeps an fp32 additive copy of it for backward. The run's plan (device cpu) traces
    that fallback, so memory.json's prediction is the measured peak within 5% (counting flex's GPU memory,
    no mask, would fall about 9% short). A GPU plan of the same recipe still counts no mask, and what it
    misses of the CPU run's measured peak is exactly what the two plans differ by: the masks."""
    import random

    seq, batch, layers = 512, 2, 4  # the tiny model's depth; two 256-token documents in every row
    rng = random.Random(0)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"input_ids": [rng.randrange(3, 256) for _ in range(seq // 2)]}) + "\n"
            for _ in range(8)
        )
    )
    out = tmp_path / "run"
    recipe = tiny_recipe(
        out,
        model={"attn_implementation": "flex_attention"},
        data={"train": str(rows), "format": "tokenized", "max_seq_len": seq, "packing": True, "eval": None},
        train={
            "max_steps": 2,
            "global_batch_size": batch,
            "micro_batch_size": batch,
            "activation_checkpointing": False,
        },
        eval={"at_start": False},
    )
    path = write_recipe(tmp_path / "flex.yaml", recipe)
    proc = subprocess.run(
        [*finetune_cmd, "run", str(path), "--measure-memory"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    memory = json.loads((out / "memory.json").read_text())
    assert "rows" not in memory, memory["rows"]  # every row as wide as planned
    assert abs(memory["error_at_measured_rows"]) < 0.05, memory

    proc = subprocess.run(
        [*finetune_cmd, "plan", str(path), "--gpus", "1", "--gpu-memory", "80GiB", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    gpu = json.loads(proc.stdout)["chosen"]["memory"]
    cpu = json.loads((out / "plan.json").read_text())["chosen"]["memory"]
    masks = cpu["activations"] - gpu["activations"]
    saved_copies = layers * batch * seq * seq * 4  # one fp32 (B, 1, T, T) per layer, kept for backward
    assert saved_copies <= masks < 2 * saved_copies, (masks, saved_copies)
    missed = memory["measured_peak"] - (gpu["total"] - gpu["overhead"])
    assert missed == pytest.approx(masks, rel=0.02), (missed, masks)


@pytest.mark.parametrize(
    ("attn", "packing", "device", "want"),
    [
        ("auto", True, "cuda", "flex_attention"),  # `finetune plan` for a GPU, packed rows
        ("auto", True, "cpu", "sdpa"),  # the same recipe planned for a run on this CPU
        ("auto", False, "cuda", "sdpa"),  # unpacked rows need no mask
        ("sdpa", True, "cuda", "sdpa"),  # a pinned kernel is kept
    ],
)
def test_auto_attention_is_flex_for_packed_rows_on_gpus(tmp_path, monkeypatch, attn, packing, device, want):
    """model.attn_implementation: auto (the default) resolves in the plan: its execution spec, which the trainer
    builds the model with, holds the kernel, and the walk says why flex was chosen."""
    from finetune.plan.command import PlanOptions, build_plan
    from finetune.plan.flowchart import plan_for_run
    from finetune.recipe.schema import load_recipe
    from tests.support import micro_model_dir

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    model = micro_model_dir(tmp_path / "micro", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    recipe = tiny_recipe(tmp_path / "out", model={"path": str(model), "attn_implementation": attn},
                         data={"packing": packing, "max_seq_len": 64})
    path = str(write_recipe(tmp_path / "r.yaml", recipe))
    if device == "cuda":
        plan = build_plan(PlanOptions(recipe=path, gpus=1, gpu_memory="80GiB"))
    else:
        plan = plan_for_run(load_recipe(path), nproc=1, nnodes=1, device="cpu")
    assert plan.execution is not None and plan.execution.attention == want
    said = [line for line in plan.walk if line.startswith("Attention: flex_attention for the packed rows")]
    assert len(said) == (want == "flex_attention" and attn == "auto")
