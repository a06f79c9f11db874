"""The inventory counts exactly what the trainer instantiates: full, LoRA (peft), QLoRA (bitsandbytes)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config, GPT2Config, Qwen2Config

from finetune.plan.shapes import build_inventory, nf4_bytes
from finetune.recipe.catalog import CATALOG
from finetune.recipe.locate import resolve_model_config
from finetune.recipe.schema import LoraConfig
from finetune.spec import execution_spec
from tests.support import TINY_MODEL


def tiny_configs() -> dict:
    return {
        "llama": AutoConfig.from_pretrained(TINY_MODEL),
        "qwen2": Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        "gpt2": GPT2Config(vocab_size=300, n_embd=64, n_layer=3, n_head=4, n_positions=128),
        "gemma2": Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "gemma2"])
def test_full_and_lora_counts_match_real_models(arch):
    cfg = tiny_configs()[arch]
    targets = "all-linear" if arch != "gpt2" else ["c_attn", "c_fc"]
    lora = LoraConfig(r=4, alpha=8, target_modules=targets)
    inv = build_inventory(cfg, arch, lora)
    model = AutoModelForCausalLM.from_config(cfg)
    assert inv.n_params == sum(p.numel() for p in model.parameters())
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    peft_model = get_peft_model(model, PeftLora(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert inv.n_adapter == trainable > 0
    st = inv.storage(execution_spec("lora", "single", "bf16", checkpointing=False))
    assert st.param_bytes == inv.n_params * 2 + trainable * 4
    assert inv.storage(execution_spec("full", "single", "bf16", checkpointing=False)).param_bytes == inv.n_params * 4
    assert inv.storage(execution_spec("full", "single", "bf16-pure", checkpointing=False)).param_bytes == inv.n_params * 2


def test_default_lora_targets_follow_the_architecture():
    """Unset lora.target_modules: q_proj+v_proj (Llama), c_attn (GPT-2), every linear layer for Phi-3, whose
    fused qkv_proj peft has no default for (the Llama default would make planning phi-3-mini fail)."""
    lora = LoraConfig(r=4, alpha=8)
    cfgs = tiny_configs()
    phi3 = AutoConfig.for_model("phi3", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)
    r = 4
    llama = cfgs["llama"]
    h, kv = llama.hidden_size, llama.num_key_value_heads * (llama.hidden_size // llama.num_attention_heads)
    per_layer = r * (h + h) + r * (h + kv)  # q_proj (h -> h) and v_proj (h -> kv)
    assert build_inventory(llama, "llama", lora).n_adapter == llama.num_hidden_layers * per_layer
    gpt2 = cfgs["gpt2"]
    assert build_inventory(gpt2, "gpt2", lora).n_adapter == 3 * r * (64 + 3 * 64)  # c_attn: 64 -> 192
    # all-linear on Phi-3: qkv_proj 64->192, o_proj 64->64, gate_up_proj 64->256, down_proj 128->64
    per_layer = r * ((64 + 192) + (64 + 64) + (64 + 256) + (128 + 64))
    assert build_inventory(phi3, "phi3", lora).n_adapter == 2 * per_layer


def test_catalog_parameter_counts_are_the_published_ones():
    expected = {"llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496, "llama-3.2-1b": 1_235_814_400,
                "qwen2.5-0.5b": 494_032_768, "mistral-7b": 7_248_023_552, "gemma-2-2b": 2_614_341_888,
                "phi-3-mini": 3_821_079_552}
    for name, n in expected.items():
        cfg, src = resolve_model_config(name)
        assert build_inventory(cfg, src).n_params == n, name
    assert len(CATALOG) >= 17


def test_qlora_storage_matches_a_real_bitsandbytes_model(tmp_path):
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from transformers import BitsAndBytesConfig

    cfg = AutoConfig.from_pretrained(TINY_MODEL)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    q = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16),
    )
    # as the trainer does (finetune.train.model.build.add_adapters): no fp32 upcast of the non-quantized parameters
    q = get_peft_model(q, PeftLora(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    storages: dict[int, int] = {}
    for p in q.parameters():
        storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            tensors = [qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code]
            for t in tensors:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    real = sum(storages.values())
    inv = build_inventory(cfg, "tiny", LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    predicted = inv.storage(execution_spec("qlora", "single", "bf16", checkpointing=False)).param_bytes
    # Exact except for the code tables bitsandbytes shares between weights (counted per weight here).
    assert abs(predicted - real) / real < 0.02, (predicted, real)
    n = 256 * 688
    assert nf4_bytes(n) == n // 2 + n // 64 + -(-n // 64 // 256) * 4 + 16 * 4 + 256 * 4 + 4
