"""Evaluation memory is planned: the eval loss forward and greedy generation traced, shown, and
`eval.batch_size: auto` picks the largest batch that fits (a run that fits in training must not die at its
first evaluation, with eval.batch_size 32 of full (B, T, V) logits and a KV cache the plan did not count)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from finetune.model.generation import greedy_tokens
from finetune.objectives.loss import causal_lm_loss
from finetune.plan.activations import TraceSpec
from finetune.plan.evaluation import eval_peak
from finetune.plan.flowchart import make_plan
from finetune.plan.hardware import Hardware
from finetune.plan.request import Request
from finetune.train.metrics.memory import PeakMemory
from tests.support import TINY_MODEL

CFG = AutoConfig.from_pretrained(TINY_MODEL)


@pytest.mark.parametrize("batch", [1, 8])
def test_predicted_eval_peak_against_memtracker_on_cpu(batch: int) -> None:
    """The real eval loss forward and generation of the tiny model (fp32, 64 tokens, 12 new tokens),
    measured with MemTracker, against the four-trace prediction at its depth (4 layers) and batch."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CFG).eval()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(3, 200, (batch, 64))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        loss_peak = PeakMemory("cpu", modules=(model,))
        with loss_peak:
            causal_lm_loss(model, {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask})
        gen_peak = PeakMemory("cpu", modules=(model,))
        with gen_peak:
            greedy_tokens(model, ids, mask, 12, contextlib.nullcontext)
    spec = TraceSpec(method="full", checkpointing=False, seq_len=64, packed=False)
    predicted = eval_peak(CFG, spec, CFG.num_hidden_layers, batch, 12)
    loss_ratio = predicted.loss / (loss_peak.measured_peak_bytes - params)
    gen_ratio = predicted.generation / (gen_peak.measured_peak_bytes - params)
    # The prediction errs on the safe side by ~2 KiB per token on this model (12-17%).
    assert 1.0 <= loss_ratio <= 1.2, loss_ratio
    assert 1.0 <= gen_ratio <= 1.2, gen_ratio


def _hw(memory: int) -> Hardware:
    return Hardware("cpu", 1, 1, int(memory), True, "cpu", "gloo", 10e9, True)


def test_auto_eval_batch_is_the_largest_that_fits_and_a_pinned_one_is_checked() -> None:
    from finetune.recipe.schema import LoraConfig

    req = Request(config=CFG, source="tiny", method="lora", strategy="single", precision="fp32", seq_len=64,
                  global_batch_size=1, micro_batch_size=1, checkpointing=False, eval_max_new_tokens=12,
                  lora=LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    roomy = make_plan(req, _hw(2**40)).chosen
    assert roomy.eval_batch_size == 64
    # memory for training and an evaluation of 6 rows, not 7
    from finetune.plan.candidates import evaluate, plan_evaluation
    from finetune.plan.setting import settle
    from finetune.plan.types import Config

    p = settle(req, _hw(2**40))
    c, _ = plan_evaluation(p, evaluate(p, Config("lora", "single", 1, False)))
    at = {}
    for b in (6, 7):
        q = make_plan(Request(**{**req.__dict__, "eval_batch_size": b}), _hw(2**40))
        at[b] = q.chosen.eval_memory
    assert c.memory.total < at[6] < at[7] and c.eval_memory == roomy.eval_memory  # evaluation is the peak
    tight = make_plan(req, _hw((at[6] + at[7]) // 2))
    assert tight.chosen.fits and tight.chosen.eval_batch_size == 6
    assert any(s.startswith("Evaluation at 64 tokens (eval.batch_size auto, the largest that fits: 6)")
               for s in tight.walk)
    pinned = make_plan(Request(**{**req.__dict__, "eval_batch_size": 32}), _hw((at[6] + at[7]) // 2))
    sentence = next(s for s in pinned.walk if s.startswith("Evaluation"))
    assert "the run would fail at its first evaluation; set eval.batch_size: auto" in sentence
