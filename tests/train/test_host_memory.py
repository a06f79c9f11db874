"""`finetune run` checks host memory before it loads anything: the job plan's host memory per node
(finetune/plan/job.py) against this node's (``--host-memory``, default MemAvailable). Over it, the run is
refused in one sentence naming the figure, the phase and what to do, before any worker or process group
starts; under it (or with ``--ignore-host-memory``) it runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.commands.run import LaunchOptions, launch, prepare
from finetune.plan.job import HOST_PER_PROCESS_CPU, available_host_memory
from finetune.units import fmt_bytes
from tests.support import tiny_recipe, write_recipe

GiB = 1024**3


def _recipe(tmp: Path, strategy: str, nproc: int, name: str = "r") -> Path:
    r = tiny_recipe(
        tmp / name,
        data={"eval": None},
        train={"max_steps": 2, "global_batch_size": 4, "micro_batch_size": 2},
        distributed={"strategy": strategy, "nproc": nproc},
    )
    return write_recipe(tmp / f"{name}.yaml", r)


@pytest.mark.slow  # a CLI subprocess
def test_run_over_host_memory_is_refused_in_one_sentence_before_any_process(tmp_path: Path) -> None:
    """ddp on 2 CPU processes holds the whole model, its gradients and AdamW's state in each: 2 x (416 MiB per
    process + the step's memory) while training, over a node given 512 MiB. The sentence carries the plan's own
    figure."""
    from finetune.plan.flowchart import plan_for_run

    recipe = _recipe(tmp_path, "ddp", 2)
    plan = plan_for_run(prepare(str(recipe), []), nproc=2, nnodes=1, device="cpu")
    need = plan.job["host_training_per_node"]
    assert need == plan.job["host_peak_per_node"] == 2 * (HOST_PER_PROCESS_CPU + plan.chosen.memory.total)
    assert 2 * HOST_PER_PROCESS_CPU + 64 * 2**20 < need < 2 * HOST_PER_PROCESS_CPU + 128 * 2**20
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "run", str(recipe), "--host-memory", "512MiB"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: host memory: full under ddp with 2 process(es) per node needs {fmt_bytes(need)} of host memory per "
        f"node (training) but this node has {fmt_bytes(512 * 2**20)} (--host-memory); use more nodes (--nnodes) "
        "with fewer processes "
        "each, or distributed.strategy: fsdp (each process holds its shard of the model), or method: lora or "
        "qlora (a frozen 16- or 4-bit base; checkpoints hold the adapters only), or pass --ignore-host-memory "
        "to run anyway"
    ]
    # Refused by the launcher: no worker ran (it would say `rank N failed`), nothing was written.
    assert "rank" not in proc.stderr and not (tmp_path / "r").exists()


def test_fsdp_names_its_own_remedies(tmp_path: Path) -> None:
    """Under fsdp the model is already sharded: the sentence does not suggest fsdp again."""
    from finetune.errors import UserError
    from finetune.plan.flowchart import plan_for_run

    recipe = _recipe(tmp_path, "fsdp", 2)
    need = plan_for_run(prepare(str(recipe), []), nproc=2, nnodes=1, device="cpu").job["host_peak_per_node"]
    with pytest.raises(UserError) as err:
        launch(str(recipe), [], LaunchOptions(host_memory="512MiB"))
    msg = str(err.value)
    assert msg.startswith(f"host memory: full under fsdp with 2 process(es) per node needs {fmt_bytes(need)}")
    assert f"(training) but this node has {fmt_bytes(512 * 2**20)} (--host-memory)" in msg
    assert "strategy: fsdp" not in msg and "method: lora or qlora" in msg and "--ignore-host-memory" in msg
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # two trainings
def test_run_under_host_memory_or_told_to_ignore_it_runs(tmp_path: Path) -> None:
    """The same check passes under a large enough --host-memory, and --ignore-host-memory runs a job over a
    tiny limit. (Every other run of the suite passes it under this machine's MemAvailable.)"""
    assert launch(str(_recipe(tmp_path, "single", 1, "big")), [], LaunchOptions(host_memory="64GiB")) == 0
    opts = LaunchOptions(host_memory="1GiB", ignore_host_memory=True)
    assert launch(str(_recipe(tmp_path, "single", 1, "forced")), [], opts) == 0
    for name in ("big", "forced"):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "loss" in r] == [1, 2]


def test_available_host_memory_is_the_kernels_memavailable() -> None:
    """MemAvailable (kB in /proc/meminfo), within what the machine has."""
    import psutil

    kib = next(
        int(ln.split()[1])
        for ln in Path("/proc/meminfo").read_text().splitlines()
        if ln.startswith("MemAvailable:")
    )
    assert abs(available_host_memory() - kib * 1024) < 256 * 2**20  # read a moment apart
    assert 0 < available_host_memory() <= psutil.virtual_memory().total
