"""memory.json and the plan-versus-measured line from every rank's figures: the worst rank is the one compared,
and on CUDA the plan's two overhead terms stand beside what was measured beyond the tensors."""

from __future__ import annotations

import pytest

from finetune.plan.memory import CUDA_CONTEXT_BYTES, overhead_parts
from finetune.plan.types import MemoryBreakdown
from finetune.train.metrics.memory import memory_report, summary_line

GiB, MiB = 2**30, 2**20
# 10 GiB of tensors, 5% allocator slack, the CUDA context term
PLAN = MemoryBreakdown(params=4 * GiB, grads=2 * GiB, optimizer=2 * GiB, activations=2 * GiB,
                       overhead=CUDA_CONTEXT_BYTES + GiB // 2)


def _cuda(rank: int, allocated: int, reserved: int, used: int) -> dict:
    return {"rank": rank, "measured_peak": allocated, "by_category": {"peak": allocated}, "reserved_peak": reserved,
            "device_used_peak": used, "device_total": 80 * GiB}


def test_the_worst_rank_is_compared_and_every_rank_is_kept() -> None:
    ranks = [_cuda(0, 9 * GiB, 9 * GiB + 300 * MiB, 10 * GiB + 300 * MiB),
             _cuda(1, 10 * GiB, 10 * GiB + 512 * MiB, 12 * GiB)]
    rep = memory_report("cuda", PLAN, ranks, 2)
    assert (rep["worst_rank"], rep["measured_peak"]) == (1, 10 * GiB)
    assert rep["error"] == 0.0  # the plan's 10 GiB of tensors against rank 1's, not rank 0's 9 GiB
    assert [r["rank"] for r in rep["ranks"]] == [0, 1] and rep["ranks"][0]["measured_peak"] == 9 * GiB
    assert rep["overhead"] == {
        "predicted": PLAN.overhead, "predicted_allocator_slack": GiB // 2,
        "predicted_outside_allocator": CUDA_CONTEXT_BYTES,
        "measured": 2 * GiB, "measured_allocator_slack": 512 * MiB, "measured_outside_allocator": 1536 * MiB,
    }
    assert rep["error_with_overhead"] == pytest.approx((PLAN.total - 12 * GiB) / (12 * GiB))
    assert summary_line(rep) == (
        "memory: predicted 10.0 GiB, measured 10.0 GiB on rank 1, the most of 2 ranks (+0.0% off); overhead "
        "predicted 1.2 GiB (allocator slack 512.0 MiB + outside the allocator 768.0 MiB), measured 2.0 GiB "
        "(reserved beyond allocated 512.0 MiB + device beyond reserved 1.5 GiB)"
    )


def test_one_cpu_process_reports_its_tensors_alone() -> None:
    cpu_plan = MemoryBreakdown(params=60 * MiB, activations=40 * MiB)
    rep = memory_report("cpu", cpu_plan, [{"rank": 0, "measured_peak": 80 * MiB, "by_category": {}}], 2)
    assert "overhead" not in rep and rep["worst_rank"] == 0
    assert summary_line(rep) == "memory: predicted 100.0 MiB, measured 80.0 MiB (+25.0% off)"


def test_the_overhead_splits_into_its_two_terms() -> None:
    """The allocator's slack is FRAGMENTATION of the tensors; the rest (the CUDA context, NCCL's buffers) lies
    outside the allocator."""
    assert overhead_parts(0, 10 * GiB) == (0, 0)  # off CUDA
    assert overhead_parts(CUDA_CONTEXT_BYTES + 1500 * MiB + GiB // 2, 10 * GiB) == (GiB // 2, CUDA_CONTEXT_BYTES + 1500 * MiB)


def test_a_phase_compares_the_worst_rank_and_each_node_s_host_memory() -> None:
    """A checkpoint's save on 2 nodes of 2 ranks: the plan's tensors against the rank that peaked highest, and
    the plan's host memory per node against the node whose ranks' host peaks sum highest."""
    from finetune.train.metrics.memory import phase_line, phase_report

    ranks = [
        {"rank": r, "measured_peak": peak, "by_category": {}, "host_peak": host}
        for r, peak, host in ((0, 8 * GiB, 3 * GiB), (1, 9 * GiB, 3 * GiB), (2, 7 * GiB, 5 * GiB), (3, 7 * GiB, 4 * GiB))
    ]
    rep = phase_report(9 * GiB + 9 * GiB // 10, ranks, host_predicted_per_node=8 * GiB, processes_per_node=2)
    assert (rep["worst_rank"], rep["measured_peak"]) == (1, 9 * GiB) and rep["error"] == pytest.approx(0.1)
    assert rep["host"] == {"predicted_per_node": 8 * GiB, "measured_per_node": 9 * GiB, "node": 1,
                           "error": pytest.approx(-1 / 9)}
    assert phase_line("checkpoint", rep) == (
        "memory, checkpoint: predicted 9.9 GiB, measured 9.0 GiB on rank 1 (+10.0% off); host memory per node "
        "predicted 8.0 GiB, measured 9.0 GiB (-11.1% off)"
    )
    # without a host sample (or a host figure) there is no host comparison
    assert "host" not in phase_report(GiB, [{"rank": 0, "measured_peak": GiB}], host_predicted_per_node=GiB)
