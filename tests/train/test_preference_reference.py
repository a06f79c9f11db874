"""dpo's reference through real short runs: the precomputed log-probabilities read back from the cache by a second
run (the same losses, bit for bit), recomputed for another reference; dpo.reference_model as the frozen copy and
as the precomputed reference (the same losses either way, and not the start's log 2); the report's preference
panels drawn from exactly a run's metrics.jsonl.

Every run: full fine-tuning of a 2-block Llama (hidden 64), fp32, 2 steps of 4 pairs out of 8, 4 eval pairs.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from finetune.commands.report import PREFERENCE_PANELS, build_figure, load_run
from finetune.commands.run import LaunchOptions, launch
from tests.support import RECIPES, micro_model_dir, step_rows, write_recipe

pytestmark = pytest.mark.slow

MICRO = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32}
LOG2 = math.log(2)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The policy's model (random init, seed 0), the same architecture drawn with seed 1 and saved (the other
    reference), and the pairs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("dpo-reference")
    micro_model_dir(root / "micro", **MICRO)
    other = micro_model_dir(root / "other", **MICRO)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(other), dtype=torch.float32).save_pretrained(other)
    for name, n in (("train", 8), ("eval", 4)):
        lines = (RECIPES / f"data/reverse-preference/{name}.jsonl").read_text().splitlines()[:n]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _run(root: Path, name: str, reference: str, reference_model: str | None = None) -> tuple[Path, str]:
    """One run through the launcher; its output dir and what it printed."""
    out = root / name
    recipe = {
        "model": {"path": str(root / "micro"), "init": "random"},
        "method": "full",
        "data": {"train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl"), "format": "preference",
                 "max_seq_len": 48, "cache_dir": str(root / "cache")},
        "train": {"objective": "dpo", "max_steps": 2, "global_batch_size": 4, "micro_batch_size": 4, "lr": 3e-3,
                  "seed": 0},
        "dpo": {"beta": 0.5, "reference": reference, "reference_model": reference_model},
        "precision": "fp32",
        "distributed": {"strategy": "single"},
        "eval": {"every": 1, "max_samples": 4, "max_new_tokens": 2, "batch_size": 4},
        "output": {"dir": str(out), "log_every": 1},
    }
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # rich's console writes to the sys.stdout of the moment
        assert launch(str(write_recipe(root / f"{name}.yaml", recipe)), [], LaunchOptions()) == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def runs(root: Path) -> dict[str, tuple[Path, str]]:
    other = str(root / "other")
    return {
        "first": _run(root, "first", "precomputed"),
        "again": _run(root, "again", "precomputed"),
        "other-precomputed": _run(root, "other-precomputed", "precomputed", other),
        "other-model": _run(root, "other-model", "model", other),
    }


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in step_rows(out)]


def test_second_run_reads_the_cached_reference_log_probs(runs: dict[str, tuple[Path, str]], root: Path) -> None:
    (first, said_first), (again, said_again) = runs["first"], runs["again"]
    cached = sorted((root / "cache").glob("reference-logps-*.safetensors"))
    assert len(cached) == 2  # the start's and the other model's
    assert "the reference log-probabilities of 12 pairs were computed and stored in the cache" in said_first
    assert "the reference log-probabilities of 12 pairs were read from the cache" in said_again
    assert "reference_logps_cached 1" in said_again and "reference_logps_cached" not in said_first
    assert _losses(again) == _losses(first)  # exactly: the same float64 values, read back
    assert [r["rewards/margin"] for r in step_rows(again)] == [r["rewards/margin"] for r in step_rows(first)]
    assert _losses(first)[0] == pytest.approx(LOG2, abs=1e-7)  # the policy is its reference at the first step


def test_reference_model_is_the_reference_copied_or_precomputed(runs: dict[str, tuple[Path, str]]) -> None:
    """Another checkpoint as the reference: its log-probs are computed (not the cached ones of the start), the
    first loss is no longer log 2, and the frozen copy gives the losses the precomputed pass gives."""
    (pre, said), (copy, _) = runs["other-precomputed"], runs["other-model"]
    assert "were computed and stored in the cache" in said
    first = _losses(pre)[0]
    assert abs(first - LOG2) > 1e-3, first
    assert _losses(copy) == pytest.approx(_losses(pre), rel=1e-5)
    saved = json.loads((runs["first"][0] / "plan.json").read_text())["chosen"]["memory"]["params"]
    with_copy = json.loads((copy / "plan.json").read_text())["chosen"]["memory"]["params"]
    assert with_copy > saved  # the frozen copy of the other model is counted


def test_report_draws_the_preference_panels_from_metrics(runs: dict[str, tuple[Path, str]]) -> None:
    out = runs["other-model"][0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    fig = build_figure([load_run(out)])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(PREFERENCE_PANELS) <= set(axes)

    def line(title: str, label: str) -> tuple[list, list]:
        (found,) = [ln for ln in axes[title].lines if ln.get_label() == label]
        return list(found.get_xdata()), list(found.get_ydata())

    def column(key: str, scale: float = 1.0) -> tuple[list, list]:
        have = [r for r in rows if key in r]
        return [r["step"] for r in have], [scale * r[key] for r in have]

    assert line("reward accuracy", "train") == column("rewards/accuracy", 100.0)
    assert line("reward accuracy", "eval") == column("eval_rewards/accuracy", 100.0)
    assert column("eval_rewards/accuracy")[0] == [0, 1, 2]  # before training and after each step
    assert line("reward margin", "train") == column("rewards/margin")
    assert line("reward margin", "eval") == column("eval_rewards/margin")
    for what in ("chosen", "rejected"):
        assert line("chosen and rejected rewards", f"train {what}") == column(f"rewards/{what}")
        assert line("chosen and rejected rewards", f"eval {what}") == column(f"eval_rewards/{what}")
    assert any(v != 0 for v in column("rewards/margin")[1])  # another reference: the margins are not all 0

    # An sft run's metrics draw no preference panel.
    sft = out.parent / "sft-copy"
    sft.mkdir()
    (sft / "metrics.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if "rewards/" not in k and "logps/" not in k}) + "\n" for r in rows
    ))
    titles = {ax.get_title() for ax in build_figure([load_run(sft)]).axes}
    assert not titles & set(PREFERENCE_PANELS)
