"""The chunked cross-entropy equals torch's, value and gradient, and needs less memory than it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import finetune.objectives.loss as loss_mod
from finetune.objectives.loss import IGNORE_INDEX, _ChunkedCrossEntropy
from finetune.objectives.loss_chunks import LossChunks
from finetune.train.metrics.memory import mem_tracker_class


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 10**6])  # one row per chunk, uneven chunks, one chunk
def test_value_and_gradient_equal_torch_cross_entropy(dtype, rows):
    torch.manual_seed(0)
    x = (torch.randn(45, 50) * 3).to(dtype).requires_grad_()
    before = x.detach().clone()
    y = torch.randint(0, 50, (45,))
    y[::4] = IGNORE_INDEX
    mine = _ChunkedCrossEntropy.apply(x, y, rows)
    (mine * 0.37).backward()
    got = x.grad.clone()
    x.grad = None
    assert torch.equal(x.detach(), before)  # backward works on copies, even of fp32 logits
    ref = F.cross_entropy(x.float(), y, ignore_index=IGNORE_INDEX, reduction="sum")
    (ref * 0.37).backward()
    assert mine.item() == pytest.approx(ref.item(), rel=2e-7)
    assert got.dtype == dtype and torch.equal(got[::4], torch.zeros_like(got[::4]))  # ignored rows: no gradient
    torch.testing.assert_close(got.float(), x.grad.float(), rtol=0, atol=5e-7 if dtype == torch.float32 else 1e-3)


def test_ignored_rows_with_infinite_logits_stay_out():
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.tensor([1, IGNORE_INDEX, 2, 3])
    with torch.no_grad():
        x[1] = float("inf")
    loss = _ChunkedCrossEntropy.apply(x, y, 1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and (x.grad[1] == 0).all()


def _peak_above_inputs(fn, x, y) -> int:
    tracker = mem_tracker_class()()
    with tracker:
        fn(x, y).backward()
    return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]


def test_less_than_half_the_memory_of_torch_for_a_large_vocabulary():
    """bf16 logits of 512 rows x 32768 classes (32 MiB): torch keeps an fp32 log-softmax and makes an fp32
    copy (64 MiB each); chunks of 4 MiB keep the peak near logits + their gradient."""
    chunks = LossChunks(logits_bytes=4 * 2**20)
    torch.manual_seed(0)
    x = torch.randn(512, 32768).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, 32768, (512,))
    rows = chunks.logits_rows(32768)
    ours = _peak_above_inputs(lambda a, b: _ChunkedCrossEntropy.apply(a, b, rows), x, y)
    theirs = _peak_above_inputs(
        lambda a, b: F.cross_entropy(a.float(), b, ignore_index=IGNORE_INDEX, reduction="sum"), x, y
    )
    logits = x.numel() * 2
    assert ours < 0.5 * theirs
    assert ours < 2 * logits + 4 * chunks.logits_bytes  # logits, their gradient, a few chunk temporaries


# -- the fused head + loss ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 10**6])
@pytest.mark.parametrize("train_head", [False, True])
def test_fused_equals_logits_then_chunked_loss(dtype, rows, train_head):
    """Value and gradients (hidden, head weight) equal the head followed by the chunked loss."""
    torch.manual_seed(0)
    h = torch.randn(45, 16).to(dtype).requires_grad_()
    w = (torch.randn(50, 16) / 4).to(dtype).requires_grad_(train_head)
    y = torch.randint(0, 50, (45,))
    y[::4] = IGNORE_INDEX
    mine = loss_mod._FusedLinearCrossEntropy.apply(h, w, y, rows, dtype)
    (mine * 0.37).backward()
    gh, gw = h.grad.clone(), (w.grad.clone() if train_head else None)
    h.grad, w.grad = None, None
    ref = _ChunkedCrossEntropy.apply(F.linear(h, w), y, rows)
    (ref * 0.37).backward()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert mine.item() == pytest.approx(ref.item(), rel=1e-5 if dtype == torch.float32 else 1e-2)
    assert gh.dtype == dtype and torch.equal(gh[::4], torch.zeros_like(gh[::4]))
    torch.testing.assert_close(gh.float(), h.grad.float(), **tol)
    if train_head:
        assert gw.dtype == dtype
        torch.testing.assert_close(gw.float(), w.grad.float(), **tol)


@pytest.mark.slow  # tens of seconds of CPU
def test_fused_never_holds_the_logits():
    """512 rows x 32768 classes: the chunked loss holds bf16 logits and their gradient (32 MiB each); the
    fused one holds chunks of 4 MiB: its peak above the inputs is far below the logits' bytes."""
    torch.manual_seed(0)
    h = torch.randn(512, 64).to(torch.bfloat16).requires_grad_()
    w = torch.randn(32768, 64).to(torch.bfloat16)
    y = torch.randint(0, 32768, (512,))
    rows = LossChunks(logits_bytes=4 * 2**20).logits_rows(32768)
    fused = _peak_above_inputs(lambda a, b: loss_mod._FusedLinearCrossEntropy.apply(a, w, b, rows, a.dtype), h, y)
    chunked = _peak_above_inputs(lambda a, b: _ChunkedCrossEntropy.apply(F.linear(a, w), b, rows), h, y)
    logits = 512 * 32768 * 2
    assert chunked > 2 * logits
    assert fused < logits and fused * 2 <= chunked


