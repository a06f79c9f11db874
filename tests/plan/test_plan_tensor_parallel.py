"""The planner's tensor parallelism: per-rank shapes, when the walk tries TP, its communication, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoConfig

from finetune.errors import UserError
from finetune.plan.candidates import evaluate
from finetune.plan.flowchart import make_plan
from finetune.plan.hardware import NCCL_COMMUNICATOR_BYTES, Hardware
from finetune.plan.request import Request
from finetune.plan.setting import Setting, settle
from finetune.plan.shapes import build_inventory
from finetune.plan.tensor_parallel import tp_config
from finetune.plan.types import Config
from finetune.recipe.schema import LoraConfig
from tests.support import ROOT, TINY_MODEL

CFG = AutoConfig.from_pretrained(TINY_MODEL)  # 4 heads, 2 KV heads, hidden 256, intermediate 688, 4 layers
LORA = LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"])


def hw(memory: int, per_node: int = 4, nodes: int = 2, nccl: dict[str, int] | None = None) -> Hardware:
    """``nodes`` nodes of ``per_node`` H100s (``nccl``: NCCL's buffers per communicator, when not the planner's)."""
    found = Hardware("cuda", per_node, nodes, int(memory), True, "h100", "infiniband", 50e9, True)
    if nccl is not None:
        found.nccl_communicator_bytes = nccl
    return found


def req(**kw) -> Request:
    base = dict(
        config=CFG,
        source="tiny",
        seq_len=2048,
        packed=True,
        global_batch_size=8,
        lora=LORA,
        method="full",
        checkpointing=False,
        tp="auto",
    )
    base.update(kw)
    return Request(**base)


def planner(r: Request, h: Hardware) -> Setting:
    return settle(r, h)


def test_one_tp_rank_holds_the_split_block_and_the_whole_rest() -> None:
    """tp 2: q/k/v/o and gate/up/down halve, norms, embeddings and the head do not (TP replicates them)."""
    whole, half = build_inventory(CFG, "tiny"), build_inventory(tp_config(CFG, 2), "tiny")
    by = {t.name: t.numel for t in half.base}
    full = {t.name: t.numel for t in whole.base}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        key = next(k for k in full if k.endswith(f"{name}.weight"))
        assert by[key] * 2 == full[key]
    for key in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        assert by[key] == full[key]
    linears = sum(v for k, v in full.items() if "proj" in k) * CFG.num_hidden_layers
    assert whole.n_params - half.n_params == linears // 2


def test_fsdp_alone_does_not_fit_but_tp_inside_the_node_does() -> None:
    """Long sequences, checkpointing pinned off: FSDP over 4 nodes x 2 GPUs cannot hold one sample's
    activations; TP 2 x FSDP halves the attention and MLP activations and fits. TP never crosses a node: the
    model's 4 heads and 4 KV heads would split 4 ways, but a node has 2 GPUs. NCCL's buffers (two communicators
    more under TP, a fixed cost the tiny model's activations cannot outweigh) are set aside: the choice on the
    tensors is what is tested (test_plan_runtime_overhead.py counts them)."""
    no_nccl = dict.fromkeys(NCCL_COMMUNICATOR_BYTES, 0)
    r = req(config=CFG.__class__(**{**CFG.to_dict(), "num_key_value_heads": 4}), sequence_parallel=False)
    p = planner(r, hw(10**15, per_node=2, nodes=4, nccl=no_nccl))
    fsdp = evaluate(p, Config("full", "fsdp", 1, False)).memory.total
    tp2 = min(evaluate(p, Config("full", s, 1, False, tp=2)).memory.total for s in ("zero2", "fsdp"))
    assert tp2 < fsdp
    assert p.tp_auto == (2,)
    plan = make_plan(r, hw((tp2 + fsdp) // 2, per_node=2, nodes=4, nccl=no_nccl))
    c = plan.chosen
    assert (c.method, c.tp, c.dp, c.fits) == ("full", 2, 4, True)
    assert c.strategy in ("zero2", "fsdp")
    why = next(s for s in plan.walk if "trying tensor parallelism" in s)
    assert why.startswith("Full fine-tuning does not fit under FSDP alone at micro-batch 1")
    assert "never across nodes" in why
    assert plan.execution.tp == 2 and plan.execution.dp == 4 and plan.execution.world_size == 8
    # TP's all-reduces: 4 per block per micro-batch of B x T x hidden bf16 values, ring 2 (tp-1)/tp
    per = c.micro_batch_size * 2048 * 256 * 2
    assert c.tp_comm_bytes_per_step == int(2 * 1 / 2 * per * 4 * 4 * c.grad_accum_steps)
    assert any(
        s.startswith("Tensor parallelism (tp 2) all-reduces") and "over nvlink (inside a node)" in s
        for s in plan.walk
    )


def test_tp_is_not_tried_when_fsdp_fits() -> None:
    p = planner(req(), hw(10**15))
    fsdp = evaluate(p, Config("full", "fsdp", 1, False)).memory.total
    plan = make_plan(req(), hw(fsdp * 1.01))
    assert plan.chosen.tp == 1 and not any("tensor parallelism" in s for s in plan.walk)


def test_pinned_tp_is_planned_and_checked() -> None:
    plan = make_plan(req(tp=2, strategy="fsdp"), hw(10**12))
    assert {c.tp for c in plan.candidates} == {2} and plan.chosen.strategy == "fsdp"
    assert plan.walk[0].startswith("Tensor parallelism: tp 2 as the recipe pins")
    assert (
        "(4 heads, 2 KV heads, 688 MLP features -> 2, 1, 344 per rank), 4 data-parallel replica(s)"
        in plan.walk[0]
    )


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"tp": 8},
            "distributed.tp: 8 is more than the 4 GPUs of a node (--nproc); tensor parallelism stays inside "
            "a node: use a tp of at most 4",
        ),
        (
            {"tp": 4, "strategy": "single"},
            "distributed.tp: 4 splits the model over 4 processes, but "
            "distributed.strategy is single (one process); use auto, ddp, zero2 or "
            "fsdp, or distributed.tp: 1",
        ),
        (
            {"tp": 2, "method": "qlora"},
            "distributed.tp: 2 with method qlora is not supported: torch's tensor-parallel "
            "styles cannot split bitsandbytes' 4-bit weights; use method lora, or "
            "distributed.tp: 1",
        ),
        (
            {"tp": 4, "config": tp_config(CFG, 1).__class__(**{**CFG.to_dict(), "num_key_value_heads": 1})},
            "distributed.tp: 4 does not divide the model's 1 KV heads (num_key_value_heads); use a tp that divides "
            "it, e.g. 1",
        ),
    ],
)
def test_bad_tp_in_the_planner(kw: dict, message: str) -> None:
    with pytest.raises(UserError) as err:
        make_plan(req(**kw), hw(10**12))
    assert str(err.value) == message


@pytest.mark.slow  # a CLI subprocess
def test_405b_on_16_nodes_shows_tp_x_fsdp_candidates_and_their_communication(tmp_path) -> None:
    env = {**os.environ, "FINETUNE_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune",
            "plan",
            "--model",
            "llama-3.1-405b",
            "--gpus",
            "8",
            "--nodes",
            "16",
            "--gpu-memory",
            "80GiB",
            "--seq-len",
            "8192",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    tp_rows = [c for c in plan["candidates"] if c["tp"] > 1 and c.get("pp", 1) == 1]  # the pipelines: test_plan_pipeline
    assert {(c["method"], c["tp"], c["strategy"]) for c in tp_rows} >= {
        ("full", t, s) for t in (2, 4, 8) for s in ("zero2", "fsdp")
    }
    # 126 blocks x 4 all-reduces of 8192 x 16384 bf16 values (ring: 2 (tp-1)/tp), global batch 128 on 128/tp
    # replicas at micro-batch 1; sequence parallelism (on by default) sends the same bytes as all-gathers and
    # reduce-scatters, plus the embeddings' gradient all-gather and the trained head's fp32 gradient all-reduce
    for c in (c for c in tp_rows if c["method"] == "full"):  # the trained head's all-reduce is full's
        t = c["tp"]
        accum = 128 // (128 // t)
        per = 8192 * 16384 * 2
        head = 128256 * 16384 * 4
        want = 2 * (t - 1) / t * per * 4 * 126 * accum + (t - 1) / t * per * accum + 2 * (t - 1) / t * head * accum
        assert c["tp_comm_bytes_per_step"] == int(want)
        assert c["comm_seconds_per_step"] > c["tp_comm_bytes_per_step"] / 300e9 * 0.999
    walk = " ".join(plan["walk"])
    assert "does not fit under FSDP alone at micro-batch 1" in walk and "never across nodes" in walk


@pytest.mark.slow
@pytest.mark.dist
def test_tp2_prediction_matches_the_measured_peak() -> None:
    """scripts/plan_accuracy.py's tp=2 row: the real 2-process TP run's peak (MemTracker, rank 0) against the
    planner's prediction for one TP rank."""
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import plan_accuracy
    finally:
        sys.path.pop(0)
    name, arch, change, nproc = next(c for c in plan_accuracy.CONFIGS if c[0] == "llama full fp32 tp2")
    with tempfile.TemporaryDirectory() as tmp:
        r = plan_accuracy.run_one(name, arch, change, nproc, Path(tmp))
    assert "predicted" in r, r
    assert r["chosen"]["strategy"] == "ddp" and abs(r["error"]) <= 0.05, r


def test_tp_flag_is_checked_like_the_recipe_key() -> None:
    from typer.testing import CliRunner

    from finetune.cli import app

    out = CliRunner().invoke(app, ["plan", "--model", "llama-3.2-1b", "--tp", "0"])
    assert out.exit_code == 2 and "--tp: 0 is not allowed" in " ".join(out.output.split()), out.output
    out = CliRunner().invoke(app, ["plan", "--model", "llama-3.2-1b", "--tp", "16", "--gpus", "8"])
    assert out.exit_code == 2, out.output
    assert "distributed.tp: 16 is more than the 8 GPUs of a node" in " ".join(out.output.split()), out.output


# ------------------------------------------------------------------------------- sequence parallelism


def _layer_acts(tp: int, sequence_parallel: bool, config=CFG, batch: int = 2, seq: int = 128) -> tuple[int, int]:
    """(one decoder layer's retained activations, the head window's peak) of a TP rank, traced."""
    from finetune.plan.activations import TraceSpec, activation_profile

    trace = TraceSpec(
        method="full", checkpointing=False, seq_len=seq, packed=True, sequence_parallel=tp if sequence_parallel else 1
    )
    profile = activation_profile(tp_config(config, tp), trace)
    return profile.point(batch).layer_acts, profile.at(config.num_hidden_layers, batch)["head"].acts


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_divides_the_residual_streams_activations_by_tp(tp: int) -> None:
    """What a block keeps for backward on the residual stream, its two RMSNorms' input, normalised output and
    per-row reciprocal norm (fp32, B x T x hidden, hidden and 1), takes 1/tp under sequence parallelism; the
    rest of the block (the gathered inputs the column-parallel linears keep, attention and MLP on the rank's
    heads and features) does not change."""
    config = CFG if tp == 2 else CFG.__class__(**{**CFG.to_dict(), "num_key_value_heads": 4})
    b, t, h = 2, 128, config.hidden_size
    residual = 2 * (2 * b * t * h + b * t) * 4  # two norms: input, normalised, rsqrt; fp32
    whole, whole_head = _layer_acts(tp, False, config)
    split, split_head = _layer_acts(tp, True, config)
    assert whole - split == residual - residual // tp
    assert split - residual // tp == whole - residual  # the non-residual part, identical
    assert split_head < whole_head  # every layer's share, and the head's rows


def test_sequence_parallel_is_the_default_under_tp_and_the_recipe_turns_it_off() -> None:
    on = make_plan(req(tp=2, strategy="fsdp"), hw(10**12))
    off = make_plan(req(tp=2, strategy="fsdp", sequence_parallel=False), hw(10**12))
    assert on.execution.sequence_parallel and not off.execution.sequence_parallel
    assert not make_plan(req(tp=1), hw(10**12)).execution.sequence_parallel  # kept only with tp > 1
    assert on.chosen.memory.activations < off.chosen.memory.activations
    sentence = next(s for s in on.walk if s.startswith("Tensor parallelism (tp 2) with sequence parallelism"))
    assert "all-gathers each block's attention and MLP inputs and reduce-scatters their outputs" in sentence
    assert "in a ring the bytes of the 4 all-reduces without it" in sentence
    assert any(s.startswith("Tensor parallelism (tp 2) all-reduces") for s in off.walk)
    # the same block bytes; sequence parallelism adds the embeddings' gradient all-gather and (full fine-tuning)
    # the head's fp32 gradient all-reduce, per micro-batch
    c, accum = on.chosen, on.chosen.grad_accum_steps
    per = c.micro_batch_size * 2048 * 256 * 2
    extra = (1 / 2 * per + 2 * 1 / 2 * CFG.vocab_size * 256 * 4) * accum
    assert on.chosen.tp_comm_bytes_per_step == off.chosen.tp_comm_bytes_per_step + int(extra)
