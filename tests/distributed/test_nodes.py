"""Several nodes, one run: node 0's plan is the run's, and nodes that disagree (recipe, package versions, model
config, data files, output.dir) stop at once, in one sentence on every rank.

Two launchers (``--nnodes 2 --nproc 1``) on 127.0.0.1 stand for two nodes; the agreement itself is also
checked on a real 2-process gloo group where each rank brings a different plan, inputs and versions, sent as JSON.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from finetune.commands.run import rendezvous_id
from finetune.train.parallel.nodes import agree_with_node0, run_fingerprint
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

    from finetune.train.parallel import nodes
    from finetune.train.parallel.distributed import DistContext, all_gather_json

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", GROUP_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = DistContext.from_env()
    recipe = {"train": {"lr": 1e-3}, "output": {"dir": f"/out-{rank}"}}
    plan = {"chosen": {"micro_batch_size": 4 if rank == 0 else 8}}  # node 1 saw more memory
    inputs = {"the model's config.json": "ab" * 32, "the data file /d/train.jsonl (data.train)": "cd" * 32}
    try:
        results[rank] = agree_with_node0(recipe, plan, ctx, inputs)
        results[f"json-{rank}"] = all_gather_json({"rank": rank, "pair": (rank, "x")})  # parsed JSON, not objects
        bad = {"train": {"lr": 1e-3 if rank == 0 else 3e-3}}
        copied = {**inputs, "the data file /d/train.jsonl (data.train)": "cd" * 32 if rank == 0 else "ef" * 32}
        for case, args in (("recipe", (bad, plan, ctx, inputs)), ("inputs", (recipe, plan, ctx, copied))):
            try:
                agree_with_node0(*args)
            except Exception as err:
                results[f"{case}-{rank}"] = str(err)
        if rank == 1:  # another torch on node 1
            versions = nodes.package_versions()
            nodes.package_versions = lambda: {**versions, "torch": "2.0.0"}
        try:
            agree_with_node0(recipe, plan, ctx, inputs)
        except Exception as err:
            results[f"versions-{rank}"] = str(err)
    finally:
        dist.barrier()
        ctx.close()


def test_every_rank_runs_node_0s_plan_and_a_differing_recipe_stops_every_rank() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_agree, args=(free_port(), results), nprocs=2, start_method="spawn")
        results = dict(results)
    assert results[0] == results[1] == {"chosen": {"micro_batch_size": 4}}
    assert results["json-0"] == results["json-1"] == [{"rank": 0, "pair": [0, "x"]}, {"rank": 1, "pair": [1, "x"]}]
    message = (
        "node 1's recipe differs from node 0's in train.lr (0.001 on node 0, 0.003 on node 1): start every node "
        "with the same recipe and --set overrides (only output.* and hardware.* may differ)"
    )
    assert results["recipe-0"] == results["recipe-1"] == message
    assert results["inputs-0"] == results["inputs-1"] == (
        "node 1's inputs differ from node 0's: the data file /d/train.jsonl (data.train) (cdcdcdcdcdcd... on node 0, "
        "efefefefefef... on node 1); give every node the same model and data files (a shared filesystem, or copies)"
    )
    from importlib.metadata import version

    assert results["versions-0"] == results["versions-1"] == (
        f"node 1's package versions differ from node 0's: torch ({version('torch')} on node 0, 2.0.0 on node 1); "
        "install the same versions on every node"
    )


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


def test_nodes_train_on_one_output_dir_and_differing_in_it_or_in_lr_stop_in_seconds(tmp_path: Path) -> None:
    """One shared output.dir (spelled differently on each node: per-node sections may differ) trains; two
    directories that are not one, or another lr, stop every node in one sentence before training."""
    (tmp_path / "shared").mkdir()
    os.symlink(tmp_path / "shared", tmp_path / "mounted-elsewhere")
    recipes = []
    for k, out in enumerate(("shared", "mounted-elsewhere")):
        r = parity_recipe(TINY_MODEL, tmp_path / out, "full", "ddp")
        r["train"]["max_steps"] = 2
        recipes.append(write_recipe(tmp_path / f"node{k}.yaml", r))
    nodes, outputs, _ = _two_nodes(recipes)
    for p, (o, e) in zip(nodes, outputs, strict=True):
        assert p.returncode == 0, o[-2000:] + e[-4000:]
    assert len(step_rows(tmp_path / "shared")) == 2  # rank 0 (node 0) writes the outputs
    assert not list((tmp_path / "shared").glob(".finetune-node-check-*"))  # the token is gone

    apart = []
    for k in (0, 1):
        r = parity_recipe(TINY_MODEL, tmp_path / f"apart-{k}", "full", "ddp")
        apart.append(write_recipe(tmp_path / f"apart{k}.yaml", r))
    nodes, outputs, seconds = _two_nodes(apart)
    assert seconds < 90, seconds
    for p, (_, e) in zip(nodes, outputs, strict=True):
        errors = [ln for ln in e.splitlines() if ln.startswith("error:")]
        assert p.returncode == 2, e[-3000:]
        assert len(errors) == 1 and "do" in errors[0] and (
            "not see the file rank 0 wrote into" in errors[0] and "on several nodes output.dir must be one directory on "
            "a filesystem every node shares: give every node that shared path" in errors[0]
        ), e[-3000:]
    assert not (tmp_path / "apart-1" / "checkpoints").exists() and not (tmp_path / "apart-0" / "checkpoints").exists()

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
