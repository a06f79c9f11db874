"""QLoRA: the 4-bit base trains on CPU, and merge folds into the 16-bit or the NF4-dequantized base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from finetune.merge import merge
from finetune.recipe.schema import recipe_from_dict, recipe_to_yaml, shipped_recipes_dir
from finetune.spec import ExecSpec, execution_spec
from finetune.train.model.quantize import bnb_config, dequantized_weight, load_quantized, quantized_modules

TINY = str(shipped_recipes_dir() / "models" / "tiny-llama")
INPUT_IDS = torch.tensor([[1, 70, 71, 72, 40, 101, 102, 103, 104, 2], [1, 80, 90, 100, 110, 120, 33, 44, 55, 2]])


def qlora_recipe(**quantization: object):
    return recipe_from_dict(
        {"model": {"path": TINY, "init": "random"}, "method": "qlora", "precision": "fp32",
         "quantization": quantization, "data": {"train": "unused.jsonl"}, "train": {"seed": 3}}
    )


def candidate(precision: str = "fp32", strategy: str = "single", lora: object = None) -> ExecSpec:
    return execution_spec("qlora", strategy, precision, checkpointing=False, lora=lora)


def with_lora(model: torch.nn.Module, targets: list[str] | str = "all-linear") -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM"))


def test_bnb_config_follows_the_recipe() -> None:
    c = bnb_config(qlora_recipe().recipe, torch.bfloat16)
    assert (c.load_in_4bit, c.bnb_4bit_quant_type, c.bnb_4bit_use_double_quant) == (True, "nf4", True)
    assert c.bnb_4bit_compute_dtype == torch.bfloat16 and c.bnb_4bit_quant_storage == torch.uint8
    c = bnb_config(qlora_recipe(quant_type="fp4", double_quant=False).recipe, torch.float32, torch.bfloat16)
    assert (c.bnb_4bit_quant_type, c.bnb_4bit_use_double_quant, c.bnb_4bit_quant_storage) == ("fp4", False, torch.bfloat16)
    c = bnb_config(qlora_recipe(bits=8).recipe, torch.float32)
    assert c.load_in_8bit and not c.load_in_4bit


@pytest.mark.slow  # trains
def test_qlora_trains_on_cpu(tmp_path: Path) -> None:
    """NF4 + double quant base, LoRA on every linear layer: the loss falls over a few AdamW steps."""
    import bitsandbytes as bnb

    loaded = qlora_recipe()
    model = load_quantized(loaded, TINY, candidate(), "cpu", base_dir=tmp_path / "base")
    four_bit = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 4 * 7 and not isinstance(model.lm_head, bnb.nn.Linear4bit)
    assert model.model.layers[0].mlp.up_proj.weight.quant_state.nested  # double quantization
    assert (tmp_path / "base" / "model.safetensors").is_file()  # the random fp32 weights it started from
    peft_model = with_lora(model)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        loss = peft_model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    peft_model.eval()
    with torch.no_grad():  # eval without gradients (bitsandbytes' CPU inference path) still runs
        assert torch.isfinite(peft_model(INPUT_IDS).logits).all()


@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
def test_dequantized_weight_is_what_the_quantized_model_computes_with(tmp_path: Path, kind: str) -> None:
    import bitsandbytes.functional as bnbf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    loaded = qlora_recipe(bits=8) if kind == "int8" else qlora_recipe(quant_type=kind)
    model = load_quantized(loaded, TINY, candidate(), "cpu", base_dir=tmp_path / "base")
    weights = load_file(str(tmp_path / "base" / "model.safetensors"))
    names = quantized_modules(AutoConfig.from_pretrained(tmp_path / "base"))
    assert len(names) == 28 and "lm_head" not in names
    for name in names:
        w = model.get_submodule(name).weight
        if kind == "int8":  # int8 codes per row, scaled by the row's absmax / 127
            trained = w.data.float() * (w.SCB.float().unsqueeze(1) / 127)
        else:
            trained = bnbf.dequantize_4bit(w.data, w.quant_state)
        mine = dequantized_weight(weights[f"{name}.weight"], loaded.recipe.quantization, torch.float32)
        assert torch.allclose(mine, trained, rtol=0, atol=1e-7 if kind == "int8" else 0), name


def make_qlora_run(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A qlora output dir as the trainer writes it: recipe.yaml, base/ (random init), the PEFT adapter."""
    loaded = qlora_recipe()
    run = tmp_path / "run"
    model = load_quantized(loaded, TINY, candidate(), "cpu", base_dir=run / "base")
    peft_model = with_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(run)
    (run / "recipe.yaml").write_text(recipe_to_yaml(loaded.recipe))
    return run, peft_model.eval()


