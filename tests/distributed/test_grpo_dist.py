"""grpo on 2 processes through the real CLI on gloo: the same completions, per-step losses, figures and saved
weights as one process, under LoRA (ddp; the reference is the base with the adapters off) and under full
fine-tuning sharded by fsdp (the reference a frozen copy sharded like the policy, two optimizer steps per batch
of completions: the old policy's log-probabilities and the clipped ratio).

Fixed completions: the rollout samples each completion row with its own uniform number per token
(finetune/model/generation.py's row_sampler), from a generator seeded by (train.seed, epoch, batch) that every
rank runs over the whole global batch, using its own rows' numbers. One process sampling all 8 completions of a
step and two ranks sampling 4 each draw the same tokens; the rewards (equal per row) prove it. The rewards: the
exact match and a python function of the completion's characters, so that every group's rewards differ and the
advantages (and gradients) are not zero. Each run: fp32, 4 steps of 2 prompts x 4 completions in micro-batches
of 2 rows (accumulation 4 on one process, 2 on two) on a 2-block Llama (hidden 64), eval off.
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

STEPS = 4
REWARD = "def score(prompt, completion, answer):\n    return (sum(map(ord, completion)) % 5) / 4\n"


def _recipe(root: Path, model_dir: Path, out: Path, method: str, strategy: str) -> dict:
    recipe = parity_recipe(model_dir, out, method, strategy)
    recipe["data"] = {"train": str(root / "prompts.jsonl"), "format": "instruction", "max_seq_len": 48}
    recipe["train"].update(objective="grpo", max_steps=STEPS, global_batch_size=8, micro_batch_size=2,
                           lr=3e-3 if method == "lora" else 1e-3, warmup_steps=1)
    recipe["grpo"] = {
        "num_generations": 4, "max_completion_length": 6, "temperature": 1.0, "beta": 0.05,
        "num_iterations": 1 if method == "lora" else 2, "loss_type": "dapo" if method == "lora" else "grpo",
        "rewards": [{"type": "exact_match"}, {"type": "python", "file": str(root / "mine.py"), "function": "score"}],
        "trust_reward_code": True,
    }
    return recipe


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("grpo-dist")
    model = micro_model_dir(
        root / "micro-llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    )
    lines = (RECIPES / "data/reverse/train.jsonl").read_text().splitlines()[:8]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    (root / "mine.py").write_text(REWARD)
    return root, model


@pytest.mark.parametrize(("method", "strategy"), [("lora", "ddp"), ("full", "fsdp")], ids=["lora-ddp", "full-fsdp"])
def test_grpo_parity_with_single_process(setup: tuple[Path, Path], method: str, strategy: str) -> None:
    root, model = setup
    single, dist = root / f"{method}-single", root / f"{method}-{strategy}"
    one = write_recipe(root / f"{method}-single.yaml", _recipe(root, model, single, method, "single"))
    assert launch(str(one), [], LaunchOptions(nproc=1)) == 0
    two = write_recipe(root / f"{method}-{strategy}.yaml", _recipe(root, model, dist, method, strategy))
    proc = finetune_run(two, "--nproc", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    want, got = step_rows(single), step_rows(dist)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    # the same completions: every reward and length figure equal (sums of the same numbers over the ranks)
    for column in ("reward", "reward_std", "reward/exact_match", "reward/score", "completion_length"):
        assert max(abs(a[column] - b[column]) for a, b in zip(got, want, strict=True)) <= 1e-9, column
    assert min(r["reward_std"] for r in got) > 0  # the groups' rewards differ: the advantages are not zero
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want, strict=True)) <= 1e-4
    assert max_rel([r["grad_norm"] for r in got], [r["grad_norm"] for r in want]) <= LOSS_RTOL
    for column in ("kl", "clip_ratio"):
        assert max(abs(a[column] - b[column]) for a, b in zip(got, want, strict=True)) <= 1e-6, column
    assert min(r["grad_norm"] for r in got) > 1e-3  # every rank's gradient counted
    assert max(r["kl"] for r in got) > 0  # the policy moved from its reference, and the KL term saw it
    if method == "full":  # the second step of each batch: the ratio to the old policy, clipped on some tokens
        assert max(r["clip_ratio"] for r in got) > 0
    weights = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    assert max_weight_diff(dist / weights, single / weights) <= WEIGHT_ATOL


def test_a_reward_function_raising_on_one_rank_stops_every_rank_with_its_sentence(setup: tuple[Path, Path]) -> None:
    """The python reward raises on rank 1 only, while rank 0 scores its completions and would go on to the step's
    sums: the ranks agree on the failure first, so the run ends at once (not after distributed.timeout) with
    exit 2 and one sentence naming the file and the function."""
    import re
    import time

    root, model = setup
    (root / "rank1.py").write_text(
        "import os, pathlib, time\n\n"
        "def score(prompt, completion, answer):\n"
        "    if os.environ.get('RANK') == '1':\n"
        f"        pathlib.Path({str(root / 'raised-at')!r}).write_text(str(time.time()))\n"
        "        raise ValueError('no score on this rank')\n"
        "    return 1.0\n"
    )
    recipe = _recipe(root, model, root / "raises", "full", "fsdp")
    recipe["grpo"]["rewards"] = [{"type": "python", "file": str(root / "rank1.py"), "function": "score"}]
    recipe["distributed"]["timeout"] = 300
    proc = finetune_run(write_recipe(root / "raises.yaml", recipe), "--nproc", "2")
    ended = time.time()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert ended - float((root / "raised-at").read_text()) < 60  # not the 300 s a waiting collective would take
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert re.fullmatch(
        rf"error: rank [01] failed: grpo\.rewards\.0: the reward function `score` of {re.escape(str(root / 'rank1.py'))} "
        r"raised ValueError: no score on this rank; fix the function .*", lines[0]
    ), lines[0]
    assert "Traceback" not in proc.stderr
