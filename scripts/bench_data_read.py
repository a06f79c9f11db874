"""Reading and tokenizing a data set that is not streamed: this checkout against another revision, side by side.

    python scripts/bench_data_read.py [--rows 400000] [--baseline REV]

Writes a .jsonl of ``--rows`` generated text rows (as scripts/bench_streaming.py does), then calls ``load_data`` on
it (recipes/models/tiny-llama's tokenizer, data.max_seq_len 256) in a fresh process for each case: the package of
revision ``--baseline`` (``git archive``, into a temporary directory) and this checkout's, each with an empty
tokenization cache and then again with the cache it filled; both with data.num_proc 1, so that the reading and the
samples are what differs, then this checkout's default processes. Time: the seconds ``load_data`` takes; memory:
the process's peak resident set (getrusage) and what it holds after ``load_data`` returns, less what it held
before (the tokenizer and the libraries loaded). Prints a table and the ratios this checkout / baseline.
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
sys.path.insert(0, str(ROOT / "scripts"))

from bench_streaming import write_rows  # noqa: E402

CHILD = r"""
import gc, json, resource, sys, time
from transformers import AutoTokenizer
import finetune
from finetune.recipe.schema import load_recipe
from finetune.train.data import load_data

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

loaded = load_recipe(sys.argv[1], [])
tokenizer = AutoTokenizer.from_pretrained(loaded.recipe.model.path)
gc.collect()
before = rss()
started = time.perf_counter()
data = load_data(loaded, tokenizer)
seconds = time.perf_counter() - started
gc.collect()
print(json.dumps({
    "seconds": seconds, "before": before, "held": rss() - before,
    "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "workers_peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    "samples": data.stats["train_samples"], "tokens": data.stats["tokens"], "cached": data.stats["cached_sources"],
    "package": finetune.__file__,
}))
"""


def measure(package: Path, tmp: Path, name: str, data: Path, cache: Path, num_proc: int | None) -> dict[str, float]:
    """``load_data`` on ``data`` with the package under ``package``, in a fresh interpreter."""
    recipe = {
        "model": {"path": str(ROOT / "recipes/models/tiny-llama"), "init": "random"},
        "data": {"train": str(data), "format": "text", "max_seq_len": 256, "cache_dir": str(cache),
                 **({"num_proc": num_proc} if num_proc else {})},
        "output": {"dir": str(tmp / f"out-{name}")},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "PYTHONPATH": str(package), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = tmp / f"{name}.log"
    with log.open("w") as sink:  # the progress bars go to the log
        proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, stderr=sink,
                              text=True, env=env, cwd=tmp)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: load_data failed:\n{log.read_text()[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(result.pop("package")).is_relative_to(package):
        raise SystemExit(f"{name}: the child imported another finetune than {package}'s")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--baseline", default="3754589", help="the revision to compare with (git rev)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base = tmp / "baseline"
        base.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline, "finetune"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        data = tmp / "train.jsonl"
        write_rows(data, args.rows)
        size = data.stat().st_size
        results: list[tuple[str, dict[str, float]]] = []
        started = time.perf_counter()
        for label, package, cache, num_proc in (
            (f"{args.baseline}, empty cache", base, tmp / "cache-base", 1),
            (f"{args.baseline}, cached", base, tmp / "cache-base", 1),
            ("this checkout, empty cache", ROOT, tmp / "cache-now", 1),
            ("this checkout, cached", ROOT, tmp / "cache-now", 1),
            ("this checkout, empty cache, default data.num_proc", ROOT, tmp / "cache-auto", None),
        ):
            results.append((label, measure(package, tmp, f"case{len(results)}", data, cache, num_proc)))
            print(f"  {label}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    mib = 2**20
    print(f"{args.rows:,} rows, {size / mib:.1f} MiB of .jsonl; {results[0][1]['samples']:,} samples, "
          f"{results[0][1]['tokens']:,} tokens")
    print("| load_data | seconds | peak resident set | held after it | largest worker |")
    print("|---|---:|---:|---:|---:|")
    for label, r in results:
        worker = f"{r['workers_peak'] / mib:,.0f} MiB" if r["workers_peak"] > 0 and "default" in label else ""
        print(f"| {label} | {r['seconds']:.1f} | {r['peak'] / mib:,.0f} MiB | {r['held'] / mib:,.0f} MiB | {worker} |")
    for i, what in ((0, "empty cache"), (1, "cached")):
        old, new = results[i][1], results[i + 2][1]
        print(f"| this checkout / {args.baseline}, {what} | {new['seconds'] / old['seconds']:.2f} | "
              f"{new['peak'] / old['peak']:.2f} | {new['held'] / old['held']:.2f} | |")
    same = {(r["samples"], r["tokens"]) for _, r in results}
    print("same samples and tokens in every case" if len(same) == 1 else f"the cases differ: {same}")


if __name__ == "__main__":
    main()
