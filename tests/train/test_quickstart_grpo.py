"""recipes/quickstart-grpo.yaml, short, through the CLI: its base is the quickstart's model (recipes/quickstart.yaml
trained here as shipped, its evaluations off), then 10 grpo steps of the recipe with evaluations before and after, on
100 held-out words. The base answers "Reverse these letters." right about one time in five; reinforcing its
own right samples must raise the held-out eval_reward by 0.15 or more in those 10 steps (the recipe's 30 steps
raise it by 0.5 and more: docs/benchmarks.md). A loss of the wrong sign, advantages that are not centred in their
group or completions scored against the wrong answers leave it where it was or lower it. One shared run serves
the metrics' columns, the rise and the report's panels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.commands.report import GRPO_PANELS, build_figure, load_run
from finetune.commands.run import LaunchOptions, launch
from tests.support import RECIPES, finetune_run

pytestmark = pytest.mark.slow

STEPS = 10
COLUMNS = ("reward", "reward_std", "kl", "completion_length", "clip_ratio", "reward/exact_match", "rollout_seconds")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("quickstart-grpo")
    base = root / "quickstart"
    quiet = ["eval.every=0", "eval.at_start=false", "eval.max_samples=4", f"output.dir={base}"]
    assert launch(str(RECIPES / "quickstart.yaml"), quiet, LaunchOptions()) == 0
    out = root / "grpo"
    proc = finetune_run(
        RECIPES / "quickstart-grpo.yaml", "--set", f"model.path={base}", "--set", f"output.dir={out}",
        "--set", f"train.max_steps={STEPS}", "--set", "eval.every=0", "--set", "eval.max_samples=100",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_metrics_rows_carry_the_rollouts_figures(run: tuple[Path, list[dict]]) -> None:
    _, rows = run
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert all(k in r for k in COLUMNS), sorted(r)
        assert 0.0 <= r["reward"] <= 1.0 and r["reward"] == r["reward/exact_match"]  # one reward, weight 1
        assert r["kl"] == 0.0  # grpo.beta 0: no KL term
        assert 1.0 <= r["completion_length"] <= 10.0 and r["rollout_seconds"] > 0
    assert any(r["reward_std"] > 0 for r in steps)  # groups of right and wrong answers: something to learn
    evals = [r for r in rows if "eval_reward" in r]
    assert [r["step"] for r in evals] == [0, STEPS]
    for r in evals:  # the mean reward of the greedy answers: their exact match, with one exact_match reward
        assert r["eval_reward"] == pytest.approx(r["eval_exact_match"])


def test_the_held_out_reward_rises(run: tuple[Path, list[dict]]) -> None:
    _, rows = run
    rewards = [r["eval_reward"] for r in rows if "eval_reward" in r]
    assert 0.05 <= rewards[0] <= 0.45, rewards  # the base half knows the wording
    assert rewards[-1] - rewards[0] >= 0.15, rewards
    sampled = [r["reward"] for r in rows if "loss" in r]
    assert sum(sampled[-3:]) > sum(sampled[:3]), sampled  # its own samples get right more often too


def test_report_draws_the_grpo_panels_from_metrics(run: tuple[Path, list[dict]]) -> None:
    out, rows = run
    fig = build_figure([load_run(out)])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(GRPO_PANELS) <= set(axes)

    def line(title: str, label: str | None = None) -> tuple[list, list]:
        (found,) = [ln for ln in axes[title].lines if label is None or ln.get_label() == label]
        return list(found.get_xdata()), list(found.get_ydata())

    def column(key: str) -> tuple[list, list]:
        have = [r for r in rows if key in r]
        return [r["step"] for r in have], [r[key] for r in have]

    reward_panel, kl_panel, length_panel = GRPO_PANELS
    assert line(reward_panel, "train") == column("reward")
    assert line(reward_panel, "eval") == column("eval_reward")
    (band,) = axes[reward_panel].collections  # reward ± reward_std at every step
    edges = band.get_paths()[0].vertices[:, 1]  # its lower and upper edges
    means, spread = column("reward")[1], column("reward_std")[1]
    assert min(edges) == pytest.approx(min(m - s for m, s in zip(means, spread, strict=True)))
    assert max(edges) == pytest.approx(max(m + s for m, s in zip(means, spread, strict=True)))
    assert line(kl_panel) == column("kl")
    assert line(length_panel) == column("completion_length")

    # An sft run's metrics draw no grpo panel.
    sft = out.parent / "sft-copy"
    sft.mkdir()
    grpo_keys = ("reward", "kl", "clip_ratio", "completion_length", "rollout_seconds", "eval_reward")
    (sft / "metrics.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if not k.startswith(grpo_keys)}) + "\n" for r in rows
    ))
    titles = {ax.get_title() for ax in build_figure([load_run(sft)]).axes}
    assert not titles & set(GRPO_PANELS)