def test_qlora_merge_into_16bit_base_and_into_dequantized(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    run, trained = make_qlora_run(tmp_path)
    assert yaml.safe_load((run / "recipe.yaml").read_text())["method"] == "qlora"
    with torch.no_grad():
        expected = trained(INPUT_IDS).logits

    def merged_logits(out: Path) -> torch.Tensor:
        m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            return m(INPUT_IDS).logits

    merge(run, tmp_path / "m16")
    merge(run, tmp_path / "mdq", into_dequantized=True)
    diff_16 = (merged_logits(tmp_path / "m16") - expected).abs().max().item()
    diff_dq = (merged_logits(tmp_path / "mdq") - expected).abs().max().item()
    print(f"QLoRA merge, max |logit diff| vs the trained 4-bit model: 16-bit base {diff_16:.3g}, "
          f"dequantized NF4 {diff_dq:.3g}")
    assert diff_dq < 1e-4, diff_dq
    assert diff_16 > 100 * diff_dq  # the quantization error the default merge does not carry over
    # a LoRA (non-quantized) run refuses --into-dequantized
    (run / "recipe.yaml").write_text((run / "recipe.yaml").read_text().replace("method: qlora", "method: lora"))
    from finetune.errors import UserError

    with pytest.raises(UserError, match="--into-dequantized needs a qlora run"):
        merge(run, tmp_path / "never", into_dequantized=True)
    assert not (tmp_path / "never").exists()


@pytest.mark.slow  # trains
def test_qlora_bf16_keeps_the_frozen_base_in_bf16_and_trains(tmp_path: Path) -> None:
    """The trainer's own QLoRA setup (load_quantized + add_adapters) at bf16: embeddings, norms and head stay
    bf16 (no fp32 upcast), adapters are fp32, the residual stream is bf16, and AdamW steps lower the loss."""
    from finetune.train.model.build import add_adapters

    loaded = recipe_from_dict(
        {"model": {"path": TINY, "init": "random"}, "method": "qlora", "precision": "bf16",
         "lora": {"target_modules": "all-linear"}, "data": {"train": "unused.jsonl"}, "train": {"seed": 3}}
    )
    model = load_quantized(loaded, TINY, candidate("bf16"), "cpu", base_dir=tmp_path / "base")
    model = add_adapters(model, loaded, candidate("bf16", lora=loaded.recipe.lora))  # all-linear, as the recipe says
    dtypes = {n: p.dtype for n, p in model.named_parameters() if p.is_floating_point()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    frozen = {n: d for n, d in dtypes.items() if "lora_" not in n}
    assert frozen and set(frozen.values()) == {torch.bfloat16}, frozen  # embed_tokens, norms, lm_head
    seen = []
    model.base_model.model.model.layers[1].register_forward_hook(lambda m, a, out: seen.append(out[0].dtype))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert seen[0] == torch.bfloat16  # a decoder layer's output: the residual stream is not fp32
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize(("precision", "strategy"), [("fp32", "single"), ("bf16", "fsdp")],
                         ids=["uint8-storage", "bf16-storage"])
def test_qlora_parameter_count_is_the_unquantized_models(tmp_path: Path, precision: str, strategy: str) -> None:
    """The run header's counts: bitsandbytes packs two 4-bit codes per uint8 (four per bf16 element under
    FSDP), so counting numel() gave about half the parameters and twice the trainable share."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.train.model.build import count_parameters

    targets = ["q_proj", "v_proj"]
    base = load_quantized(qlora_recipe(), TINY, candidate(precision, strategy), "cpu", tmp_path / "base")
    storage = {p.dtype for n, p in base.named_parameters() if "proj" in n and "weight" in n}
    assert storage == {torch.uint8 if strategy == "single" else torch.bfloat16}  # the codes' storage dtype
    quantized = with_lora(base, targets)
    plain = with_lora(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY)), targets)
    expected = plain.get_nb_trainable_parameters()
    assert expected == (28_672, 3_037_440 + 28_672)  # the tiny model and r=8 adapters on q (256->256), v (256->128)
    assert count_parameters(quantized) == expected
    assert count_parameters(quantized) == quantized.get_nb_trainable_parameters()
