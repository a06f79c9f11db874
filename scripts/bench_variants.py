"""Training speed of finetune's own variants side by side: eager, train.compile, flex attention.

    python scripts/bench_variants.py [--steps 12] [--max-seq-len 256] [--batch 8] [--rounds 1] [--json out.json]
    python scripts/bench_variants.py --recipe recipes/smollm2-135m-lora.yaml   # another job (same variants)
    python scripts/bench_variants.py --cpu-time   # + tokens per CPU second (a loaded CPU machine's figure)

Each variant is the same recipe (packed rows, fixed steps, no eval) changed in one key, run by
``finetune run`` in its own process, one after the other (``--rounds`` repeats the sequence, interleaved, so a
machine whose load drifts hurts every variant alike). tokens/s is the median of the per-step figures the trainer
logs (real tokens, padding excluded) after the first two steps, so compilation is not counted; its cost is shown
apart as the first step's seconds. The default job is the built-in tiny Llama (random init, fp32 on CPU).

On CPU, flex attention runs finetune's CPU path (torch 2.13 has no flex backward on CPU: the BlockMask is
evaluated densely and sdpa does the work), so its figure there measures that path, not the fused kernel; on a
CUDA GPU it is transformers' compiled flex kernel.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

VARIANTS: dict[str, dict] = {
    "eager": {},
    "compile": {"train": {"compile": True}},
    "flex_attention": {"model": {"attn_implementation": "flex_attention"}},
    "flex_attention+compile": {
        "model": {"attn_implementation": "flex_attention"},
        "train": {"compile": True},
    },
}


def tiny_job(out: Path, steps: int, max_seq_len: int, batch: int) -> dict:
    """The default job: tiny Llama, full fine-tuning, fp32, packed rows of ``max_seq_len`` tokens."""
    return {
        "model": {"path": str(ROOT / "recipes" / "models" / "tiny-llama"), "init": "random"},
        "method": "full",
        "data": {
            "train": str(ROOT / "recipes" / "data" / "reverse" / "train.jsonl"),
            "format": "instruction",
            "max_seq_len": max_seq_len,
            "packing": True,
        },
        "train": {
            "max_steps": steps,
            "global_batch_size": batch,
            "micro_batch_size": batch,
            "lr": 1e-3,
            "seed": 0,
        },
        "precision": "auto",
        "distributed": {"strategy": "single"},
        "eval": {"every": 0, "at_start": False},
        "output": {"dir": str(out), "log_every": 1},
    }


def job_from(recipe: Path, out: Path, steps: int) -> dict:
    """A recipe file as a benchmark job: fixed steps, packed, no eval, output in ``out``."""
    raw = yaml.safe_load(recipe.read_text())
    raw["model"]["path"] = _absolute(raw["model"]["path"], recipe.parent)
    for key in ("train", "eval"):
        if isinstance(raw["data"].get(key), str):
            raw["data"][key] = _absolute(raw["data"][key], recipe.parent)
    raw["data"].pop("eval", None)
    raw["data"]["packing"] = True
    raw.setdefault("train", {}).update({"max_steps": steps})
    raw["eval"] = {"every": 0, "at_start": False}
    raw["output"] = {"dir": str(out), "log_every": 1}
    return raw


def _absolute(value: str, base: Path) -> str:
    p = base / value
    return str(p.resolve()) if p.exists() else value


def merge(job: dict, change: dict) -> dict:
    """``job`` with the sections of ``change`` updated."""
    out = copy.deepcopy(job)
    for section, values in change.items():
        out.setdefault(section, {}).update(values)
    return out


def run_variant(name: str, job: dict, tmp: Path) -> dict:
    """One ``finetune run``; tokens/s (median after two steps), the first step's seconds, the last loss, and
    the run's CPU seconds (user + system of the children waited for) and tokens."""
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(path)], capture_output=True, text=True
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    metrics = Path(job["output"]["dir"]) / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
        return {"variant": name, "error": f"finetune run failed ({proc.returncode}): {tail}"}
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [r for r in rows if "tokens_per_s" in r]
    later = [r["tokens_per_s"] for r in steps if r["step"] > 2]
    first = steps[0]["tokens"] / steps[0]["tokens_per_s"] if steps else None
    return {
        "variant": name,
        "tokens_per_s": statistics.median(later) if later else None,
        "first_step_s": first,
        "final_loss": [r["loss"] for r in rows if "loss" in r][-1],
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "tokens": steps[-1]["tokens"] if steps else 0,
    }


