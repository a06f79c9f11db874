"""The head + loss's memory and time: logits materialised (torch's cross_entropy; finetune's chunked loss
before the fusion) against finetune's fused head + loss, which never holds the (N, V) logits.

Each computes the summed fp32 next-token loss of ``hidden @ head.T`` and its gradient with respect to the
hidden states (the head frozen, as under LoRA; ``--train-head`` for full fine-tuning), side by side in one
process on real CPU tensors; peak tensor memory of forward + backward (inputs included) is measured with
torch's MemTracker, time is the best of a few repeats. The loss and gradients of each are compared with the
first row's.

    python scripts/bench_loss.py [--tokens 4096] [--vocab 128256] [--hidden 512] [--dtype bf16|fp32] [--train-head]
                                 [--targets 0.75]

The fused loss sends only the target rows through the head: ``--targets 0.25`` (a chat batch's completion
tokens) shows what skipping the prompt rows saves in time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from finetune.objectives.loss import (
    IGNORE_INDEX,
    _ChunkedCrossEntropy,
    _FusedLinearCrossEntropy,
)
from finetune.objectives.loss_chunks import FUSED_CHUNK_BYTES, LOSS_CHUNK_BYTES
from finetune.train.metrics.memory import mem_tracker_class


def torch_loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Logits, then one cross_entropy over their fp32 upcast."""
    return F.cross_entropy(F.linear(h, w).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Logits, then finetune's chunked cross-entropy (the loss before the fusion)."""
    logits = F.linear(h, w)
    return _ChunkedCrossEntropy.apply(logits, targets, max(1, LOSS_CHUNK_BYTES // (4 * logits.shape[-1])))


def fused_loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """finetune's fused head + loss: logits a chunk at a time, recomputed in backward."""
    rows = max(1, FUSED_CHUNK_BYTES // (4 * w.shape[0]))
    return _FusedLinearCrossEntropy.apply(h, w, targets, rows, h.dtype)


def measure(
    fn, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, repeat: int
) -> tuple[int, float, float, tuple]:
    """Peak bytes (inputs included), best seconds, the loss and the gradients of ``fn``."""
    x = h.detach().requires_grad_()
    tracker = mem_tracker_class()()
    with tracker:
        tracker.track_external(x, w)
        loss = fn(x, w, targets)
        loss.backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    best = float("inf")
    for _ in range(repeat):
        x.grad = None
        w.grad = None
        t0 = time.perf_counter()
        loss = fn(x, w, targets)
        loss.backward()
        best = min(best, time.perf_counter() - t0)
    return peak, best, float(loss), (x.grad, w.grad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256, help="Llama 3's vocabulary")
    ap.add_argument(
        "--hidden", type=int, default=512, help="the logits' bytes do not depend on it; time does"
    )
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--train-head", action="store_true", help="the head is trained too (full fine-tuning)")
    ap.add_argument(
        "--targets",
        type=float,
        default=0.75,
        help="fraction of the rows that are targets (the rest: a prompt; the fused loss skips their rows)",
    )
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    h = torch.randn(args.tokens, args.hidden).to(dtype)
    w = (torch.randn(args.vocab, args.hidden) / args.hidden**0.5).to(dtype).requires_grad_(args.train_head)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    targets[: round(args.tokens * (1 - args.targets))] = IGNORE_INDEX  # a prompt whose tokens are not targets
    logit_bytes = args.tokens * args.vocab * h.element_size()
    print(
        f"{args.tokens} tokens ({args.targets:.0%} targets) x {args.vocab} vocabulary, hidden {args.hidden}, "
        f"{args.dtype}; logits would be "
        f"{logit_bytes / 2**20:.0f} MiB; peak tensor memory of head + loss + backward, inputs included"
    )
    rows = {}
    for name, fn in (
        ("torch cross_entropy", torch_loss),
        ("chunked (before)", chunked_loss),
        ("fused (now)", fused_loss),
    ):
        rows[name] = measure(fn, h, w, targets, args.repeat)
        peak, secs, loss, _ = rows[name]
        print(f"{name:20s} peak {peak / 2**20:8.0f} MiB   {secs * 1e3:8.1f} ms   loss {loss:.6f}")
    p0, s0, l0, (gh0, gw0) = rows["chunked (before)"]
    p1, s1, l1, (gh1, gw1) = rows["fused (now)"]
    dw = (gw1.float() - gw0.float()).abs().max().item() if gw0 is not None else 0.0
    print(
        f"fused vs chunked: peak {p0 / p1:.2f}x lower, time {s1 / s0:.2f}x; loss rel. difference "
        f"{abs(l1 - l0) / abs(l0):.1e}, max |d grad_hidden| {(gh1.float() - gh0.float()).abs().max():.1e}, "
        f"max |d grad_head| {dw:.1e}"
    )


if __name__ == "__main__":
    main()
