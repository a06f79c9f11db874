"""FSDP2 under gradient accumulation: every micro-batch's gradients are reduce-scattered into the sharded ones
(ExecSpec.sync_every_micro_batch), and the plan counts exactly that."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from finetune.spec import execution_spec
from tests.support import ROOT


def test_fsdp2_reduces_every_micro_batch_and_the_others_the_last() -> None:
    """The execution spec's decision, read by the trainer's accumulation loop and the planner alike: FSDP2's
    strategies reduce-scatter every micro-batch; DDP and ZeRO-1 all-reduce on the last; a pipeline's stages are
    the schedule's (it turns FSDP2's sync off until the last micro-batch)."""
    def every(strategy: str, **kw: object) -> bool:
        return execution_spec("full", strategy, "bf16", checkpointing=False, world_size=4, **kw).sync_every_micro_batch

    assert every("zero2") and every("fsdp") and every("hsdp", nodes=2)
    assert not every("ddp") and not every("zero1")
    assert not every("fsdp", pp=2, pp_layers=(1, 1))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", ["llama-26m full fp32 fsdp x2 accum4", "llama-26m full fp32 zero2 x2 accum4"])
def test_accumulation_rows_match_the_measured_peak(name: str) -> None:
    """scripts/plan_accuracy.py's accumulation rows (26.4M parameters, fp32, 2 processes, accumulation 4): the
    real run's peak (MemTracker, rank 0) against the planner's prediction, within 5%."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import plan_accuracy
    finally:
        sys.path.pop(0)
    _, arch, change, nproc = next(c for c in plan_accuracy.CONFIGS if c[0] == name)
    with tempfile.TemporaryDirectory() as tmp:
        r = plan_accuracy.run_one(name, arch, change, nproc, Path(tmp))
    assert "predicted" in r, r
    assert r["chosen"]["grad_accum_steps"] == 4, r["chosen"]
    assert abs(r["error"]) <= 0.05, r
