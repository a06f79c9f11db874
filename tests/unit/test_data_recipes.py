"""The shipped recipes of each data format validate, and the chat one loads the shipped chat data."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from finetune.recipe.schema import check_files, load_recipe
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


def test_agent_recipe_loads_the_shipped_agent_data(tmp_path):
    """recipes/agent-tools.yaml: every conversation's tool call and reasoning reach its template and train."""
    loaded = load_recipe(RECIPES / "agent-tools.yaml", [f"data.cache_dir={tmp_path}"])
    assert check_files(loaded) == []
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    data = load_data(loaded, tok)
    s = data.stats
    assert (s["train_samples"], s["eval"], s["truncated"], s["dropped"], s["skipped_bad_rows"]) == (600, 50, 0, 0, 0)
    # exact match where the last answer is the tool's result; a follow-up answered after reasoning has no prompt
    assert s["eval_prompts"] == sum("Now in capitals." not in tok.decode(e.input_ids) for e in data.eval)
    first = data.samples[0]
    trained = tok.decode([t for t, label in zip(first.input_ids, first.labels, strict=True) if label != -100])
    assert trained == (
        "<think>\neufmned has 7 letters. The reverse tool spells it backwards.\n</think>\n\n<tool_call>\n"
        '{"name": "reverse", "arguments": {"word": "eufmned"}}\n</tool_call><|im_end|></s>denmfue<|im_end|></s>'
    )
