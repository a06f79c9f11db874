"""DDP's gradient buckets: per-rank host memory with and without ``gradient_as_bucket_view``, side by side.

Two gloo processes train a Llama of a few tens of MB (random weights) for a few optimizer steps the way the
trainer does (finetune.train.parallel.parallelize.data_parallel, fused AdamW, no_sync for the non-final micro-batches,
clip_grad_norm_, zero_grad(set_to_none=True)) in three modes: ``copy``, the buckets a second copy of the
gradients (torch's default, ``bucket_view=False``); ``view``, the gradients views into the buckets (the
trainer's ``bucket_view=True``); and ``view, zeroed in place``, the views with ``zero_grad(set_to_none=False)``
(gradients zeroed in place stay views, so the non-final micro-batches of gradient accumulation, which DDP
does not touch, accumulate into the buckets too); and ``view, in place from step 1``, which sets them to
None after the first step only: DDP rebuilds its buckets at the start of the second step, and views of the
old buckets would keep those alive while the new ones are allocated. Each rank reads its own memory from /proc/self/status:
RssAnon at the start of every step and at the end of its backward, and the step's peak resident set (VmHWM,
reset through /proc/self/clear_refs at the start of the step). glibc is told to serve every allocation over
64 KiB with mmap, so that a freed tensor leaves the resident set at once.

    python scripts/ddp_bucket_memory.py                 # micro-batch 1 x 32 tokens, accumulation 1 and 2
    python scripts/ddp_bucket_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
MMAP_THRESHOLD = 65536  # bytes: larger allocations are mmap'd and unmapped when freed

# tiny-llama widened: 11.3M parameters, 43 MiB of fp32 gradients
MODEL = {"vocab_size": 264, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512}


def proc_status() -> dict[str, int]:
    """RssAnon, VmRSS and VmHWM of this process, in bytes."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """Reset VmHWM to the current resident set (Linux's clear_refs, value 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def _rank(
    rank: int, port: int, bucket_view: bool, none_until: int, accum: int, steps: int, tokens: int, out: str
) -> None:
    """One rank: build, wrap, train ``steps`` steps of ``accum`` micro-batches, setting the gradients to None
    after the steps before ``none_until`` and zeroing them in place after the others; rank 0 writes the
    records."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.train.optimizer import optimizer_class
    from finetune.train.parallel.distributed import DistContext
    from finetune.train.parallel.parallelize import data_parallel, no_sync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = data_parallel(model, DistContext(rank, 2, rank, torch.device("cpu")), bucket_view=bucket_view)
    cls, options = optimizer_class("adamw")
    opt = cls(model.parameters(), lr=1e-4, **options)
    gen = torch.Generator().manual_seed(1 + rank)
    records = []
    for step in range(steps):
        batches = [torch.randint(3, 264, (1, tokens), generator=gen) for _ in range(accum)]
        reset_peak()
        start = proc_status()
        losses = []
        for i, x in enumerate(batches):
            with no_sync(ddp, enabled=i < accum - 1):
                loss = ddp(input_ids=x, labels=x).loss / accum
            loss.backward()
            losses.append(float(loss.detach()))
        after_backward = proc_status()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=step < none_until)
        end = proc_status()
        records.append({
            "step": step, "loss": sum(losses),
            "anon_start": start["RssAnon"], "anon_after_backward": after_backward["RssAnon"],
            "anon_end": end["RssAnon"],
            # the step's peak above its start (VmHWM and VmRSS both count file pages, which do not change)
            "peak_above_start": end["VmHWM"] - start["VmRSS"], "peak_rss": end["VmHWM"],
        })
    if rank == 0:
        Path(out).write_text(json.dumps({"grad_bytes": grad_bytes, "steps": records}))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# name -> (gradient_as_bucket_view, zero_grad(set_to_none=True) after the steps before this one)
MODES = {"copy": (False, 10**9), "view": (True, 10**9), "view, zeroed in place": (True, 0),
         "view, in place from step 1": (True, 1)}


def measure(mode: str, accum: int = 1, steps: int = 4, tokens: int = 32) -> dict[str, Any]:
    """Rank 0's records of one 2-process run in ``mode`` (a key of MODES): ``grad_bytes`` and one dict per
    optimizer step (bytes)."""
    import torch.multiprocessing as mp

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # read by glibc when each rank starts
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "records.json")
        mp.spawn(_rank, args=(_free_port(), *MODES[mode], accum, steps, tokens, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def summary(copy: dict[str, Any], view: dict[str, Any]) -> dict[str, float]:
    """Steady-state figures (the steps after the first two: DDP rebuilds its buckets at the start of the
    second) of two runs, in bytes, and their ratios."""

    def steady(run: dict[str, Any], key: str) -> float:
        return max(r[key] for r in run["steps"][2:])

    def backward_growth(run: dict[str, Any]) -> float:
        return max(r["anon_after_backward"] - r["anon_start"] for r in run["steps"][2:])

    return {
        "grad_bytes": copy["grad_bytes"],
        "peak_copy": steady(copy, "peak_rss"), "peak_view": steady(view, "peak_rss"),
        "peak_drop": steady(copy, "peak_rss") - steady(view, "peak_rss"),
        "peak_ratio": steady(view, "peak_rss") / steady(copy, "peak_rss"),
        "backward_growth_copy": backward_growth(copy), "backward_growth_view": backward_growth(view),
        "max_loss_difference": max(abs(a["loss"] - b["loss"]) for a, b in zip(copy["steps"], view["steps"], strict=True)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per micro-batch (one row)")
    ap.add_argument("--accum", type=int, nargs="*", default=[1, 2], help="gradient accumulation steps to run")
    ap.add_argument("--json", help="write every record here")
    args = ap.parse_args()
    results = {}
    for accum in args.accum:
        runs = {mode: measure(mode, accum, args.steps, args.tokens) for mode in MODES}
        results[f"accum{accum}"] = {"runs": runs}
        print(f"accumulation {accum}: gradients {runs['copy']['grad_bytes'] / MiB:.1f} MiB per rank")
        for mode in MODES:
            for r in runs[mode]["steps"]:
                print(f"  {mode:26s} step {r['step']}  loss {r['loss']:.6f}  RssAnon start {r['anon_start'] / MiB:7.1f} MiB"
                      f"  +{(r['anon_after_backward'] - r['anon_start']) / MiB:5.1f} MiB after backward"
                      f"  peak {r['peak_rss'] / MiB:7.1f} MiB ({r['peak_above_start'] / MiB:+.1f} MiB over the start)")
        for mode in list(MODES)[1:]:
            s = summary(runs["copy"], runs[mode])
            results[f"accum{accum}"][mode] = s
            print(f"  steady peak (steps 2+): copy {s['peak_copy'] / MiB:.1f} MiB, {mode} {s['peak_view'] / MiB:.1f} MiB:"
                  f" {s['peak_drop'] / MiB:.1f} MiB less ({s['peak_drop'] / s['grad_bytes']:.2f} x the gradients),"
                  f" ratio {s['peak_ratio']:.3f}; losses differ by at most {s['max_loss_difference']:.1e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
