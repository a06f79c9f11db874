"""How long `finetune plan` takes: Llama-3.1-405B on 64 GPUs (8 nodes x 8 x 80 GiB), 4096 tokens.

Runs the real CLI in a fresh process (imports included), alternately with an empty trace cache (the first
plan of a model on a machine: every activation trace is taken) and with the cache that run left (the same
model again), and prints wall and CPU seconds of each against the issue's 5 s target.

    python scripts/bench_plan.py [--model llama-3.1-405b] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 5.0


def timed(cmd: list[str], cache: str) -> tuple[float, float, str]:
    """Wall and CPU seconds of one run of ``cmd`` with ``FINETUNE_CACHE=cache``, and its stdout."""
    env = dict(os.environ, FINETUNE_CACHE=cache)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-405b")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "finetune", "plan", "--model", args.model, "--gpus", str(args.gpus), "--nodes",
           str(args.nodes), "--gpu-memory", "80GiB", "--seq-len", str(args.seq_len), "--method", "auto", "--json"]
    timed(cmd, tempfile.mkdtemp())  # warm the OS file cache (first import of torch from disk)
    runs: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
    traces = 0
    for _ in range(args.repeat):
        cache = tempfile.mkdtemp(prefix="finetune-bench-")
        wall, cpu, out = timed(cmd, cache)
        runs["cold"].append((wall, cpu))
        traces = len(list((Path(cache) / "traces").glob("*.json")))
        wall, cpu, out = timed(cmd, cache)
        runs["warm"].append((wall, cpu))
    c = json.loads(out)["chosen"]
    print(f"{args.model} on {args.gpus * args.nodes} GPUs: chose {c['method']} / {c['strategy']}, micro-batch "
          f"{c['micro_batch_size']}, checkpointing {c['activation_checkpointing']}, "
          f"{c['memory']['total'] / 2**30:.1f} GiB per GPU; {traces} activation traces taken when cold")
    for kind, label in (("cold", "first plan of the model (empty trace cache)"), ("warm", "again (traces cached)")):
        walls = [w for w, _ in runs[kind]]
        cpus = [c for _, c in runs[kind]]
        med = statistics.median(walls)
        print(f"{label:45s} wall {', '.join(f'{w:.2f}' for w in walls)} s (median {med:.2f}, "
              f"{med / TARGET_S:.2f}x the {TARGET_S:.0f} s target); CPU {statistics.median(cpus):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
