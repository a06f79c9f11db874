"""The chunked cross-entropy equals torch's, value and gradient, and needs less memory than it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import finetune.loss as loss_mod
from finetune.loss import IGNORE_INDEX, _ChunkedCrossEntropy
from finetune.train.memory import mem_tracker_class


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


def test_less_than_half_the_memory_of_torch_for_a_large_vocabulary(monkeypatch):
    """bf16 logits of 512 rows x 32768 classes (32 MiB): torch keeps an fp32 log-softmax and makes an fp32
    copy (64 MiB each); chunks of 4 MiB keep the peak near logits + their gradient."""
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_BYTES", 4 * 2**20)
    torch.manual_seed(0)
    x = torch.randn(512, 32768).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, 32768, (512,))
    rows = max(1, loss_mod.LOSS_CHUNK_BYTES // (4 * 32768))
    ours = _peak_above_inputs(lambda a, b: _ChunkedCrossEntropy.apply(a, b, rows), x, y)
    theirs = _peak_above_inputs(
        lambda a, b: F.cross_entropy(a.float(), b, ignore_index=IGNORE_INDEX, reduction="sum"), x, y
    )
    logits = x.numel() * 2
    assert ours < 0.5 * theirs
    assert ours < 2 * logits + 4 * loss_mod.LOSS_CHUNK_BYTES  # logits, their gradient, a few chunk temporaries
