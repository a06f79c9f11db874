"""The preference format: rows of ``{"prompt", "chosen", "rejected"}`` -> pairs of token rows (train.objective
dpo, simpo, orpo).

A row's ``prompt`` is a string, or a conversation (a list of ``{role, content}`` messages) rendered with the chat
template and its generation prompt; ``chosen`` and ``rejected`` are the completions: strings, or the assistant's
turn (a message, or a list holding one assistant message), rendered after the conversation. Each pair becomes two
token rows sharing the prompt, with labels only on the completion's tokens (the objective scores completions
only). A bad row (a missing field, a completion that is not text, chosen equal to rejected) is reported with its
file, line and field, as for every format.

A micro-batch of ``B`` pairs is one batch of ``2B`` rows: the chosen rows, then the rejected ones, padded
together (:func:`collate_pairs`), so one forward pass runs both. ``ref_logps`` holds the reference policy's
log-probabilities of both completions when dpo.reference is precomputed (filled in before training, or read back
from the cache beside the tokenized data: finetune/train/model/reference.py).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.objectives.loss import IGNORE_INDEX
from finetune.recipe.schema import LoadedRecipe
from finetune.train.data.batches import BatchStream, Example, as_tensor
from finetune.train.data.cache import digests_dir, tokenize_source
from finetune.train.data.formats import BAD, DROPPED_LONG, OK, TRUNCATED, BadRow, Encoder, describe, row_error
from finetune.train.data.sources import ROW_COLUMN, WHERE_COLUMN, Source, read_hf, read_sources


@dataclass
class PreferenceExample(Example):
    """One pair: the chosen row in ``input_ids``/``labels`` (so the stream's fingerprint and lengths see it),
    the rejected row beside it, and the reference's log-probabilities (chosen, rejected) once precomputed."""

    rejected_ids: Sequence[int] | None = None
    rejected_labels: Sequence[int] | None = None
    ref_logps: tuple[float, float] | None = None


def _completion(row: dict[str, Any], col: str) -> str:
    """A completion's text: a string, an assistant message, or a list holding one assistant message."""
    if col not in row or row[col] is None:
        raise BadRow(col, "missing (set data.columns if your data names it differently)")
    value = row[col]
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        if value.get("role", "assistant") != "assistant":
            raise BadRow(f"{col}.role", f"expected the assistant's turn, got `{value.get('role')}`")
        value = value.get("content")
        col = f"{col}.content"
    if not isinstance(value, str):
        raise BadRow(col, f"expected a string or an assistant message, got {describe(value)}")
    if not value:
        raise BadRow(col, "is empty")
    return value


class PreferenceEncoder(Encoder):
    """Turns a preference row into its chosen and rejected token rows (``datasets.map`` function)."""

    def required_columns(self) -> list[str]:
        """Columns a tabular source must have."""
        c = self.columns
        return [c["prompt"], c["chosen"], c["rejected"]]

    def settings(self) -> dict[str, Any]:
        """What decides the output besides the tokenizer and the data (the cache key)."""
        return {**super().settings(), "preference": 1}

    def _prompt(self, row: dict[str, Any]) -> tuple[str | list[dict[str, Any]], list[int]]:
        """The prompt as given (text or messages) and its token ids."""
        col = self.columns["prompt"]
        if col not in row or row[col] is None:
            raise BadRow(col, "missing (set data.columns.prompt if your data names it differently)")
        value = row[col]
        if isinstance(value, str):
            if not value:
                raise BadRow(col, "is empty")
            return value, self.bos_prefix + self._ids(value)
        if isinstance(value, list):
            msgs = self._conversation(value)
            text = self.render(msgs, add_generation_prompt=True)
            return msgs, self._ids(text)
        raise BadRow(col, f"expected a string or a list of {{role, content}} messages, got {describe(value)}")

    def _conversation(self, msgs: list[Any]) -> list[dict[str, Any]]:
        """A prompt's messages, checked: the conversation before the answer (it need hold no assistant turn)."""
        col = self.columns["prompt"]
        if not msgs:
            raise BadRow(col, "the conversation is empty")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise BadRow(f"{col}[{i}]", f"expected an object with role and content, got {describe(m)}")
            for key in ("role", "content"):
                if not isinstance(m.get(key), str):
                    raise BadRow(f"{col}[{i}].{key}", f"expected a string, got {describe(m.get(key))}")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]

    def _row(self, prompt: str | list[dict[str, Any]], prompt_ids: list[int], completion: str) -> tuple[list[int], list[int]]:
        """One completion after the prompt: ids, and labels on the completion's tokens only."""
        if isinstance(prompt, str):
            done = self._ids(completion) + ([self.eos_id] if self.eos_id is not None else [])
            return prompt_ids + done, [IGNORE_INDEX] * len(prompt_ids) + done
        msgs = [*prompt, {"role": "assistant", "content": completion}]
        before = self.render(prompt, add_generation_prompt=True)
        text = self.render(msgs)
        if not text.startswith(before):
            raise BadRow(
                self.columns["prompt"],
                "the chat template does not render the conversation as a prefix of the conversation with its answer",
            )
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        start, end = len(before), len(text.rstrip())
        labels = [
            t if b > a and start <= a and b <= end else IGNORE_INDEX
            for t, (a, b) in zip(ids, enc["offset_mapping"], strict=True)
        ]
        return ids, labels

    def __call__(self, example: dict[str, Any], index: int, source: str = "") -> dict[str, Any]:
        """``datasets.map`` function: the pair's two rows, length-checked, or the row's error."""
        where = example.get(WHERE_COLUMN) or f"{source}: row {index}"
        out: dict[str, Any] = {
            "input_ids": [], "labels": [], "rejected_ids": [], "rejected_labels": [], "prompt_ids": [],
            "answer": "", "status": OK, "error": "",
        }
        try:
            row = json.loads(example[ROW_COLUMN]) if ROW_COLUMN in example else example
            prompt, prompt_ids = self._prompt(row)
            chosen = _completion(row, self.columns["chosen"])
            rejected = _completion(row, self.columns["rejected"])
            if chosen == rejected:
                raise BadRow(self.columns["rejected"], "is the same text as chosen, so there is nothing to prefer")
            rows = [self._row(prompt, prompt_ids, text) for text in (chosen, rejected)]
            for ids, labels in rows:
                self.check_ids(ids, labels)
        except Exception as exc:  # whatever the row holds, it is that row's problem
            out.update(status=BAD, error=row_error(where, exc))
            return out
        if any(len(ids) > self.max_seq_len for ids, _ in rows):
            if self.drop_long:
                out["status"] = DROPPED_LONG
                return out
            rows = [(ids[: self.max_seq_len], labels[: self.max_seq_len]) for ids, labels in rows]
            out["status"] = TRUNCATED
        if any(all(label == IGNORE_INDEX for label in labels[1:]) for _, labels in rows):
            out["status"] = DROPPED_LONG  # the prompt alone fills max_seq_len: no completion token is left
            return out
        (ids, labels), (rids, rlabels) = rows
        out.update(
            input_ids=ids, labels=labels, rejected_ids=rids, rejected_labels=rlabels, prompt_ids=prompt_ids,
            answer=chosen,
        )
        return out


