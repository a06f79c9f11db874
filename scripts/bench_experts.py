"""A mixture of experts' experts kernel on this machine: training tokens/s of eager, batched_mm and grouped_mm.

transformers 5 runs fused experts through one of several implementations (finetune/model/kernels.py chooses one per
device and dtype for every model build). This times the training step (forward, loss, backward) of a small
Qwen3-MoE under each, on the same weights and tokens, and prints tokens/s side by side with each kernel's ratio to
eager, and the largest difference of its loss and gradients from eager's (the kernels compute the same thing).

    python scripts/bench_experts.py                      # fp32 and bf16, 1 thread
    python scripts/bench_experts.py --dtype fp32 --threads 2 --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KERNELS = ("eager", "batched_mm", "grouped_mm")


def build(dtype: str, experts: int, top_k: int, hidden: int, layers: int) -> object:
    """The benchmark's Qwen3-MoE (random weights from seed 0) in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1, norm_topk_prob=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]))


def time_kernel(model: object, kernel: str, ids: object, steps: int) -> tuple[float, float, list[object]]:
    """(median seconds of a training step after one warm-up, its loss, its gradients) under ``kernel``."""
    from finetune.model.kernels import set_experts_kernel
    from finetune.objectives.loss import causal_lm_loss

    set_experts_kernel(model, kernel)
    times, loss = [], 0.0
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        s, n = causal_lm_loss(model, {"input_ids": ids, "labels": ids})  # type: ignore[arg-type]
        (s / n).backward()
        if i:
            times.append(time.perf_counter() - t0)
        loss = (s / n).item()
    grads = [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None]  # type: ignore[attr-defined]
    return statistics.median(times), loss, grads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per kernel (after one warm-up)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    tokens = args.batch * args.seq
    print(f"qwen3_moe hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, {args.layers} layers; "
          f"{args.batch} x {args.seq} tokens; {args.threads} thread(s); forward + loss + backward, median of "
          f"{args.steps}")
    for dtype in ("fp32", "bf16") if args.dtype == "both" else (args.dtype,):
        model = build(dtype, args.experts, args.top_k, args.hidden, args.layers)
        results = {k: time_kernel(model, k, ids, args.steps) for k in KERNELS}
        base_s, base_loss, base_grads = results["eager"]
        for k in KERNELS:
            s, loss, grads = results[k]
            diff = max((a - b).abs().max().item() for a, b in zip(grads, base_grads, strict=True))
            print(f"  {dtype}  {k:10s} {tokens / s:9,.0f} tokens/s  x{base_s / s:5.2f} eager's  "
                  f"loss {loss:.6f} (eager {base_loss:.6f})  max |grad - eager's| {diff:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
