"""eval.retain: forgetting measured during training.

The fast tests read retain files of each format and refuse bad ones. The slow tests share one trained base
(the tiny model taught the reversal task) and fine-tune it on another task (capitals) with the reversal rows
as the retain set: a full fine-tune raises the retain loss, LoRA on the same task and steps raises it less,
and the figures are in metrics.jsonl, the summary line and the report.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from finetune.errors import UserError
from finetune.recipe.schema import check_files, recipe_from_dict
from finetune.train.data.retain import load_retain
from finetune.train.evaluate import EvalResult
from finetune.train.metrics.console import retain_change
from tests.support import RECIPES, TINY_MODEL, clean_env, tiny_recipe, write_jsonl, write_recipe

REVERSE = RECIPES / "data" / "reverse"
RETAIN = RECIPES / "data" / "retain" / "tiny-llama-reverse.jsonl"


def _loaded(tmp_path: Path, retain: Path):
    raw = tiny_recipe(tmp_path / "out", eval={"retain": str(retain)}, data={"cache_dir": str(tmp_path / "cache")})
    return recipe_from_dict(raw, base_dir=tmp_path)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(TINY_MODEL))


def test_retain_rows_are_read_in_their_format(tmp_path: Path, tok) -> None:
    """Instruction and chat rows give prompts with answers; text rows give the loss only."""
    instruction = load_retain(_loaded(tmp_path, RETAIN), tok)
    assert instruction is not None and instruction.format == "instruction"
    assert len(instruction.examples) == len(instruction.prompts) == 64
    first = json.loads(RETAIN.read_text().splitlines()[0])
    assert instruction.prompts[0].answer == first["output"]
    assert tok.decode(instruction.prompts[0].prompt_ids) == f"{first['instruction']}\n{first['input']}\nAnswer: "
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "Reverse the letters: abc -> cba"}] * 3)
    plain = load_retain(_loaded(tmp_path, text), tok)
    assert plain is not None and plain.format == "text" and len(plain.examples) == 3 and plain.prompts == []
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "user", "content": "Rev: abc"}, {"role": "assistant", "content": "cba"}]}])
    talk = load_retain(_loaded(tmp_path, chat), tok)
    assert talk is not None and talk.format == "chat" and [p.answer for p in talk.prompts] == ["cba"]


def test_retain_row_of_no_format_is_one_sentence(tmp_path: Path, tok) -> None:
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"question": "?", "reply": "!"}])
    with pytest.raises(UserError) as err:
        load_retain(_loaded(tmp_path, odd), tok)
    assert str(err.value).startswith(f"eval.retain: {odd}:1: a retain row needs a `text` field")
    assert "it has `question`, `reply`" in str(err.value)


def test_missing_retain_file_is_a_recipe_problem(tmp_path: Path) -> None:
    problems = check_files(_loaded(tmp_path, tmp_path / "nowhere.jsonl"))
    assert [p.key for p in problems] == ["eval.retain"]
    assert "no data found at" in problems[0].message


def test_summary_line_says_the_change() -> None:
    before = EvalResult(None, None, 0, [], retain_loss=2.3111, retain_exact_match=0.75)
    after = EvalResult(0.5, 0.5, 8, [], retain_loss=2.4523, retain_exact_match=0.5)
    assert retain_change(before, after) == "retain: loss 2.31 -> 2.45 (+0.14), exact match 75.0% -> 50.0% (-25.0 points)"
    assert retain_change(None, after) is None


# ------------------------------------------------------------------------------------------------------
# Forgetting, measured: one base taught the reversal, then a full fine-tune and LoRA on capitals
# ------------------------------------------------------------------------------------------------------

BASE_STEPS, STEPS = 40, 8


def _launch(recipe: Path) -> str:
    """The same launch() `finetune run RECIPE` calls, in this process (no interpreter start); what it printed."""
    from finetune.commands.run import LaunchOptions, launch

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = launch(str(recipe), [], LaunchOptions(nproc=1))
    assert code == 0, printed.getvalue()[-3000:]
    return printed.getvalue()


@pytest.fixture(scope="module")
def forgetting(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    d = tmp_path_factory.mktemp("retain")
    retain = write_jsonl(d / "retain.jsonl", [json.loads(x) for x in RETAIN.read_text().splitlines()[:16]])
    base = tiny_recipe(
        d / "base", train={"max_steps": BASE_STEPS, "global_batch_size": 16, "micro_batch_size": 16, "lr": 3e-3,
                           "warmup_steps": 4},
        eval={"at_start": False}, data={"eval": None},
    )
    base["data"].pop("eval")
    _launch(write_recipe(d / "base.yaml", base))
    out: dict[str, Path | str] = {"base": d / "base"}
    for method in ("full", "lora"):
        recipe = tiny_recipe(
            d / method, model={"path": str(d / "base"), "init": "pretrained"}, method=method,
            lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            data={"train": str(RECIPES / "data/uppercase/train.jsonl")},
            train={"max_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 8, "lr": 3e-3},
            eval={"every": STEPS // 2, "max_new_tokens": 6, "retain": str(retain)},
        )
        recipe["data"].pop("eval")
        out[method], out[f"{method}_run"] = d / method, _launch(write_recipe(d / f"{method}.yaml", recipe))
    return out


def _retain_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "retain_loss" in r]


@pytest.mark.slow
def test_full_fine_tuning_forgets_more_than_lora(forgetting) -> None:
    rises = {}
    for method in ("full", "lora"):
        rows = _retain_rows(forgetting[method])
        # before training (eval.at_start's row), at eval.every, and the final evaluation
        assert [r["step"] for r in rows] == [0, STEPS // 2, STEPS]
        assert all(r["retain_exact_match"] is not None for r in rows)
        rises[method] = rows[-1]["retain_loss"] - rows[0]["retain_loss"]
        line = next(x for x in forgetting[f"{method}_run"].splitlines() if x.startswith("retain: loss"))
        assert line.startswith(f"retain: loss {rows[0]['retain_loss']:.2f} -> {rows[-1]['retain_loss']:.2f} ({rises[method]:+.2f})")
    # both start from the same base, so from the same retain loss
    assert _retain_rows(forgetting["full"])[0]["retain_loss"] == pytest.approx(_retain_rows(forgetting["lora"])[0]["retain_loss"], rel=1e-5)
    assert rises["full"] > 0.5, rises
    assert rises["lora"] < rises["full"] / 2, rises


@pytest.mark.slow
def test_report_plots_the_retain_loss(forgetting, tmp_path: Path) -> None:
    from finetune.commands.report import build_figure, load_run

    runs = [load_run(forgetting["full"]), load_run(forgetting["lora"])]
    fig = build_figure(runs)
    ax = next(a for a in fig.axes if a.get_title() == "retain loss (forgetting)")
    plotted = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
    assert plotted["full"] == [r["retain_loss"] for r in _retain_rows(forgetting["full"])]
    assert plotted["lora"] == [r["retain_loss"] for r in _retain_rows(forgetting["lora"])]
    done = subprocess.run(
        [sys.executable, "-m", "finetune", "report", str(forgetting["full"]), "--out", str(tmp_path / "r.html")],
        capture_output=True, text=True, env=clean_env(), timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "retain_loss" in (tmp_path / "r.html").read_text()
