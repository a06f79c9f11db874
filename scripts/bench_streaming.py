"""data.streaming against reading the whole set first: time to the first step and peak host memory, side by side.

    python scripts/bench_streaming.py [--rows 400000] [--buffer 10000] [--words 24,40] [--max-seq-len 256]

Writes a .jsonl of ``--rows`` text rows of ``--words`` words (generated here, in a temporary directory), then runs
``finetune run`` on
the tiny model for one step twice as subprocesses, on the same file and settings but data.streaming: a fresh
tokenization cache for the whole-set run (what a first run pays), the stream through a shuffle buffer of
``--buffer`` rows. Time to the first step: from the start of the process to metrics.jsonl's first step row; peak
host memory: the process's peak resident set (getrusage of the child). Prints both, the ratios, and a PASS or
FAIL line for each limit: the stream's time to the first step and its peak host memory each at most a quarter of
the whole set's (the exit status is 1 when one fails).
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
#: The stream's figures may be at most this fraction of the whole set's.
LIMIT = 0.25
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "by", "at", "from", "his", "her", "they", "this", "that", "have"]


def write_rows(path: Path, n: int, seed: int = 0, words: tuple[int, int] = (24, 40)) -> None:
    """``n`` rows of ``words`` (24 to 40: about 140 characters, a short instruction) random words each, written
    line by line."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
            f.write(json.dumps({"text": f"{i} {text}"}) + "\n")


def run(tmp: Path, name: str, data: Path, streaming: bool, buffer: int, max_seq_len: int = 256) -> dict[str, float]:
    """One step of the tiny model on ``data``; the seconds to the first step and the peak RSS in bytes."""
    out = tmp / name
    recipe = {
        "model": {"path": str(ROOT / "recipes/models/tiny-llama"), "init": "random"},
        "method": "full",
        "data": {"train": str(data), "format": "text", "max_seq_len": max_seq_len, "cache_dir": str(tmp / f"cache-{name}"),
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
    ap.add_argument("--words", default="24,40", help="the words of a row: MIN,MAX")
    ap.add_argument("--max-seq-len", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "train.jsonl"
        low, high = (int(w) for w in args.words.split(","))
        write_rows(data, args.rows, words=(low, high))
        size = data.stat().st_size
        whole = run(tmp, "whole", data, False, args.buffer, args.max_seq_len)
        stream = run(tmp, "stream", data, True, args.buffer, args.max_seq_len)
    print(f"{args.rows:,} rows of {low}-{high} words, {size / 2**20:.1f} MiB of .jsonl; data.max_seq_len "
          f"{args.max_seq_len}; shuffle buffer {args.buffer:,} rows")
    print("| data | time to first step | peak host memory |")
    print("|---|---|---|")
    for label, r in (("whole set (tokenized first, fresh cache)", whole), ("data.streaming", stream)):
        print(f"| {label} | {r['first_step_s']:.1f} s | {r['peak_rss'] / 2**20:,.0f} MiB |")
    ratios = {"time to first step": stream["first_step_s"] / whole["first_step_s"],
              "peak host memory": stream["peak_rss"] / whole["peak_rss"]}
    print(f"| streaming / whole | {ratios['time to first step']:.3f} | {ratios['peak host memory']:.3f} |")
    for what, ratio in ratios.items():
        print(f"{'PASS' if ratio <= LIMIT else 'FAIL'}: {what}, streaming / whole = {ratio:.3f} (at most {LIMIT})")
    if any(ratio > LIMIT for ratio in ratios.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
