"""The loss's memory and time: torch's cross_entropy on the whole (N, V) block against finetune's chunked one.

Both compute the summed fp32 next-token loss of bf16 logits and its gradient (forward + backward of the loss
alone, logits given), side by side in one process on real CPU tensors; peak tensor memory above the logits is
measured with torch's MemTracker, time is the best of a few repeats.

    python scripts/bench_loss.py [--tokens 4096] [--vocab 128256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from finetune.loss import IGNORE_INDEX, LOSS_CHUNK_BYTES, _ChunkedCrossEntropy
from finetune.train.memory import mem_tracker_class


def torch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What finetune did before: one cross_entropy over the fp32 upcast of every row."""
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """finetune.loss's chunked cross-entropy."""
    return _ChunkedCrossEntropy.apply(logits, targets, max(1, LOSS_CHUNK_BYTES // (4 * logits.shape[-1])))


def measure(fn, logits: torch.Tensor, targets: torch.Tensor, repeat: int) -> tuple[int, float, float, torch.Tensor]:
    """Peak bytes above the inputs, best seconds, the loss and the gradient of ``fn``."""
    x = logits.detach().requires_grad_()
    tracker = mem_tracker_class()()
    with tracker:
        loss = fn(x, targets)
        loss.backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    best = float("inf")
    for _ in range(repeat):
        x.grad = None
        t0 = time.perf_counter()
        loss = fn(x, targets)
        loss.backward()
        best = min(best, time.perf_counter() - t0)
    return peak, best, float(loss), x.grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256, help="Llama 3's vocabulary")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab) * 2).to(torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    targets[: args.tokens // 4] = IGNORE_INDEX  # a prompt whose tokens are not targets
    base = logits.numel() * logits.element_size()
    print(f"{args.tokens} tokens x {args.vocab} vocabulary, bf16 logits {base / 2**20:.0f} MiB; "
          f"peak tensor memory of loss + backward, logits included")
    rows = {}
    for name, fn in (("torch cross_entropy", torch_loss), ("finetune chunked", chunked_loss)):
        peak, secs, loss, grad = measure(fn, logits, targets, args.repeat)
        rows[name] = (peak, secs, loss, grad)
        print(f"{name:20s} peak {peak / 2**20:8.0f} MiB   {secs * 1e3:8.1f} ms   loss {loss:.6f}")
    (p0, s0, l0, g0), (p1, s1, l1, g1) = rows.values()
    print(f"chunked / torch: memory {p1 / p0:.2f}x, time {s1 / s0:.2f}x; loss rel. difference "
          f"{abs(l1 - l0) / abs(l0):.1e}, gradient max difference {(g1.float() - g0.float()).abs().max():.1e}")


if __name__ == "__main__":
    main()
