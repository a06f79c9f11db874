"""What the sections share: small model directories, recipes, `finetune run` through the real CLI, and the
files a run leaves (metrics.jsonl, memory.json, plan.json).

Models are built from ``recipes/models/tiny-llama`` (its byte-level tokenizer, a config with other sizes) and
initialised from ``train.seed`` (``model.init: random``): nothing is downloaded, on the lent machine either.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
TINY = ROOT / "recipes" / "models" / "tiny-llama"
DATA = ROOT / "recipes" / "data"

#: The model of the GPU runs of the memory and optimizer sections: a Llama of ~150M parameters (8 blocks of
#: width 1024, a 32000-token vocabulary), big enough that its memory is GiBs, small enough to start in seconds.
MID_LLAMA: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 2048,
}

#: The dry run's model: tiny-llama's tokenizer, 2 blocks of width 64 (CPU seconds, not minutes, on 2 cores).
MICRO_LLAMA: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32,
}


def cuda() -> bool:
    """Whether a CUDA device is visible (imports torch)."""
    import torch

    return torch.cuda.is_available()


def model_dir(dest: Path, **config: Any) -> Path:
    """tiny-llama's tokenizer and config in ``dest``, the config's keys in ``config`` changed."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in TINY.iterdir():
        if f.name != "config.json":
            shutil.copy(f, dest / f.name)
    cfg = json.loads((TINY / "config.json").read_text())
    cfg.update(config)
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    return dest


def recipe(out: Path, model_path: Path, **sections: Any) -> dict[str, Any]:
    """A recipe dict for a few steps of the model at ``model_path`` (random init) on the reverse task;
    ``sections`` replace or update its sections (a dict updates, anything else replaces)."""
    r: dict[str, Any] = {
        "model": {"path": str(model_path), "init": "random"},
        "method": "full",
        "data": {
            "train": str(DATA / "reverse" / "train.jsonl"),
            "eval": str(DATA / "reverse" / "eval.jsonl"),
            "max_seq_len": 48,
        },
        "train": {"max_steps": 2, "global_batch_size": 4, "micro_batch_size": 4, "lr": 1e-3, "seed": 0,
                  "warmup_steps": 0},
        "precision": "fp32",
        "distributed": {"strategy": "single"},
        "eval": {"at_start": False, "max_samples": 4, "max_new_tokens": 4, "batch_size": 4},
        "output": {"dir": str(out), "log_every": 1},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            r.setdefault(key, {}).update(value)
        else:
            r[key] = value
    return r


def small_data(dest: Path, rows: int, source: str = "reverse") -> dict[str, str]:
    """The first ``rows`` training rows (and a quarter as many eval rows) of a shipped task in ``dest``: the dry
    run tokenizes tens of samples, not thousands."""
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", rows), ("eval", max(4, rows // 4))):
        lines = (DATA / source / f"{split}.jsonl").read_text().splitlines()[:n]
        (dest / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        out[split] = str(dest / f"{split}.jsonl")
    return out


def write_recipe(path: Path, r: dict[str, Any]) -> Path:
    """``r`` as YAML at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(r, sort_keys=False))
    return path


def finetune(
    args: list[str], *, in_process: bool, env: dict[str, str] | None = None, capture: bool = False
) -> tuple[int, float, str]:
    """``finetune ARGS`` through the real CLI; returns its exit code, seconds and (``capture``) its stdout.

    ``in_process``: the CLI's Typer app in this process (the dry run: no interpreter start, no second import
    of torch per run); else a child process, whose memory and CUDA context are its own (the GPU runs: what a
    user runs). Its output goes to this section's log (stdout, unless captured). ``env``: variables set for
    that run.
    """
    started = time.perf_counter()
    print(f"$ finetune {' '.join(args)}", flush=True)
    if not in_process:
        child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        done = subprocess.run([sys.executable, "-m", "finetune", *args], env=child_env,
                              stdout=subprocess.PIPE if capture else None, text=True)
        return done.returncode, time.perf_counter() - started, done.stdout or ""
    import contextlib
    import io

    saved_env = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    buffer = io.StringIO()
    try:
        from finetune.cli import app, bare_resume

        with contextlib.redirect_stdout(buffer) if capture else contextlib.nullcontext():
            app(args=bare_resume(args))
        rc = 0
    except SystemExit as exit_:
        rc = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        sys.stdout.flush()
    return rc, time.perf_counter() - started, buffer.getvalue()


def step_rows(out: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows of optimizer steps."""
    return [r for r in _rows(out) if "loss" in r]


def eval_rows(out: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows of evaluations."""
    return [r for r in _rows(out) if any(k.startswith("eval") for k in r) and "loss" not in r]


def _rows(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def memory_json(out: Path) -> dict[str, Any] | None:
    """The run's memory.json (the plan's prediction beside the measured peak), or None."""
    path = out / "memory.json"
    return json.loads(path.read_text()) if path.is_file() else None


def plan_chosen(out: Path) -> dict[str, Any]:
    """The ``chosen`` configuration of the run's plan.json ({} when there is none)."""
    path = out / "plan.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("chosen", {})


#: memory.json keys copied into a section's figures when the run wrote them (reserved and device-used figures
#: appear where the trainer records them).
MEMORY_KEYS = ("device", "predicted", "predicted_with_overhead", "measured_peak", "error", "predicted_at_measured_rows",
               "error_at_measured_rows", "steps_measured", "rows", "overhead", "reserved_peak", "device_used_peak",
               "error_with_overhead")


def memory_figures(mem: dict[str, Any] | None) -> dict[str, Any]:
    """The plan-vs-measured figures of a memory.json: its main keys, every key that names reserved or
    device-used memory, and the ratios measured / predicted."""
    if mem is None:
        return {"memory_json": None}
    got = {k: mem[k] for k in MEMORY_KEYS if k in mem}
    for key, value in mem.items():
        if any(word in key for word in ("reserved", "device_used", "used", "nvml", "driver")) and key not in got:
            got[key] = value
    for key, value in (mem.get("by_category") or {}).items():
        if any(word in key for word in ("reserved", "used")):
            got[f"by_category.{key}"] = value
    pred, meas = mem.get("predicted"), mem.get("measured_peak")
    if pred and meas:
        got["measured_over_predicted"] = round(meas / pred, 4)
    with_overhead = mem.get("predicted_with_overhead")
    for key in ("reserved", "reserved_peak", "device_used", "device_used_peak"):
        value = got.get(key)
        if isinstance(value, (int, float)) and with_overhead:
            got[f"{key}_over_predicted_with_overhead"] = round(value / with_overhead, 4)
    return got


def size(n: float | None) -> str:
    """Bytes in the largest binary unit that keeps a figure of at least 1 ('-' for None)."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def max_rel(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two series of the same length (inf when the lengths differ)."""
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))
