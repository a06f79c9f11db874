"""The planner against peaks others measured on GPUs (scripts/published_peaks.py: litgpt's resource tables),
with the publisher's settings pinned."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support import ROOT


@pytest.mark.slow  # three plans of 1.3B-7B models at 1044-1304 tokens, traced on fake tensors (a minute on 2 cores)
def test_litgpt_rows_within_the_documented_errors(tmp_path: Path) -> None:
    """Llama 2 7B LoRA on one A100 (bf16-true, lora r 8 on q and v with dropout 0.05, 1304 tokens) within 6% of
    litgpt's 21.30 GB; its QLoRA below litgpt's 13.84 GB by what bitsandbytes 0.41 kept of every quantized layer's
    input (0.50 keeps none) and more; phi-1.5's LoRA above litgpt's 4.82 GB by what transformers' gelu_new keeps
    (python ops, where litgpt's phi runs the fused tanh GELU) and less."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import published_peaks as pp
    finally:
        sys.path.pop(0)
    rows = {r[:3]: r[3] for r in pp.LITGPT}
    err = {}
    for key in (("llama-2-7b", None, 1), ("llama-2-7b", "nf4-dq", 1), ("phi-1.5", None, 1)):
        err[key] = (pp.plan_row(*key, tmp_path) / 1e9 - rows[key]) / rows[key]
    assert abs(err["llama-2-7b", None, 1]) <= 0.06, err
    assert -0.25 <= err["llama-2-7b", "nf4-dq", 1] <= -0.15, err
    assert 0.10 <= err["phi-1.5", None, 1] <= 0.25, err
