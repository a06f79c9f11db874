"""The planner's pipeline parallelism: the split of the layers, the schedules' micro-batches in flight and bubble,
each stage's memory by hand, the recipe's checks through `finetune plan`, and the 405B layouts on 16 nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from finetune.plan.activations import TraceSpec, activation_profile
from finetune.plan.candidates import evaluate
from finetune.plan.hardware import Hardware
from finetune.plan.memory import Setup, StageProfile, pipeline_stages, stage_memory
from finetune.plan.pipeline import (
    balanced_split,
    boundaries_across_nodes,
    bubble_fraction,
    in_flight,
    in_flight_with_gradients,
    memory_balanced_split,
    microbatch_problem,
    pipeline_note,
    stage_inventory,
)
from finetune.plan.request import Request
from finetune.plan.setting import settle
from finetune.plan.shapes import build_inventory
from finetune.plan.types import Config
from tests.support import RECIPES, TINY_MODEL, tiny_recipe, write_recipe

CFG = AutoConfig.from_pretrained(TINY_MODEL)  # hidden 256, 4 layers, vocab 264, untied head
LAYER = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 688 + 2 * 256  # q, k + v, o, gate/up/down, 2 norms
EMBED = 264 * 256


# -- the split -------------------------------------------------------------------------------------------------
def test_balanced_split_gives_the_end_stages_fewer_layers_by_their_cost() -> None:
    assert balanced_split(8, 4) == (2, 2, 2, 2)
    assert balanced_split(12, 3, 0.5, 0.5) == (4, 4, 4)  # max cost 4.5 either way: nothing to move
    # costs 2.6, 3, 3, 3.4: [3, 3, 3, 1] would cost 3.6 on the first stage
    assert balanced_split(10, 4, 0.6, 1.4) == (2, 3, 3, 2)
    # the first stage at 16.66, the last at 15.9: the middle ones take 16 each
    assert balanced_split(126, 8, 0.66, 1.9) == (16, 16, 16, 16, 16, 16, 16, 14)
    assert balanced_split(4, 4, 5.0, 5.0) == (1, 1, 1, 1)  # every stage keeps a layer


def test_memory_balanced_split_levels_the_ranks_peaks() -> None:
    # rank 0 starts 10 units higher: it keeps one layer, rank 1 the other nine (peaks 11 and 9)
    assert memory_balanced_split([10.0, 0.0], [1.0, 1.0], 10) == (1, 9)
    # 1f1b's in-flight micro-batches make rank 0's layers dearer (3 a layer, rank 2's 1): all three level at 6
    assert memory_balanced_split([0.0, 0.0, 0.0], [3.0, 2.0, 1.0], 11) == (2, 3, 6)


# -- the schedules ---------------------------------------------------------------------------------------------
def _torch_interleaved_in_flight(pp: int, v: int, m: int, rank: int) -> int:
    """Forwards minus backwards at their most in torch's own interleaved-1F1B order for ``rank``."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    s = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    s.pp_group_size, s.n_local_stages, s._n_microbatches, s.rank = pp, v, m, rank
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    live = peak = 0
    for action in s._calculate_single_rank_operations(rank):
        if action is None:
            continue
        live += {_ComputationType.FORWARD: 1, _ComputationType.FULL_BACKWARD: -1}.get(action.computation_type, 0)
        peak = max(peak, live)
    return peak


