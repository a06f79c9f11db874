"""`finetune export --format gguf`: the file read back by transformers' own GGUF loader
(`from_pretrained(dir, gguf_file=...)`) computes the exported model's logits: in f16 exactly what the model with
its weight matrices rounded to f16 computes (1e-5), within 1e-3 of the run's own; in q8_0 within 3% of the
largest logit; LoRA adapters are folded into their base first (Llama, Mistral, Qwen2, Qwen3); the
tokenizer comes back with the same ids, special tokens and chat template; a family llama.cpp's converter does not
cover is refused in one sentence, nothing written.

The families' models are seeded random tiny models with random (non-zero) LoRA adapters, so no training is
needed to compare; the slow test exports a run of the quickstart recipe through the real CLI.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from finetune.cli import app
from tests.support import ARCH_COMMON, RECIPES, TINY_MODEL, arch_model_dir, micro_model_dir

pytest.importorskip("gguf", reason="finetune export needs the gguf package (pip install -e '.[export]')")

IDS = torch.tensor([[1, 70, 71, 72, 40, 101, 102, 103, 104, 2], [1, 80, 90, 100, 110, 120, 33, 44, 55, 2]])
F16_ATOL = 1e-3  # a trained run's logits against its f16 export
ROUNDED_ATOL = 1e-5  # the f16 export against the model with its matrices rounded to f16: the same numbers
Q8_REL = 0.03  # of the largest logit: 8-bit codes with one scale per 32 values
FAMILIES = {
    "llama": None,  # tiny-llama's own config (micro_model_dir)
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "intermediate_size": 128,
                "sliding_window": None},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "intermediate_size": 128},
    # head_dim 128, as every released Qwen3 has: transformers' GGUF loader takes it from Qwen3's config default
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "intermediate_size": 128, "head_dim": 128},
}


def export(*args: str) -> tuple[int, str]:
    """`finetune export ARGS` through the CLI, in this process."""
    result = CliRunner().invoke(app, ["export", *args])
    return result.exit_code, result.output


def family_dir(d: Path, family: str) -> Path:
    """A seeded random model of ``family`` saved with tiny-llama's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = FAMILIES[family]
    if extra is None:
        micro_model_dir(d, num_hidden_layers=2)
    else:
        d.mkdir(parents=True)
        for f in TINY_MODEL.iterdir():
            if f.name != "config.json":
                (d / f.name).write_bytes(f.read_bytes())
        (d / "config.json").write_text(json.dumps({**ARCH_COMMON, **extra, "torch_dtype": "float32"}))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d)).save_pretrained(d)
    return d


def random_lora(base: Path, out: Path) -> Path:
    """A peft LoRA adapter of ``base`` on every linear layer of its blocks, with random A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(out)
    return out


def read_back(gguf_file: Path) -> tuple[torch.nn.Module, object]:
    """The model and tokenizer transformers builds from ``gguf_file``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    return model(IDS).logits.float()


