"""One test per branch of the flowchart, on the tiny model with hypothetical GPUs sized to force each branch."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from transformers import AutoConfig

from finetune.errors import UserError
from finetune.plan.candidates import evaluate
from finetune.plan.flowchart import make_plan
from finetune.plan.hardware import Hardware
from finetune.plan.request import Request
from finetune.plan.setting import settle
from finetune.plan.types import Config
from finetune.recipe.schema import LoraConfig
from finetune.units import fmt_bytes as gib
from tests.support import TINY_MODEL

CFG = AutoConfig.from_pretrained(TINY_MODEL)
LORA = LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"])


def hw(memory: int, gpus: int = 2) -> Hardware:
    return Hardware("cuda", gpus, 1, int(memory), True, "h100", "nvlink", 300e9, True)


def req(**kw) -> Request:
    base = dict(config=CFG, source="tiny", seq_len=128, packed=True, global_batch_size=16, lora=LORA)
    base.update(kw)
    return Request(**base)


def totals(r: Request, gpus: int = 2) -> dict:
    """Per-GPU totals at micro-batch 1 without checkpointing, by (method, strategy)."""
    p = settle(r, hw(10**15, gpus))
    return {(m, s): evaluate(p, Config(m, s, 1, False)).memory.total
            for m in ("full", "lora", "qlora") for s in ("ddp", "zero1", "zero2", "fsdp")}


T = totals(req())


def between(lo: int, hi: int) -> int:
    assert lo < hi, (lo, hi)
    return (lo + hi) // 2


def test_full_under_ddp_when_it_fits():
    plan = make_plan(req(), hw(T["full", "ddp"] * 4))
    c = plan.chosen
    assert (c.method, c.strategy, c.precision, c.activation_checkpointing) == ("full", "ddp", "bf16", False)
    assert c.micro_batch_size * c.grad_accum_steps * 2 == 16 and c.micro_batch_size == 8
    assert plan.walk[0].startswith("Precision: bf16 mixed precision")
    assert "Full fine-tuning under DDP needs" in plan.walk[1] and ": fits" in plan.walk[1]


def test_zero2_when_ddp_does_not_fit():
    cap = between(T["full", "zero2"], T["full", "ddp"])
    plan = make_plan(req(), hw(cap))
    assert (plan.chosen.method, plan.chosen.strategy) == ("full", "zero2")
    assert "Full fine-tuning under DDP needs" in plan.walk[1] and f"> {gib(cap)}; ZeRO-2" in plan.walk[1]
    assert f"ZeRO-2 needs {gib(T['full', 'zero2'])} per GPU: fits" in plan.walk[1]
    # ZeRO-2 sends what DDP sends in each micro-batch (8 a step: 16 rows over 2 GPUs at micro-batch 1)
    assert "ZeRO-2 reduce-scatters gradients and all-gathers parameters in each of the step's 8 micro-batches, each " \
           "no more than that all-reduce" in " ".join(plan.walk)
    assert "the price of gradients that stay sharded between micro-batches" in " ".join(plan.walk)


def test_fsdp_when_zero2_does_not_fit():
    cap = between(T["full", "fsdp"], T["full", "zero2"])
    plan = make_plan(req(), hw(cap))
    assert (plan.chosen.method, plan.chosen.strategy) == ("full", "fsdp")
    by = {c.strategy: c for c in plan.candidates if c.method == "full" and c.micro_batch_size == 1}
    assert by["fsdp"].comm_bytes_per_step > by["zero2"].comm_bytes_per_step  # the extra all-gather


def test_lora_when_full_does_not_fit_even_with_checkpointing():
    t_ac = settle(req(), hw(10**15))
    full_ac = min(evaluate(t_ac, Config("full", s, 1, True)).memory.total for s in ("ddp", "zero2", "fsdp"))
    lora_best = min(T["lora", s] for s in ("ddp", "zero2", "fsdp"))
    plan = make_plan(req(), hw(between(lora_best, min(full_ac, min(T["full", s] for s in ("ddp", "zero2", "fsdp"))))))
    assert plan.chosen.method == "lora"
    assert any("trying LoRA" in s for s in plan.walk)


def test_qlora_when_lora_does_not_fit():
    p = settle(req(), hw(10**15))
    lora_min = min(evaluate(p, Config("lora", s, 1, ac)).memory.total for s in ("ddp", "zero2", "fsdp") for ac in (False, True))
    qlora_min = min(evaluate(p, Config("qlora", s, 1, ac)).memory.total for s in ("ddp", "zero2", "fsdp") for ac in (False, True))
    plan = make_plan(req(), hw(between(qlora_min, lora_min)))
    assert plan.chosen.method == "qlora" and plan.chosen.fits
    assert any("trying QLoRA" in s for s in plan.walk)


def test_nothing_fits_suggests_with_numbers():
    plan = make_plan(req(), hw(64 * 1024**2))
    assert not plan.chosen.fits
    advice = next(s for s in plan.walk if s.startswith("Nothing fits"))
    assert advice.startswith(f"Nothing fits in 64.0 MiB per GPU: the smallest option, QLoRA under FSDP at "
                             f"micro-batch 1, needs at least {gib(plan.chosen.memory.total)}")  # states alone
    assert plan.chosen.method == "qlora" and plan.chosen.strategy == "fsdp"


def test_pinned_choices_are_respected_and_checked():
    r = req(method="lora", strategy="ddp", micro_batch_size=2, checkpointing=True, precision="fp32")
    plan = make_plan(r, hw(T["full", "ddp"] * 4))
    c = plan.chosen
    assert (c.method, c.strategy, c.micro_batch_size, c.activation_checkpointing, c.precision) == (
        "lora", "ddp", 2, True, "fp32")
    assert c.grad_accum_steps == 16 // (2 * 2)
    assert (
        "Pinned by the recipe and checked: method, distributed.strategy, precision, train.micro_batch_size, "
        "train.activation_checkpointing." in plan.walk
    )
    small = make_plan(r, hw(1024**2))
    assert not small.chosen.fits and small.chosen.method == "lora" and small.chosen.strategy == "ddp"
    assert any("> 1.0 MiB" in s for s in small.walk)


def test_bf16_only_where_supported_and_batch_checks():
    old = Hardware("cuda", 2, 1, 10**12, False, "v100", "nvlink", 300e9, True)
    plan = make_plan(req(), old)
    assert plan.chosen.precision == "fp16" and "loss scaling" in plan.walk[0]
    with pytest.raises(UserError, match="global_batch_size"):
        make_plan(req(global_batch_size=15, for_run=True), hw(10**12))
    with pytest.raises(UserError, match="micro_batch_size"):
        make_plan(req(micro_batch_size=3), hw(10**12))


def test_nothing_fits_finds_the_longest_sequence_that_does():
    """At 8192 tokens nothing fits 800 MiB (0.75 GiB of it CUDA context); the walk names the longest length
    that does, found on traced totals: it fits there and not 64 tokens later."""
    r = req(seq_len=8192, global_batch_size=8)
    plan = make_plan(r, hw(800 * 1024**2, gpus=1))
    assert not plan.chosen.fits
    advice = next(s for s in plan.walk if s.startswith("Nothing fits"))
    m = re.search(r"Shorter sequences would fit: (\d+) tokens instead of 8192 \((\w+) under ([\w -]+?)(, activation "
                  r"checkpointing on)?: ([\d.]+ [KMG]iB) per GPU\)", advice)
    assert m, advice
    seq, ckpt = int(m.group(1)), bool(m.group(4))
    method = {"full fine-tuning": "full", "LoRA": "lora", "QLoRA": "qlora"}[m.group(2)]
    assert 64 <= seq < 8192 and seq % 64 == 0

    def pinned(n: int):
        return make_plan(replace(r, seq_len=n, method=method, strategy="single", checkpointing=ckpt,
                                 micro_batch_size=1), hw(800 * 1024**2, gpus=1)).chosen

    assert pinned(seq).fits and gib(pinned(seq).memory.total) == m.group(5)
    assert not pinned(seq + 64).fits
