"""Shared fixtures: the repo's paths, a tiny, fast recipe for end-to-end runs, and a private planner cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
TINY_MODEL = RECIPES / "models" / "tiny-llama"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Fault injection (failure, NaN, kill, slow steps) lives with the tests; every run of the suite installs it.
os.environ.setdefault("FINETUNE_HOOKS", f"{Path(__file__).resolve().parent / 'fault_hooks.py'}:FaultHooks")


def tiny_recipe(out_dir: Path, **sections: dict) -> dict:
    """A recipe dict for a few fast steps of the tiny model (override sections by keyword)."""
    recipe = {
        "model": {"path": str(TINY_MODEL), "init": "random"},
        "method": "full",
        "data": {
            "train": str(RECIPES / "data/reverse/train.jsonl"),
            "eval": str(RECIPES / "data/reverse/eval.jsonl"),
            "max_seq_len": 48,
        },
        "train": {"max_steps": 4, "global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-3, "seed": 0},
        "precision": "fp32",
        "distributed": {"strategy": "single"},
        "eval": {"max_samples": 8, "max_new_tokens": 4, "batch_size": 8},
        "output": {"dir": str(out_dir), "log_every": 1},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            recipe.setdefault(key, {}).update(value)
        else:
            recipe[key] = value
    return recipe


def write_recipe(path: Path, recipe: dict) -> Path:
    """Write a recipe dict as YAML and return its path."""
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture(scope="session", autouse=True)
def private_trace_cache(tmp_path_factory: pytest.TempPathFactory):
    """The planner's activation traces go to a directory of this test run ($FINETUNE_CACHE, read when a trace is
    looked up, and inherited by every CLI subprocess), not to ~/.cache/finetune. The SmolLM2 model is found
    through $FINETUNE_SMOLLM2 or its own path under the home directory, which this leaves alone."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FINETUNE_CACHE", str(tmp_path_factory.mktemp("finetune-cache")))
        yield


@pytest.fixture
def finetune_cmd() -> list[str]:
    """The real CLI, run as a subprocess with this interpreter."""
    return [sys.executable, "-m", "finetune"]


def micro_model_dir(d: Path, **config: object) -> Path:
    """tiny-llama's tokenizer and config in ``d``, with the config keys in ``config`` changed (small test models)."""
    import json
    import shutil

    d.mkdir(parents=True, exist_ok=True)
    for f in TINY_MODEL.iterdir():
        if f.name != "config.json":
            shutil.copy(f, d / f.name)
    cfg = json.loads((TINY_MODEL / "config.json").read_text())
    cfg.update(config)
    (d / "config.json").write_text(json.dumps(cfg))
    return d
