"""The training data of a recipe as the trainer reads it, whatever its format (``finetune data`` reads it so too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from finetune.recipe.schema import LoadedRecipe
from finetune.train.data import TaskData, load_data
from finetune.train.data.preference import load_preference_data


def load_task_data(loaded: LoadedRecipe, tokenizer: Any, on_miss: Callable[[str], None] | None = None) -> TaskData:
    """The recipe's train and eval data: preference pairs (data.format: preference), else the rows of the other
    formats, tokenized through the cache (``on_miss(source)`` before a source that is not in it)."""
    if loaded.recipe.data.format == "preference":
        data: TaskData = load_preference_data(loaded, tokenizer, on_miss)
        return data
    return load_data(loaded, tokenizer, on_miss)
