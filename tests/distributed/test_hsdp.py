"""HSDP through the real CLI: two launchers on 127.0.0.1 (``--nnodes 2 --nproc 2``) stand for two nodes of two
processes; the run shards inside each "node" and replicates across them on a (2, 2) ("dp_replicate", "dp_shard")
mesh. Its losses, gradient norms and saved weights equal one process's (fp32, the same global batch), and
its step-4 checkpoint (DCP, written from the 2-D mesh) resumes in one process to the same steps 5-8."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.commands.run import LaunchOptions, launch
from tests.support import (
    LOSS_RTOL,
    WEIGHT_ATOL,
    clean_env,
    free_port,
    max_rel,
    max_weight_diff,
    micro_model_dir,
    parity_recipe,
    step_rows,
    write_recipe,
)

pytestmark = pytest.mark.dist

STEPS = 8


def _recipe(model: Path, out: Path, strategy: str) -> dict:
    r = parity_recipe(model, out, "full", strategy)
    r["train"]["max_steps"] = STEPS
    r["output"]["save_every"] = 4
    return r


def test_hsdp_on_two_nodes_of_two_processes_matches_one_process(tmp_path: Path) -> None:
    model = micro_model_dir(
        tmp_path / "micro", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32,
    )
    single = tmp_path / "single"
    assert launch(str(write_recipe(tmp_path / "single.yaml", _recipe(model, single, "single"))), [],
                  LaunchOptions(nproc=1)) == 0

    hsdp = tmp_path / "hsdp"
    recipe = write_recipe(tmp_path / "hsdp.yaml", _recipe(model, hsdp, "hsdp"))
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "finetune", "run", str(recipe), "--nnodes", "2", "--nproc", "2",
             "--rdzv-endpoint", endpoint, "--node-rank", str(k)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(OMP_NUM_THREADS="1"),
        )
        for k in (0, 1)
    ]
    outputs = [p.communicate(timeout=600) for p in nodes]
    for p, (o, e) in zip(nodes, outputs, strict=True):
        assert p.returncode == 0, o[-2000:] + e[-4000:]

    plan = json.loads((hsdp / "plan.json").read_text())
    assert (plan["chosen"]["strategy"], plan["chosen"]["nproc"], plan["chosen"]["nnodes"]) == ("hsdp", 2, 2)
    assert (plan["execution"]["nodes"], plan["chosen"]["grad_accum_steps"]) == (2, 1)
    got, want = step_rows(hsdp), step_rows(single)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert max_rel([r["loss"] for r in got], [r["loss"] for r in want]) <= LOSS_RTOL
    assert max_rel([r["grad_norm"] for r in got], [r["grad_norm"] for r in want]) <= LOSS_RTOL
    assert got[-1]["loss"] < 0.9 * got[0]["loss"]  # it learned: parity of a run that learns nothing proves little
    assert max_weight_diff(hsdp / "model.safetensors", single / "model.safetensors") <= WEIGHT_ATOL

    # the checkpoint of step 4, written by 4 ranks of which each pair holds one replica, read by one process
    resumed = tmp_path / "resumed"
    shutil.copytree(hsdp, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step-{STEPS}")
    (resumed / "model.safetensors").unlink()
    again = write_recipe(tmp_path / "resumed.yaml", _recipe(model, resumed, "single"))
    assert launch(str(again), [], LaunchOptions(nproc=1, resume="latest")) == 0
    rows = step_rows(resumed)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert max_rel([r["loss"] for r in rows[4:]], [r["loss"] for r in want[4:]]) <= LOSS_RTOL
    assert max_weight_diff(resumed / "model.safetensors", single / "model.safetensors") <= WEIGHT_ATOL
