"""data.streaming against reading the whole set first: time to the first step and peak host memory, side by side.

    python scripts/bench_streaming.py [--rows 400000] [--buffer 10000]

Writes a .jsonl of ``--rows`` text rows (generated here, in a temporary directory), then runs ``finetune run`` on
the tiny model for one step twice as subprocesses, on the same file and settings but data.streaming: a fresh
tokenization cache for the whole-set run (what a first run pays), the stream through a shuffle buffer of
``--buffer`` rows. Time to the first step: from the start of the process to metrics.jsonl's first step row; peak
host memory: the process's peak resident set (getrusage of the child). Prints both, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "by", "at", "from", "his", "her", "they", "this", "that", "have"]


def write_rows(path: Path, n: int, seed: int = 0) -> None:
    """``n`` rows of 24 to 40 random words each (about 140 characters: a short instruction), written line by line."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(24, 40)))
            f.write(json.dumps({"text": f"{i} {words}"}) + "\n")


def run(tmp: Path, name: str, data: Path, streaming: bool, buffer: int) -> dict[str, float]:
    """One step of the tiny model on ``data``; the seconds to the first step and the peak RSS in bytes."""
    out = tmp / name
    recipe = {
        "model": {"path": str(ROOT / "recipes/models/tiny-llama"), "init": "random"},
        "method": "full",
        "data": {"train": str(data), "format": "text", "max_seq_len": 256, "cache_dir": str(tmp / f"cache-{name}"),
                 "streaming": streaming, "shuffle_buffer": buffer},
        "train": {"max_steps": 1, "global_batch_size": 8, "micro_batch_size": 8, "lr": 1e-3},
        "precision": "fp32",
        "distributed": {"strategy": "single"},
        "eval": {"at_start": False},
        "output": {"dir": str(out), "log_every": 1},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp / f"{name}.log"
    started = time.perf_counter()
    with log.open("w") as sink:  # a file, not a pipe: the progress bars of a large set would fill a pipe
        proc = subprocess.Popen([sys.executable, "-m", "finetune", "run", str(path)], stdout=sink, stderr=sink, env=env)
    first = None
    metrics = out / "metrics.jsonl"
    while True:  # reaped by wait4 itself, for the child's resource usage
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if first is None and metrics.is_file() and '"loss"' in metrics.read_text():
            first = time.perf_counter() - started
        if pid:
            break
        time.sleep(0.02)
    if os.waitstatus_to_exitcode(status) != 0 or first is None:
        raise SystemExit(f"{name}: finetune run failed:\n{log.read_text()[-3000:]}")
    return {"first_step_s": first, "peak_rss": float(usage.ru_maxrss * 1024)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--buffer", type=int, default=10_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "train.jsonl"
        write_rows(data, args.rows)
        size = data.stat().st_size
        whole = run(tmp, "whole", data, False, args.buffer)
        stream = run(tmp, "stream", data, True, args.buffer)
    print(f"{args.rows:,} rows, {size / 2**20:.1f} MiB of .jsonl; shuffle buffer {args.buffer:,} rows")
    print("| data | time to first step | peak host memory |")
    print("|---|---|---|")
    for label, r in (("whole set (tokenized first, fresh cache)", whole), ("data.streaming", stream)):
        print(f"| {label} | {r['first_step_s']:.1f} s | {r['peak_rss'] / 2**20:,.0f} MiB |")
    print(
        f"| streaming / whole | {stream['first_step_s'] / whole['first_step_s']:.3f} | "
        f"{stream['peak_rss'] / whole['peak_rss']:.3f} |"
    )


if __name__ == "__main__":
    main()