def _torch_interleaved_backwards(pp: int, v: int, m: int, rank: int) -> tuple[int, int]:
    """(Micro-batches in flight at ``rank``'s first backward, the most at a later one) in torch's own
    interleaved-1F1B order (the backward's own micro-batch included)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    s = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    s.pp_group_size, s.n_local_stages, s._n_microbatches, s.rank = pp, v, m, rank
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    live, first, later = 0, None, 0
    last_stage = most_of_last = 0  # the last stage's micro-batches in flight on its rank
    for action in s._calculate_single_rank_operations(rank):
        if action is None:
            continue
        last = action.stage_index == pp * v - 1
        if action.computation_type == _ComputationType.FORWARD:
            live += 1
            last_stage += last
        elif action.computation_type == _ComputationType.FULL_BACKWARD:
            if first is None:
                first = live
            else:
                later = max(later, live)
            live -= 1
            last_stage -= last
        most_of_last = max(most_of_last, last_stage)
    assert first is not None
    # the last stage runs each micro-batch's backward right after its forward: it holds none beside the current
    # one (memory.StageProfile's held_last is off on an interleaved rank)
    assert most_of_last <= 1
    return first, later


def test_micro_batches_in_flight_at_the_first_and_at_later_backwards() -> None:
    # gpipe: every forward first; the second backward has one micro-batch fewer
    assert [in_flight_with_gradients("gpipe", 2, 1, 4, r) for r in range(2)] == [3, 3]
    # 1f1b: a forward runs between two backwards while micro-batches remain; rank 0's warm-up of 4 takes all 4
    assert [in_flight_with_gradients("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight_with_gradients("1f1b", 4, 1, 4, r) for r in range(4)] == [3, 3, 2, 1]
    assert in_flight_with_gradients("gpipe", 2, 1, 1, 0) == 0  # one micro-batch: no later backward
    for pp, v, m in ((4, 2, 8), (2, 2, 4), (4, 3, 8), (2, 2, 2), (4, 2, 4)):
        for r in range(pp):
            ours = (in_flight("interleaved-1f1b", pp, v, m, r), in_flight_with_gradients("interleaved-1f1b", pp, v, m, r))
            assert ours == _torch_interleaved_backwards(pp, v, m, r), (pp, v, m, r)


def test_micro_batches_in_flight_per_schedule() -> None:
    assert [in_flight("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("gpipe", 4, 1, 8, r) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight("gpipe", 4, 1, 2, r) for r in range(4)] == [2, 2, 2, 2]
    assert [in_flight("interleaved-1f1b", 4, 2, 8, r) for r in range(4)] == [11, 9, 7, 5]
    for pp, v, m in ((4, 2, 8), (2, 2, 4), (4, 3, 8), (2, 2, 6)):
        ours = [in_flight("interleaved-1f1b", pp, v, m, r) for r in range(pp)]
        assert ours == [_torch_interleaved_in_flight(pp, v, m, r) for r in range(pp)], (pp, v, m)


def test_bubble_and_the_schedules_micro_batch_rules() -> None:
    assert bubble_fraction("1f1b", 4, 1, 12) == pytest.approx(3 / 15)
    assert bubble_fraction("gpipe", 4, 1, 12) == pytest.approx(3 / 15)
    assert bubble_fraction("interleaved-1f1b", 4, 2, 12) == pytest.approx(3 / 27)
    assert bubble_fraction("1f1b", 1, 1, 12) == 0.0
    assert microbatch_problem("1f1b", 4, 4) is None and microbatch_problem("interleaved-1f1b", 4, 8) is None
    assert "1f1b needs at least pp = 4 micro-batches" in (microbatch_problem("1f1b", 4, 3) or "")
    assert "a multiple of pp 4" in (microbatch_problem("interleaved-1f1b", 4, 6) or "")
    assert microbatch_problem("gpipe", 4, 2) is None
    assert "the bubble is 60% of the step" in (pipeline_note("gpipe", 4, 2) or "")


def test_stage_boundaries_between_nodes() -> None:
    assert boundaries_across_nodes(4, 16, 8) == 1  # 4 ranks a stage: only the boundary at rank 8 crosses
    assert boundaries_across_nodes(16, 128, 8) == 15  # a stage per node
    assert boundaries_across_nodes(2, 8, 8) == 0


# -- each stage's memory ---------------------------------------------------------------------------------------
def _setting(**kw: object):  # the tiny model on 2 CPU processes
    base: dict = dict(config=CFG, source="tiny", method="full", strategy="ddp", precision="fp32", seq_len=48,
                      global_batch_size=8, micro_batch_size=2, checkpointing=False, pp=2)
    base.update(kw)
    hw = Hardware("cpu", 2, 1, 2**40, False, "cpu", "loopback", 1e9, True)
    return settle(Request(**base), hw)


def test_stage_inventories_hold_their_layers_and_ends() -> None:
    inv = build_inventory(CFG, "tiny")
    first, last = stage_inventory(inv, 2, True, False), stage_inventory(inv, 2, False, True)
    assert first.n_params == 2 * LAYER + EMBED
    assert last.n_params == 2 * LAYER + 256 + EMBED  # final norm + untied head
    assert first.n_params + last.n_params == inv.n_params


def test_per_stage_memory_of_the_tiny_model_by_hand() -> None:
    s = _setting()
    c = evaluate(s, Config("full", "ddp", 2, False, pp=2))
    assert c.pp_layers == (2, 2) and c.grad_accum_steps == 4 and c.dp == 1
    r0, r1 = c.stage_memory
    # fp32 full fine-tuning on one replica: 4 bytes of weight, 4 of gradient, 8 of AdamW state per parameter
    for m, n in ((r0, 2 * LAYER + EMBED), (r1, 2 * LAYER + 256 + EMBED)):
        assert (m.params, m.grads, m.optimizer) == (4 * n, 4 * n, 8 * n)
    # activations: one micro-batch through 2 layers (the traced windows at depth 2, the head's on the last stage
    # only), rank 0 keeping 1f1b's second micro-batch's 2 layers and its embedding output; receive buffers for the
    # other 3 micro-batches (48 tokens x 256 hidden x 4 bytes x 2 rows) on one side of each stage
    spec = s.exec_spec("full", "ddp", False, 2, 1, pp=2)
    prof = activation_profile(CFG, TraceSpec.of(spec, seq_len=48, packed=False, attn_implementation="sdpa",
                                                device="cpu"))
    windows = prof.at(2, 2)
    layer = prof.at(3, 2)["first"].acts - windows["first"].acts
    row = 48 * 256 * 4
    largest = 688 * 256  # the largest trainable tensor: an MLP weight (the embedding is 264 x 256)
    # rank 0's held micro-batch: its 2 layers, the embeddings' output (2 rows) and the position embeddings
    positions = prof.point(2).position_acts
    assert 2 * 48 * 64 * 4 <= positions < row  # cos and sin: 48 positions x head_dim 64, fp32
    held = 2 * layer + 2 * row + positions
    # grad_accum > 1: every gradient exists from the start; the largest gradient's temporary on top
    acts0 = max(max(w.acts, w.grads_and_acts - w.grads_at_peak) for k, w in windows.items() if k != "head")
    acts0 += held + 4 * largest
    acts1 = max(max(w.acts, w.grads_and_acts - w.grads_at_peak) for w in windows.values()) + 4 * largest
    assert r0.activations == acts0
    assert r1.activations == acts1
    assert r0.buffers == r1.buffers == 3 * row * 2
    assert c.memory.total == max(r0.total, r1.total)
    assert c.pp_comm_bytes_per_step == 2 * 4 * 2 * row  # activations forward + gradients back, 4 micro-batches


def test_stage_profile_in_flight_on_the_first_stage() -> None:
    s = _setting()
    spec = s.exec_spec("full", "ddp", False, 2, 1, pp=2)
    stages = pipeline_stages(spec.pp_layers, 2, "1f1b", 4)
    assert [(x.layers, x.first, x.last, x.in_flight, x.in_flight_with_gradients) for x in stages] == [
        (2, True, False, 2, 2), (2, False, True, 1, 1)]
    prof = s.profile(spec)
    p0 = StageProfile(prof, 2, 2, False, True, 48 * 256 * 4)
    assert set(p0.at(4, 1)) == {"first", "last"}  # no head on the first stage
    assert p0.held(1) == 2 * p0.layer_acts(1) + 48 * 256 * 4 + prof.point(1).position_acts
    setup = Setup(spec, 1, 4, 1, "cpu", "adamw")
    mem, _ = stage_memory(s.inventory(1), prof, setup, stages[0], 48 * 256 * 4)
    assert mem.activations > 0 and mem.buffers == 3 * 48 * 256 * 4


def test_gpipe_peaks_at_the_first_backward_with_every_micro_batch_and_no_earlier_gradients() -> None:
    """GPipe's 4 micro-batches of 4 rows of 128 tokens on 2 stages of 2 layers (scripts/plan_accuracy.py's
    "llama full fp32 pp2 gpipe"), by hand from the trace. Every forward runs before the first backward, and the
    optimizer set the gradients to None after the last step: at the first backward's peak a stage holds 3
    micro-batches beside the current one and only the gradients that backward has made (the traced window's);
    a later backward holds every gradient of the stage beside 2. A held micro-batch keeps its 2 layers'
    activations and its own position embeddings; on the first stage also the embeddings' output, on the last
    what the final norm, the head and the loss retain (its input is a receive buffer, counted apart)."""
    s = _setting(pp_schedule="gpipe", seq_len=128, micro_batch_size=4, global_batch_size=16)
    c = evaluate(s, Config("full", "ddp", 4, False, pp=2))
    assert c.grad_accum_steps == 4
    spec = s.exec_spec("full", "ddp", False, 4, 1, pp=2)
    prof = activation_profile(CFG, TraceSpec.of(spec, seq_len=128, packed=False, attn_implementation="sdpa",
                                                device="cpu"))
    windows = prof.at(2, 4)
    layer = prof.at(3, 4)["first"].acts - windows["first"].acts
    row = 128 * 256 * 4
    positions, head = prof.point(4).position_acts, prof.point(4).head_acts
    assert 2 * 128 * 64 * 4 <= positions < row  # cos and sin of 128 positions x head_dim 64, fp32 (and indices)
    assert head > 4 * row  # the final norm's output (4 rows) among what the final norm, head and loss keep
    held = (2 * layer + 4 * row + positions, 2 * layer + positions + head)
    largest = 688 * 256 * 4
    r0, r1 = c.stage_memory
    for m, n, h, names in ((r0, 2 * LAYER + EMBED, held[0], ("first", "last")),
                           (r1, 2 * LAYER + 256 + EMBED, held[1], ("head", "first", "last"))):
        assert (m.params, m.optimizer, m.buffers) == (4 * n, 8 * n, 3 * 4 * row)
        first = max(((w.grads_at_peak, w.grads_and_acts - w.grads_at_peak + 3 * h) for w in map(windows.get, names)),
                    key=sum)
        later = (4 * n, max(max(w.acts, w.grads_and_acts - w.grads_at_peak) for w in map(windows.get, names))
                 + largest + 2 * h)
        assert sum(first) > sum(later)  # the first backward's peak: a micro-batch's activations outweigh the grads
        assert (m.grads, m.activations) == first
        assert m.grads < 4 * n  # not the stage's whole gradients
    # 1f1b's rank 0 peaks in its steady state: 2 micro-batches in flight and every gradient of the stage
    one = evaluate(_setting(seq_len=128, micro_batch_size=4, global_batch_size=16), Config("full", "ddp", 4, False, pp=2))
    assert one.stage_memory[0].grads == 4 * (2 * LAYER + EMBED)
    assert one.stage_memory[0].activations == (
        max(max(w.acts, w.grads_and_acts - w.grads_at_peak) for w in (windows["first"], windows["last"]))
        + largest + held[0])
    # StageProfile's count of the held micro-batches, and the in-flight counts stage_memory takes
    assert StageProfile(prof, 2, 4, True, False, row).held(4) == 3 * held[1]
    assert StageProfile(prof, 2, 4, False, True, row).held(4) == 3 * held[0]
    stages = pipeline_stages(spec.pp_layers, 2, "gpipe", 4)
    assert [(x.in_flight, x.in_flight_with_gradients) for x in stages] == [(4, 3), (4, 3)]


def test_sequence_parallel_stages_divide_their_boundaries_and_residual_stream_by_tp() -> None:
    hw = Hardware("cpu", 4, 1, 2**40, False, "cpu", "loopback", 1e9, True)
    base: dict = dict(config=CFG, source="tiny", method="full", strategy="ddp", precision="fp32", seq_len=48,
                      global_batch_size=8, micro_batch_size=2, checkpointing=False, pp=2, tp=2)
    sp, whole = (settle(Request(**base, sequence_parallel=on), hw) for on in (True, False))
    c_sp, c_whole = (evaluate(x, Config("full", "ddp", 2, False, tp=2, pp=2)) for x in (sp, whole))
    assert (c_sp.dp, c_sp.grad_accum_steps) == (1, 4)
    row = 48 * 256 * 4
    # receive buffers for the other 3 micro-batches of 2 rows: each tp rank's half of the sequence under SP
    assert [m.buffers for m in c_sp.stage_memory] == [3 * 2 * row // 2] * 2
    assert [m.buffers for m in c_whole.stage_memory] == [3 * 2 * row] * 2
    assert c_sp.pp_comm_bytes_per_step * 2 == c_whole.pp_comm_bytes_per_step
    # a stage's decoder layer keeps what plain TP with sequence parallelism keeps (the same traced function)
    spec = sp.exec_spec("full", "ddp", False, 4, 2, pp=2)
    assert spec.sequence_parallel and not whole.exec_spec("full", "ddp", False, 4, 2, pp=2).sequence_parallel
    plain = sp.profile(sp.exec_spec("full", "ddp", False, 4, 2))
    stage = StageProfile(sp.profile(spec), 2, 2, False, True, row // 2)
    plain_layer = plain.at(3, 2)["first"].acts - plain.at(2, 2)["first"].acts
    assert stage.layer_acts(2) == plain_layer
    whole_layer = StageProfile(whole.profile(whole.exec_spec("full", "ddp", False, 4, 2, pp=2)), 2, 2, False, True,
                               row).layer_acts(2)
    assert plain_layer < whole_layer
    assert c_sp.stage_memory[0].activations < c_whole.stage_memory[0].activations
    # TP's collectives of the busiest rank, the last: its 2 layers' 4 per micro-batch (2 rows x 48 x 256 fp32,
    # a ring's 2 (tp-1)/tp each) over 4 micro-batches, and the trained head's fp32 gradient all-reduce
    per = 2 * 48 * 256 * 4
    assert c_sp.tp_comm_bytes_per_step == per * 4 * 2 * 4 + 264 * 256 * 4 * 4


def test_gpipe_holds_every_micro_batch_and_its_time_has_a_bubble() -> None:
    one = evaluate(_setting(pp_schedule="1f1b"), Config("full", "ddp", 2, False, pp=2))
    all_ = evaluate(_setting(pp_schedule="gpipe"), Config("full", "ddp", 2, False, pp=2))
    layer_rows = all_.stage_memory[1].activations - one.stage_memory[1].activations
    assert layer_rows > 0  # the last stage keeps 4 micro-batches under gpipe, 1 under 1f1b
    assert one.time is not None and one.time.bubble == pytest.approx(one.time.compute * (1 / 5) / (4 / 5))


def test_a_layout_the_walk_chooses_says_what_runs_it() -> None:
    from finetune.plan.flowchart import _pipeline_layout

    hw = Hardware("cpu", 2, 2, 2**40, False, "cpu", "ethernet", 1e9, True)
    s = settle(Request(config=CFG, source="tiny", method="full", seq_len=64, global_batch_size=8, tp="auto",
                       pp="auto", packed=True), hw)
    assert s.pp == 1 and s.pp_auto == (2,)  # stages across the 2 nodes; tp inside one
    c = evaluate(s, Config("full", "fsdp", 1, False, pp=2))
    assert (c.pp, c.dp, c.grad_accum_steps) == (2, 2, 4)
    step = _pipeline_layout(s, c)
    assert step.settings == ("distributed.pp: 2", "distributed.strategy: fsdp", "data.packing: false")
    assert step.crossing == 1 and step.in_flight == (2, 1) and step.bubble_fraction == pytest.approx(1 / 5)
    assert "To run it: distributed.pp: 2, distributed.strategy: fsdp, data.packing: false." in step.render()


# -- the recipe's checks through the CLI --------------------------------------------------------------------------
def _plan(tmp_path: Path, *sets: str, gpus: int = 2) -> tuple[int, str]:
    from typer.testing import CliRunner

    from finetune.cli import app

    recipe = tiny_recipe(tmp_path / "out", distributed={"strategy": "ddp", "pp": 2},
                         train={"global_batch_size": 8, "micro_batch_size": 2})
    recipe["data"].pop("eval")
    path = write_recipe(tmp_path / "pp.yaml", recipe)
    args = ["plan", str(path), "--gpus", str(gpus), "--json"]
    for s in sets:
        args += ["--set", s]
    out = CliRunner().invoke(app, args)
    return out.exit_code, out.output


@pytest.mark.parametrize(
    ("sets", "gpus", "message"),
    [
        ((), 3, "distributed.pp: 2 x distributed.tp 1 = 2 does not divide the 3 GPUs"),
        (("distributed.pp=8",), 8, "distributed.pp: 8 ranks x 1 stage each need at least 8 decoder layers and the "
         "model has 4; use a pp of at most 4"),
        (("distributed.pp_layers=[1,2]",), 2, "distributed.pp_layers: [1, 2] has 2 stages of 3 layers; pp 2 x 1 "
         "stage per rank needs 2 numbers summing to the model's 4 decoder layers"),
        (("distributed.pp_stages_per_rank=2",), 2, "distributed.pp_stages_per_rank: 2 stages per rank need "
         "distributed.pp_schedule: interleaved-1f1b"),
        (("distributed.pp_schedule=interleaved-1f1b", "distributed.pp_stages_per_rank=1"), 2,
         "distributed.pp_stages_per_rank: interleaved-1f1b runs 2 or more stages on each rank"),
        (("train.global_batch_size=2",), 2, "distributed.pp_schedule: 1f1b needs at least pp = 2 micro-batches"),
        (("distributed.pp=1", "distributed.pp_layers=[2,2]"), 2, "distributed.pp_layers: set without a pipeline"),
    ],
)
def test_pipeline_recipe_errors_exit_2_with_one_sentence(tmp_path, sets, gpus, message) -> None:
    code, output = _plan(tmp_path, *sets, gpus=gpus)
    assert code == 2, output
    assert message in " ".join(output.split())
    assert "Traceback" not in output


def test_validate_refuses_packed_rows_across_stages(tmp_path) -> None:
    from typer.testing import CliRunner

    from finetune.cli import app

    recipe = tiny_recipe(tmp_path / "out", distributed={"strategy": "ddp", "pp": 2})
    recipe["data"]["packing"] = True
    out = CliRunner().invoke(app, ["validate", str(write_recipe(tmp_path / "pp.yaml", recipe))])
    assert out.exit_code == 2, out.output
    assert "packed rows' document masks do not cross the stages of distributed.pp: 2" in " ".join(out.output.split())


@pytest.mark.slow  # plans the evaluation and the table's rows too
def test_pinned_pipeline_reaches_the_execution_spec_through_the_cli(tmp_path) -> None:
    code, output = _plan(tmp_path, "distributed.pp_layers=[1,3]")
    assert code == 0, output
    p = json.loads(output)
    e, c = p["execution"], p["chosen"]
    assert (e["pp"], e["pp_schedule"], e["pp_layers"], e["world_size"]) == (2, "1f1b", [1, 3], 2)
    assert (c["pp"], c["pp_layers"], c["strategy"]) == (2, [1, 3], "ddp")
    assert len(c["stage_memory"]) == 2 and c["memory"]["total"] == max(m["total"] for m in c["stage_memory"])
    assert any(s["kind"] == "PinnedPipeline" and s["split"] == [1, 3] for s in p["steps"])
    assert any(s["kind"] == "PipelineLayout" for s in p["steps"])


def test_under_a_pipeline_the_walk_takes_the_micro_batch_with_the_shortest_step(tmp_path) -> None:
    """Every micro-batch of 1, 2 and 4 rows fits the tiny model; with 8 rows a step on one pipeline of 2 stages,
    1 makes 8 micro-batches (bubble 1/9 of the step) and 4 makes 2 (1/3): the walk takes 1 and says why. A
    pinned micro-batch is kept."""
    code, output = _plan(tmp_path, "train.micro_batch_size=auto")
    assert code == 0, output
    p = json.loads(output)
    c = p["chosen"]
    assert (c["pp"], c["micro_batch_size"], c["grad_accum_steps"]) == (2, 1, 8)
    (step,) = [s for s in p["steps"] if s["kind"] == "PipelineMicroBatch"]
    assert (step["micro_batch_size"], step["largest"]) == (1, 4)
    assert step["step_seconds"] == pytest.approx(c["time"]["step"])
    assert step["step_seconds"] < step["largest_step_seconds"]
    # bubble = compute x f / (1 - f): f 1/9 here, 1/3 for micro-batch 4, with the step's compute the same
    assert step["bubble_seconds"] == pytest.approx(c["time"]["bubble"])
    assert c["time"]["bubble"] / c["time"]["compute"] == pytest.approx(1 / 8, rel=1e-6)
    assert step["largest_bubble_seconds"] / step["bubble_seconds"] == pytest.approx(4, rel=1e-6)
    assert not any(s["kind"] == "LargestMicroBatch" for s in p["steps"])
    code, output = _plan(tmp_path)  # micro_batch_size: 2 pinned
    assert code == 0, output
    pinned = json.loads(output)
    assert pinned["chosen"]["micro_batch_size"] == 2
    assert not any(s["kind"] == "PipelineMicroBatch" for s in pinned["steps"])


def test_the_table_shows_pp_dp_tp(tmp_path) -> None:
    from rich.console import Console

    from finetune.plan.render import print_plan
    from finetune.plan.types import Plan

    code, output = _plan(tmp_path)
    assert code == 0, output
    console = Console(width=250, record=True)
    print_plan(Plan.from_dict(json.loads(output)), console)
    text = console.export_text()
    assert "pp/dp/tp" in text and "2/1/1" in text and "1/2/1" in text  # the chosen pp2 row, and ddp's
    assert "pipeline stages (layers [2, 2], 1f1b): rank 0" in text


# -- the lecture's case: Llama 3.1 405B on 16 nodes of 8 x 80 GiB ------------------------------------------------
@pytest.mark.slow  # traces a 405B layer's shapes (cached after the first run)
def test_405b_full_fine_tuning_on_16_nodes_sizes_every_pipeline_layout(tmp_path) -> None:
    """Full fine-tuning of 405B on 16 nodes of 8 x 80 GiB at 8192 tokens: FSDP alone and TP x FSDP do not fit, so
    the walk sizes every pipeline layout, the fewest stages first. torch.distributed.pipelining keeps an FSDP
    stage's units gathered and its gradients unsharded from the first backward to the last micro-batch's
    (ExecSpec.sync_every_micro_batch), and every layout holds NCCL's buffers for each of its communicators: none
    fits, and the walk says QLoRA would."""
    from finetune.plan.command import PlanOptions, build_plan

    opts = PlanOptions(model="llama-3.1-405b", method="full", gpus=8, nodes=16, gpu_memory="80GiB", seq_len=8192)
    build_plan(opts)  # warm the traces and record the config
    plan = build_plan(opts)
    steps = {s["kind"]: s for s in plan.steps}
    assert "TryPipeline" in steps and list(steps["TryPipeline"]["degrees"]) == [2, 4, 8, 16]
    sized = steps["PipelineTried"]["attempts"]
    assert [(a["pp"], a["tp"]) for a in sized] == [(p, t) for p in (2, 4, 8, 16) for t in (1, 2, 4, 8)]
    cap = 80 * 2**30
    assert not any(a["fits"] for a in sized) and min(a["total"] for a in sized) > cap
    c = plan.chosen
    assert c.method == "full" and not c.fits and c.memory.total > cap
    assert "NothingFits" in steps and any("QLoRA would need" in s and "(fits)" in s for s in plan.walk)
    print(f"405B: closest {c.strategy} tp {c.tp} x dp {c.dp} at {c.memory.total / 2**30:.1f} GiB; layouts "
          f"{[(a['pp'], a['tp'], round(a['total'] / 2**30, 1)) for a in sized]}")
    # the same plan through the CLI with a warm cache imports neither torch nor transformers (the warm plan's
    # seconds are in docs/benchmarks.md: scripts/plan_speed.py)
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "finetune", "plan", "--model", "llama-3.1-405b", "--method",
         "full", "--gpus", "8", "--nodes", "16", "--gpu-memory", "80GiB", "--seq-len", "8192", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert json.loads(out.stdout)["chosen"] == json.loads(json.dumps(plan.to_dict()))["chosen"]
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
    assert "finetune.plan.flowchart" in imported and not imported & {"torch", "transformers"}


def test_catalog_405b_layers_and_untied_head() -> None:
    from finetune.recipe.catalog import CATALOG

    facts = CATALOG["llama-3.1-405b"]
    assert facts["num_hidden_layers"] == 126 and not facts.get("tie_word_embeddings", False)
    assert RECIPES.exists()
