"""Rows -> token ids and labels, one format at a time: text, instruction, chat, tokenized.

:class:`Encoder` is the function ``datasets.map`` runs (it is pickled to worker processes for
``data.num_proc``). It never raises for a bad row: it returns the row's error (``where: field `x`: what``)
in the ``error`` column, so that every bad row can be reported or counted after the map, and one bad row
in a worker does not kill the pool. Any failure while encoding a row is that row's (:func:`row_error`), and so
is a token id or label the model's embeddings have no row for (``embedding_rows``: the model's vocabulary,
which may differ from the tokenizer's length), whatever the format.

Labels are IGNORE_INDEX (-100) where the loss does not count: the prompt of an instruction, everything but
the assistant turns of a conversation (completion-only loss; ``data.assistant_turns``, ``data.reasoning``:
finetune/train/data/chat.py), unless ``data.train_on_prompt`` is set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from finetune.objectives.loss import IGNORE_INDEX
from finetune.train.data.chat import (
    ChatTemplate,
    assistant_spans,
    check_rendered,
    read_conversation,
    reasoning_spans,
    render_checked,
    span_labels,
)
from finetune.train.data.rows import BadRow, describe, list_value
from finetune.train.data.sources import ROW_COLUMN, WHERE_COLUMN, unreadable

PROMPT_TEMPLATE = "{instruction}\n{input}\nAnswer: "
PROMPT_TEMPLATE_NO_INPUT = "{instruction}\nAnswer: "

# status of an encoded row
OK, TRUNCATED, DROPPED_LONG, NO_LABELS, BAD = "ok", "truncated", "dropped_long", "no_labels", "bad"


class BeyondEmbeddings(Exception):
    """A row's tokens (from the tokenizer, not a field of the row) that the model's embeddings have no row for."""


def row_error(where: str, exc: Exception) -> str:
    """The error of a row that could not be encoded: a :class:`BadRow`'s field and problem, else what failed."""
    return f"{where}: {exc if isinstance(exc, (BadRow, BeyondEmbeddings)) else unreadable(exc)}"


def _string(row: dict[str, Any], col: str, *, optional: bool = False) -> str:
    if col not in row or (optional and row[col] is None):
        if optional:
            return ""
        raise BadRow(col, "missing (set data.columns if your data names it differently)")
    value = row[col]
    if not isinstance(value, str):
        raise BadRow(col, f"expected a string, got {describe(value)}")
    return value


def _int_list(row: dict[str, Any], col: str, *, allow_ignore: bool) -> list[int]:
    value = list_value(row[col])
    if not isinstance(value, list):
        raise BadRow(col, f"expected a list of token ids, got {describe(value)}")
    for i, v in enumerate(value):
        if (
            not isinstance(v, int)
            or isinstance(v, bool)
            or (v < 0 and not (allow_ignore and v == IGNORE_INDEX))
        ):
            raise BadRow(f"{col}[{i}]", f"expected a non-negative integer token id, got {describe(v)}")
    return value


@dataclass
class Encoded:
    """One row as token ids: the training sample, and the prompt/answer for exact-match evaluation."""

    input_ids: list[int]
    labels: list[int]
    prompt_ids: list[int] = field(default_factory=list)
    answer: str = ""