@torch.no_grad()
def rounded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its weight matrices rounded to f16 (norms and biases stay f32), as the f16 export holds them."""
    for p in model.parameters():
        if p.ndim >= 2:
            p.copy_(p.half().float())
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_lora_adapter_is_folded_and_read_back_by_transformers(tmp_path: Path, family: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = family_dir(tmp_path / "base", family)
    adapter = random_lora(base, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    expected = logits(peft_model)
    in_f16 = logits(rounded(peft_model.merge_and_unload()))
    plain = logits(AutoModelForCausalLM.from_pretrained(base).eval())
    assert (expected - plain).abs().max() > 0.05  # the adapter changes the logits: a missed fold would show
    code, out = export(str(adapter), "--out", str(tmp_path / "model.gguf"))
    assert code == 0, out
    arch = "llama" if family in ("llama", "mistral") else family
    assert out.startswith(f"exported {tmp_path / 'model.gguf'} ({arch}, its LoRA adapter folded into the base")
    model, tok = read_back(tmp_path / "model.gguf")
    assert model.config.model_type == ("llama" if family == "mistral" else family)
    got = logits(model)
    assert (got - in_f16).abs().max() < ROUNDED_ATOL
    assert (got - expected).abs().max() < 2 * F16_ATOL  # what f16 costs these random weights
    text = "Reverse the letters.\nhello wörld 123 <s>"
    original = tokenizer_of(base)
    assert tok(text)["input_ids"] == original(text)["input_ids"]
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []  # no temporary file left


def tokenizer_of(d: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d)


def test_q8_0_is_within_its_tolerance_and_smaller(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = family_dir(tmp_path / "base", "llama")
    expected = logits(AutoModelForCausalLM.from_pretrained(base).eval())
    for dtype in ("f16", "q8_0"):
        code, out = export(str(base), "--out", str(tmp_path / f"{dtype}.gguf"), "--dtype", dtype)
        assert code == 0, out
    f16, q8 = (tmp_path / "f16.gguf").stat().st_size, (tmp_path / "q8_0.gguf").stat().st_size
    # 34 bytes per 32 values against 64; down_proj's rows of 688 values (not a multiple of 32) stay f16
    assert q8 < 0.7 * f16
    err = (logits(read_back(tmp_path / "q8_0.gguf")[0]) - expected).abs().max()
    assert 1e-4 < err < Q8_REL * expected.abs().max()  # quantized (not f16), and close


def test_refusals_name_what_to_do_and_write_nothing(tmp_path: Path) -> None:
    gemma = arch_model_dir(tmp_path / "gemma", "gemma3_text")
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gemma)).save_pretrained(gemma)
    out = tmp_path / "m.gguf"
    code, printed = export(str(gemma), "--out", str(out))
    assert code == 2
    assert printed == (
        f"error: RUN_OR_MODEL: {gemma} is a gemma3_text model, which finetune export does not write as GGUF; it "
        "exports llama, mistral, qwen2, qwen3 models\n"
    )
    code, printed = export(str(gemma), "--out", str(out), "--dtype", "q4_k")
    assert code == 2 and printed == "error: --dtype q4_k is not one of f16, q8_0\n"
    out.write_text("mine")
    code, printed = export(str(TINY_MODEL), "--out", str(out))
    assert code == 2 and printed == f"error: --out {out} already exists; pass --force to replace it\n"
    assert out.read_text() == "mine"
    prefix = prefix_adapter(tmp_path)
    code, printed = export(str(prefix), "--out", str(tmp_path / "p.gguf"))
    assert code == 2 and printed.startswith(f"error: RUN_OR_MODEL {prefix} holds a prefix adapter, which export "
                                            "cannot fold into the base (only LoRA adapters are folded)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "gemma", "m.gguf", "prefix"]


def prefix_adapter(tmp_path: Path) -> Path:
    from peft import PrefixTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = family_dir(tmp_path / "base", "llama")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    model.save_pretrained(tmp_path / "prefix")
    return tmp_path / "prefix"


@pytest.mark.slow
def test_the_quickstart_run_exported_computes_its_logits(tmp_path: Path) -> None:
    """`finetune run recipes/quickstart.yaml` (a few steps), then `finetune export RUN` in f16 and q8_0: the
    files read back by transformers give the run's logits, and its tokenizer and chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.commands.run import LaunchOptions, launch

    run = tmp_path / "run"
    printed = io.StringIO()
    with redirect_stdout(printed):
        code = launch(str(RECIPES / "quickstart.yaml"), [f"output.dir={run}", "train.max_steps=20",
                                                          "eval.at_start=false"], LaunchOptions(nproc=1))
    assert code == 0, printed.getvalue()[-3000:]
    trained = AutoModelForCausalLM.from_pretrained(run, dtype=torch.float32).eval()
    expected = logits(trained)
    for dtype in ("f16", "q8_0"):
        code, out = export(str(run), "--out", str(tmp_path / f"quickstart-{dtype}.gguf"), "--dtype", dtype)
        assert code == 0, out
    f16, tok = read_back(tmp_path / "quickstart-f16.gguf")
    err_f16 = (logits(f16) - expected).abs().max()
    assert err_f16 < F16_ATOL, float(err_f16)
    err_q8 = (logits(read_back(tmp_path / "quickstart-q8_0.gguf")[0]) - expected).abs().max()
    assert err_q8 < Q8_REL * expected.abs().max(), (float(err_q8), float(expected.abs().max()))
    original = AutoTokenizer.from_pretrained(run)
    for row in (RECIPES / "data/reverse/eval.jsonl").read_text().splitlines()[:20]:
        text = json.loads(row)["instruction"] + "\n" + json.loads(row)["input"]
        assert tok(text)["input_ids"] == original(text)["input_ids"]
    assert tok.chat_template == original.chat_template
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (original.bos_token, original.eos_token, original.pad_token)