def _features() -> Any:
    import datasets

    ids = datasets.List(datasets.Value("int64"))
    text = datasets.Value("string")
    return datasets.Features({
        "input_ids": ids, "labels": ids, "rejected_ids": ids, "rejected_labels": ids, "prompt_ids": ids,
        "answer": text, "status": text, "error": text,
    })


@dataclass
class _Pairs:
    """The usable pairs of one or more sources, with their eval prompts and counts."""

    examples: list[PreferenceExample]
    prompts: list[tuple[Sequence[int], str]]
    truncated: int = 0
    dropped: int = 0
    bad: list[str] | None = None
    cached: int = 0


def encode_pairs(
    src: Source, encoder: PreferenceEncoder, cache_dir: Path, num_proc: int | None,
    on_miss: Callable[[str], None] | None = None,
) -> _Pairs:
    """Tokenize one source into the cache (or read it back), then collect its pairs, a batch of rows at a time."""
    from finetune.train.data import token_rows

    done = tokenize_source(src, encoder, _features(), cache_dir, "preference", num_proc, encoder.settings(), on_miss)
    out = _Pairs([], [], bad=list(done.bad_rows), cached=int(done.hit))
    assert out.bad is not None
    for batch in done.batches():
        ids, labels, rids, rlabels, prompt_ids = (
            token_rows(batch.column(c)) for c in ("input_ids", "labels", "rejected_ids", "rejected_labels", "prompt_ids")
        )
        status, error, answer = (batch.column(c).to_pylist() for c in ("status", "error", "answer"))
        for i, state in enumerate(status):
            if state == BAD:
                out.bad.append(error[i])
            elif state == DROPPED_LONG:
                out.dropped += 1
            else:
                out.truncated += state == TRUNCATED
                out.examples.append(PreferenceExample(ids[i], labels[i], rejected_ids=rids[i], rejected_labels=rlabels[i]))
                out.prompts.append((prompt_ids[i], answer[i]))
    return out


