"""Per-rank host memory and checkpoint time of a sharded run, old (git main) vs new (this checkout).

The model: a seeded Llama of ~67M parameters (256 MiB in fp32, largest tensor 47 MiB) saved as bf16
safetensors, as published checkpoints are (full fine-tuning stores fp32 master weights).
Each side runs `finetune run` under fsdp on 2 gloo processes (one step, a checkpoint, the final save), then
resumes from that checkpoint. tests/hostmem_hooks.py, installed through $FINETUNE_HOOKS, samples each rank's
RssAnon (/proc/self/status) every millisecond and wraps the Trainer's phases, which have the same names in
both versions: load (Trainer._setup_model), checkpoint (RunCheckpoints.save), final (Trainer.save), resume
(RunCheckpoints.start, i.e. loading the checkpoint). "Old" is `git archive <ref>` of main unpacked in a
temporary directory and run with this interpreter (PYTHONPATH pointing at it).

Then the load alone (one step, no checkpoint) of the methods that used to build the whole model on every
rank: QLoRA (4-bit, bf16), a full fine-tune from ``model.init: random``, DoRA, prefix tuning and bottleneck
adapters (bf16 base), old vs new, per rank.

    python scripts/bench_sharded.py [--old-ref main] [--skip-full-run]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.distributed.test_sharded_memory import BIG, HOOKS, RECIPES, make_model  # noqa: E402
from tests.support import tiny_recipe, write_recipe  # noqa: E402

MiB = 2**20


def probed_run(code: Path, recipe: Path, probe: Path, *args: str) -> dict[int, dict]:
    """`finetune run` of the code at ``code`` with the host-memory probe; each rank's phase peaks."""
    env = {
        **os.environ,
        "PYTHONPATH": str(code),
        "FINETUNE_HOOKS": f"{HOOKS}:HostMemoryHooks",
        "FINETUNE_HOSTMEM_DIR": str(probe),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(recipe), *args],
        cwd=code, capture_output=True, text=True, env=env, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {rank: json.loads((probe / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def run(code: Path, tmp: Path, name: str, model_dir: Path) -> dict[int, dict]:
    out = tmp / name
    r = tiny_recipe(
        out,
        model={"path": str(model_dir), "init": "pretrained"},
        data={"train": str(RECIPES / "data/reverse/train.jsonl"), "eval": None, "max_seq_len": 48},
        train={"max_steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-4},
        distributed={"strategy": "fsdp", "nproc": 2},
        output={"dir": str(out), "save_every": 1, "keep": 1},
    )
    recipe = write_recipe(tmp / f"{name}.yaml", r)
    phases: dict[int, dict] = {0: {}, 1: {}}
    for attempt, args in (("first", []), ("resumed", ["--resume", "latest"])):
        probed = probed_run(code, recipe, tmp / f"{name}-{attempt}", *args)
        for rank in (0, 1):
            got = probed[rank]
            keep = ("load", "checkpoint", "final") if attempt == "first" else ("resume",)
            phases[rank].update({k: v for k, v in got.items() if k in keep})
    return phases


#: A model whose linear weights dominate (~235M parameters: 470 MB in bf16 on disk, ~100 MB of 4-bit codes, the
#: 16000 x 1024 embedding and head 33 MB each in bf16), so that QLoRA's per-rank 4-bit share shows.
QLORA_BIG = {
    **BIG,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
}

#: (label, recipe overrides) of the load-only rows ("model": "qlora-big" uses QLORA_BIG).
LOAD_ROWS = [
    ("qlora", {"method": "qlora", "precision": "bf16"}),
    ("qlora-big", {"method": "qlora", "precision": "bf16", "model": "qlora-big"}),
    ("full random", {"method": "full", "init": "random"}),
    ("dora", {"method": "lora", "precision": "bf16", "lora": {"use_dora": True}}),
    ("prefix", {"method": "prefix", "precision": "bf16"}),
    ("adapter", {"method": "adapter", "precision": "bf16"}),
]


def load_only(code: Path, tmp: Path, name: str, model_dir: Path, overrides: dict) -> dict[int, dict]:
    """One step of ``overrides``' method under fsdp x2, no checkpoint; each rank's ``load`` phase."""
    out = tmp / name
    r = tiny_recipe(
        out,
        model={"path": str(model_dir), "init": overrides.get("init", "pretrained")},
        method=overrides["method"],
        precision=overrides.get("precision", "fp32"),
        lora={"r": 8, **overrides.get("lora", {})},
        data={"train": str(RECIPES / "data/reverse/train.jsonl"), "eval": None, "max_seq_len": 48},
        train={"max_steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-4},
        distributed={"strategy": "fsdp", "nproc": 2},
        output={"dir": str(out)},
    )
    recipe = write_recipe(tmp / f"{name}.yaml", r)
    probed = probed_run(code, recipe, tmp / f"{name}-probe")
    return {rank: probed[rank]["load"] for rank in (0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-ref", default="main", help="git ref of the old behaviour (default: main)")
    ap.add_argument("--skip-full-run", action="store_true", help="only the load-only rows")
    ap.add_argument("--rows", default=",".join(label for label, _ in LOAD_ROWS), help="load-only rows to run")
    args = ap.parse_args()
    rows = [(label, o) for label, o in LOAD_ROWS if label in args.rows.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as t:
        tmp = Path(t)
        model_bytes, largest = make_model(tmp / "model", BIG)
        old_code = tmp / "old"
        old_code.mkdir()
        tar = tmp / "old.tar"
        subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(tar), args.old_ref], check=True)
        with tarfile.open(tar) as f:
            f.extractall(old_code, filter="data")
        if any(o.get("model") == "qlora-big" for _, o in rows):
            make_model(tmp / "qlora-big", QLORA_BIG)
        loads = {
            label: (
                load_only(old_code, tmp, f"old-{i}", tmp / o.get("model", "model"), o),
                load_only(ROOT, tmp, f"new-{i}", tmp / o.get("model", "model"), o),
            )
            for i, (label, o) in enumerate(rows)
        }
        if args.skip_full_run:
            _print_loads(model_bytes, largest, loads)
            return
        old = run(old_code, tmp, "old", tmp / "model")
        new = run(ROOT, tmp, "new", tmp / "model")
    _print_loads(model_bytes, largest, loads)
    print(
        f"model {model_bytes / MiB:.0f} MiB (fp32), largest tensor {largest / MiB:.0f} MiB; fsdp x2 on gloo"
    )
    print("peak RssAnon during the phase, per rank (MiB); and above the phase's start (freed memory the")
    print("allocator kept from an earlier phase is reused without showing there, so read both)")
    print(f"{'phase':<12}{'rank':>5}{'old':>9}{'new':>9}{'new/old':>9}{'old+':>9}{'new+':>9}")
    for phase in ("load", "checkpoint", "final", "resume"):
        for rank in (0, 1):
            o, n = old[rank][phase], new[rank][phase]
            print(
                f"{phase:<12}{rank:>5}{o['peak'] / MiB:>9.1f}{n['peak'] / MiB:>9.1f}{n['peak'] / o['peak']:>9.2f}"
                f"{(o['peak'] - o['start']) / MiB:>9.1f}{(n['peak'] - n['start']) / MiB:>9.1f}"
            )
    print("time on rank 0 (s)")
    print(f"{'phase':<12}{'old':>10}{'new':>10}{'new/old':>9}")
    for phase, label in (
        ("checkpoint", "ckpt save"),
        ("resume", "ckpt load"),
        ("final", "final save"),
        ("load", "model load"),
    ):
        o, n = old[0][phase]["seconds"], new[0][phase]["seconds"]
        print(f"{label:<12}{o:>10.2f}{n:>10.2f}{n / max(o, 1e-9):>9.2f}")


def _print_loads(model_bytes: int, largest: int, loads: dict[str, tuple[dict, dict]]) -> None:
    print(
        f"model {model_bytes / MiB:.0f} MiB in fp32, largest tensor {largest / MiB:.0f} MiB; fsdp x2 on gloo"
    )
    print("load only: peak RssAnon while loading, per rank (MiB), and above the phase's start")
    print(
        f"{'method':<13}{'rank':>5}{'old':>9}{'new':>9}{'new/old':>9}{'old+':>9}{'new+':>9}{'old s':>8}{'new s':>8}"
    )
    for label, (old, new) in loads.items():
        for rank in (0, 1):
            o, n = old[rank], new[rank]
            print(
                f"{label:<13}{rank:>5}{o['peak'] / MiB:>9.1f}{n['peak'] / MiB:>9.1f}{n['peak'] / o['peak']:>9.2f}"
                f"{(o['peak'] - o['start']) / MiB:>9.1f}{(n['peak'] - n['start']) / MiB:>9.1f}"
                f"{o['seconds']:>8.1f}{n['seconds']:>8.1f}"
            )


if __name__ == "__main__":
    main()
