"""pissa/olora on 2 processes vs one, through the real CLI: per-step losses and the merged models' logits.

    python scripts/pissa_parity.py [--steps 10] [--work DIR]

Runs the tests' parity recipe (a 2-block, 64-wide Llama from a seed, fp32, global batch 8, LoRA r=4 on
q/v) with ``lora.init: pissa`` and ``olora`` as one process and as 2 gloo processes under ddp, zero2 and
fsdp, folds each saved adapter into the original base with ``finetune merge``, and prints, beside the
single-process run, the largest per-step loss difference (absolute and relative) and the largest logit
difference of the merged models on two fixed sequences.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "models" / "tiny-llama"
IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 7, 3, 42], [2, 8, 16, 32, 64, 120, 4, 11, 19, 27]])


def micro_model(d: Path) -> Path:
    """tiny-llama's tokenizer with the tests' 2-block, 64-wide config."""
    d.mkdir(parents=True, exist_ok=True)
    for f in TINY.iterdir():
        if f.name != "config.json":
            shutil.copy(f, d / f.name)
    config = json.loads((TINY / "config.json").read_text())
    config.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    (d / "config.json").write_text(json.dumps(config))
    return d


def run(work: Path, model: Path, init: str, strategy: str, nproc: int, steps: int) -> Path:
    """One CLI run; returns its output directory."""
    out = work / f"{init}-{strategy}-{nproc}"
    recipe = {
        "model": {"path": str(model), "init": "random"},
        "method": "lora",
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "init": init},
        "data": {"train": str(ROOT / "recipes/data/reverse/train.jsonl"), "max_seq_len": 48},
        "train": {
            "max_steps": steps,
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "lr": 3e-3,
            "warmup_steps": 2,
            "max_grad_norm": 1.0,
            "seed": 0,
        },
        "precision": "fp32",
        "distributed": {"strategy": strategy},
        "output": {"dir": str(out), "log_every": 1},
    }
    path = work / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "finetune", "run", str(path), "--overwrite", "--nproc", str(nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return out


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def merged_logits(out: Path) -> torch.Tensor:
    """Logits of the run's adapter folded into its original base by `finetune merge`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    merged = out.parent / f"{out.name}-merged"
    cmd = [sys.executable, "-m", "finetune", "merge", str(out), "--out", str(merged), "--force"]
    subprocess.run(cmd, check=True, capture_output=True)
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(IDS).logits


def main() -> None:
    """Run the comparison and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--work", type=Path, default=None, help="where the runs go (a temporary directory)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="pissa-parity-"))
    model = micro_model(work / "micro-llama")
    header = f"{'init':6} {'strategy':8} {'max |dloss|':>12} {'max rel':>10} {'max |dlogit|':>13}"
    print(f"{header}  (vs 1 process)")
    for init in ("pissa", "olora"):
        single = run(work, model, init, "single", 1, args.steps)
        want, want_logits = losses(single), merged_logits(single)
        for strategy in ("ddp", "zero2", "fsdp"):
            dist = run(work, model, init, strategy, 2, args.steps)
            got = losses(dist)
            diff = max(abs(a - b) for a, b in zip(got, want, strict=True))
            rel = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
            logit = (merged_logits(dist) - want_logits).abs().max().item()
            print(f"{init:6} {strategy:8} {diff:12.2e} {rel:10.2e} {logit:13.2e}", flush=True)


if __name__ == "__main__":
    main()
