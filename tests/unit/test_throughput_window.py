"""tokens/s and MFU cover training time only: what passes between steps (an evaluation, a checkpoint, logging)
does not lower the logged figure."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from finetune.train.metrics.log import MetricsProcessor, MetricsWriter
from finetune.train.metrics.throughput import MfuMeter
from finetune.train.state import StepResult


def test_time_between_steps_is_outside_the_window(tmp_path: Path) -> None:
    """Three steps of 0.05 s with 0.2 s of other work after each: every row is the window's tokens over its
    steps' seconds (the wall clock would give less than a fifth of it)."""
    path = tmp_path / "metrics.jsonl"
    meter = MfuMeter(torch.nn.Linear(2, 2), None, "fp32", 1, "cpu")
    metrics = MetricsProcessor(MetricsWriter(path, True), meter, log_every=2, total_steps=4, start_step=0)
    metrics.start()
    for step, tokens in enumerate((100, 200, 300, 400), start=1):
        result = StepResult(loss=1.0, grad_norm=1.0, input_tokens=tokens, epoch=0, row_widths=(8 * tokens, tokens))
        metrics.log_step(step, result, 0.05, lr=1e-3, tokens=sum(range(100, 100 * step + 1, 100)))
        time.sleep(0.2)  # an evaluation, a checkpoint
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    assert [r["train_seconds"] for r in rows] == pytest.approx([0.1, 0.1])
    assert [r["tokens_per_s"] for r in rows] == pytest.approx([300 / 0.1, 700 / 0.1])
