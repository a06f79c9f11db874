"""The planner as a pure function: ``decide(request, hardware)`` changes neither, every candidate it tried has a
status (refused ones with the capability table's sentence), and the walk is rendered from its typed steps."""

from __future__ import annotations

import copy
from dataclasses import replace

from transformers import AutoConfig

from finetune.plan.flowchart import decide
from finetune.plan.hardware import Hardware
from finetune.plan.request import Request
from finetune.plan.types import Candidate, Plan, Status
from finetune.recipe.schema import LoraConfig, QuantizationConfig
from tests.support import TINY_MODEL

CFG = AutoConfig.from_pretrained(TINY_MODEL)
LORA = LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"])


def hw(memory: int, gpus: int = 2) -> Hardware:
    return Hardware("cuda", gpus, 1, int(memory), True, "h100", "nvlink", 300e9, True)


def req(**kw) -> Request:
    return Request(**{**dict(config=CFG, source="tiny", seq_len=128, packed=True, global_batch_size=16, lora=LORA), **kw})


def test_decide_changes_neither_the_request_nor_the_hardware() -> None:
    r, h = req(strategy="single"), hw(10**12, gpus=8)  # single on 8 GPUs: the walk plans for one process
    before_r, before_h = copy.deepcopy(r.__dict__), copy.deepcopy(h)
    d = decide(r, h)
    assert d.walk[0] == "distributed.strategy is single: planning for one process, not 8."
    assert d.chosen.nproc == 1 and d.setting.hw.gpus_per_node == 1
    assert h == before_h and h.gpus_per_node == 8
    assert r.__dict__.keys() == before_r.keys() and all(
        r.__dict__[k] is before_r[k] or r.__dict__[k] == before_r[k] for k in ("strategy", "seq_len", "attn_implementation")
    )
    again = decide(r, h)  # same answer twice: nothing carried over between calls
    assert again.walk == d.walk and again.chosen == d.chosen


def test_every_tried_candidate_has_a_status_and_refused_ones_say_why() -> None:
    """8-bit QLoRA cannot be sharded by FSDP2: when DDP does not fit, the walk rules out zero2/fsdp for it."""
    plan_req = req(method="qlora", quantization=QuantizationConfig(bits=8))
    roomy = decide(plan_req, hw(10**12))
    assert roomy.chosen.status is Status.FITS and roomy.chosen.strategy == "ddp"
    assert not [c for c in roomy.tried if c.status is Status.REFUSED]  # never considered: DDP fits first
    d = decide(plan_req, hw(roomy.tried[0].memory.total * 0.97))  # DDP at micro-batch 1 just over
    refused = [c for c in d.tried if c.status is Status.REFUSED]
    assert {c.strategy for c in refused} == {"zero2", "fsdp"}, [(c.strategy, c.status) for c in d.tried]
    assert all("quantization.bits: 8" in c.why and not c.fits for c in refused)
    assert d.tried[0].strategy == "ddp" and d.tried[0].status in (Status.OVER, Status.STATES_OVER)
    plan = d.plan()
    assert [c["strategy"] for c in plan.refused] == [c.strategy for c in refused]
    assert any(s.startswith("QLoRA under ZeRO-2 is ruled out: quantization.bits: 8") for s in plan.walk), plan.walk


def test_the_walk_is_its_typed_steps_rendered_and_the_json_keeps_its_keys() -> None:
    d = decide(req(), hw(10**12))
    plan = d.plan()
    assert plan.walk == [s.render() for s in d.steps]
    data = plan.to_dict()
    assert [s["kind"] for s in data["steps"]][:2] == ["PrecisionChosen", "Tried"]
    tried = data["steps"][1]
    assert tried["method"] == "full" and tried["attempts"][0]["label"] == "DDP" and tried["attempts"][0]["fits"]
    old_keys = {"method", "strategy", "precision", "micro_batch_size", "grad_accum_steps", "activation_checkpointing",
                "nproc", "nnodes", "memory", "comm_bytes_per_step", "comm_seconds_per_step", "fits", "note",
                "eval_batch_size", "eval_memory", "tp", "tp_comm_bytes_per_step"}
    assert old_keys <= data["chosen"].keys() and {"status", "optimizer", "offload", "time"} <= data["chosen"].keys()
    assert {"chosen", "candidates", "walk", "hardware", "model", "execution", "job"} <= data.keys()
    back = Plan.from_dict(data)
    assert back.chosen == plan.chosen and back.chosen.time == plan.chosen.time


def test_a_plan_written_before_statuses_reads_back() -> None:
    """plan.json files without ``status``: it follows from ``fits`` and ``note`` as they were written."""
    base = decide(req(), hw(10**12)).chosen.to_dict()
    for fits, note, status in (
        (True, "", Status.FITS), (False, "", Status.OVER),
        (False, "model states alone exceed the memory (activations not traced)", Status.STATES_OVER),
        (False, "activations not traced (the walk did not need this method)", Status.NOT_TRACED),
    ):
        old = {k: v for k, v in base.items() if k not in ("status", "why", "optimizer", "offload", "time",
                                                        "offload_bytes_per_step")}
        c = Candidate.from_dict({**old, "fits": fits, "note": note})
        assert c.status is status and c.fits is fits and c.note == note
    assert replace(Candidate.from_dict(base), status=Status.HOST_OVER).fits is False