def test_fused_head_runs_only_the_rows_with_a_target():
    """A completion-only batch: 7 of 300 rows have a target. The frozen head's three matmuls (forward,
    recomputation, gradient of the hidden rows) run on those 7 rows only, counted by torch's FLOP counter;
    the loss and gradient still equal the logits of every row followed by the chunked loss."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    n, hidden, vocab, kept = 300, 16, 64, 7
    h = torch.randn(n, hidden).requires_grad_()
    w = torch.randn(vocab, hidden) / 4
    y = torch.full((n,), IGNORE_INDEX)
    y[torch.randperm(n)[:kept]] = torch.randint(0, vocab, (kept,))
    with FlopCounterMode(display=False) as counter:
        loss = loss_mod._FusedLinearCrossEntropy.apply(h, w, y, 4, torch.float32)
        loss.backward()
    assert counter.get_total_flops() == 3 * 2 * kept * hidden * vocab  # all 300 rows: 43 times more
    got = h.grad.clone()
    h.grad = None
    ref = _ChunkedCrossEntropy.apply(F.linear(h, w), y, 4)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(got, h.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(got.abs().sum(1)) == kept


def _tiny_model(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("prompt", [0, 5])
def test_model_loss_fused_equals_unfused(tied, autocast, prompt):
    """Through a real model (tied embeddings or not, bf16 autocast or fp32, every token a target or a
    5-token prompt without loss, whose rows the fused head skips): same loss and same gradient of every
    parameter with and without the fusion; the head's forward is restored afterwards."""
    model = _tiny_model(tied)
    assert loss_mod.fusable_head(model) is model.lm_head
    ids = torch.randint(0, 300, (2, 12))
    labels = ids.clone()
    labels[:, :prompt] = IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    results = []
    for fused in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            s, n = loss_mod.causal_lm_loss(model, batch, LossChunks(fused_head=fused))
        s.backward()
        results.append((s.item(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (l1, g1), (l2, g2) = results
    assert n.item() == 22 - 2 * max(0, prompt - 1)
    assert l1 == pytest.approx(l2, rel=1e-6 if not autocast else 1e-3)
    for k in g1:
        tol = {"rtol": 1e-5, "atol": 1e-6} if not autocast else {"rtol": 2e-2, "atol": 2e-3}
        torch.testing.assert_close(g1[k], g2[k], **tol, msg=k)
    assert model.lm_head(torch.zeros(1, 32)).shape == (1, 300)  # plain logits again outside the loss
