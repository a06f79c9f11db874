"""An out-of-memory error from a library (NCCL's, as torch raises it) in the middle of a real run ends it like
torch's own: the one-sentence message with the phase, the step, what failed and what to run instead; exit 3, no
traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.train.runtime.preflight import OOM_EXIT
from tests.support import clean_env, finetune_run, tiny_recipe, write_recipe

HOOKS = Path(__file__).resolve().parent / "oom_hooks.py"


@pytest.mark.slow
def test_an_nccl_allocation_failure_gives_the_out_of_memory_sentence(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path / "run", eval={"at_start": False}, train={"max_steps": 3})
    recipe["data"].pop("eval")
    env = clean_env(
        FINETUNE_HOOKS=f"{HOOKS}:RaiseOOM", FINETUNE_TEST_OOM_AT_STEP="2", FINETUNE_TEST_OOM_KIND="nccl",
        OMP_NUM_THREADS="1", COLUMNS="1000",
    )
    proc = finetune_run(write_recipe(tmp_path / "r.yaml", recipe), env=env)
    assert proc.returncode == OOM_EXIT, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())
    assert "rank 0 ran out of memory in the forward phase of step 2 (an allocation of 6.0 MiB in NCCL):" in err, err
    assert "the plan predicted" in err and "finetune run" in err, err
