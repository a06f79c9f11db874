"""Rows -> token ids and labels, one format at a time: text, instruction, chat, tokenized.

:class:`Encoder` is the function ``datasets.map`` runs (it is pickled to worker processes for
``data.num_proc``). It never raises for a bad row: it returns the row's error (``where: field `x`: what``)
in the ``error`` column, so that every bad row can be reported or counted after the map, and one bad row
in a worker does not kill the pool.

Labels are IGNORE_INDEX (-100) where the loss does not count: the prompt of an instruction, everything but
the assistant turns of a conversation (completion-only loss), unless ``data.train_on_prompt`` is set.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from finetune.loss import IGNORE_INDEX
from finetune.train.data.sources import ROW_COLUMN, WHERE_COLUMN

PROMPT_TEMPLATE = "{instruction}\n{input}\nAnswer: "
PROMPT_TEMPLATE_NO_INPUT = "{instruction}\nAnswer: "
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")

# status of an encoded row
OK, TRUNCATED, DROPPED_LONG, NO_LABELS, BAD = "ok", "truncated", "dropped_long", "no_labels", "bad"


class BadRow(Exception):
    """A row that cannot be used: which field, and what is wrong with it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"field `{field}`: {problem}")


def describe(value: Any) -> str:
    """A short description of a JSON value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value[:30]!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _string(row: dict[str, Any], col: str, *, optional: bool = False) -> str:
    if col not in row or (optional and row[col] is None):
        if optional:
            return ""
        raise BadRow(col, "missing (set data.columns if your data names it differently)")
    value = row[col]
    if not isinstance(value, str):
        raise BadRow(col, f"expected a string, got {describe(value)}")
    return value


def _list_value(value: Any) -> Any:
    """A list written as JSON text (how a .csv cell holds one) is read as the list; anything else is kept."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _int_list(row: dict[str, Any], col: str, *, allow_ignore: bool) -> list[int]:
    value = _list_value(row[col])
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
        self.vocab_size = len(tok)
        self.generation_marks = bool(self.chat_template and GENERATION_MARK.search(self.chat_template))

    def settings(self) -> dict[str, Any]:
        """Everything besides the tokenizer and the data that decides the output (for the cache key)."""
        return {
            "format": self.format,
            "columns": self.columns,
            "max_seq_len": self.max_seq_len,
            "drop_long": self.drop_long,
            "train_on_prompt": self.train_on_prompt,
            "chat_template": self.chat_template,
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
        row = json.loads(example[ROW_COLUMN]) if ROW_COLUMN in example else example
        out: dict[str, Any] = {
            "input_ids": [],
            "labels": [],
            "prompt_ids": [],
            "answer": "",
            "status": OK,
            "error": "",
        }
        try:
            enc = self.encode(row)
        except BadRow as exc:
            out.update(status=BAD, error=f"{where}: {exc}")
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
        too_big = next((i for i, v in enumerate(ids) if v >= self.vocab_size), None)
        if too_big is not None:
            raise BadRow(
                f"{c['input_ids']}[{too_big}]",
                f"token id {ids[too_big]} is not in the tokenizer's vocabulary of {self.vocab_size}",
            )
        if row.get(c["labels"]) is None:
            return Encoded(list(ids), list(ids))
        labels = _int_list(row, c["labels"], allow_ignore=True)
        if len(labels) != len(ids):
            raise BadRow(c["labels"], f"has {len(labels)} values but {c['input_ids']} has {len(ids)}")
        return Encoded(list(ids), list(ids) if self.train_on_prompt else list(labels))

    # ------------------------------------------------------------------------------------------- chat

    def _messages(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        col = self.columns["messages"]
        if col not in row:
            raise BadRow(col, "missing (set data.columns.messages if your data names it differently)")
        msgs = _list_value(row[col])
        if not isinstance(msgs, list):
            raise BadRow(col, f"expected a list of {{role, content}} messages, got {describe(msgs)}")
        if not msgs:
            raise BadRow(col, "the conversation is empty")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise BadRow(f"{col}[{i}]", f"expected an object with role and content, got {describe(m)}")
            for key in ("role", "content"):
                if key not in m:
                    raise BadRow(f"{col}[{i}].{key}", "missing")
                if not isinstance(m[key], str):
                    raise BadRow(f"{col}[{i}].{key}", f"expected a string, got {describe(m[key])}")
        if not self.train_on_prompt and not any(m["role"] == "assistant" for m in msgs):
            raise BadRow(col, "the conversation has no assistant message, so nothing to learn from")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text, through the chat template."""
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def _render_checked(self, msgs: list[dict[str, Any]]) -> str:
        from jinja2 import TemplateError

        try:
            return self.render(msgs)
        except TemplateError as exc:
            # find the first message the template refuses
            col = self.columns["messages"]
            for j in range(1, len(msgs) + 1):
                try:
                    self.render(msgs[:j])
                except TemplateError:
                    raise BadRow(
                        f"{col}[{j - 1}].role",
                        f"the chat template refuses this message (role `{msgs[j - 1]['role']}`: {exc})",
                    ) from None
            raise BadRow(col, f"the chat template refuses the conversation ({exc})") from None

    def _encode_chat(self, row: dict[str, Any]) -> Encoded:
        msgs = self._messages(row)
        text = self._render_checked(msgs)
        if self.generation_marks and not self.train_on_prompt:
            out = self.tokenizer.apply_chat_template(
                msgs,
                chat_template=self.chat_template,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            ids = list(out["input_ids"])
            labels = [t if m else IGNORE_INDEX for t, m in zip(ids, out["assistant_masks"], strict=True)]
        else:
            enc = self.tokenizer(
                text, add_special_tokens=False, return_offsets_mapping=not self.train_on_prompt
            )
            ids = list(enc["input_ids"])
            labels = (
                list(ids)
                if self.train_on_prompt
                else self._assistant_labels(msgs, text, ids, enc["offset_mapping"])
            )
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
        if last is None:
            return Encoded(ids, labels)
        prompt = self.render(msgs[:last], add_generation_prompt=True)
        return Encoded(ids, labels, self._ids(prompt), msgs[last]["content"])

    def _assistant_labels(
        self, msgs: list[dict[str, Any]], text: str, ids: list[int], offsets: list[tuple[int, int]]
    ) -> list[int]:
        """Labels on the tokens of each assistant turn, found by rendering the conversation prefix by prefix.

        The turn of message k is the text between the rendering of messages[:k] with the generation prompt
        and the rendering of messages[:k+1] (without the whitespace the template adds after it).
        """
        spans = []
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = (
                self.render(msgs[:k], add_generation_prompt=True)
                if k
                else self.render([], add_generation_prompt=True)
            )
            upto = self.render(msgs[: k + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise BadRow(
                    self.columns["messages"],
                    "the chat template does not render this conversation prefix by prefix, so the assistant "
                    "tokens cannot be found; mark them with {% generation %}...{% endgeneration %} in data.chat_template",
                )
            spans.append((len(before), len(upto.rstrip())))
        labels = [IGNORE_INDEX] * len(ids)
        for i, (a, b) in enumerate(offsets):
            if b > a and any(s <= a and b <= e for s, e in spans):
                labels[i] = ids[i]
        return labels
