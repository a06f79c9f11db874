"""Every tiny architecture of the tests (tests/support.py's ``ARCHITECTURES``: dense models and mixtures of experts)
under FSDP on 2 gloo processes: does it train, and how far is the plan from the measured peak?

Each row is ``finetune run RECIPE --nproc 2 --measure-memory`` (the real CLI and trainer) for one optimizer step
of micro-batch 4, rows of 64 tokens packed from two 32-token samples, random weights from the seed, as
tests/train/test_architectures.py runs them on one process. The prediction is the planner's first-step peak
without the runtime overhead; the measurement is MemTracker's peak of tensor memory over the step on the worst
rank (memory.json). Methods: full fine-tuning in fp32; LoRA and QLoRA in bf16 on attention (r 4); on the
mixtures also LoRA and QLoRA ``all-linear`` (their fused experts adapted, and stored in NF4 under QLoRA).

    python scripts/fsdp_architectures.py                     # every architecture and method, a markdown table
    python scripts/fsdp_architectures.py --only qwen3_moe mixtral --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import ARCHITECTURES, MOE_ARCHITECTURES, arch_model_dir  # noqa: E402

SEQ, MBS = 64, 4
#: column name -> (method, precision, LoRA targets: None for attention)
METHODS = {
    "full fp32": ("full", "fp32", None),
    "LoRA bf16": ("lora", "bf16", None),
    "QLoRA bf16": ("qlora", "bf16", None),
    "LoRA all-linear bf16": ("lora", "bf16", "all-linear"),
    "QLoRA all-linear bf16": ("qlora", "bf16", "all-linear"),
}
#: LoRA on attention (DeepSeek-V3's multi-head latent attention has no q_proj/v_proj)
ATTENTION = {"deepseek_v3": ["q_b_proj", "kv_b_proj"]}


def recipe(arch: str, model_dir: Path, rows: Path, out: Path, column: str) -> dict:
    """The recipe of one architecture and column, under fsdp on 2 processes."""
    method, precision, targets = METHODS[column]
    return {
        "model": {"path": str(model_dir), "init": "random"},
        "method": method,
        "lora": {"r": 4, "alpha": 8, "target_modules": targets or ATTENTION.get(arch, ["q_proj", "v_proj"])},
        "data": {"train": str(rows), "format": "tokenized", "max_seq_len": SEQ, "packing": True},
        "train": {"max_steps": 1, "global_batch_size": 2 * MBS, "micro_batch_size": MBS, "lr": 1e-3, "seed": 0},
        "precision": precision,
        "distributed": {"strategy": "fsdp", "nproc": 2},
        "eval": {"every": 0},
        "output": {"dir": str(out), "log_every": 1},
    }


def run_one(arch: str, column: str, root: Path, rows: Path) -> dict:
    """One run through the CLI: the plan's prediction, the measured peak, the error and the step's loss."""
    from finetune.plan.flowchart import chosen_memory
    from finetune.plan.types import Plan
    from finetune.recipe.schema import load_recipe

    model_dir = root / arch
    if not model_dir.exists():
        arch_model_dir(model_dir, arch)
    out = root / f"{arch}-{column.replace(' ', '-')}"
    path = root / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe(arch, model_dir, rows, out, column), sort_keys=False))
    done = subprocess.run([sys.executable, "-m", "finetune", "run", str(path), "--nproc", "2", "--measure-memory"],
                          capture_output=True, text=True, timeout=1200)
    if done.returncode != 0 or not (out / "memory.json").exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        return {"arch": arch, "column": column, "failed": " | ".join(tail)}
    plan = Plan.from_dict(json.loads((out / "plan.json").read_text()))
    first = chosen_memory(load_recipe(path), plan, device="cpu", first_step=True)
    predicted = first.total - first.overhead
    measured = int(json.loads((out / "memory.json").read_text())["measured_peak"])
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loss = next(r["loss"] for r in steps if "loss" in r)
    return {"arch": arch, "column": column, "strategy": plan.chosen.strategy, "predicted": predicted,
            "measured": measured, "error": (predicted - measured) / measured, "loss": loss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="architectures to run (default: every one)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    archs = [a for a in ARCHITECTURES if not args.only or a in args.only]
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rng = random.Random(0)
        rows = root / "rows.jsonl"
        rows.write_text("".join(json.dumps({"input_ids": [rng.randrange(3, 256) for _ in range(SEQ // 2)]}) + "\n"
                                for _ in range(64)))
        for arch in archs:
            for column in METHODS:
                if "all-linear" in column and arch not in MOE_ARCHITECTURES:
                    continue
                r = run_one(arch, column, root, rows)
                results.append(r)
                said = r["failed"] if "failed" in r else (
                    f"{r['strategy']} predicted {r['predicted'] / 2**20:.2f} MiB, measured {r['measured'] / 2**20:.2f} "
                    f"MiB, error {100 * r['error']:+.2f}%, loss {r['loss']:.4f}")
                print(f"{arch:12s} {column:22s} {said}", flush=True)
    print("\n| architecture | " + " | ".join(f"fsdp {c}" for c in METHODS) + " |")
    print("|---" * (len(METHODS) + 1) + "|")
    for arch in archs:
        cells = []
        for column in METHODS:
            found = [x for x in results if x["arch"] == arch and x["column"] == column]
            cells.append("-" if not found else "fails" if "failed" in found[0] else f"{100 * found[0]['error']:+.2f}%")
        print(f"| {arch} | " + " | ".join(cells) + " |")
    errors = [abs(r["error"]) for r in results if "error" in r]
    failed = [r for r in results if "failed" in r]
    if errors:
        print(f"\n{len(errors)} runs trained, {len(failed)} failed: median |error| "
              f"{100 * statistics.median(errors):.2f}%, worst {100 * max(errors):.2f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
