"""The small commands: `python -m finetune`, `finetune recipes ls/cp`, and a user's mistake on `run`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from finetune.recipe.schema import load_recipe

CMD = [sys.executable, "-m", "finetune"]


def test_recipes_ls_lists_the_shipped_recipes_with_their_description() -> None:
    proc = subprocess.run([*CMD, "recipes", "ls"], capture_output=True, text=True, check=True)
    lines = {ln.split()[0]: ln for ln in proc.stdout.splitlines()}
    assert "quickstart" in lines and "quickstart-lora" in lines
    assert "reverse words" in lines["quickstart"]


def test_recipes_cp_copies_a_recipe_that_still_validates_elsewhere(tmp_path: Path) -> None:
    proc = subprocess.run([*CMD, "recipes", "cp", "quickstart", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    copied = tmp_path / "quickstart.yaml"
    loaded = load_recipe(copied)
    # model.path: tiny-llama and data/... resolve to the shipped files from anywhere
    assert loaded.resolve_input(loaded.recipe.model.path).joinpath("config.json").is_file()
    assert loaded.resolve_input(loaded.recipe.data.train).is_file()
    again = subprocess.run([*CMD, "recipes", "cp", "quickstart", str(tmp_path)], capture_output=True, text=True)
    assert again.returncode == 2 and "already exists" in again.stderr
    unknown = subprocess.run([*CMD, "recipes", "cp", "nope", str(tmp_path)], capture_output=True, text=True)
    assert unknown.returncode == 2 and "no shipped recipe named `nope`" in unknown.stderr


def test_run_with_a_missing_model_is_one_clear_line(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model:\n  path: someone/not-downloaded\nmethod: full\ndata:\n  train: data/reverse/train.jsonl\n"
        f"output:\n  dir: {tmp_path / 'out'}\n"
    )
    # --offline: without it the run would try to download the id (tests/train/test_hub.py covers that path)
    proc = subprocess.run(
        [*CMD, "run", str(recipe), "--offline"], capture_output=True, text=True,
        cwd=Path(__file__).parents[2] / "recipes",
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert (
        f"{recipe}:2: model.path: `someone/not-downloaded` is neither a local directory nor a model in the Hugging "
        "Face cache, and downloads are off (HF_HUB_OFFLINE=1 or --offline)"
    ) in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.slow  # a CLI subprocess
def test_sharded_strategy_on_one_process_and_bad_counts_are_refused(tmp_path: Path) -> None:
    recipe = Path(__file__).parents[2] / "recipes" / "quickstart.yaml"
    for strategy in ("zero1", "fsdp"):
        proc = subprocess.run(
            [*CMD, "run", str(recipe), "--set", f"distributed.strategy={strategy}", "--set", f"output.dir={tmp_path / strategy}"],
            capture_output=True, text=True,
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert f"`{strategy}` shards over several processes but this run has one" in proc.stderr
    zero = subprocess.run([*CMD, "run", str(recipe), "--nproc", "0"], capture_output=True, text=True)
    assert zero.returncode == 2 and "Traceback" not in zero.stderr and "--nproc" in zero.stderr


def test_recipes_cp_into_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([*CMD, "recipes", "cp", "quickstart", str(tmp_path / "no" / "x.yaml")], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is not a directory; create it first" in proc.stderr
