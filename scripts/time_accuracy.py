"""How right is the planner's time? Predicted against measured seconds per optimizer step, on real runs.

Each configuration runs the real CLI (``finetune run RECIPE --set train.max_steps=N ...``: the quickstart's
full fine-tuning, LoRA on its output, and the quickstart under FSDP on 2 gloo processes) with a metrics line
every step. A step's seconds are its tokens over the tokens/s of its line (the window of a line is one
step); the first ``--skip`` steps are warm-up and left out, and the median of the rest is the measurement.
The prediction is ``plan.chosen.time.step`` from the run's plan.json when the planner wrote one, else
``finetune.plan.timing.step_time`` of ``plan.chosen`` computed here.

Rows are packed (``data.packing: true``) so that every row is ``data.max_seq_len`` tokens, as the prediction
assumes; ``--unpacked`` adds the quickstart as shipped, whose rows are padded to each batch's longest only.

    python scripts/time_accuracy.py                  # 12 steps each, a table
    python scripts/time_accuracy.py --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"

# name, recipe, extra --set overrides, processes (``{quickstart}``: the first run's output directory)
RUNS: list[tuple[str, str, list[str], int]] = [
    ("quickstart full, 1 process", "quickstart.yaml", [], 1),
    ("LoRA on it, 1 process", "quickstart-lora.yaml", ["model.path={quickstart}"], 1),
    ("quickstart full, fsdp x2", "quickstart.yaml", ["distributed.strategy=fsdp"], 2),
]
UNPACKED = ("quickstart full, unpacked", "quickstart.yaml", ["data.packing=false"], 1)


def run(name: str, recipe: str, extra: list[str], nproc: int, out: Path, steps: int, packed: bool) -> Path:
    """``finetune run`` one configuration for ``steps`` steps into ``out``; returns ``out``."""
    sets = [
        f"train.max_steps={steps}", "output.log_every=1", "eval.every=0", "eval.at_start=false",
        "eval.max_samples=4", f"output.dir={out}", "output.save_every=0",
    ]
    if packed:
        sets.append("data.packing=true")
    sets += extra
    cmd = [sys.executable, "-m", "finetune.cli", "run", str(RECIPES / recipe), "--overwrite"]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    for s in sets:
        cmd += ["--set", s]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name}: finetune run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  {name}: ran in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return out


def measured_seconds(run_dir: Path, skip: int) -> tuple[list[float], float]:
    """(seconds of every step after the first ``skip``, mean tokens of a row) from metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "tokens_per_s" in r]
    seconds, tokens, last = [], [], 0
    for r in steps:
        step_tokens = r["tokens"] - last
        last = r["tokens"]
        if r["step"] > skip:
            seconds.append(step_tokens / r["tokens_per_s"])
            tokens.append(step_tokens)
    return seconds, statistics.mean(tokens) if tokens else 0.0


def predicted(run_dir: Path) -> tuple[Any, str, dict[str, Any]]:
    """(the StepTime of the run's plan, where it came from, the plan's JSON)."""
    from finetune.plan.types import Plan

    data = json.loads((run_dir / "plan.json").read_text())
    plan = Plan.from_dict(data)
    if plan.chosen.time is not None:
        return plan.chosen.time, "plan.json", data
    return own_step_time(run_dir, plan), "step_time", data


def own_step_time(run_dir: Path, plan: Any) -> Any:
    """``step_time`` of ``plan.chosen`` for the run's own recipe and hardware."""
    from finetune.plan.flowchart import request_from_recipe
    from finetune.plan.hardware import Hardware
    from finetune.plan.timing import step_time
    from finetune.recipe import load_recipe
    from finetune.spec import adapter_spec

    loaded = load_recipe(run_dir / "recipe.yaml")
    r = loaded.recipe
    req = request_from_recipe(loaded)
    fields = {f.name for f in dataclasses.fields(Hardware)}
    hw = Hardware(**{k: v for k, v in plan.hardware.items() if k in fields})
    c = plan.chosen
    adapter = adapter_spec(c.method.value, r.lora, r.prefix, r.adapter)
    return step_time(c, req.config, hw, seq_len=plan.model["seq_len"], adapter=adapter, steps=r.train.max_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the measurement")
    ap.add_argument("--unpacked", action="store_true", help="also the quickstart with unpacked (padded) rows")
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="time_accuracy-"))
    configs = [(*cfg, True) for cfg in RUNS] + ([(*UNPACKED, False)] if args.unpacked else [])
    results = []
    quickstart_dir = out / "quickstart"
    for i, (name, recipe, extra, nproc, packed) in enumerate(configs):
        run_dir = quickstart_dir if i == 0 else out / f"run{i}"
        extra = [e.format(quickstart=quickstart_dir) for e in extra]
        run(name, recipe, extra, nproc, run_dir, args.steps, packed)
        seconds, row_tokens = measured_seconds(run_dir, args.skip)
        t, source, plan = predicted(run_dir)
        c = plan["chosen"]
        measured = statistics.median(seconds)
        results.append({
            "name": name, "method": c["method"], "strategy": c["strategy"], "processes": nproc,
            "precision": c["precision"], "micro_batch": c["micro_batch_size"], "accumulation": c["grad_accum_steps"],
            "seq_len": plan["model"]["seq_len"], "tokens_per_step": row_tokens, "measured": measured,
            "measured_min": min(seconds), "measured_max": max(seconds), "predicted": t.step,
            "compute": t.compute, "communication": t.communication, "offload": t.offload,
            "peak_flops": t.peak_flops, "utilisation": t.utilisation, "ratio": t.step / measured, "source": source,
        })
    print(f"{'configuration':<28} {'batch':>10} {'tokens/step':>11} {'measured s':>18} {'predicted s':>11} "
          f"{'(compute + comm)':>17} {'pred/meas':>9}")
    for r in results:
        batch = f"{r['micro_batch']}x{r['accumulation']}x{r['processes']}"
        spread = f"{r['measured']:.3f} ({r['measured_min']:.2f}-{r['measured_max']:.2f})"
        parts = f"{r['compute']:.3f} + {r['communication']:.3f}"
        print(f"{r['name']:<28} {batch:>10} {r['tokens_per_step']:>11.0f} {spread:>18} {r['predicted']:>11.3f} "
              f"{parts:>17} {r['ratio']:>9.2f}")
    first = results[0]
    print(f"peak: {first['peak_flops'] / 1e9:.1f} GFLOP/s per process (1 process) at utilisation "
          f"{first['utilisation']:.2f}; prediction from {first['source']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
