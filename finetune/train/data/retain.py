"""``eval.retain``: data the model should keep doing well on, read and tokenized like the task's data.

A retain file holds rows of one of the training formats, told apart by their fields (named by
``data.columns``): ``messages`` (chat), ``instruction`` and ``output`` (instruction), ``text`` (text). Its
loss counts what training would count (the answer of an instruction or chat row, every token of a text row),
and instruction and chat rows also give a prompt and the exact answer expected from greedy generation. The
same :class:`~finetune.train.data.formats.Encoder` and tokenization cache as ``data.train`` are used, so a
retain row is measured exactly as a training row of that format would be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.recipe.schema import LoadedRecipe
from finetune.train.data import (
    EncodedRows,
    EvalPrompt,
    Example,
    check_bad_rows,
    default_cache_dir,
    embedding_rows,
    encode_source,
    local_rank_zero_first,
    resolve_chat_template,
)
from finetune.train.data.cache import digests_dir
from finetune.train.data.formats import Encoder
from finetune.train.data.sources import ROW_COLUMN, WHERE_COLUMN, Source, read_sources

KEY = "eval.retain"


@dataclass
class RetainData:
    """The retain set as the evaluation uses it: samples for the loss, prompts with answers for exact match."""

    examples: list[Example]
    prompts: list[EvalPrompt] = field(default_factory=list)
    format: str = "text"
    source: str = ""

    def describe(self) -> str:
        """One line for the run's header: how many rows, their format, how many have answers."""
        answers = f", {len(self.prompts)} with answers" if self.prompts else ""
        return f"eval.retain: {len(self.examples)} {self.format} rows{answers} from {self.source}"


def row_format(row: dict[str, Any], columns: dict[str, str]) -> str | None:
    """The data format a retain row is written in, by its fields (None when it has none of them)."""
    if columns["messages"] in row:
        return "chat"
    if columns["instruction"] in row and columns["output"] in row:
        return "instruction"
    if columns["text"] in row:
        return "text"
    return None


def _first_row(src: Source) -> tuple[dict[str, Any], str]:
    """The first row of a source and where it is (file:line)."""
    if len(src.dataset) == 0:
        raise UserError(f"{KEY}: {src.name} has no rows; give a file with at least one row")
    first = src.dataset[0]
    if src.is_json_rows:
        return json.loads(first[ROW_COLUMN]), first[WHERE_COLUMN]
    return dict(first), f"{src.name}: row 0"


def load_retain(loaded: LoadedRecipe, tokenizer: Any) -> RetainData | None:
    """Read and tokenize ``eval.retain`` (None when the recipe has none); one sentence naming the key for a file
    whose rows are of no known format, or that has no usable row."""
    inputs = loaded.inputs
    assert inputs is not None, "load_recipe resolves the inputs"
    if inputs.retain is None:
        return None
    d = loaded.recipe.data
    columns = d.columns.model_dump()
    with local_rank_zero_first():
        cache_dir = Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()
        sources = list(read_sources(inputs.retain, KEY, "train", [], digests_dir(cache_dir)))
        row, where = _first_row(sources[0])
        fmt = row_format(row, columns)
        if fmt is None:
            raise UserError(
                f"{KEY}: {where}: a retain row needs a `{columns['text']}` field (text), `{columns['instruction']}` "
                f"and `{columns['output']}` (instruction) or `{columns['messages']}` (chat), named as in data.columns; "
                f"it has {', '.join(f'`{k}`' for k in row) or 'no fields'}"
            )
        template = resolve_chat_template(loaded, tokenizer) if fmt == "chat" else None
        encoder = Encoder(
            tokenizer, fmt, columns, d.max_seq_len, d.drop_long, False, template, embedding_rows=embedding_rows(loaded)
        )
        enc = EncodedRows()
        for src in sources:
            enc.extend(encode_source(src, encoder, cache_dir, d.num_proc))
        check_bad_rows(enc, d.on_bad_row)
    if not enc.examples:
        raise UserError(f"{KEY}: no usable rows in `{loaded.recipe.eval.retain}` (every row was too long or empty)")
    prompts = [p for p in enc.prompts if p is not None]
    return RetainData(enc.examples, prompts, fmt, str(loaded.recipe.eval.retain))