def _extend(into: _Pairs, more: _Pairs) -> None:
    into.examples += more.examples
    into.prompts += more.prompts
    into.truncated += more.truncated
    into.dropped += more.dropped
    into.bad = (into.bad or []) + (more.bad or [])
    into.cached += more.cached


def load_preference_data(loaded: LoadedRecipe, tokenizer: Any, on_miss: Callable[[str], None] | None = None) -> Any:
    """The recipe's preference pairs as :class:`~finetune.train.data.TaskData`: train and eval pairs, and the
    eval prompts with their chosen completion as the expected answer (exact match); ``on_miss(source)`` before a
    source the cache does not hold is tokenized."""
    from finetune.train.data import (
        EvalPrompt,
        TaskData,
        cache_dir_of,
        check_bad_rows,
        embedding_rows,
        local_rank_zero_first,
        resolve_chat_template,
    )

    r = loaded.recipe
    d = r.data
    template = resolve_chat_template(loaded, tokenizer) if _needs_template(loaded) else None
    encoder = PreferenceEncoder(
        tokenizer, d.format, d.columns.model_dump(), d.max_seq_len, d.drop_long, False, template,
        embedding_rows=embedding_rows(loaded),
    )
    cache_dir = cache_dir_of(loaded)
    digests = digests_dir(cache_dir)
    inputs = loaded.inputs
    assert inputs is not None, "load_recipe resolves the inputs"
    train, held = _Pairs([], [], bad=[]), _Pairs([], [], bad=[])
    with local_rank_zero_first():
        for i, location in enumerate(inputs.train):
            key = "data.train" if isinstance(d.train, str) else f"data.train.{i}"
            for src in read_sources(location, key, d.split, encoder.required_columns(), digests):
                _extend(train, encode_pairs(src, encoder, cache_dir, d.num_proc, on_miss))
        check_bad_rows(train, d.on_bad_row)  # type: ignore[arg-type]  # reads .bad only
        if inputs.eval is not None:
            if inputs.eval.kind == "split":
                src = read_hf(inputs.train[0].value, inputs.eval.value, "data.eval", encoder.required_columns())
                _extend(held, encode_pairs(src, encoder, cache_dir, d.num_proc, on_miss))
            else:
                for src in read_sources(inputs.eval, "data.eval", d.split, encoder.required_columns(), digests):
                    _extend(held, encode_pairs(src, encoder, cache_dir, d.num_proc, on_miss))
            check_bad_rows(held, d.on_bad_row)  # type: ignore[arg-type]
    if d.eval_fraction:
        n = len(train.examples)
        k = max(1, round(n * d.eval_fraction))
        if k >= n:
            raise UserError(f"data.eval_fraction: {d.eval_fraction} of {n} pairs leaves none to train on; lower it")
        chosen = set(random.Random(r.train.seed).sample(range(n), k))
        held.examples = [e for i, e in enumerate(train.examples) if i in chosen]
        held.prompts = [p for i, p in enumerate(train.prompts) if i in chosen]
        train.examples = [e for i, e in enumerate(train.examples) if i not in chosen]
    if r.eval.max_samples:
        held.examples, held.prompts = held.examples[: r.eval.max_samples], held.prompts[: r.eval.max_samples]
    if not train.examples:
        why = (
            f": all {train.dropped} were longer than data.max_seq_len={d.max_seq_len} with no completion token left "
            "after truncation, or dropped by data.drop_long; raise data.max_seq_len" if train.dropped else ""
        )
        raise UserError(f"data.train: no usable preference pairs in `{d.train}`{why}")
    skipped = len(train.bad or []) + len(held.bad or [])
    tokens = sum(len(e.input_ids) + len(e.rejected_ids or []) for e in train.examples)
    stats: dict[str, int | float] = {
        "train": len(train.examples), "train_samples": len(train.examples), "eval": len(held.examples),
        "eval_prompts": len(held.prompts), "tokens": tokens, "truncated": train.truncated + held.truncated,
        "dropped": train.dropped + held.dropped, "skipped_bad_rows": skipped, "padding_fraction": 0.0,
        "cached_sources": train.cached + held.cached,
    }
    notes = []
    if stats["truncated"]:
        notes.append(f"{stats['truncated']} pairs were longer than data.max_seq_len={d.max_seq_len} and were truncated")
    if stats["dropped"]:
        notes.append(
            f"{stats['dropped']} pairs were left out: longer than data.max_seq_len={d.max_seq_len} with "
            "data.drop_long, or no completion token left after truncation"
        )
    if skipped:
        first = ((train.bad or []) + (held.bad or []))[0]
        notes.append(f"{skipped} bad rows were skipped (data.on_bad_row: skip); the first: {first}")
    return TaskData(
        train=list(train.examples), eval=list(held.examples),
        eval_prompts=[EvalPrompt(ids, answer) for ids, answer in held.prompts], stats=stats, notes=notes,
    )


