"""Pipeline parallelism against one process, every layout x schedule x method, through the real CLI on gloo.

    python scripts/pipeline_parity.py [--steps 8] [--only full-pp2-gpipe ...] [--work DIR]

The tests' pipeline recipe (a 4-layer, 64-wide Llama from a seed, fp32, global batch 8 in micro-batches of 2,
so 4 pipeline micro-batches a step; LoRA r=4 on q/v) as one process, then with ``distributed.pp=2`` as
pp 2 (2 processes), pp 2 x dp 2 under fsdp (4) and pp 2 x tp 2 with sequence parallelism (4), each under the
1F1B and the GPipe schedule, for full fine-tuning and for LoRA: 12 runs. Prints, beside the single process,
the largest relative difference of the per-step losses and gradient norms and the largest absolute difference
of the saved weights (the model for full fine-tuning, the adapter for LoRA). The test suite runs a subset
(tests/distributed/test_pipeline.py); this is the whole matrix.
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
sys.path.insert(0, str(ROOT))

from tests.support import max_rel, max_weight_diff, micro_model_dir  # noqa: E402

#: layout -> (distributed.strategy, processes, --set arguments besides pp and the schedule)
LAYOUTS = {"pp2": ("ddp", 2, []), "pp2xdp2": ("fsdp", 4, []), "pp2xtp2": ("ddp", 4, ["distributed.tp=2"])}
SCHEDULES = ("1f1b", "gpipe")
METHODS = ("full", "lora")


def run(work: Path, model: Path, name: str, method: str, strategy: str, nproc: int, sets: list[str],
        steps: int) -> tuple[Path, float]:
    """One CLI run; its output directory and wall seconds."""
    out = work / name
    recipe = {
        "model": {"path": str(model), "init": "random"},
        "method": method,
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "data": {"train": str(ROOT / "recipes/data/reverse/train.jsonl"), "max_seq_len": 48},
        "train": {"max_steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3,
                  "warmup_steps": 2, "max_grad_norm": 1.0, "seed": 0},
        "precision": "fp32",
        "distributed": {"strategy": strategy},
        "output": {"dir": str(out), "log_every": 1},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "finetune", "run", str(path), "--overwrite", "--nproc", str(nproc),
           *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return out, time.perf_counter() - start


def series(out: Path, key: str) -> list[float]:
    """The per-step ``key`` (loss, grad_norm) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if "loss" in r]


def main() -> None:
    """Run the single-process references, then each requested pipeline run, and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", nargs="*", help="runs to do, e.g. full-pp2-gpipe lora-pp2xtp2-1f1b (default: all)")
    ap.add_argument("--work", type=Path, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    names = [f"{m}-{lay}-{s}" for m in METHODS for lay in LAYOUTS for s in SCHEDULES]
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; known: {', '.join(names)}")
    names = [n for n in names if not args.only or n in args.only]
    work = args.work or Path(tempfile.mkdtemp(prefix="pipeline-parity-"))
    work.mkdir(parents=True, exist_ok=True)
    # tiny-llama's tokenizer with 4 layers, 64 wide (2 KV heads, so tp 2 splits them): the suite's model
    model = micro_model_dir(work / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    reference = {m: run(work, model, f"{m}-single", m, "single", 1, [], args.steps)[0]
                 for m in METHODS if any(n.startswith(m) for n in names)}
    print(f"{args.steps} fp32 steps, 4 micro-batches a step, against one process ({os.cpu_count()} cores)")
    print(f"{'run':24} {'procs':>5} {'loss rel':>10} {'gnorm rel':>10} {'weights abs':>12} {'wall s':>7}")
    for name in names:
        method, layout, schedule = name.split("-")
        strategy, nproc, sets = LAYOUTS[layout]
        sets = [*sets, "distributed.pp=2", f"distributed.pp_schedule={schedule}"]
        out, seconds = run(work, model, name, method, strategy, nproc, sets, args.steps)
        want = reference[method]
        weights = "model.safetensors" if method == "full" else "adapter_model.safetensors"
        print(f"{name:24} {nproc:5d} {max_rel(series(out, 'loss'), series(want, 'loss')):10.1e} "
              f"{max_rel(series(out, 'grad_norm'), series(want, 'grad_norm')):10.1e} "
              f"{max_weight_diff(out / weights, want / weights):12.1e} {seconds:7.1f}", flush=True)


if __name__ == "__main__":
    main()
