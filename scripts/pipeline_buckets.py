"""A pipeline's row-width buckets against padding every step to data.max_seq_len, through the real CLI on gloo.

    python scripts/pipeline_buckets.py [--steps 12] [--seq 512] [--buckets 4] [--work DIR]

The same fp32 recipe (a 4-layer, 256-wide Llama from a seed, full fine-tuning, pp 2 under 1F1B on 2 processes,
global batch 8 in micro-batches of 2) on the reverse task, whose rows are 37 to 45 tokens, with
``data.max_seq_len`` well above them (what a recipe sets for its longest rows): once with
``distributed.pp_buckets: 1`` (every step padded to max_seq_len) and once with ``--buckets`` widths (each step
padded to the narrowest that holds it). Prints each run's seconds of training per step (the steps after the
first two, the trainer's own ``train_seconds``), their ratio, and the largest relative difference of the
losses and gradient norms (the padding carries no target, so the runs compute the same steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import max_rel, micro_model_dir  # noqa: E402


def run(work: Path, model: Path, name: str, seq: int, buckets: int, steps: int) -> tuple[list[dict], float]:
    """One CLI run; its step rows and wall seconds."""
    out = work / name
    recipe = {
        "model": {"path": str(model), "init": "random"},
        "method": "full",
        "data": {"train": str(ROOT / "recipes/data/reverse/train.jsonl"), "max_seq_len": seq},
        "train": {"max_steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "lr": 1e-3,
                  "warmup_steps": 2, "max_grad_norm": 1.0, "seed": 0},
        "precision": "fp32",
        "distributed": {"strategy": "ddp", "pp": 2, "pp_schedule": "1f1b", "pp_buckets": buckets},
        "output": {"dir": str(out), "log_every": 1},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "finetune", "run", str(path), "--overwrite", "--nproc", "2"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], time.perf_counter() - start


def main() -> None:
    """Both runs, then the comparison."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq", type=int, default=512, help="data.max_seq_len")
    ap.add_argument("--buckets", type=int, default=4, help="distributed.pp_buckets of the second run")
    ap.add_argument("--work", type=Path, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="pipeline-buckets-"))
    work.mkdir(parents=True, exist_ok=True)
    model = micro_model_dir(work / "model", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    padded, padded_wall = run(work, model, "padded", args.seq, 1, args.steps)
    bucketed, bucketed_wall = run(work, model, "buckets", args.seq, args.buckets, args.steps)

    def per_step(rows: list[dict]) -> float:
        return statistics.mean(r["train_seconds"] for r in rows[2:])

    a, b = per_step(padded), per_step(bucketed)
    print(f"pp 2, 1f1b, {args.steps} fp32 steps, rows of 37-45 tokens, data.max_seq_len {args.seq} "
          f"({os.cpu_count()} cores)")
    print(f"{'run':28} {'s/step':>8} {'wall s':>7}")
    print(f"{'pp_buckets 1 (max_seq_len)':28} {a:8.3f} {padded_wall:7.1f}")
    print(f"{f'pp_buckets {args.buckets}':28} {b:8.3f} {bucketed_wall:7.1f}")
    print(f"speed-up {a / b:.2f}x; losses max rel {max_rel([r['loss'] for r in bucketed], [r['loss'] for r in padded]):.1e}, "
          f"grad norms max rel {max_rel([r['grad_norm'] for r in bucketed], [r['grad_norm'] for r in padded]):.1e}")


if __name__ == "__main__":
    main()
