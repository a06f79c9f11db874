"""`finetune plan` plans the whole job: the load peak per GPU, host memory per node while loading, saving a
checkpoint and saving the final model, and the disk a checkpoint and the final model take, by the formulas of
finetune/plan/job.py; --host-memory marks a configuration over it as not fitting, with the reason in the walk."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from finetune.plan.job import HOST_PER_PROCESS

GiB = 1024**3


def _plan(*extra: str) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune",
            "plan",
            "--model",
            "llama-3.1-70b",
            "--method",
            "full",
            "--strategy",
            "fsdp",
            "--gpus",
            "8",
            "--nodes",
            "2",
            "--gpu-memory",
            "80GiB",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow  # a CLI subprocess
def test_llama_70b_fsdp_on_2x8_whole_job_follows_the_sharding() -> None:
    plan = _plan("--host-memory", "2TiB")
    job, n = plan["job"], plan["model"]["parameters"]
    p = 4 * n  # bf16 mixed precision: fp32 master weights
    largest = 4 * 128256 * 8192  # the embedding (and the untied head): vocabulary x hidden, fp32
    assert plan["model"]["param_bytes"] == p
    assert job["load_peak_per_gpu"] == p // 16 + largest  # 16 shards + one tensor being read
    assert job["host_loading_per_node"] == 8 * (HOST_PER_PROCESS + largest)
    assert job["host_checkpoint_per_node"] == 8 * (HOST_PER_PROCESS + largest // 16)
    assert job["host_final_save_per_node"] == 8 * HOST_PER_PROCESS + largest
    assert job["checkpoint_bytes"] == p + 8 * n + 64 * 1024  # weights + AdamW's two fp32 moments
    assert job["final_model_bytes"] == p
    assert 20 * GiB < job["load_peak_per_gpu"] < 21 * GiB and job["host_peak_per_node"] < 48 * GiB
    assert not any("host memory" in w for w in plan["walk"])

    small = _plan("--host-memory", "40GiB")
    assert small["chosen"]["fits"] is False
    assert any(
        "needs 47.3 GiB of host memory per node (loading) but a node has 40.0 GiB (--host-memory): it does not fit"
        in w
        for w in small["walk"]
    ), small["walk"]
