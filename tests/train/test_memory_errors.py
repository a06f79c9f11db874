"""The preflight and the out-of-memory message, on CPU, under a real address-space cap (RLIMIT_AS).

Each test runs the real CLI in a subprocess that first plans the recipe once (so every module the run imports
is loaded and the activation traces are cached), then caps its own address space and runs. glibc is told to
map every block of 64 KiB or more on its own (MALLOC_MMAP_THRESHOLD_), so a tensor allocation past the cap
fails when it is made, as on a GPU, instead of being served from memory freed earlier.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.units import fmt_bytes
from tests.support import TINY_MODEL, tiny_recipe, write_recipe

pytestmark = pytest.mark.slow

MiB = 2**20

CAPPED = """
import os, resource, sys
import psutil, torch
from finetune.commands.run import prepare
from finetune.plan.flowchart import plan_for_run
plan_for_run(prepare(sys.argv[2], []), nproc=1, nnodes=1, device="cpu")  # imports + trace cache, before the cap
headroom = int(os.environ["CAP_HEADROOM"])

def cap() -> None:
    vms = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (vms + headroom, resource.RLIM_INFINITY))

if os.environ.get("CAP_AT_FIRST_FORWARD"):
    # The first forward of the first training step (no eval before it): from then on, only `headroom` more.
    done = []
    def hook(module, args):
        if not done:
            done.append(1)
            cap()
    torch.nn.modules.module.register_module_forward_pre_hook(hook)
else:
    cap()
from finetune.cli import main
sys.argv = ["finetune", *sys.argv[1:]]
main()
"""


def _model(tmp: Path, hidden: int, layers: int) -> Path:
    """The tiny model's tokenizer with a wider, deeper config (random init: nothing to download)."""
    d = tmp / f"llama-{hidden}x{layers}"
    shutil.copytree(TINY_MODEL, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _run_capped(
    recipe: Path, headroom: int, *, at_first_forward: bool = False
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "CAP_HEADROOM": str(headroom),
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "1000",
    }
    if at_first_forward:
        env["CAP_AT_FIRST_FORWARD"] = "1"
    return subprocess.run(
        [sys.executable, "-c", CAPPED, "run", str(recipe)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_preflight_refuses_a_plan_beyond_the_cap(tmp_path: Path) -> None:
    """A full fine-tune needing ~0.5 GiB under a 200 MiB cap stops before loading, with the plan that fits."""
    out = tmp_path / "run"
    model = _model(tmp_path, 512, 8)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tiny_recipe(out, model={"path": str(model), "init": "random"}, method="full"),
    )
    res = _run_capped(recipe, 200 * MiB)
    err = " ".join(res.stderr.split())  # rich may wrap
    assert res.returncode == 3, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert err.startswith("error: rank 0: the plan needs ")
    assert "per process but only" in err
    assert (
        "is address space left under this process's RLIMIT_AS (ulimit -v), so it would run out of memory; "
        "stopped before loading anything." in err
    )
    plan = json.loads((out / "plan.json").read_text())["chosen"]
    assert f"the plan needs {fmt_bytes(plan['memory']['total'])} per process" in err
    # The planner's choice for that much memory: LoRA on the same model, as a command to copy.
    assert f"run: finetune run {recipe} --set method=lora" in err
    assert not (out / "model.safetensors").exists() and not (out / "metrics.jsonl").exists()


def test_allocation_failure_mid_step_names_phase_step_and_next_config(tmp_path: Path) -> None:
    """The cap lands at the first forward: the step's activations cannot be allocated. The message names the
    phase and step, the plan's breakdown beside what the process held, and a configuration needing less."""
    out = tmp_path / "run"
    model = _model(tmp_path, 256, 4)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tiny_recipe(
            out,
            model={"path": str(model), "init": "random"},
            data={"eval": None, "max_seq_len": 48},
            train={"max_steps": 2, "global_batch_size": 16, "micro_batch_size": 16, "lr": 1e-3, "seed": 0},
            eval={"at_start": False},
        ),
    )
    res = _run_capped(recipe, 2 * MiB, at_first_forward=True)
    err = " ".join(res.stderr.split())
    assert res.returncode == 3, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert err.startswith("error: rank 0 ran out of memory in the forward phase of step 1 (an allocation of ")
    assert "process resident " in err and "the plan predicted " in err
    assert "(params " in err and "activations " in err
    assert f"run: finetune run {recipe} --set train.micro_batch_size=" in err