def _needs_template(loaded: LoadedRecipe) -> bool:
    """Whether the prompts are conversations (the first train file's first row tells; a Hub dataset: assumed
    when data.chat_template is set)."""
    if loaded.recipe.data.chat_template is not None:
        return True
    inputs = loaded.inputs
    assert inputs is not None
    col = loaded.recipe.data.columns.prompt
    for location in inputs.train:
        path = Path(str(location.value))
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        for f in files:
            if f.suffix == ".jsonl" and f.is_file():
                with f.open(encoding="utf-8") as fh:
                    for line in fh:
                        if line.strip():
                            try:
                                return isinstance(json.loads(line).get(col), list)
                            except (json.JSONDecodeError, AttributeError):
                                return False
    return False


def collate_pairs(pairs: list[PreferenceExample], pad_id: int) -> dict[str, Any]:
    """``B`` pairs as one batch of ``2B`` rows (chosen rows first, then rejected), right-padded together;
    ``pairs`` holds ``B`` (a 0-d tensor) and ``ref_logps`` (B, 2) the precomputed reference when there is one."""
    import torch

    rows = [(p.input_ids, p.labels) for p in pairs] + [(p.rejected_ids or [], p.rejected_labels or []) for p in pairs]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)] = as_tensor(x)
        labels[i, : len(y)] = as_tensor(y)
        mask[i, : len(x)] = 1
    batch: dict[str, Any] = {
        "input_ids": ids, "labels": labels, "attention_mask": mask,
        "num_tokens": torch.tensor(sum(len(x) for x, _ in rows)), "pairs": torch.tensor(len(pairs)),
    }
    if all(p.ref_logps is not None for p in pairs):
        batch["ref_logps"] = torch.tensor([p.ref_logps for p in pairs], dtype=torch.float64)
    return batch


class PreferenceStream(BatchStream):
    """The deterministic batch stream over pairs: the same order and rank slices as :class:`BatchStream`, each
    micro-batch collated as chosen and rejected rows (:func:`collate_pairs`)."""

    def micro_batches(
        self, epoch: int, step_in_epoch: int, *, rank: int, world_size: int, micro_batch_size: int
    ) -> list[dict[str, Any]]:
        """This rank's micro-batches of pairs of global batch ``step_in_epoch`` of ``epoch``."""
        mine = self.rank_rows(epoch, step_in_epoch, rank=rank, world_size=world_size)
        return [
            collate_pairs(mine[i : i + micro_batch_size], self.pad_id)  # type: ignore[arg-type]  # pairs only
            for i in range(0, len(mine), micro_batch_size)
        ]
