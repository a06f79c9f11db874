"""End to end through the real CLI: `finetune run` a LoRA/QLoRA recipe, `finetune merge` it, and load the
merged directory with transformers alone (peft made unimportable) to compare logits with the adapter model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.recipe.schema import shipped_recipes_dir

pytestmark = pytest.mark.slow

TINY = shipped_recipes_dir() / "models" / "tiny-llama"
IDS = [[1, 70, 71, 72, 40, 101, 102, 103, 104, 2], [1, 80, 90, 100, 110, 120, 33, 44, 55, 2]]

# Loads a model directory with `import peft` made impossible, prints its logits as JSON.
LOAD_WITHOUT_PEFT = """
import importlib.abc, importlib.machinery, json, sys
attempts = []
class NoPeft(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # `import peft` fails as if it were not installed, and every attempt is recorded
    def find_spec(self, name, path=None, target=None):
        if name == "peft" or name.startswith("peft."):
            return importlib.machinery.ModuleSpec(name, self)
        return None
    def create_module(self, spec):
        attempts.append(spec.name)
        raise ModuleNotFoundError("peft is not installed here", name=spec.name)
    def exec_module(self, module):
        raise AssertionError("unreachable")
sys.meta_path.insert(0, NoPeft())
try:
    import peft  # noqa: F401
    raise SystemExit("peft is importable")
except ModuleNotFoundError:
    attempts.clear()
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
assert not attempts, attempts
with torch.no_grad():
    print(json.dumps(m(torch.tensor(json.loads(sys.argv[2]))).logits.tolist()))
"""


def finetune_run(recipe: Path, cwd: Path) -> None:
    """`finetune run` in its own process, as a user runs it."""
    out = subprocess.run([sys.executable, "-m", "finetune", "run", str(recipe)], cwd=cwd, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def finetune_merge(*args: str, cwd: Path) -> str:
    """`finetune merge` through the real CLI (in this process: the merge itself imports no peft)."""
    import os

    from typer.testing import CliRunner

    from finetune.cli import app

    here = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, ["merge", *args])
    finally:
        os.chdir(here)
    assert result.exit_code == 0, result.output
    return result.output


def write_recipe(tmp: Path, method: str) -> Path:
    """A few-step LoRA/QLoRA recipe on a saved tiny-llama base (16 rows of the uppercase task)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = tmp / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY)).save_pretrained(base)
    for f in TINY.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copyfile(f, base / f.name)
    rows = (shipped_recipes_dir() / "data" / "uppercase" / "train.jsonl").read_text().splitlines()
    (tmp / "train.jsonl").write_text("\n".join(rows[:24]) + "\n")
    (tmp / "eval.jsonl").write_text("\n".join(rows[24:26]) + "\n")
    recipe = tmp / f"{method}.yaml"
    recipe.write_text(
        f"model: {{path: base, init: pretrained}}\nmethod: {method}\n"
        "lora: {r: 8, alpha: 16, target_modules: all-linear}\n"
        "data: {train: train.jsonl, eval: eval.jsonl, max_seq_len: 64}\n"
        "train: {max_steps: 3, global_batch_size: 8, micro_batch_size: 8, lr: 1.0e-2, warmup_steps: 0}\n"
        "precision: fp32\ndistributed: {strategy: single}\neval: {max_new_tokens: 2, max_samples: 2}\n"
        f"output: {{dir: run-{method}}}\n"
    )
    return recipe


def adapter_logits(tmp: Path, run: Path, quantized: bool) -> torch.Tensor:
    """Logits of the trained model: the base (4-bit for qlora, as the run loaded it) plus the saved adapter."""
    from peft import PeftModel

    from finetune.recipe.schema import load_recipe
    from finetune.spec import execution_spec
    from finetune.train.model.quantize import load_quantized

    if quantized:
        loaded = load_recipe(tmp / "qlora.yaml")
        chosen = execution_spec("qlora", "single", "fp32", checkpointing=False, quantization=loaded.recipe.quantization)
        model = load_quantized(loaded, str(tmp / "base"), chosen, "cpu")
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tmp / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(model, run).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits


def merged_logits(out: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits


def merged_logits_without_peft(out: Path) -> torch.Tensor:
    res = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PEFT, str(out), json.dumps(IDS)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    return torch.tensor(json.loads(res.stdout.strip().splitlines()[-1]))


def test_lora_run_merge_load_without_peft(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "lora")
    finetune_run(recipe, tmp_path)
    run = tmp_path / "run-lora"
    assert (run / "adapter_model.safetensors").is_file() and (run / "recipe.yaml").is_file()
    printed = finetune_merge("run-lora", "--out", "merged", cwd=tmp_path)
    assert "merged 28 adapted modules" in printed
    expected = adapter_logits(tmp_path, run, quantized=False)
    diff = (merged_logits_without_peft(tmp_path / "merged") - expected).abs().max().item()
    assert diff < 1e-4, diff


def test_qlora_run_merge_into_dequantized(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "qlora")
    finetune_run(recipe, tmp_path)
    run = tmp_path / "run-qlora"
    finetune_merge("run-qlora", "--out", "merged-dq", "--into-dequantized", cwd=tmp_path)
    finetune_merge("run-qlora", "--out", "merged-16", cwd=tmp_path)
    expected = adapter_logits(tmp_path, run, quantized=True)
    diff_dq = (merged_logits(tmp_path / "merged-dq") - expected).abs().max().item()
    diff_16 = (merged_logits(tmp_path / "merged-16") - expected).abs().max().item()
    print(f"QLoRA run merged: max |logit diff| vs trained 4-bit model: dequantized {diff_dq:.3g}, 16-bit {diff_16:.3g}")
    assert diff_dq < 1e-4, diff_dq
    assert diff_16 > 100 * diff_dq
