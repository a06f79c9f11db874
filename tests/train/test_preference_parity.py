"""dpo's loss and gradients against TRL's DPOTrainer on the same model, pairs and settings, for the first steps.

Both sides start from the same weights and see the same batch of pairs (our collation: chosen rows, then
rejected rows, labels on the completions). TRL's loss is its trainer's ``compute_loss`` on that batch (its
public loss API: the reference is the base with the adapter disabled for LoRA, a frozen copy for full
fine-tuning); ours is :class:`finetune.objectives.preference.PreferenceObjective`. Each step both take the same SGD update
from their own gradients, so a divergence in any step's gradient shows in the next step's loss.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support import TINY_MODEL

trl = pytest.importorskip("trl", reason="TRL is the reference implementation (pip install -e .[test])")

STEPS = 3
PAIRS = [
    ("Reverse the letters.\nabc\nAnswer: ", "cba", "abc"),
    ("Reverse the letters.\nhello\nAnswer: ", "olleh", "olelh"),
    ("Reverse the letters.\nword\nAnswer: ", "drow", "drw"),
    ("Reverse the letters.\nqueue\nAnswer: ", "euueq", "eueuq"),
]


def _model_and_batch(method: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from finetune.train.data.preference import PreferenceEncoder, collate_pairs

    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), dtype=torch.float32)
    model.config.use_cache = False
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        # a fresh adapter (B = 0): the policy starts as its reference, the base, as in TRL's own LoRA runs
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    enc = PreferenceEncoder(tok, "preference", {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected",
                                                "messages": "messages"}, 64)
    rows = [enc({"prompt": p, "chosen": c, "rejected": r}, i) for i, (p, c, r) in enumerate(PAIRS)]
    from finetune.train.data.preference import PreferenceExample

    pairs = [PreferenceExample(r["input_ids"], r["labels"], rejected_ids=r["rejected_ids"],
                               rejected_labels=r["rejected_labels"]) for r in rows]
    return tok, model, collate_pairs(pairs, tok.pad_token_id)


def _trl_trainer(model, ref, tok, loss_type: str, beta: float, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    ds = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"), beta=beta, loss_type=[loss_type], report_to=[], use_cpu=True,
        per_device_train_batch_size=len(PAIRS), max_length=64, bf16=False, fp16=False,
    )
    return DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=ds, processing_class=tok)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_matches_trl(method: str, loss_type: str, tmp_path) -> None:
    from finetune.objectives.preference import (
        PreferenceObjective,
        PreferenceSettings,
        reference_logps,
        sequence_logps,
    )

    beta = 0.1 if loss_type == "sigmoid" else 0.5
    tok, ours, batch = _model_and_batch(method)
    theirs = copy.deepcopy(ours)
    frozen = copy.deepcopy(ours).eval().requires_grad_(False) if method == "full" else None
    trainer = _trl_trainer(theirs, copy.deepcopy(frozen) if frozen is not None else None, tok, loss_type, beta, tmp_path)
    theirs = trainer.model
    if method == "lora":
        def reference(b):
            with ours.disable_adapter():
                return sequence_logps(ours, b)
    else:
        def reference(b):
            return sequence_logps(frozen, b)
    objective = PreferenceObjective(
        PreferenceSettings("dpo", beta=beta, loss_type=loss_type), lambda b: reference_logps(reference, b)
    )
    trl_inputs = {
        "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
        "completion_mask": (batch["labels"] != -100).long(),
    }
    ours.train()
    theirs.train()
    lr = 0.2
    for step in range(STEPS):
        loss_sum, pairs = objective(ours, batch)
        ours_loss = loss_sum / pairs
        trl_loss = trainer.compute_loss(theirs, dict(trl_inputs))
        assert abs(float(ours_loss.detach()) - float(trl_loss.detach())) <= 1e-5 * abs(float(trl_loss.detach())), (
            step, float(ours_loss), float(trl_loss))
        ours_loss.backward()
        trl_loss.backward()
        with torch.no_grad():
            ours_params = {n: p for n, p in ours.named_parameters() if p.requires_grad}
            for n, p in theirs.named_parameters():
                if p.requires_grad:
                    g, h = ours_params[n].grad, p.grad
                    # fp32 rounding differs (TRL's fused head): each gradient within 1e-4 of its norm
                    assert float((g - h).norm()) <= 1e-4 * float(h.norm()) + 1e-9, (step, n, float((g - h).norm()))
            for model in (ours, theirs):
                for p in model.parameters():
                    if p.grad is not None:
                        p -= lr * p.grad
                        p.grad = None
