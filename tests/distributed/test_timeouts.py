"""The process groups' timeouts: ``distributed.timeout`` reaches the training group, and the phases where one
rank works alone (here: rank 0 finishing a checkpoint, local rank 0 tokenizing the data) wait in the gloo wait
group, so that they may last longer than the training group's timeout without stopping the run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.fault_hooks import CHECKPOINT_SLEEP, TOKENIZE_LOG, TOKENIZE_SLEEP
from tests.support import (
    TINY_MODEL,
    clean_env,
    finetune_run,
    free_port,
    parity_recipe,
    step_rows,
    write_recipe,
)

pytestmark = pytest.mark.dist


def _timeouts(rank: int, port: int, results: dict) -> None:
    import torch
    import torch.distributed as dist

    from finetune.train.parallel import distributed as d

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    ctx = d.DistContext.from_env(timeout=7, wait_timeout=95)
    try:
        cpu = torch.device("cpu")
        main = dist.distributed_c10d._get_default_group()._get_backend(cpu)
        wait = d.wait_group()._get_backend(cpu)
        results[rank] = (main.options._timeout.total_seconds(), wait.options._timeout.total_seconds(),
                         d.wait_broadcast(f"from rank {rank}"))
        ctx.wait_barrier()
    finally:
        ctx.close()
    results[f"closed-{rank}"] = d.wait_group() is None and not dist.is_initialized()


def test_the_timeouts_reach_both_process_groups() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_timeouts, args=(free_port(), results), nprocs=2, start_method="spawn")
        results = dict(results)
    assert results[0] == results[1] == (7.0, 95.0, "from rank 0")
    assert results["closed-0"] and results["closed-1"]


def test_rank_0_finishing_a_checkpoint_longer_than_the_timeout_does_not_stop_the_run(tmp_path: Path) -> None:
    """Rank 0 stalls 30 s in the checkpoint of step 2 (tensors written, meta.json not yet), where rank 1 waits
    for it; the training group's timeout is 20 s (a collective of the training group waiting that long fails
    with gloo's "Timed out waiting 20000ms"). Waiting in the wait group instead, the run finishes."""
    recipe = parity_recipe(TINY_MODEL, tmp_path / "out", "full", "ddp")
    recipe["train"]["max_steps"] = 2
    recipe["output"]["save_every"] = 2
    path = write_recipe(tmp_path / "recipe.yaml", recipe)
    env = clean_env(OMP_NUM_THREADS="1", **{CHECKPOINT_SLEEP: "2:30"})
    proc = finetune_run(path, "--nproc", "2", "--set", "distributed.timeout=20", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert [r["step"] for r in step_rows(tmp_path / "out")] == [1, 2]
    assert (tmp_path / "out" / "checkpoints" / "step-2" / "meta.json").is_file()


def test_local_rank_0_tokenizing_longer_than_the_timeout_does_not_stop_the_run(tmp_path: Path) -> None:
    """Local rank 0 takes 30 s to tokenize (a fresh cache), the training group's timeout is 15 s: rank 1 waits for
    it in the wait group, then reads the tokens back from the cache, and both train."""
    recipe = parity_recipe(TINY_MODEL, tmp_path / "out", "full", "ddp")
    recipe["train"]["max_steps"] = 2
    recipe["data"]["cache_dir"] = str(tmp_path / "cache")
    path = write_recipe(tmp_path / "recipe.yaml", recipe)
    log = tmp_path / "tokenized.log"
    env = clean_env(OMP_NUM_THREADS="1", **{TOKENIZE_SLEEP: "30", TOKENIZE_LOG: str(log)})
    started = time.monotonic()
    proc = finetune_run(path, "--nproc", "2", "--set", "distributed.timeout=15", env=env)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert took > 30
    assert log.read_text() == f"0 {recipe['data']['train']}\n"  # rank 0 tokenized; rank 1 read its cache back
    assert [r["step"] for r in step_rows(tmp_path / "out")] == [1, 2]
