"""The recipe schema: every error at once, with key path, YAML line and a suggestion; overrides; shipped recipes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from finetune.recipe.schema import RecipeError, check_files, load_recipe
from tests.support import RECIPES, tiny_recipe, write_recipe

BAD = """\
model:
  path: tiny-llama
  init: random
method: lora
lora:
  rank: 8
data:
  train: data/reverse/train.jsonl
  max_seq_len: lots
trian:
  lr: 1.0e-3
precision: fp8
"""


def test_every_error_at_once_with_lines_and_suggestions(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    by_key = {p.key: p for p in info.value.problems}
    assert set(by_key) == {"lora.rank", "data.max_seq_len", "trian", "precision"}
    assert by_key["lora.rank"].line == 6 and "did you mean `r`?" in by_key["lora.rank"].message
    assert by_key["trian"].line == 10 and "did you mean `train`?" in by_key["trian"].message
    assert by_key["data.max_seq_len"].line == 9 and "'lots'" in by_key["data.max_seq_len"].message
    assert by_key["precision"].line == 12 and "fp8" in by_key["precision"].message
    assert all(p.file == str(path) for p in info.value.problems)


def test_validate_cli_exit_code_two_and_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    proc = subprocess.run([sys.executable, "-m", "finetune", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(lines) == 4
    assert any(f"{path}:10: trian: unknown key; did you mean `train`?" in ln for ln in lines)


def test_missing_files_are_reported_with_their_keys(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path / "out")
    recipe["model"]["path"] = str(tmp_path / "no-such-model")
    recipe["data"]["train"] = "nowhere/train.jsonl"
    loaded = load_recipe(write_recipe(tmp_path / "r.yaml", recipe))
    problems = {p.key: p for p in check_files(loaded)}
    assert set(problems) == {"model.path", "data.train"}
    assert "nor a Hub id (org/name)" in problems["model.path"].message
    assert problems["data.train"].line == 6  # model: path: init: method: data: train:


def test_overrides_are_read_as_yaml_and_typed(tmp_path: Path) -> None:
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out"))
    loaded = load_recipe(
        path, ["lora.target_modules=[q_proj,k_proj,v_proj]", "train.lr=3e-4", "method=lora", "train.max_steps=7"]
    )
    r = loaded.recipe
    assert r.lora.target_modules == ["q_proj", "k_proj", "v_proj"]
    assert r.train.lr == pytest.approx(3e-4) and r.train.max_steps == 7 and r.method == "lora"


def test_bad_overrides_name_the_flag(tmp_path: Path) -> None:
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out"))
    with pytest.raises(RecipeError) as info:
        load_recipe(path, ["train.lrr=1", "train.max_steps=many", "nokey"])
    text = str(info.value)
    assert "--set train.lrr: unknown key `lrr`; did you mean `lr`?" in text
    assert "--set train.max_steps:" in text and "'many'" in text
    assert "--set nokey: expected KEY=VALUE" in text


def test_defaults_a_user_expects(tmp_path: Path) -> None:
    r = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path / "out", method="lora"))).recipe
    assert (r.lora.r, r.lora.alpha, r.lora.target_modules) == (8, 16.0, None)  # None: peft's per-architecture default


def test_not_yaml_and_missing_recipe(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  path: [unclosed\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "not valid YAML" in str(info.value)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "absent.yaml")


def test_a_key_written_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys silently: a stray `model:` line would replace the whole section."""
    path = tmp_path / "twice.yaml"
    path.write_text(
        "model: SmolLM2 learns to answer\nmethod: full\nmodel:\n  path: tiny-llama\n  init: random\n"
        "data:\n  train: data/reverse/train.jsonl\n  max_seq_len: 32\n  max_seq_len: 64\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "finetune", "validate", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stdout + result.stderr == (
        f"error: {path}:3: model: written twice (lines 1 and 3); keep one of them\n"
        f"error: {path}:9: data.max_seq_len: written twice (lines 8 and 9); keep one of them\n"
    )


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path: Path) -> None:
    loaded = load_recipe(path)
    problems = check_files(loaded)
    # A recipe that continues from another recipe's output (model.path: runs/...) can only name a model
    # that does not exist yet; everything else it names must exist.
    if loaded.recipe.model.path.startswith("runs/"):
        problems = [p for p in problems if p.key != "model.path"]
    # The SmolLM2 recipes name the model scripts/get_smollm2.py converts (the `smollm2` extra); without it
    # that one problem is expected, and nothing else may be wrong.
    if loaded.recipe.model.path.startswith("~/.cache/finetune/models/") and not Path(
        loaded.recipe.model.path
    ).expanduser().is_dir():
        missing = [p for p in problems if p.key == "model.path"]
        assert missing, "the SmolLM2 model is absent, so model.path should be reported"
        problems = [p for p in problems if p.key != "model.path"]
    assert problems == []


def test_help_and_validate_import_no_torch() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from finetune.cli import app\n"
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output\n"
        f"r = CliRunner().invoke(app, ['validate', {str(RECIPES / 'quickstart.yaml')!r}]); assert r.exit_code == 0, r.output\n"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'datasets', 'bitsandbytes') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
