"""SLURM jobs on one machine, against one node with 2 processes (the reference, shared).

Two nodes: each launcher is given only SLURM's environment and `--nproc 1`; they must find each other (the node
list's first host, the port derived from the job id), take their node ranks from SLURM_NODEID, and train what
the reference trains: the same losses within 1e-4. A warning before the time limit: SIGUSR1 to the launcher
(the task SLURM started) reaches both workers through torchrun's agent, which save one checkpoint and exit 138;
the requeued job (SLURM_RESTART_COUNT=1) resumes and ends with the reference's losses.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.train.runtime.slurm import job_port
from tests.support import (
    LOSS_RTOL,
    TINY_MODEL,
    clean_env,
    finetune_run,
    max_rel,
    parity_recipe,
    step_rows,
    write_recipe,
)

pytestmark = pytest.mark.dist

STEPS = 3


def _free_job_id() -> int:
    """A job id whose rendezvous port is free on this machine now."""
    for job in range(4100, 19000, 37):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", job_port(job)))
            except OSError:
                continue
            return job
    raise AssertionError("no free port in the rendezvous range")


def _recipe(tmp: Path, name: str) -> Path:
    r = parity_recipe(TINY_MODEL, tmp / name, "full", "ddp")
    r["train"]["max_steps"] = STEPS
    return write_recipe(tmp / f"{name}.yaml", r)


def _slurm(job: int, nnodes: int, node: int, **extra: str) -> dict[str, str]:
    return clean_env(
        OMP_NUM_THREADS="1", SLURM_JOB_ID=str(job), SLURM_NNODES=str(nnodes), SLURM_NODEID=str(node),
        SLURM_PROCID=str(node), SLURM_NTASKS=str(nnodes), SLURM_JOB_NODELIST="localhost", **extra,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """One node, 2 processes, given by flags: its per-step losses."""
    tmp = tmp_path_factory.mktemp("one-node")
    one_node = finetune_run(_recipe(tmp, "one-node"), "--nproc", "2", env=clean_env(OMP_NUM_THREADS="1"))
    assert one_node.returncode == 0, one_node.stdout[-2000:] + one_node.stderr[-3000:]
    return [r["loss"] for r in step_rows(tmp / "one-node")]


def test_two_slurm_tasks_rendezvous_and_train_as_one_node_with_two_processes(
    reference: list[float], tmp_path: Path
) -> None:
    job, recipe = _free_job_id(), _recipe(tmp_path, "nodes")  # one output.dir, as nodes share a filesystem
    nodes = []
    for k in (0, 1):
        env = _slurm(job, 2, k, SLURM_GPUS_ON_NODE="1")
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "finetune", "run", str(recipe), "--nproc", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        ))
    outputs = [p.communicate(timeout=300) for p in nodes]
    for p, (o, e) in zip(nodes, outputs, strict=True):
        assert p.returncode == 0, o[-2000:] + e[-4000:]
    assert outputs[0][0].startswith("finetune full | ddp x2 | fp32 | micro-batch 2 x accumulation 2 x 2 process(es)")

    slurm = [r["loss"] for r in step_rows(tmp_path / "nodes")]
    assert len(reference) == len(slurm) == STEPS
    assert max_rel(slurm, reference) < LOSS_RTOL, (slurm, reference)
    print(f"losses: SLURM 2 nodes x 1 {slurm}, one node x 2 {reference}")


def test_sigusr1_to_the_launcher_saves_on_both_ranks_and_the_requeue_resumes(
    reference: list[float], tmp_path: Path
) -> None:
    recipe, out = _recipe(tmp_path, "job"), tmp_path / "job"
    env = _slurm(_free_job_id(), 1, 0, FINETUNE_TEST_STEP_SLEEP="1")
    warned = subprocess.Popen(
        [sys.executable, "-m", "finetune", "run", str(recipe), "--nproc", "2", "--resume", "auto"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    metrics, end = out / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert warned.poll() is None and time.monotonic() < end, warned.communicate()
        time.sleep(0.05)
    warned.send_signal(signal.SIGUSR1)  # what SLURM sends the task ahead of the time limit
    stdout, stderr = warned.communicate(timeout=300)
    assert warned.returncode == 138, stdout[-2000:] + stderr[-3000:]
    assert "SIGUSR1 received: finishing this step and saving a checkpoint" in stdout
    saved = json.loads(next((out / "checkpoints").glob("step-*/meta.json")).read_text())
    assert 1 <= saved["step"] < STEPS and saved["saved_by"] == {"world_size": 2}

    requeued = finetune_run(recipe, "--nproc", "2", "--resume", "auto", env={**env, "SLURM_RESTART_COUNT": "1",
                                                                             "FINETUNE_TEST_STEP_SLEEP": "0"})
    assert requeued.returncode == 0, requeued.stdout[-2000:] + requeued.stderr[-3000:]
    assert f"at step {saved['step']} of {STEPS}" in requeued.stdout
    losses = [r["loss"] for r in step_rows(out)]
    assert len(losses) == STEPS and max_rel(losses, reference) < LOSS_RTOL, (losses, reference)
