"""How right is the planner's time? Predicted against measured seconds per optimizer step, on real runs.

Each configuration runs the real CLI (``finetune run RECIPE --set train.max_steps=N ...``: the quickstart's
full fine-tuning, LoRA on its output, and the quickstart under FSDP on 2 gloo processes) with a metrics line
every step. A step's seconds are its tokens over the tokens/s of its line (the window of a line is one
step); the first ``--skip`` steps are warm-up and left out, and the median of the rest is the measurement.
The prediction is ``plan.chosen.time.step`` from the run's plan.json when the planner wrote one, else
``finetune.plan.timing.step_time`` of ``plan.chosen`` computed here.

Rows are packed (``data.packing: true``) at ``data.max_seq_len: 128`` (about three of the tasks' 41-token
samples a row, 96% of the row) with 16 rows a step, so that rows are as wide as the prediction assumes;
``--unpacked`` adds the quickstart as shipped (32 rows of about 41 tokens, padded to each micro-batch's longest,
which the prediction at the 64-token ``data.max_seq_len`` over-counts).

Seconds are wall-clock: the median step and the fastest. On a host busy with other work they measure the
neighbours as much as the step, so the share of its cores each run had (its CPU seconds over its wall-clock
seconds x processes x threads) is printed too, and "own cores" is the median x that share: an estimate of
the step on cores of its own (exact only if the share was the same during every step; meaningful with one
thread a process, ``--threads 1``: waiting OpenMP threads spin and count as busy). The prediction is compared
with both.

    python scripts/time_accuracy.py                  # 12 steps each, a table
    python scripts/time_accuracy.py --steps 20 --json out.json
    python scripts/time_accuracy.py --threads 1     # one thread a process (a host busy with other work)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
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
PACKED_SEQ_LEN, PACKED_BATCH = 128, 16


def run(name: str, recipe: str, extra: list[str], nproc: int, out: Path, steps: int, packed: bool) -> float:
    """``finetune run`` one configuration for ``steps`` steps into ``out``; returns the share of its cores the
    run had: the CPU seconds (user + system) it and every process it started used / (its wall-clock seconds x
    its processes x their threads)."""
    sets = [
        f"train.max_steps={steps}", "output.log_every=1", "eval.every=0", "eval.at_start=false",
        "eval.max_samples=4", f"output.dir={out}", "output.save_every=0",
    ]
    if packed:
        sets += ["data.packing=true", f"data.max_seq_len={PACKED_SEQ_LEN}", f"train.global_batch_size={PACKED_BATCH}"]
    sets += extra
    cmd = [sys.executable, "-m", "finetune.cli", "run", str(RECIPES / recipe), "--overwrite"]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    for s in sets:
        cmd += ["--set", s]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name}: finetune run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter() - started
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    share = cpu / (wall * nproc * threads_per_process(nproc))
    print(f"  {name}, {steps} steps: ran in {wall:.0f} s, {100 * share:.0f}% of its cores", file=sys.stderr)
    return share


def threads_per_process(nproc: int) -> int:
    """Torch threads of each of ``nproc`` processes on this host (what the trainer sets)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else max(1, len(os.sched_getaffinity(0)) // nproc)


def measured_seconds(run_dir: Path, skip: int) -> tuple[list[float], float]:
    """(seconds of every step after the first ``skip``, their mean tokens) from metrics.jsonl."""
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
    from finetune.plan.hardware import Hardware
    from finetune.plan.request import request_from_recipe
    from finetune.plan.timing import step_time
    from finetune.recipe.schema import load_recipe
    from finetune.spec import adapter_spec

    loaded = load_recipe(run_dir / "recipe.yaml")
    r = loaded.recipe
    req = request_from_recipe(loaded)
    fields = {f.name for f in dataclasses.fields(Hardware)}
    hw = Hardware(**{k: v for k, v in plan.hardware.items() if k in fields})
    c = plan.chosen
    adapter = adapter_spec(c.method.value, r.lora, r.prefix, r.adapter, r.prompt)
    return step_time(c, req.config, hw, seq_len=plan.model["seq_len"], adapter=adapter, steps=r.train.max_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the measurement")
    ap.add_argument("--unpacked", action="store_true", help="also the quickstart with unpacked (padded) rows")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per process (OMP_NUM_THREADS; default: the cores / the processes)")
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args()
    if args.threads:  # the runs' trainers and their plans' CPU peak (and step_time here) all follow it
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="time_accuracy-"))
    configs = [(*cfg, True) for cfg in RUNS] + ([(*UNPACKED, False)] if args.unpacked else [])
    results = []
    quickstart_dir = out / "quickstart"
    for i, (name, recipe, extra, nproc, packed) in enumerate(configs):
        run_dir = quickstart_dir if i == 0 else out / f"run{i}"
        extra = [e.format(quickstart=quickstart_dir) for e in extra]
        share = run(name, recipe, extra, nproc, run_dir, args.steps, packed)
        seconds, step_tokens = measured_seconds(run_dir, args.skip)
        t, source, plan = predicted(run_dir)
        c = plan["chosen"]
        measured = statistics.median(seconds)
        results.append({
            "name": name, "method": c["method"], "strategy": c["strategy"], "processes": nproc,
            "threads": threads_per_process(nproc), "precision": c["precision"], "micro_batch": c["micro_batch_size"],
            "accumulation": c["grad_accum_steps"], "seq_len": plan["model"]["seq_len"],
            "tokens_per_step": step_tokens, "measured": measured, "measured_min": min(seconds),
            "measured_max": max(seconds), "share": share, "own_cores": statistics.median(seconds) * min(1.0, share), "predicted": t.step, "compute": t.compute,
            "communication": t.communication, "offload": t.offload, "peak_flops": t.peak_flops,
            "utilisation": t.utilisation, "ratio": t.step / measured, "ratio_own": t.step / (measured * min(1.0, share)),
            "source": source,
        })
    print(f"{'configuration':<28} {'batch':>8} {'tokens':>6} {'fastest':>7} {'median':>7} {'cores':>5} "
          f"{'own cores':>9} {'predicted':>9} {'(compute + comm)':>17} {'pred/median':>11} {'pred/own':>8}")
    for r in results:
        batch = f"{r['micro_batch']}x{r['accumulation']}x{r['processes']}"
        parts = f"{r['compute']:.3f} + {r['communication']:.3f}"
        print(f"{r['name']:<28} {batch:>8} {r['tokens_per_step']:>6.0f} {r['measured_min']:>7.3f} "
              f"{r['measured']:>7.3f} {100 * r['share']:>4.0f}% {r['own_cores']:>9.3f} {r['predicted']:>9.3f} "
              f"{parts:>17} {r['ratio']:>11.2f} {r['ratio_own']:>8.2f}")
    first = results[0]
    print(f"peak: {first['peak_flops'] / 1e9:.1f} GFLOP/s per process (1 process) at utilisation "
          f"{first['utilisation']:.2f}; prediction from {first['source']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
