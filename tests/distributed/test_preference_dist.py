"""DPO on 2 processes through the real CLI on gloo: the same per-step losses, reward figures and saved weights as
one process, for each of the reference's code paths.

One run per reference: the base with the adapters off (LoRA, ddp), the frozen copy of the starting weights
sharded like the policy (full fine-tuning, fsdp), and the log-probabilities precomputed in a strided share per
rank and summed (full fine-tuning, zero2). Each is compared with the same recipe on one process (fp32, global
batch of 4 pairs in micro-batches of 1 pair: accumulation 4 on one process, 2 on two), 8 steps of a 2-block
Llama (hidden 64) on 4 of the shipped reversal pairs (every step sees them all: the loss must fall).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.commands.run import LaunchOptions, launch
from tests.support import (
    LOSS_RTOL,
    RECIPES,
    WEIGHT_ATOL,
    finetune_run,
    max_rel,
    max_weight_diff,
    micro_model_dir,
    parity_recipe,
    step_rows,
    write_recipe,
)

pytestmark = pytest.mark.dist

STEPS = 8


def _recipe(model_dir: Path, data: Path, out: Path, method: str, reference: str, strategy: str) -> dict:
    recipe = parity_recipe(model_dir, out, method, strategy)
    # Each run its own tokenization cache, so the precomputed reference is computed by its own ranks (not read
    # back from the cache the single-process run wrote).
    recipe["data"] = {"train": str(data), "format": "preference", "max_seq_len": 64, "cache_dir": str(out) + "-cache"}
    recipe["train"].update(objective="dpo", max_steps=STEPS, global_batch_size=4, micro_batch_size=1,
                           lr=3e-3, warmup_steps=1)
    recipe["dpo"] = {"beta": 0.5, "reference": reference}
    return recipe


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("dpo-dist")
    model = micro_model_dir(
        root / "micro-llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    )
    data = root / "pairs.jsonl"
    lines = (RECIPES / "data/reverse-preference/train.jsonl").read_text().splitlines()[:4]
    data.write_text("\n".join(lines) + "\n")
    return root, model, data


@pytest.mark.parametrize(
    ("method", "reference", "strategy"),
    [("lora", "model", "ddp"), ("full", "model", "fsdp"), ("full", "precomputed", "zero2")],
    ids=["lora-base-ddp", "full-copy-fsdp", "full-precomputed-zero2"],
)
def test_dpo_parity_with_single_process(
    setup: tuple[Path, Path, Path], method: str, reference: str, strategy: str
) -> None:
    root, model, data = setup
    key = f"{method}-{reference}"
    single, dist = root / f"{key}-single", root / f"{key}-{strategy}"
    one = write_recipe(root / f"{key}-single.yaml", _recipe(model, data, single, method, reference, "single"))
    assert launch(str(one), [], LaunchOptions(nproc=1)) == 0
    two = write_recipe(root / f"{key}-{strategy}.yaml", _recipe(model, data, dist, method, reference, strategy))
    proc = finetune_run(two, "--nproc", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    want, got = step_rows(single), step_rows(dist)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    # The first step's policy is its reference: every pair's loss is log 2 and half its rewards tie.
    assert abs(got[0]["loss"] - 0.6931472) < 1e-4
    for column in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
        assert max_rel([r[column] for r in got], [r[column] for r in want]) <= LOSS_RTOL, column
    for column in ("rewards/margin", "rewards/chosen", "rewards/rejected"):  # 0 at the first step: absolute
        assert max(abs(a[column] - b[column]) for a, b in zip(got, want, strict=True)) <= 1e-5, column
    assert [r["rewards/accuracy"] for r in got] == [r["rewards/accuracy"] for r in want]
    assert min(r["grad_norm"] for r in got) > 0.01  # every rank's gradient counted (not the gathered views')
    assert got[-1]["loss"] < 0.95 * got[0]["loss"]  # it learned: parity of a run that learns nothing proves little
    weights = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    assert max_weight_diff(dist / weights, single / weights) <= WEIGHT_ATOL
