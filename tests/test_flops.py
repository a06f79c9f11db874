"""Model FLOPs per training token (finetune.plan.flops) against torch's FLOP counter, and the MFU arithmetic."""

from __future__ import annotations

import pytest
import torch

from finetune.plan.flops import training_flops_per_token
from tests.conftest import TINY_MODEL

BATCH, SEQ = 2, 128


def counted_flops_per_token(model: torch.nn.Module) -> float:
    """One training micro-step (forward, loss, backward) counted by ``FlopCounterMode``, per token.

    Eager attention: the counter has no formula for CPU sdpa's fused kernel, while eager's score and value
    matmuls are plain ``matmul``s it counts (over the whole T x T square, as the formula does)."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(3, 250, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops() / (BATCH * SEQ)


def tiny(method: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).train()
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        )
    return model


@pytest.mark.parametrize("method", ["full", "lora"])
def test_flops_per_token_match_the_counted_step(method):
    model = tiny(method)
    formula = training_flops_per_token(model, seq_len=SEQ)
    counted = counted_flops_per_token(model)
    print(
        f"{method}: formula {formula.per_token:,.0f} counted {counted:,.0f} FLOPs/token "
        f"ratio {formula.per_token / counted:.4f}"
    )
    assert formula.per_token == pytest.approx(counted, rel=0.01)
