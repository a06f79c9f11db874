"""The plan of a mixture's experts under QLoRA: Qwen3-30B-A3B on one 24 GiB GPU, its experts in NF4 per expert."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30
#: Qwen3-30B-A3B's published config (the shape the catalog's qwen3-30b-a3b plans).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False, "router_aux_loss_coef": 0.001,
}


def _model(tmp: Path) -> str:
    """The catalog's name when the catalog has the model, else a directory holding its config."""
    from finetune.recipe.catalog import catalog_name

    if catalog_name("qwen3-30b-a3b") is not None:
        return "qwen3-30b-a3b"
    d = tmp / "qwen3-30b-a3b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return str(d)


def _plan(tmp: Path, model: str, method: str) -> dict:
    env = dict(os.environ, FINETUNE_CACHE=str(tmp / "cache"))
    done = subprocess.run(
        [sys.executable, "-m", "finetune", "plan", "--model", model, "--method", method, "--gpus", "1",
         "--gpu-memory", "24GiB", "--json"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow  # two CLI subprocesses tracing a 48-layer model's config
def test_qwen3_30b_a3b_qlora_fits_one_24gib_gpu_with_nf4_experts(tmp_path: Path) -> None:
    model = _model(tmp_path)
    plan = _plan(tmp_path, model, "qlora")
    info = plan["model"]
    base = info["param_bytes"] - 4 * info["trainable"]  # the adapters train in fp32
    assert plan["chosen"]["fits"] and plan["chosen"]["method"] == "qlora"
    assert base <= 18 * GiB, base / GiB
    experts = info["experts"]
    assert experts["tensors"] == experts["quantized"] == experts["adapted"] == 96
    assert experts["values"] / info["parameters"] > 0.9
    # each expert's codes and constants: about 0.52 bytes per expert weight
    assert 0.515 < experts["stored_bytes"] / experts["values"] < 0.52
    lora = _plan(tmp_path, model, "lora")["model"]
    assert lora["param_bytes"] - 4 * lora["trainable"] > 55 * GiB  # the same experts in bf16
