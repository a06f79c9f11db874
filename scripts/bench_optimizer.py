"""AdamW's three implementations side by side on GPT-2-small-shaped parameters (124M, tied 50257 x 768
embedding): time per step and the optimizer's peak tensor memory during ``step()`` (MemTracker), with
ratios against the fused kernel the trainer uses (finetune/train/optimizer.py: optimizer_class).

    python scripts/bench_optimizer.py [--steps 3] [--device cpu|cuda] [--json]

What it shows: the per-parameter loop holds two temporaries of the largest tensor, foreach one
state-sized temporary of every tensor at once, fused none; on CPU the fused kernel is also the fastest.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = [(50257, 768)] + [(768, 2304), (2304,), (768, 768), (768,), (768, 3072), (3072,), (3072, 768), (768,),
                           (768,), (768,), (768,), (768,)] * 12


def measure(options: dict, steps: int, device: str) -> dict:
    """Seconds per step, the optimizer's peak bytes and the first tensor after ``steps`` steps."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, **options)
    opt.step()  # the moments exist from here on
    tracker = MemTracker()
    tracker.track_external(*params, opt)
    start = time.perf_counter()
    with tracker:
        for _ in range(steps):
            opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    peak = tracker.get_tracker_snapshot("peak")[torch.device(device)]
    opt_bytes = sum(v for k, v in peak.items() if str(k).endswith("OPT"))
    return {"s_per_step": seconds, "optimizer_peak_bytes": opt_bytes, "first": params[0].detach().cpu()}


def main() -> None:
    """Print the table (or --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    variants = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    res = {name: measure(opts, args.steps, args.device) for name, opts in variants.items()}
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    fused = res["fused"]
    rows = []
    for name, r in res.items():
        rows.append({
            "implementation": name,
            "ms_per_step": round(r["s_per_step"] * 1000, 1),
            "optimizer_peak_MiB": round(r["optimizer_peak_bytes"] / 2**20, 1),
            "temporaries_MiB": round((r["optimizer_peak_bytes"] - 2 * 4 * numel) / 2**20, 1),
            "time_vs_fused": round(r["s_per_step"] / fused["s_per_step"], 2),
            "memory_vs_fused": round(r["optimizer_peak_bytes"] / fused["optimizer_peak_bytes"], 3),
            "max_abs_diff_vs_fused": float((r["first"] - fused["first"]).abs().max()),
        })
    if args.json:
        print(json.dumps({"params": numel, "device": args.device, "threads": torch.get_num_threads(), "rows": rows}))
        return
    print(f"AdamW on {numel / 1e6:.1f}M fp32 parameters, {args.device}, {torch.get_num_threads()} threads, "
          f"{args.steps} steps")
    print(f"{'implementation':15s} {'ms/step':>9s} {'opt peak MiB':>13s} {'temps MiB':>10s} {'time/fused':>11s} "
          f"{'mem/fused':>10s} {'max|diff|':>10s}")
    for r in rows:
        print(f"{r['implementation']:15s} {r['ms_per_step']:9.1f} {r['optimizer_peak_MiB']:13.1f} "
              f"{r['temporaries_MiB']:10.1f} {r['time_vs_fused']:11.2f} {r['memory_vs_fused']:10.3f} "
              f"{r['max_abs_diff_vs_fused']:10.1e}")


if __name__ == "__main__":
    main()
