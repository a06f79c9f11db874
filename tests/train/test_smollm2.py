"""A real pretrained model: SmolLM2-135M-Instruct, converted by scripts/get_smollm2.py (CI runs it first).

Skipped, with the command to run, where the converted model is absent.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.support import ROOT, write_recipe

sys.path.insert(0, str(ROOT / "scripts"))
from get_smollm2 import DONE, default_dest

MODEL = default_dest()
pytestmark = [
    pytest.mark.slow,  # loads the 135M model
    pytest.mark.skipif(
        not (MODEL / DONE).is_file(),
        reason=f"SmolLM2-135M-Instruct is not converted at {MODEL}: run `python scripts/get_smollm2.py` first",
    ),
]


def test_converted_model_answers_paris():
    from get_smollm2 import answer

    assert "Paris" in answer(MODEL, "What is the capital of France?", max_new_tokens=10)


def test_fused_loss_equals_logits_loss_on_the_real_model():
    """Tied embeddings, LoRA on q/v: the fused head + loss gives the loss and adapter gradients of logits
    followed by the chunked loss (fp32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import finetune.objectives.loss as loss_mod
    from finetune.objectives.loss_chunks import LossChunks

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    model = get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    assert loss_mod.fusable_head(model) is model.get_base_model().lm_head
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    got = []
    for fused in (True, False):
        model.zero_grad()
        s, _ = loss_mod.causal_lm_loss(model, batch, LossChunks(fused_head=fused))
        s.backward()
        got.append((s.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    (l1, g1), (l2, g2) = got
    assert l1 == pytest.approx(l2, rel=1e-5)
    assert g1.keys() == g2.keys() and len(g1) == 2 * 2 * model.config.num_hidden_layers
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow
def test_recipe_runs_end_to_end(tmp_path, finetune_cmd):
    """The shipped recipe, shortened to 2 steps of 4 conversations, through the real CLI: the base model
    answers none of the held-out requests in the exact format, the run trains and saves a PEFT adapter. The
    training file is the shipped one's first 16 conversations (the run reads 8; tokenizing all 2000 through
    the chat template would take longer than the run)."""
    import yaml

    recipe = yaml.safe_load((ROOT / "recipes/smollm2-135m-lora.yaml").read_text())
    recipe["model"]["path"] = str(MODEL)
    rows = (ROOT / "recipes/data/extract-json/train.jsonl").read_text().splitlines(keepends=True)[:16]
    (tmp_path / "train.jsonl").write_text("".join(rows))
    recipe["data"]["train"] = str(tmp_path / "train.jsonl")
    recipe["data"]["eval"] = str(ROOT / "recipes/data/extract-json/eval.jsonl")
    recipe["train"].update(max_steps=2, global_batch_size=4)
    recipe["eval"].update(max_samples=4, batch_size=4)
    recipe["output"].update(dir=str(tmp_path / "run"), log_every=1)
    path = write_recipe(tmp_path / "r.yaml", recipe)
    proc = subprocess.run([*finetune_cmd, "run", str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and rows[0]["eval_exact_match"] == 0.0
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(0 < x < 5 for x in losses)
    assert (tmp_path / "run/adapter_model.safetensors").is_file()
