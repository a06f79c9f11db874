"""How long `finetune plan` takes on the largest catalog model: a cold trace cache, then a warm one.

    python scripts/plan_speed.py [--runs 3] [-- extra plan flags]

Each run is a fresh `finetune plan --model llama-3.1-405b --gpus 64 --gpu-memory 80GiB` process (imports
included, as a user waits for them). Cold: an empty $FINETUNE_CACHE (the config read by transformers,
activations traced, inventories and FLOPs counted from a built model); warm: the same cache again (the
config, traces, inventories and FLOPs read back: neither torch nor transformers is imported). Prints wall and CPU seconds of each (run it on an idle
machine: other work stretches both).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

COMMAND = ["plan", "--model", "llama-3.1-405b", "--gpus", "64", "--gpu-memory", "80GiB"]


def run_once(cache: str, extra: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one `finetune plan` process with ``cache`` as its $FINETUNE_CACHE."""
    env = {**os.environ, "FINETUNE_CACHE": cache}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "finetune", *COMMAND, *extra], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    """Cold once per run (a new cache each time), warm after each cold run; the best of each is printed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    cold, warm = [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            cold.append(run_once(cache, args.extra))
            warm.append(run_once(cache, args.extra))
    print(f"finetune {' '.join(COMMAND + args.extra)}  ({os.cpu_count()} cores; later flags win)")
    for name, rows in (("cold cache", cold), ("warm cache", warm)):
        wall, cpu = min(rows)
        print(f"  {name}: {wall:5.2f} s wall, {cpu:5.2f} s CPU (best of {len(rows)}; all walls: "
              f"{', '.join(f'{w:.2f}' for w, _ in rows)})")
    print(f"  warm / cold: {min(warm)[0] / min(cold)[0]:.2f}")


if __name__ == "__main__":
    main()
