"""``finetune merge --into-dequantized`` of a QLoRA mixture: its fused experts, NF4 per expert in training,
folded into exactly the weights the run computed with (the base checkpoint keeps one tensor per expert)."""

from __future__ import annotations

import pytest
import torch

from finetune.merge import merge
from finetune.model.experts import (
    add_to_peft_dir,
    experts_layer_names,
    fused_experts,
    is_expert_codes,
    peft_layout,
)
from finetune.recipe.schema import recipe_from_dict, recipe_to_yaml
from finetune.spec import execution_spec
from finetune.train.model.build import build_model
from tests.support import arch_model_dir

pytestmark = pytest.mark.slow  # builds and quantizes a model, merges twice
IDS = torch.tensor([[1, 70, 71, 72, 40, 101, 102, 103, 104, 2], [1, 80, 90, 100, 110, 120, 33, 44, 55, 2]])


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A QLoRA model of a tiny Qwen3-MoE as the trainer builds it (NF4 linears and experts, LoRA all-linear),
    its adapters set to random values and saved as a run saves them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("merge-experts")
    config_dir = arch_model_dir(tmp / "config", "qwen3_moe")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    base.save_pretrained(tmp / "base")  # one tensor per expert, as the Hub's checkpoints
    for f in config_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (tmp / "base" / f.name).write_bytes(f.read_bytes())
    loaded = recipe_from_dict({
        "model": {"path": str(tmp / "base")}, "method": "qlora", "precision": "fp32",
        "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}, "data": {"train": "unused.jsonl"},
    })
    spec = execution_spec("qlora", "single", "fp32", checkpointing=False, lora=loaded.recipe.lora,
                          quantization=loaded.recipe.quantization)
    model = build_model(loaded, spec, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    run = tmp / "run"
    state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    rest, tensors, targets = peft_layout(state, model)
    model.save_pretrained(run, state_dict=rest)
    add_to_peft_dir(run, tensors, targets, experts_layer_names(model))
    (run / "recipe.yaml").write_text(recipe_to_yaml(loaded.recipe))
    return {"tmp": tmp, "run": run, "model": model, "logits": logits}


def test_qlora_experts_are_nf4_codes(qlora_run: dict) -> None:
    experts = list(fused_experts(qlora_run["model"]).values())
    assert len(experts) == 2 and all(is_expert_codes(e.gate_up_proj) and is_expert_codes(e.down_proj) for e in experts)


def test_merge_into_dequantized_experts_computes_what_the_qlora_model_did(qlora_run: dict) -> None:
    from transformers import AutoModelForCausalLM

    tmp = qlora_run["tmp"]
    merge(qlora_run["run"], tmp / "deq", base=str(tmp / "base"), into_dequantized=True)
    merge(qlora_run["run"], tmp / "plain", base=str(tmp / "base"))
    with torch.no_grad():
        deq = AutoModelForCausalLM.from_pretrained(tmp / "deq", dtype=torch.float32).eval()(input_ids=IDS).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp / "plain", dtype=torch.float32).eval()(input_ids=IDS).logits
    torch.testing.assert_close(deq, qlora_run["logits"], atol=1e-4, rtol=1e-4)
    assert (plain - qlora_run["logits"]).abs().max() > 100 * (deq - qlora_run["logits"]).abs().max()
