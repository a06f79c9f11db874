"""The parts the trainer calls for each step: the metrics processor (rows, log cadence, tokens/s, steady
throughput), the MFU meter, the evaluation schedule and the run's phase in the out-of-memory message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.train.evaluate import EvalResult
from finetune.train.metrics.log import MetricsProcessor, MetricsWriter
from finetune.train.metrics.throughput import MfuMeter, row_widths
from finetune.train.runtime.preflight import RunPhase
from finetune.train.schedule import EvalSchedule
from finetune.train.state import StepResult
from tests.support import TINY_MODEL


def _eval(loss: float) -> EvalResult:
    return EvalResult(loss=loss, exact_match=0.5, n_prompts=4, samples=[])


def _step(tokens: int, width: int = 8) -> StepResult:
    return StepResult(loss=2.0, grad_norm=1.5, input_tokens=tokens, epoch=0, row_widths=(width * tokens, tokens))


def test_rows_every_log_every_at_the_end_and_with_an_evaluation(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    cpu = MfuMeter(torch.nn.Linear(2, 2), "h100", "bf16", 1, "cpu")
    metrics = MetricsProcessor(MetricsWriter(path, True), cpu, log_every=2, total_steps=5, start_step=0)
    metrics.start()
    tokens = 0
    for step in range(1, 6):
        tokens += 10 * step
        ev = _eval(1.25) if step == 3 else None
        tps = metrics.log_step(step, _step(10 * step), 0.5, lr=1e-3 * step, tokens=tokens, ev=ev)
        assert tps > 0
    metrics.log_eval(5, _eval(1.0))
    metrics.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 4, 5, 5]
    assert list(rows[0]) == [
        "step", "loss", "lr", "tokens", "tokens_per_s", "train_seconds", "grad_norm", "epoch"
    ]  # no MFU on CPU
    assert rows[1]["eval_loss"] == 1.25 and rows[1]["eval_exact_match"] == 0.5 and rows[1]["tokens"] == 60
    assert rows[3]["lr"] == pytest.approx(5e-3) and rows[3]["tokens"] == 150
    assert rows[4] == {"step": 5, "eval_loss": 1.0, "eval_exact_match": 0.5}
    # steady throughput: the steps after the first (which warms up), by their own seconds
    tokens_per_s, mfu = metrics.steady()
    assert tokens_per_s == pytest.approx((20 + 30 + 40 + 50) / (4 * 0.5)) and mfu is None


def test_a_one_step_run_counts_its_only_step_and_a_resumed_run_skips_its_first(tmp_path: Path) -> None:
    cpu = MfuMeter(torch.nn.Linear(2, 2), None, "fp32", 1, "cpu")
    one = MetricsProcessor(MetricsWriter(tmp_path / "a.jsonl", True), cpu, log_every=10, total_steps=1, start_step=0)
    one.log_step(1, _step(40), 2.0, lr=0.1, tokens=40)
    assert one.steady()[0] == pytest.approx(20.0)
    resumed = MetricsProcessor(MetricsWriter(tmp_path / "b.jsonl", True), cpu, log_every=10, total_steps=8, start_step=4)
    assert resumed.steady() == (None, None)
    resumed.log_step(5, _step(40), 2.0, lr=0.1, tokens=200)
    resumed.log_step(6, _step(30), 1.0, lr=0.1, tokens=230)
    assert resumed.steady()[0] == pytest.approx(30.0)
    assert not (tmp_path / "b.jsonl").exists()  # neither step 5 nor 6 is due a row


@pytest.mark.slow  # builds a (meta-device) model: transformers' model import alone takes seconds
def test_the_mfu_meter_is_linear_in_the_row_width_and_none_off_a_gpu() -> None:
    """The meter counts the model's FLOPs per token at widths 0 and 1 once; at any other width it must agree
    with counting there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.plan.flops import mfu, training_flops_per_token

    with torch.device("meta"):  # sizes come from the declared shapes
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
    meter = MfuMeter(model, "h100", "bf16", 2, "cuda")
    for width in (37.5, 128.0):
        got = meter(5000.0, width)
        want = mfu(5000.0, training_flops_per_token(model, seq_len=width).per_token, "h100", "bf16", 2)
        assert got is not None and got.mfu == pytest.approx(want.mfu, rel=1e-9)
    assert meter(0.0, 128.0) is None and meter(5000.0, 0.0) is None
    assert MfuMeter(model, "h100", "bf16", 2, "cpu")(5000.0, 128.0) is None
    assert MfuMeter(model, "no-such-gpu", "bf16", 2, "cuda")(5000.0, 128.0) is None
    # a pipeline rank holds only its stage's layers: its meter counts the whole model, from the config
    with torch.device("meta"):
        stage = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
    del stage.model.layers[2:]
    alone = MfuMeter(stage, "h100", "bf16", 2, "cuda").flops_per_token(128.0)
    whole = MfuMeter(stage, "h100", "bf16", 2, "cuda", whole=(stage.config, None)).flops_per_token(128.0)
    assert whole == pytest.approx(meter.flops_per_token(128.0), rel=1e-12) and alone < 0.8 * whole


def test_row_widths_weight_each_row_by_its_real_tokens() -> None:
    micro = [
        {"input_ids": torch.zeros(2, 16, dtype=torch.long), "num_tokens": torch.tensor(20)},
        {"input_ids": torch.zeros(1, 64, dtype=torch.long), "num_tokens": torch.tensor(60)},
    ]
    assert row_widths(micro) == (16 * 20 + 64 * 60, 80)


def test_the_eval_schedule() -> None:
    every3 = EvalSchedule(at_start=True, every=3, total=9)
    assert [s for s in range(1, 10) if every3.due(s)] == [3, 6]  # step 9's evaluation is the final one
    assert every3.before_training(0) and not every3.before_training(4)  # a resumed run does not evaluate first
    never = EvalSchedule(at_start=False, every=0, total=9)
    assert not any(never.due(s) for s in range(1, 10)) and not never.before_training(0)


@pytest.mark.slow  # plans the tiny recipe, then the next configuration for the message
def test_the_phase_a_trainer_records_is_the_one_the_oom_message_names(tmp_path: Path) -> None:
    from finetune.commands.run import prepare
    from finetune.plan.flowchart import plan_for_run
    from finetune.train.runtime.preflight import oom_message
    from tests.support import tiny_recipe, write_recipe

    loaded = prepare(str(write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out"))), [])
    plan = plan_for_run(loaded, nproc=1, nnodes=1, device="cpu")
    phase = RunPhase()
    assert (phase.phase, phase.step) == ("load", 0)
    loading = oom_message("", loaded, plan, torch.device("cpu"), 0, None, phase, "held 1 GiB")
    assert "rank 0 ran out of memory while loading the model and data: held 1 GiB" in loading
    phase.at("forward", 7)
    phase.at("backward")
    text = oom_message("tried to allocate 2048 bytes", loaded, plan, torch.device("cpu"), 1, None, phase, "held")
    assert text.startswith("rank 1 ran out of memory in the backward phase of step 7 (an allocation of 2.0 KiB): held;")
