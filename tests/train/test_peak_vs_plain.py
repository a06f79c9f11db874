"""The trainer's training step holds no more tensor memory than a plain transformers step, and the planner
predicts it; attention with dropout on CPU (finetune.model.attention) computes exactly dropout attention.

The peaks are counted by scripts/peak_vs_plain.py's StorageCounter (every live tensor storage), the same
counter for both steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from finetune.model.attention import MARK, _DropoutAttention, enable

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def _reference(q, k, v, mask, causal, scale, p, seed):
    """Dropout attention by autograd over plain torch ops, drawing each batch row's keep-mask as
    _DropoutAttention does (one uniform (H, T, S) draw per row from a generator seeded with ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    t = q.shape[-2]
    outs = []
    for b in range(q.shape[0]):
        s = q[b] @ k[b].transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        else:
            s = s.masked_fill(~mask[b], float("-inf"))
        probs = torch.softmax(s, -1).nan_to_num(0.0)
        keep = (torch.rand(probs.shape, generator=gen) >= p).to(q.dtype) / (1 - p)
        outs.append((probs * keep) @ v[b])
    return torch.stack(outs)


@pytest.mark.parametrize("causal", [True, False])
def test_dropout_attention_matches_autograd_reference(causal: bool) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 5, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = None if causal else torch.rand(2, 1, 7, 7) > 0.3
    mask = mask if causal else mask | torch.eye(7, dtype=torch.bool)  # every row attends somewhere
    args = (mask, causal, 5**-0.5, 0.3, 1234)
    out = _DropoutAttention.apply(q, k, v, *args)
    ref = _reference(q, k, v, *args)
    grad = torch.randn_like(out)
    got, want = torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
    # the function computes in fp32: agreement to fp32 precision, and the dropout did drop something
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-5), (g - w).abs().max()
    no_drop = _reference(q, k, v, mask, causal, 5**-0.5, 0.0, 1234)
    assert (out - no_drop).abs().max() > 0.1


def test_marked_gpt2_without_dropout_is_transformers_sdpa() -> None:
    """No dropout (eval mode): a marked model computes exactly what transformers' sdpa computes."""
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16)
    plain = AutoModelForCausalLM.from_config(cfg).eval()
    marked = AutoModelForCausalLM.from_config(cfg).eval()
    marked.load_state_dict(plain.state_dict())
    enable(marked)
    assert getattr(marked.transformer.h[0].attn, MARK)
    ids = torch.randint(0, 64, (2, 16))
    assert torch.equal(plain(input_ids=ids).logits, marked(input_ids=ids).logits)


def test_marked_gpt2_with_dropout_draws_the_same_masks_from_the_same_seed() -> None:
    """Train mode: a seeded forward and backward is reproducible, and the dropout is applied (the loss differs
    from the model without dropout)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.5)
    torch.manual_seed(0)
    model = enable(AutoModelForCausalLM.from_config(cfg).train())
    ids = torch.randint(0, 64, (2, 16))
    losses, grads = [], []
    for _ in range(2):
        torch.manual_seed(1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(model.transformer.h[0].attn.c_attn.weight.grad.clone())
        model.zero_grad(set_to_none=True)
    assert losses[0] == losses[1] and torch.equal(grads[0], grads[1])
    with torch.no_grad():
        model.eval()
        no_dropout = float(model(input_ids=ids, labels=ids).loss)
    assert abs(no_dropout - losses[0]) > 1e-3


@pytest.mark.slow
def test_gpt2_trainer_peak_at_most_plain_step_and_planned_within_5_percent(tmp_path: Path) -> None:
    """GPT-2 (vocab 8192, 256 wide, 3 layers, full, bf16, 4 x 256 tokens): the trainer's first step against
    a plain step in train mode and one with dropout off; the planner within 5% of the trainer."""
    import peak_vs_plain as pvp

    r = pvp.measure("gpt2", tmp_path, "bf16", steps=1, no_dropout=True)
    assert r["trainer"] <= r["plain"], r
    assert r["trainer"] <= r["plain_no_dropout"], r
    assert abs(r["predicted"] / r["trainer"] - 1) <= 0.05, r
    # the trainer's loss is the plain step's loss up to the dropout masks (different draws): within 1%
    assert abs(r["trainer_loss"][0] - r["plain_loss"][0]) / r["plain_loss"][0] < 0.01, r
