"""How long `finetune plan` takes: Llama-3.1-405B on 64 GPUs (8 nodes x 8 x 80 GiB), 4096 tokens.

Runs the real CLI in a fresh process (imports included) a few times and prints wall and CPU seconds.

    python scripts/bench_plan.py [--model llama-3.1-405b] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


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
    walls, cpus = [], []
    for _ in range(args.repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    plan = json.loads(out)
    c = plan["chosen"]
    print(f"{args.model} on {args.gpus * args.nodes} GPUs: chose {c['method']} / {c['strategy']}, micro-batch "
          f"{c['micro_batch_size']}, checkpointing {c['activation_checkpointing']}, "
          f"{c['memory']['total'] / 2**30:.1f} GiB per GPU")
    print(f"wall seconds: {', '.join(f'{w:.2f}' for w in walls)} (best {min(walls):.2f}); "
          f"CPU seconds: {', '.join(f'{c:.2f}' for c in cpus)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