@dataclass
class Encoder:
    """Turns a row (a dict) into an :class:`Encoded` sample according to ``data.format``."""

    tokenizer: Any
    format: str
    columns: dict[str, str]
    max_seq_len: int
    drop_long: bool = False
    train_on_prompt: bool = False
    chat_template: str | None = None
    reasoning: str = "train"  # data.reasoning: train | mask | drop
    assistant_turns: str = "all"  # data.assistant_turns: all | last
    template_name: str = "the chat template"  # which template, in messages
    embedding_rows: int | None = None  # the model's vocabulary (config.json vocab_size); None: the tokenizer's length

    def __post_init__(self) -> None:
        tok = self.tokenizer
        self.eos_id: int | None = tok.eos_token_id
        # Tokenizers that add a BOS (Llama, Gemma) get it at the start of every text and prompt.
        with_special = tok("a")["input_ids"]
        plain = tok("a", add_special_tokens=False)["input_ids"]
        bos = tok.bos_token_id
        self.bos_prefix = (
            [bos] if bos is not None and with_special[:1] == [bos] and plain[:1] != [bos] else []
        )
        self.vocab_size = self.embedding_rows or len(tok)
        text = self.chat_template or getattr(tok, "chat_template", None)
        self.template = ChatTemplate(tok, text, self.template_name) if isinstance(text, str) else None
        self.generation_marks = bool(self.template and self.template.marks)

    def settings(self) -> dict[str, Any]:
        """Everything besides the tokenizer and the data that decides the output (for the cache key)."""
        return {
            "format": self.format,
            "columns": self.columns,
            "max_seq_len": self.max_seq_len,
            "drop_long": self.drop_long,
            "train_on_prompt": self.train_on_prompt,
            "chat_template": self.chat_template,
            "reasoning": self.reasoning,
            "assistant_turns": self.assistant_turns,
            "template_name": self.template_name,
            "embedding_rows": self.embedding_rows,
            # the prompt layout is part of the output: a changed template must not read stale cache entries
            "instruction_templates": [PROMPT_TEMPLATE, PROMPT_TEMPLATE_NO_INPUT],
        }

    def required_columns(self) -> list[str]:
        """Columns a tabular source must have for this format."""
        c = self.columns
        return {
            "text": [c["text"]],
            "instruction": [c["instruction"], c["output"]],
            "chat": [c["messages"]],
            "tokenized": [c["input_ids"]],
        }[self.format]

    # -------------------------------------------------------------------------------------------- map

    def __call__(self, example: dict[str, Any], index: int, source: str = "") -> dict[str, Any]:
        """``datasets.map`` function: the encoded, length-checked row, or its error."""
        where = example.get(WHERE_COLUMN) or f"{source}: row {index}"
        out: dict[str, Any] = {
            "input_ids": [],
            "labels": [],
            "prompt_ids": [],
            "answer": "",
            "status": OK,
            "error": "",
        }
        try:
            row = json.loads(example[ROW_COLUMN]) if ROW_COLUMN in example else example
            enc = self.encode(row)
            self.check_ids(enc.input_ids, enc.labels)
        except Exception as exc:  # whatever the row holds, it is that row's problem
            out.update(status=BAD, error=row_error(where, exc))
            return out
        out.update(prompt_ids=enc.prompt_ids, answer=enc.answer)
        ids, labels = enc.input_ids, enc.labels
        if len(ids) > self.max_seq_len:
            if self.drop_long:
                out["status"] = DROPPED_LONG
                return out
            ids, labels = ids[: self.max_seq_len], labels[: self.max_seq_len]
            out["status"] = TRUNCATED
        # labels[0] is never a target (nothing predicts the first token)
        if all(label == IGNORE_INDEX for label in labels[1:]):
            out["status"] = NO_LABELS
            return out
        out.update(input_ids=ids, labels=labels)
        return out

    def check_ids(self, ids: list[int], labels: list[int]) -> None:
        """Every token id and label (but -100) must have a row in the model's embeddings, or the forward would
        index past them (on a GPU: a device-side assert hours in). Raises :class:`BadRow` naming the first."""
        c = self.columns
        what = "the model's embeddings" if self.embedding_rows else "the tokenizer's vocabulary"
        for col, values in ((c.get("input_ids", "input_ids"), ids), (c.get("labels", "labels"), labels)):
            beyond = next((i for i, v in enumerate(values) if v >= self.vocab_size), None)
            if beyond is None:
                continue
            if self.format == "tokenized":
                raise BadRow(f"{col}[{beyond}]", f"token id {values[beyond]} is not in {what} of {self.vocab_size}")
            raise BeyondEmbeddings(
                f"the tokenizer gives token id {values[beyond]}, which is not in {what} of {self.vocab_size}: the "
                "tokenizer does not belong to the model (or its added tokens were never given embeddings)"
            )

    def encode(self, row: dict[str, Any]) -> Encoded:
        """Encode one row (raises :class:`BadRow`)."""
        return getattr(self, f"_encode_{self.format}")(row)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ---------------------------------------------------------------------------------------- formats

    def _encode_text(self, row: dict[str, Any]) -> Encoded:
        col = self.columns["text"]
        text = _string(row, col)
        if not text:
            raise BadRow(col, "is empty")
        ids = self.bos_prefix + self._ids(text) + ([self.eos_id] if self.eos_id is not None else [])
        return Encoded(ids, list(ids))

    def _encode_instruction(self, row: dict[str, Any]) -> Encoded:
        c = self.columns
        instruction = _string(row, c["instruction"])
        given = _string(row, c["input"], optional=True)
        output = _string(row, c["output"])
        prompt = (
            PROMPT_TEMPLATE.format(instruction=instruction, input=given)
            if given
            else PROMPT_TEMPLATE_NO_INPUT.format(instruction=instruction)
        )
        p = self.bos_prefix + self._ids(prompt)
        completion = self._ids(output) + ([self.eos_id] if self.eos_id is not None else [])
        ids = p + completion
        labels = list(ids) if self.train_on_prompt else [IGNORE_INDEX] * len(p) + completion
        return Encoded(ids, labels, p, output)

    def _encode_tokenized(self, row: dict[str, Any]) -> Encoded:
        c = self.columns
        if c["input_ids"] not in row:
            raise BadRow(
                c["input_ids"], "missing (set data.columns.input_ids if your data names it differently)"
            )
        ids = _int_list(row, c["input_ids"], allow_ignore=False)
        if not ids:
            raise BadRow(c["input_ids"], "is empty")
        self.check_ids(ids, [])
        if row.get(c["labels"]) is None:
            return Encoded(list(ids), list(ids))
        labels = _int_list(row, c["labels"], allow_ignore=True)
        if len(labels) != len(ids):
            raise BadRow(c["labels"], f"has {len(labels)} values but {c['input_ids']} has {len(ids)}")
        return Encoded(list(ids), list(ids) if self.train_on_prompt else list(labels))

    # ------------------------------------------------------------------------------------------- chat

    def render(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """The conversation as text, through the chat template."""
        assert self.template is not None, "a conversation is rendered with a chat template"
        return self.template.render(messages, tools, add_generation_prompt=add_generation_prompt)

    def _encode_chat(self, row: dict[str, Any]) -> Encoded:
        t = self.template
        assert t is not None, "the chat format has a chat template (data.chat_template or the tokenizer's)"
        conv = read_conversation(
            row, self.columns["messages"], self.columns.get("tools", "tools"), reasoning=self.reasoning,
            need_assistant=not self.train_on_prompt,
        )
        text = render_checked(t, conv)
        check_rendered(t, conv)
        if self.train_on_prompt:
            ids = self._ids(text)
            labels = list(ids)
        else:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            turns = conv.assistants[-1:] if self.assistant_turns == "last" else conv.assistants
            trained = assistant_spans(t, conv, text, turns)
            masked = reasoning_spans(t, conv, text, turns) if self.reasoning == "mask" else []
            labels = span_labels(ids, enc["offset_mapping"], trained, masked)
        # exact match: the conversation up to its last assistant message, whose content is the answer (not when
        # that message calls tools or reasons first: its text is more than the content)
        last = conv.assistants[-1] if conv.assistants else None
        if last is None or set(conv.messages[last]) & {"tool_calls", "reasoning_content"}:
            return Encoded(ids, labels)
        prompt = t.render(conv.messages[:last], conv.tools, add_generation_prompt=True)
        return Encoded(ids, labels, self._ids(prompt), conv.messages[last]["content"])
