"""HSDP in the planner: model states sharded over the GPUs of one node, communication split into the part
inside a node and the part across nodes (each over its own link), and the walk choosing it on several nodes
where it fits and is predicted faster."""

from __future__ import annotations

import io

import pytest
from transformers import AutoConfig

from finetune.errors import UserError
from finetune.plan.candidates import evaluate
from finetune.plan.flowchart import make_plan
from finetune.plan.hardware import NCCL_COMMUNICATOR_BYTES, Hardware
from finetune.plan.request import Request
from finetune.plan.setting import settle
from finetune.plan.types import Config, Status
from finetune.recipe.locate import resolve_model_config
from tests.support import TINY_MODEL

N_8B = 8_030_261_248  # Llama 3.1 8B's parameters (test_plan_shapes checks the catalog's count)
ROOT_8B = 2 * 128_256 * 4096 + 4096  # its root unit: embeddings, untied head, final norm


def two_nodes(memory: int, gpus: int = 8, nodes: int = 2, nccl: dict[str, int] | None = None) -> Hardware:
    """``nodes`` nodes of ``gpus`` H100s, NVLink inside a node, InfiniBand (50 GB/s per GPU) between them
    (``nccl``: NCCL's buffers per communicator, when not the planner's)."""
    found = Hardware("cuda", gpus, nodes, int(memory), True, "h100", "infiniband", 50e9, True, gpu_type="h100")
    if nccl is not None:
        found.nccl_communicator_bytes = nccl
    return found


def test_llama_8b_full_hsdp_on_2_nodes_of_8_gpus_as_computed_by_hand() -> None:
    cfg, src = resolve_model_config("llama-3.1-8b")
    s = settle(Request(config=cfg, source=src, method="full", precision="bf16", seq_len=1024,
                       global_batch_size=64, micro_batch_size=1), two_nodes(10**15))
    hsdp = evaluate(s, Config("full", "hsdp", 1, False), traced=frozenset())  # model states (activations not traced)
    fsdp = evaluate(s, Config("full", "fsdp", 1, False), traced=frozenset())
    assert hsdp.status is Status.NOT_TRACED
    # fp32 master weights and AdamW's two fp32 moments, split over the 8 GPUs of a node (fsdp: all 16)
    assert hsdp.memory.params == -(-4 * N_8B // 8) == 4_015_130_624
    assert hsdp.memory.optimizer == -(-8 * N_8B // 8) == N_8B
    assert fsdp.memory.params == -(-4 * N_8B // 16)
    # across nodes: the ring all-reduce of each GPU's fp32 gradient shard with its replica on the other node,
    # 2 (R - 1) / R x 4 N / 8 bytes
    assert hsdp.comm_inter_node_bytes_per_step == 4 * N_8B // 8 == 4_015_130_624
    # inside a node, in each of the step's 4 micro-batches (64 rows over 16 GPUs at micro-batch 1): the
    # reduce-scatter of the fp32 gradients (4 N) and the bf16 all-gathers of every unit for forward and again for
    # backward, the root once (2 x 2 N - 2 x root), each ring moving 7/8 of it
    gathers = 2 * 2 * N_8B - 2 * ROOT_8B
    assert hsdp.grad_accum_steps == 4
    assert hsdp.comm_intra_node_bytes_per_step == 4 * (7 * (4 * N_8B + gathers) // 8) == 217_492_574_208
    assert hsdp.comm_bytes_per_step == 217_492_574_208 + 4_015_130_624
    assert hsdp.comm_intra_node_seconds_per_step == pytest.approx(217_492_574_208 / 300e9)  # NVLink
    assert hsdp.comm_inter_node_seconds_per_step == pytest.approx(4_015_130_624 / 50e9)  # InfiniBand
    assert hsdp.comm_seconds_per_step == pytest.approx(217_492_574_208 / 300e9 + 4_015_130_624 / 50e9)
    # flat FSDP's rings span both nodes: all of its bytes cross the network
    assert (fsdp.comm_intra_node_bytes_per_step, fsdp.comm_inter_node_bytes_per_step) == (0, fsdp.comm_bytes_per_step)
    assert fsdp.comm_seconds_per_step == pytest.approx(fsdp.comm_bytes_per_step / 50e9)
    assert hsdp.time is not None and fsdp.time is not None and hsdp.time.communication < fsdp.time.communication


CFG = AutoConfig.from_pretrained(TINY_MODEL)


def tiny(**kw: object) -> Request:
    base: dict = dict(config=CFG, source="tiny", method="full", seq_len=128, packed=True, global_batch_size=16)
    base.update(kw)
    return Request(**base)


def test_the_walk_chooses_hsdp_on_two_nodes_when_it_fits_and_is_faster() -> None:
    """Memory between HSDP's need and ZeRO-2's: DDP and ZeRO-2 do not fit, FSDP does, and HSDP (more per GPU
    than FSDP, less than ZeRO-2) fits too and is predicted faster: the walk takes it, and says why. NCCL's
    buffers (hsdp's two communicators beside the training group, more than the tiny model's states) are set
    aside: the choice on the tensors is what is tested (test_plan_runtime_overhead.py counts them)."""
    no_nccl = dict.fromkeys(NCCL_COMMUNICATOR_BYTES, 0)
    s = settle(tiny(), two_nodes(10**15, nccl=no_nccl))
    total = {st: evaluate(s, Config("full", st, 1, False)).memory.total for st in ("zero2", "fsdp", "hsdp")}
    assert total["fsdp"] < total["hsdp"] < total["zero2"]
    plan = make_plan(tiny(), two_nodes((total["hsdp"] + total["zero2"]) // 2, nccl=no_nccl))
    c = plan.chosen
    assert (c.strategy, c.nnodes, c.nproc) == ("hsdp", 2, 8)
    assert plan.execution is not None and (plan.execution.nodes, plan.execution.shard_ranks) == (2, 8)
    faster = next(x for x in plan.walk if x.startswith("HSDP and FSDP both fit"))
    assert "HSDP is predicted faster" in faster
    said = next(x for x in plan.walk if x.startswith("HSDP (full fine-tuning) shards over the 8 GPUs"))
    assert "over nvlink" in said and "over infiniband" in said
    # the JSON keeps every key it had and adds the split
    row = plan.to_dict()["chosen"]
    assert {"comm_bytes_per_step", "comm_seconds_per_step", "memory", "strategy", "nnodes"} <= row.keys()
    assert row["comm_inter_node_bytes_per_step"] + row["comm_intra_node_bytes_per_step"] == row["comm_bytes_per_step"]

    from rich.console import Console

    from finetune.plan.render import print_plan

    out = io.StringIO()
    print_plan(plan, Console(file=out, width=250))
    assert any(line.split("│")[2].strip() == "hsdp" and "x-node" in line for line in out.getvalue().splitlines()
               if line.count("│") > 3)


def test_hsdp_is_no_candidate_on_one_node_and_refused_when_pinned() -> None:
    plan = make_plan(tiny(), two_nodes(10**12, nodes=1))
    assert "hsdp" not in {str(c.strategy) for c in plan.candidates}
    with pytest.raises(UserError) as err:
        make_plan(tiny(strategy="hsdp"), two_nodes(10**12, nodes=1))
    assert str(err.value) == (
        "distributed.strategy: hsdp shards inside each node and replicates across nodes, but this run has one node; "
        "use fsdp (it shards over every process of the node), or run on 2 or more nodes (--nnodes)"
    )
