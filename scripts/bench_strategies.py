"""Training throughput of each data-parallel strategy on 2 CPU processes (gloo), side by side.

    python scripts/bench_strategies.py [--steps 20] [--nproc 2] [--method full] [--strategies single,ddp,...]

Each strategy trains the built-in tiny Llama (random init, fp32) on the reverse task with the same global
batch through the real CLI (`finetune run --nproc N`). Throughput is the input tokens of the steps after the
first two (warm-up) divided by their wall time, from metrics.jsonl; the final loss is printed beside it so
the table also shows that every strategy trained the same model. ``single`` runs one process (with all the
cores as torch threads unless ``--threads`` says otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 2


def recipe(out: Path, strategy: str, method: str, steps: int, global_batch: int, micro: int, seq: int) -> dict:
    """The benchmark recipe for one strategy."""
    return {
        "model": {"path": str(ROOT / "recipes/models/tiny-llama"), "init": "random"},
        "method": method,
        "data": {"train": str(ROOT / "recipes/data/reverse/train.jsonl"), "max_seq_len": seq},
        "train": {"max_steps": steps, "global_batch_size": global_batch, "micro_batch_size": micro, "lr": 1e-3,
                  "seed": 0},
        "precision": "fp32",
        "distributed": {"strategy": strategy},
        "output": {"dir": str(out), "log_every": 1},
    }


def bench_one(workdir: Path, strategy: str, nproc: int, args: argparse.Namespace) -> dict:
    """Run one strategy; return its tokens/s after warm-up, final loss and wall time."""
    out = workdir / strategy
    path = workdir / f"{strategy}.yaml"
    per_rank = args.global_batch // nproc
    path.write_text(yaml.safe_dump(recipe(out, strategy, args.method, args.steps, args.global_batch,
                                          min(args.micro, per_rank), args.seq_len)))
    started = time.perf_counter()
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run([sys.executable, "-m", "finetune", "run", str(path), "--nproc", str(nproc)],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    timed = rows[WARMUP_STEPS:]
    # tokens_per_s of each row covers one step (log_every 1): time = tokens / rate, summed.
    tokens = sum(r["tokens"] - p["tokens"] for p, r in zip(rows[WARMUP_STEPS - 1 :], timed, strict=False))
    seconds = sum((r["tokens"] - p["tokens"]) / r["tokens_per_s"] for p, r in zip(rows[WARMUP_STEPS - 1 :], timed,
                                                                                  strict=False))
    return {"strategy": strategy, "processes": nproc, "tokens_per_s": tokens / seconds,
            "final_loss": rows[-1]["loss"], "wall_s": wall}


def main() -> None:
    """Parse the options, run every strategy, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--method", default="full", choices=["full", "lora"])
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--strategies", default="single,ddp,zero1,zero2,fsdp")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per process (default: finetune's cores / processes). On a machine other "
                    "jobs share, 1 avoids OpenMP spinning against them")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of the table")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-strategies-") as tmp:
        for s in args.strategies.split(","):
            results.append(bench_one(Path(tmp), s, 1 if s == "single" else args.nproc, args))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    base = next((r["tokens_per_s"] for r in results if r["strategy"] == "single"), None)
    print(f"{'strategy':10s} {'procs':>5s} {'tokens/s':>10s} {'vs single':>9s} {'final loss':>10s} {'wall s':>7s}")
    for r in results:
        rel = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{r['strategy']:10s} {r['processes']:5d} {r['tokens_per_s']:10,.0f} {rel:>9s} "
              f"{r['final_loss']:10.4f} {r['wall_s']:7.1f}")


if __name__ == "__main__":
    main()
