"""Several nodes, one run: node 0's plan is the run's, and nodes that disagree stop at once, in one sentence.

Two launchers (``--nnodes 2 --nproc 1``) on 127.0.0.1 stand for two nodes; the agreement itself is also
checked on a real 2-process gloo group where each rank brings a different plan.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from finetune.launch import rendezvous_id
from finetune.train.nodes import agree_with_node0, run_fingerprint
from tests.support import TINY_MODEL, clean_env, free_port, parity_recipe, step_rows, write_recipe

pytestmark = pytest.mark.dist


def test_rendezvous_id_depends_on_the_endpoint_not_the_recipe() -> None:
    """It was a hash of output.dir: two nodes whose recipes differed there waited 300 s for each other."""
    assert rendezvous_id("node0:29500") == rendezvous_id("node0:29500")
    assert rendezvous_id("node0:29500") != rendezvous_id("node0:29501")


def test_fingerprint_leaves_out_per_node_keys() -> None:
    a = {"train": {"lr": 1e-3, "seed": 0}, "output": {"dir": "/a"}, "hardware": {"gpus": 8}}
    b = {"train": {"lr": 1e-3, "seed": 0}, "output": {"dir": "/b"}, "hardware": {"gpus": 4}}
    assert run_fingerprint(a) == run_fingerprint(b) == {"train.lr": 1e-3, "train.seed": 0}


def _agree(rank: int, port: int, results: dict) -> None:
    import torch.distributed as dist

    from finetune.train.distributed import DistContext

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", GROUP_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = DistContext.from_env()
    recipe = {"train": {"lr": 1e-3}, "output": {"dir": f"/out-{rank}"}}
    plan = {"chosen": {"micro_batch_size": 4 if rank == 0 else 8}}  # node 1 saw more memory
    try:
        results[rank] = agree_with_node0(recipe, plan, ctx)
        bad = {"train": {"lr": 1e-3 if rank == 0 else 3e-3}}
        try:
            agree_with_node0(bad, plan, ctx)
        except Exception as err:
            results[f"error-{rank}"] = str(err)
    finally:
        dist.barrier()
        ctx.close()


def test_every_rank_runs_node_0s_plan_and_a_differing_recipe_stops_every_rank() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_agree, args=(free_port(), results), nprocs=2, start_method="spawn")
        results = dict(results)
    assert results[0] == results[1] == {"chosen": {"micro_batch_size": 4}}
    message = (
        "node 1's recipe differs from node 0's in train.lr (0.001 on node 0, 0.003 on node 1): start every node "
        "with the same recipe and --set overrides (only output.* and hardware.* may differ)"
    )
    assert results["error-0"] == results["error-1"] == message


def _two_nodes(recipes: list[Path]) -> tuple[list[subprocess.Popen], list[tuple[str, str]], float]:
    endpoint = f"127.0.0.1:{free_port()}"
    env = clean_env(OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "finetune", "run", str(r), "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint",
             endpoint, "--node-rank", str(k)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for k, r in enumerate(recipes)
    ]
    outputs = [p.communicate(timeout=300) for p in nodes]
    return nodes, outputs, time.monotonic() - t0


def test_nodes_differing_in_output_dir_train_and_in_lr_stop_in_seconds(tmp_path: Path) -> None:
    recipes = []
    for k in (0, 1):
        r = parity_recipe(TINY_MODEL, tmp_path / f"out-{k}", "full", "ddp")
        r["train"]["max_steps"] = 2
        recipes.append(write_recipe(tmp_path / f"node{k}.yaml", r))
    nodes, outputs, _ = _two_nodes(recipes)
    for p, (o, e) in zip(nodes, outputs, strict=True):
        assert p.returncode == 0, o[-2000:] + e[-4000:]
    assert len(step_rows(tmp_path / "out-0")) == 2  # rank 0 (node 0) writes the outputs

    r = parity_recipe(TINY_MODEL, tmp_path / "lr", "full", "ddp")
    r["train"]["lr"] = 1e-2
    recipes[1] = write_recipe(tmp_path / "node1-lr.yaml", r)
    recipes[0] = write_recipe(tmp_path / "node0-lr.yaml", parity_recipe(TINY_MODEL, tmp_path / "lr0", "full", "ddp"))
    nodes, outputs, seconds = _two_nodes(recipes)
    assert seconds < 60, seconds  # was: the 300 s join timeout, then a rendezvous error
    for p, (_, e) in zip(nodes, outputs, strict=True):
        errors = [ln for ln in e.splitlines() if ln.startswith("error:")]
        assert p.returncode == 2, e[-3000:]
        assert len(errors) == 1 and "node 1's recipe differs from node 0's in train.lr (0.003 on node 0, 0.01 on " \
            "node 1)" in errors[0], e[-3000:]
