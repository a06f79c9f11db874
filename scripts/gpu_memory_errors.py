"""On a CUDA GPU: the preflight refusal and the out-of-memory message with ``--debug-memory``'s snapshot.

1. Preflight: this process first holds all but 256 MiB of the GPU (as another job would), then runs a recipe
   whose plan needs more; the run must stop with exit 3 and "rank 0: the plan needs ..." before loading.
2. OOM: the caching allocator is capped (``torch.cuda.set_per_process_memory_fraction``) below the plan, which
   ``mem_get_info`` does not see, so the preflight passes and a step fails; the message must name the phase
   and step and a memory snapshot file that exists. Prints one line per check; exits 1 if one fails.

    python scripts/gpu_memory_errors.py        (from scripts/gpu_check.sh)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WRAPPER = """
import os, sys, torch
mode = os.environ["GPU_MODE"]
if mode == "hold":
    free, _ = torch.cuda.mem_get_info()
    held = torch.empty(free - 256 * 2**20, dtype=torch.uint8, device="cuda")
else:
    torch.cuda.set_per_process_memory_fraction(float(os.environ["GPU_FRACTION"]))
from finetune.cli import main
sys.argv = ["finetune", *sys.argv[1:]]
main()
"""


def _recipe(tmp: Path, out: Path) -> Path:
    model = tmp / "model"
    model.mkdir()
    src = ROOT / "recipes/models/tiny-llama"
    for f in src.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    )
    (model / "config.json").write_text(json.dumps(cfg))
    import yaml

    recipe = {
        "model": {"path": str(model), "init": "random"},
        "method": "full",
        "data": {"train": str(ROOT / "recipes/data/reverse/train.jsonl"), "max_seq_len": 64},
        "train": {"max_steps": 2, "global_batch_size": 32, "micro_batch_size": 32},
        "precision": "bf16",
        "distributed": {"strategy": "single"},
        "eval": {"at_start": False},
        "output": {"dir": str(out)},
    }
    path = tmp / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _run(recipe: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WRAPPER, "run", str(recipe), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "1000", **env},
        timeout=600,
    )


def main() -> int:
    ok = True
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        recipe = _recipe(tmp, tmp / "run")
        res = _run(recipe, {"GPU_MODE": "hold"})
        err = " ".join(res.stderr.split())
        good = res.returncode == 3 and "rank 0: the plan needs" in err and "Traceback" not in err
        print(f"preflight with the GPU held: exit {res.returncode}: {'OK' if good else 'FAIL'}: {err[:600]}")
        ok &= good
        plan = json.loads((tmp / "run" / "plan.json").read_text())["chosen"]["memory"]["total"]
        import torch

        fraction = 0.6 * plan / torch.cuda.mem_get_info()[1]
        res = _run(recipe, {"GPU_MODE": "cap", "GPU_FRACTION": str(fraction)}, "--debug-memory")
        err = " ".join(res.stderr.split())
        snap = re.search(r"Memory snapshot: (\S+\.pickle)", err)
        good = (
            res.returncode == 3
            and "ran out of memory in the" in err
            and "Traceback" not in err
            and snap is not None
            and Path(snap.group(1)).stat().st_size > 0
        )
        print(
            f"out of memory under a {fraction:.3f} allocator cap: exit {res.returncode}: "
            f"{'OK' if good else 'FAIL'}: {err[:800]}"
        )
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
