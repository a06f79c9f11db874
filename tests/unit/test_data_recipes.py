"""The shipped recipes of each data format validate, and the chat one loads the shipped chat data."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from finetune.recipe import check_files, load_recipe
from finetune.train.data import load_data
from tests.support import RECIPES, TINY_MODEL

FORMAT_RECIPES = ["chat-reverse", "instruction-uppercase", "text-reverse", "tokenized-uppercase"]


@pytest.mark.parametrize("name", FORMAT_RECIPES)
def test_format_recipe_validates(name):
    loaded = load_recipe(RECIPES / f"{name}.yaml")
    assert loaded.recipe.data.format == name.split("-")[0]
    assert check_files(loaded) == []


def test_chat_recipe_loads_the_shipped_chat_data(tmp_path):
    loaded = load_recipe(RECIPES / "chat-reverse.yaml", [f"data.cache_dir={tmp_path}"])
    data = load_data(loaded, AutoTokenizer.from_pretrained(TINY_MODEL))
    s = data.stats
    assert (s["train_samples"], s["eval"], s["eval_prompts"]) == (4000, 200, 200)
    assert (s["truncated"], s["dropped"], s["skipped_bad_rows"]) == (0, 0, 0)
    assert s["train"] <= 4000 / 4  # packed: four or more conversations per 256-token row
    assert s["padding_fraction"] < 0.1
    first = data.eval_prompts[0]
    assert first.answer == "yumroo"
    assert AutoTokenizer.from_pretrained(TINY_MODEL).decode(first.prompt_ids) == (
        "User: Reverse the letters: oormuy\nAssistant: "
    )


def test_validate_reports_a_missing_chat_template_file():
    loaded = load_recipe(RECIPES / "chat-reverse.yaml", ["data.chat_template=missing.jinja"])
    assert [str(p) for p in check_files(loaded)] == [
        "--set: data.chat_template: no template file at `missing.jinja` (a template itself contains {%)"
    ]
