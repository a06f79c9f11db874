"""Early stopping's rules: the recipe's sentences, the patience count, its state, and pruning that keeps the best."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.errors import UserError
from finetune.recipe.schema import EarlyStoppingConfig, RecipeError, load_recipe
from finetune.train.checkpoint import checkpointer as ck
from finetune.train.checkpoint.early_stopping import EarlyStopping
from finetune.train.evaluate import EvalResult
from tests.support import tiny_recipe, write_recipe


def _problems(tmp_path: Path, **sections: dict) -> list[str]:
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out", **sections))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    return [str(p) for p in info.value.problems]


def test_early_stopping_without_evaluation_is_one_sentence(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    assert _problems(tmp_path, train={"early_stopping": {"patience": 2}}) == [
        f"{path}:15: train.early_stopping: it compares evaluations during training, but eval.every is 0 (one "
        "evaluation, at the end); set eval.every, e.g. eval.every: 100"
    ]
    [problem] = _problems(tmp_path, data={"eval": None}, train={"early_stopping": {}}, eval={"every": 5})
    assert problem.endswith(
        "train.early_stopping.metric: eval_loss is measured on held-out data, which the recipe does not have; set "
        "data.eval or data.eval_fraction"
    )
    [problem] = _problems(tmp_path, train={"early_stopping": {"metric": "retain_loss"}}, eval={"every": 5})
    assert problem.endswith(
        "train.early_stopping.metric: retain_loss is measured on eval.retain, which the recipe does not set; set "
        "eval.retain or watch eval_loss"
    )


def test_the_metric_and_its_direction(tmp_path: Path) -> None:
    every = {"every": 5}
    [problem] = _problems(tmp_path, train={"early_stopping": {"metric": "loss"}}, eval=every)
    assert problem.endswith(
        "train.early_stopping: metric `loss` is not an evaluation's figure; use eval_loss, eval_exact_match, "
        "retain_loss or another eval_* / retain_* column of metrics.jsonl"
    )
    [problem] = _problems(tmp_path, train={"early_stopping": {"metric": "eval_logps/chosen"}}, eval=every)
    assert problem.endswith(
        "train.early_stopping: cannot tell whether a higher or a lower eval_logps/chosen is better; set "
        "train.early_stopping.mode: min or max"
    )
    assert EarlyStoppingConfig().better == "min"
    assert EarlyStoppingConfig(metric="eval_exact_match").better == "max"
    assert EarlyStoppingConfig(metric="eval_rewards/margin").better == "max"
    assert EarlyStoppingConfig(metric="eval_logps/chosen", mode="max").better == "max"
    with pytest.raises(UserError) as err:
        EarlyStopping(EarlyStoppingConfig(metric="eval_rewards/accuracy"), ["eval_loss", "eval_exact_match"])
    assert str(err.value) == (
        "train.early_stopping.metric: this run's evaluations do not report eval_rewards/accuracy; they report "
        "eval_loss, eval_exact_match: choose one of them"
    )


def _ev(loss: float, exact: float = 0.0) -> EvalResult:
    return EvalResult(loss=loss, exact_match=exact, n_prompts=8, samples=[])


def _same(value: float | None) -> float | None:
    return value


def test_patience_counts_evaluations_without_an_improvement_beyond_min_delta() -> None:
    early = EarlyStopping(EarlyStoppingConfig(patience=2, min_delta=0.05), ["eval_loss", "eval_exact_match"])
    verdicts = [early.observe(step, _ev(loss), _same) for step, loss in
                [(10, 2.0), (20, 1.5), (30, 1.48), (40, 1.2), (50, 1.3), (60, 1.17)]]
    # 1.48 is not 0.05 below 1.5; 1.17 is not 0.05 below 1.2: the second in a row stops
    assert [(v.improved, v.stop) for v in verdicts] == [
        (True, False), (True, False), (False, False), (True, False), (False, False), (False, True)
    ]
    assert (early.best_step, early.best_value, early.stopped_at, early.bad_evaluations) == (40, 1.2, 60, 2)
    assert early.summary(100) == (
        "early stopping: stopped after step 60 of 100 (2 evaluation(s) without an improvement); best eval_loss "
        "1.2000 at step 40 (checkpoints/step-40)"
    )
    higher = EarlyStopping(EarlyStoppingConfig(metric="eval_exact_match", patience=1), ["eval_loss", "eval_exact_match"])
    assert higher.observe(5, _ev(3.0, 0.25), _same).improved and higher.observe(10, _ev(1.0, 0.5), _same).improved
    assert higher.observe(15, _ev(0.5, 0.5), _same).stop and higher.best_step == 10


def test_the_state_resumes_exactly() -> None:
    config = EarlyStoppingConfig(patience=3)
    first = EarlyStopping(config, ["eval_loss"])
    for step, loss in [(1, 3.0), (2, 2.5), (3, 2.7)]:
        first.observe(step, _ev(loss), _same)
    saved = json.loads(json.dumps(first.state_dict()))  # as meta.json holds it
    again = EarlyStopping(config, ["eval_loss"])
    again.load_state_dict(saved)
    assert again.state_dict() == first.state_dict() == {
        "metric": "eval_loss", "best_value": 2.5, "best_step": 2, "bad_evaluations": 1, "stopped_at": None
    }
    for step, loss in [(4, 2.6), (5, 2.55)]:
        assert [e.observe(step, _ev(loss), _same).stop for e in (first, again)] == [step == 5] * 2
    # a checkpoint that watched another figure starts the count afresh
    other = EarlyStopping(EarlyStoppingConfig(metric="eval_exact_match"), ["eval_loss", "eval_exact_match"])
    other.load_state_dict(saved)
    assert (other.best_step, other.bad_evaluations) == (None, 0)


def test_pruning_never_deletes_the_best_checkpoint(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        (ck.checkpoints_dir(tmp_path) / f"step-{step}").mkdir(parents=True)
        (ck.checkpoints_dir(tmp_path) / f"step-{step}" / ck.META).write_text("{}")
    ck.write_best(tmp_path, {"step": 2, "checkpoint": "checkpoints/step-2"})
    assert ck.best_step(tmp_path) == 2
    deleted = ck.prune(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step-1", "step-3"]
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 4, 5]
    ck.write_best(tmp_path, None)
    assert ck.best_step(tmp_path) is None and [p.name for p in ck.prune(tmp_path, keep=2)] == ["step-2"]
