"""The catalog of 2025-26 models: every entry built on the meta device has its published parameter count
(within 2%), the architecture its model card describes (experts, top-k, shared experts, dense first layers,
the router's dtype), and is found by its hub id."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from finetune.recipe.catalog import CATALOG, catalog_name
from finetune.recipe.locate import ModelLocation, model_config

# Billions of parameters, as the source cited beside each family in finetune/recipe/catalog.py publishes them.
PUBLISHED = {
    "qwen3-0.6b": 0.6, "qwen3-1.7b": 1.7, "qwen3-4b": 4.0, "qwen3-8b": 8.19, "qwen3-14b": 14.8, "qwen3-32b": 32.8,
    "qwen3-30b-a3b": 30.53, "qwen3-235b-a22b": 235.09,
    "gpt-oss-20b": 20.91, "gpt-oss-120b": 116.83,
    "deepseek-v3": 671.0,
    "llama-3.3-70b": 70.55,
    "gemma-3-4b": 0.675 + 3.209, "gemma-3-12b": 1.012 + 10.759, "gemma-3-27b": 1.416 + 25.600,
    "mistral-small-3.1-24b": 23.57,
    "phi-4": 14.7,
    "olmo-2-7b": 7.30, "olmo-2-13b": 13.7, "olmo-2-32b": 32.2,
    "smollm3-3b": 3.08,
    "llama-4-scout": 109.0, "llama-4-maverick": 400.0,  # with the vision encoder (under 2% of either)
}


def built(name: str) -> Any:
    """The catalog entry's model, built on the meta device as the planner builds it."""
    config, source = model_config(ModelLocation(name, "catalog", name))
    assert source == f"catalog:{name}"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_is_the_published_one(name: str) -> None:
    n = sum(p.numel() for p in built(name).parameters())  # tied weights once
    assert abs(n / 1e9 - PUBLISHED[name]) <= 0.02 * PUBLISHED[name], (name, n)


def mlp_params(layer: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return mlp_params_of(layer.mlp)


def mlp_params_of(block: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: (tuple(p.shape), p.dtype) for n, p in block.named_parameters()}


def test_mixtures_of_experts_have_their_real_layout() -> None:
    # Qwen3-30B-A3B: 128 fused experts of width 768 in every layer, 8 per token, no shared expert
    qwen = built("qwen3-30b-a3b")
    assert qwen.config.num_experts_per_tok == 8 and qwen.config.norm_topk_prob
    for layer in qwen.model.layers:
        assert mlp_params(layer) == {
            "experts.gate_up_proj": ((128, 2 * 768, 2048), torch.bfloat16),
            "experts.down_proj": ((128, 2048, 768), torch.bfloat16),
            "gate.weight": ((128, 2048), torch.bfloat16),
        }
    # DeepSeek-V3: 3 dense layers, then 256 routed experts + 1 shared; the router (and its score correction)
    # in fp32, everything else bf16
    ds = built("deepseek-v3")
    assert len(ds.model.layers) == 61 and ds.config.num_experts_per_tok == 8
    assert {n for n in mlp_params(ds.model.layers[2])} == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    moe = mlp_params(ds.model.layers[3])
    assert moe["experts.gate_up_proj"] == ((256, 2 * 2048, 7168), torch.bfloat16)
    assert moe["gate.weight"] == ((256, 7168), torch.float32)
    assert moe["shared_experts.gate_proj.weight"] == ((2048, 7168), torch.bfloat16)
    assert dict(ds.model.layers[60].mlp.named_buffers())["gate.e_score_correction_bias"].dtype == torch.float32
    assert sum(1 for layer in ds.model.layers if hasattr(layer.mlp, "experts")) == 58
    # gpt-oss: bf16 experts with biases (the MXFP4 of the hub's weights is not the trained layout), 4 per token,
    # a router with a bias, alternating sliding and full attention
    for name, experts, layers in (("gpt-oss-20b", 32, 24), ("gpt-oss-120b", 128, 36)):
        oss = built(name)
        assert len(oss.model.layers) == layers and oss.config.num_experts_per_tok == 4
        assert getattr(oss.config, "quantization_config", None) is None
        assert mlp_params(oss.model.layers[0]) == {
            "router.weight": ((experts, 2880), torch.bfloat16), "router.bias": ((experts,), torch.bfloat16),
            "experts.gate_up_proj": ((experts, 2880, 2 * 2880), torch.bfloat16),
            "experts.gate_up_proj_bias": ((experts, 2 * 2880), torch.bfloat16),
            "experts.down_proj": ((experts, 2880, 2880), torch.bfloat16),
            "experts.down_proj_bias": ((experts, 2880), torch.bfloat16),
        }
        assert oss.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    # Llama 4: one routed expert a token plus the shared one; Scout routes in all 48 layers, Maverick in every
    # second (the first dense), its dense layers 16384 wide
    for name, experts, routed in (("llama-4-scout", 16, 48), ("llama-4-maverick", 128, 24)):
        llama4 = built(name)
        assert llama4.config.num_experts_per_tok == 1 and len(llama4.model.layers) == 48
        moe = [i for i, layer in enumerate(llama4.model.layers) if hasattr(layer.feed_forward, "experts")]
        assert len(moe) == routed and moe[0] == (0 if routed == 48 else 1)
        assert mlp_params_of(llama4.model.layers[moe[0]].feed_forward) == {
            "experts.gate_up_proj": ((experts, 5120, 2 * 8192), torch.bfloat16),
            "experts.down_proj": ((experts, 8192, 5120), torch.bfloat16),
            "router.weight": ((experts, 5120), torch.bfloat16),
            "shared_expert.gate_proj.weight": ((8192, 5120), torch.bfloat16),
            "shared_expert.up_proj.weight": ((8192, 5120), torch.bfloat16),
            "shared_expert.down_proj.weight": ((5120, 8192), torch.bfloat16),
        }
        if routed < 48:
            assert llama4.model.layers[0].feed_forward.gate_proj.weight.shape == (16384, 5120)


@pytest.mark.parametrize(
    ("hub_id", "name"),
    [
        ("Qwen/Qwen3-8B", "qwen3-8b"), ("Qwen/Qwen3-0.6B-Base", "qwen3-0.6b"), ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
        ("Qwen/Qwen3-235B-A22B-Instruct-2507", "qwen3-235b-a22b"), ("openai/gpt-oss-20b", "gpt-oss-20b"),
        ("openai/gpt-oss-120b", "gpt-oss-120b"), ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
        ("deepseek-ai/DeepSeek-V3-Base", "deepseek-v3"), ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b"),
        ("google/gemma-3-4b-it", "gemma-3-4b"), ("google/gemma-3-27b-pt", "gemma-3-27b"),
        ("mistralai/Mistral-Small-3.1-24B-Instruct-2503", "mistral-small-3.1-24b"), ("microsoft/phi-4", "phi-4"),
        ("allenai/OLMo-2-1124-7B-Instruct", "olmo-2-7b"), ("allenai/OLMo-2-0325-32B", "olmo-2-32b"),
        ("HuggingFaceTB/SmolLM3-3B", "smollm3-3b"), ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama-4-scout"),
        ("meta-llama/Llama-4-Maverick-17B-128E-Instruct", "llama-4-maverick"),
        ("openai/gpt-oss-7b", None), ("google/gemma-3-270m", None),
    ],
)
def test_hub_ids_name_their_entries(hub_id: str, name: str | None) -> None:
    assert catalog_name(hub_id) == name
    assert name is None or name in CATALOG