def cpu_rate(long: dict, short: dict) -> float | None:
    """Tokens per CPU second of the steps the long run has beyond the short one: start-up and compilation,
    common to both, cancel, and other processes on a loaded machine do not count (a CPU-only figure)."""
    if "error" in long or "error" in short or long["cpu_s"] <= short["cpu_s"]:
        return None
    return (long["tokens"] - short["tokens"]) / (long["cpu_s"] - short["cpu_s"])


def main() -> int:
    """Run every variant (``--rounds`` times, interleaved) and print a table with ratios to eager."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, help="a recipe to benchmark instead of the tiny job")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="also run each variant for 4 steps and report tokens per CPU second of the extra steps "
        "(robust to a loaded machine; meaningful on CPU only)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if "eager" not in args.variants:
        args.variants.insert(0, "eager")

    def job_for(out: Path, steps: int) -> dict:
        if args.recipe:
            return job_from(args.recipe, out, steps)
        return tiny_job(out, steps, args.max_seq_len, args.batch)

    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for rnd in range(args.rounds):
            for name in args.variants:
                r = run_variant(name, merge(job_for(tmp / f"{name}-{rnd}", args.steps), VARIANTS[name]), tmp)
                if args.cpu_time:
                    short_job = merge(job_for(tmp / f"{name}-{rnd}-short", 4), VARIANTS[name])
                    r["cpu_tokens_per_s"] = cpu_rate(r, run_variant(f"{name}-short", short_job, tmp))
                results[name].append(r)
                print(f"  round {rnd + 1} {name}: {r.get('tokens_per_s') or r.get('error')}", flush=True)
    table = []
    base = _median(results["eager"], "tokens_per_s")
    cpu_base = _median(results["eager"], "cpu_tokens_per_s")
    header = f"\n{'variant':24s} {'tokens/s':>10s} {'vs eager':>9s} {'first step s':>13s} {'final loss':>11s}"
    print(header + (f" {'tokens/CPU-s':>13s} {'vs eager':>9s}" if args.cpu_time else ""))
    for name in args.variants:
        errors = [r["error"] for r in results[name] if "error" in r]
        if errors:
            print(f"{name:24s} {errors[0]}")
            table.append({"variant": name, "error": errors[0]})
            continue
        tps = _median(results[name], "tokens_per_s")
        first = _median(results[name], "first_step_s")
        loss = _median(results[name], "final_loss")
        ratio = tps / base if tps and base else None
        cpu_tps = _median(results[name], "cpu_tokens_per_s")
        cpu_ratio = cpu_tps / cpu_base if cpu_tps and cpu_base else None
        extra = ""
        if args.cpu_time:
            extra = f" {cpu_tps:13,.0f} {cpu_ratio:8.2f}x" if cpu_ratio else f" {'-':>13s} {'-':>9s}"
        print(f"{name:24s} {tps:10,.0f} {ratio:8.2f}x {first:13.1f} {loss:11.4f}" + extra)
        table.append(
            {
                "variant": name,
                "tokens_per_s": tps,
                "vs_eager": ratio,
                "first_step_s": first,
                "final_loss": loss,
                "cpu_tokens_per_s": cpu_tps,
                "cpu_vs_eager": cpu_ratio,
                "runs": results[name],
            }
        )
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")
    return 0 if all("error" not in r for r in table) else 1


def _median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


if __name__ == "__main__":
    sys.exit(main())
