"""``finetune data RECIPE``: what a run would train on, from the tokenizer alone (no GPU, no weights).

The data is read, checked and tokenized by the trainer's own loader (``load_task_data``), through the same
tokenization cache, so a run afterwards reads it back instead of tokenizing again. The report counts rows, tokens and
the tokens the loss trains on, truncated, dropped and bad rows, per source and in all, packing when it is on; and
shows the first rows with their trained tokens marked: styled in a terminal, between ``[[`` and ``]]`` elsewhere,
and as character spans of the row's text in ``--json``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.objectives.loss import IGNORE_INDEX
from finetune.recipe.schema import LoadedRecipe, RecipeError, check_files, load_recipe

#: How trained text is marked when the output is not a terminal.
OPEN, CLOSE = "[[", "]]"
#: Bad rows' errors listed in full (the rest are counted).
BAD_SHOWN = 20


@dataclass
class DataOptions:
    """``finetune data``'s arguments."""

    recipe: str
    overrides: list[str]
    show: int = 2
    as_json: bool = False


@dataclass
class ShownRow:
    """One training sample as text: its pieces, each trained or not, and where it came from."""

    index: int
    where: str
    pieces: list[tuple[str, bool]]
    tokens: int
    trained_tokens: int
    part: str = ""  # a preference pair's `chosen` or `rejected`

    @property
    def text(self) -> str:
        """The sample's text."""
        return "".join(p for p, _ in self.pieces)

    def spans(self) -> list[list[int]]:
        """The character spans ``[start, end)`` of its trained text."""
        out, at = [], 0
        for piece, trained in self.pieces:
            if trained and piece:
                out.append([at, at + len(piece)])
            at += len(piece)
        return out

    def marked(self) -> str:
        """Its text with the trained pieces between ``[[`` and ``]]``."""
        return "".join(f"{OPEN}{p}{CLOSE}" if t else p for p, t in self.pieces)


def pieces(tokenizer: Any, ids: list[int], labels: list[int]) -> tuple[list[tuple[str, bool]], list[list[int]]]:
    """A sample's text in pieces, each the tokens of a run of trained (label set, and not the first token: nothing
    predicts it) or untrained ones, and the token spans ``[start, end)`` of the trained runs.

    Each piece is the difference between the decoded prefixes around it, so that tokenizers whose decoder changes
    a token at the start of a text (SentencePiece's leading space) give the whole text's characters.
    """
    flags = [i > 0 and label != IGNORE_INDEX for i, label in enumerate(labels)]
    bounds = [0] + [i for i in range(1, len(ids)) if flags[i] != flags[i - 1]] + [len(ids)]

    def decode(upto: int) -> str:
        return str(tokenizer.decode(ids[:upto], skip_special_tokens=False, clean_up_tokenization_spaces=False))

    out: list[tuple[str, bool]] = []
    token_spans: list[list[int]] = []
    before = ""
    for a, b in itertools.pairwise(bounds):
        if a == b:
            continue
        upto = decode(b)
        piece = upto[len(before) :] if upto.startswith(before) else decode_range(tokenizer, ids[a:b])
        out.append((piece, flags[a]))
        if flags[a]:
            token_spans.append([a, b])
        before = upto
    return out, token_spans


def decode_range(tokenizer: Any, ids: list[int]) -> str:
    """Token ids as text, special tokens included."""
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


@dataclass
class DataReport:
    """What ``finetune data`` found: the recipe's data settings, the loader's counts and the rows shown."""

    loaded: LoadedRecipe
    data: Any  # finetune.train.data.TaskData
    template: str | None
    rows: list[ShownRow]
    token_spans: list[list[list[int]]]

    def as_json(self) -> dict[str, Any]:
        """The report as JSON: settings, ``train`` and ``eval`` counts, ``sources`` (a list, one per file or
        dataset split), bad rows, notes, and ``rows`` with their trained character and token spans."""
        r = self.loaded.recipe
        d, s = r.data, self.data.stats
        return {
            "recipe": str(self.loaded.path),
            "model": r.model.path,
            "format": d.format,
            "chat_template": self.template,
            "max_seq_len": d.max_seq_len,
            "train_on_prompt": d.train_on_prompt,
            "reasoning": d.reasoning,
            "assistant_turns": d.assistant_turns,
            "train": {
                "samples": s["train_samples"],
                "tokens": s["tokens"],
                "trained_tokens": s.get("trained_tokens"),
                "truncated": s["truncated"],
                "dropped": s["dropped"],
                "bad_rows": s["skipped_bad_rows"],
            },
            "eval": {"samples": s["eval"], "prompts": s["eval_prompts"]},
            "packing": {"rows": s["train"], "padding_fraction": s["padding_fraction"]} if d.packing else None,
            "sources": [dataclasses.asdict(src) for src in self.data.sources],
            "bad_rows": self.data.bad[:BAD_SHOWN],
            "notes": list(self.data.notes),
            "rows": [
                {
                    "index": row.index, "where": row.where, **({"part": row.part} if row.part else {}),
                    "tokens": row.tokens, "trained_tokens": row.trained_tokens, "text": row.text,
                    "trained": row.spans(), "trained_token_spans": spans,
                }
                for row, spans in zip(self.rows, self.token_spans, strict=True)
            ],
        }


def inspect_data(loaded: LoadedRecipe, show: int) -> DataReport:
    """Read and tokenize the recipe's data as a run would (tokenizer only), and take its first ``show`` samples."""
    from finetune.train.data import chat_template_name
    from finetune.train.data.task import load_task_data
    from finetune.train.model.build import load_tokenizer

    tokenizer = load_tokenizer(loaded)
    data = load_task_data(loaded, tokenizer)
    samples = data.samples or data.train  # preference pairs are not packed
    if data.stream is not None:  # data.streaming: the first samples the run would draw, nothing more is read
        from finetune.train.data.stream import StreamingBatches

        stream = StreamingBatches(data.stream, max(show, 1), loaded.recipe.train.seed, tokenizer.pad_token_id, 1)
        samples, data.where = stream.global_rows(0, 0)[: max(show, 0)], stream.where
    rows, spans = [], []
    for i, sample in enumerate(samples[: max(show, 0)]):
        where = data.where[i] if i < len(data.where) else ""  # preference pairs keep no row
        pair: Any = sample
        parts = [("", sample.input_ids, sample.labels)]
        if getattr(pair, "rejected_ids", None) is not None:  # a preference pair: its two rows
            parts = [("chosen", pair.input_ids, pair.labels), ("rejected", pair.rejected_ids, pair.rejected_labels)]
        for part, ids, labels in parts:
            text, token_spans = pieces(tokenizer, list(ids), list(labels))
            trained = sum(b - a for a, b in token_spans)
            rows.append(ShownRow(i + 1, where, text, len(ids), trained, part))
            spans.append(token_spans)
    template = chat_template_name(loaded) if loaded.recipe.data.format == "chat" else None
    return DataReport(loaded, data, template, rows, spans)


def print_report(report: DataReport, console: Any) -> None:
    """The report for a person: counts, then the rows with their trained text styled (a terminal) or marked."""
    from rich.text import Text

    r = report.loaded.recipe
    d, s = r.data, report.data.stats
    here = f"{Path.cwd()}/"

    def say(line: str) -> None:  # paths under the current directory are shown relative to it
        console.print(line.replace(here, ""), markup=False, highlight=False)

    chat = f"; {report.template}; reasoning {d.reasoning}; assistant turns {d.assistant_turns}" if report.template else ""
    say(f"{report.loaded.path}: {d.format} data, tokenizer of {r.model.path}, max_seq_len {d.max_seq_len}{chat}")
    trained = s.get("trained_tokens")
    share = f", {trained:,} trained ({100 * trained / max(s['tokens'], 1):.1f}%)" if trained is not None else ""
    say(
        f"train: {s['train_samples']:,} samples, {s['tokens']:,} tokens{share}; truncated {s['truncated']}, "
        f"dropped {s['dropped']}, bad rows {s['skipped_bad_rows']}"
    )
    for src in report.data.sources:
        held = f", {src.held_out} held out" if src.held_out else ""
        say(
            f"  {src.key} {src.name}: {src.rows:,} rows, {src.rows_used:,} used{held}, {src.dropped} dropped, "
            f"{src.bad} bad; {src.tokens:,} tokens, {src.trained_tokens:,} trained"
        )
    if s["eval"] or s["eval_prompts"]:
        say(f"eval: {s['eval']:,} samples, {s['eval_prompts']:,} exact-match prompts")
    if d.packing:
        say(f"packing: {s['train']:,} rows of {d.max_seq_len} tokens, {100 * s['padding_fraction']:.1f}% padding")
    for note in report.data.notes:
        say(f"note: {note}")
    for bad in report.data.bad[:BAD_SHOWN]:
        say(f"bad row: {bad}")
    if not report.rows:
        return
    styled = console.is_terminal
    say("trained tokens in green" if styled else f"trained tokens between {OPEN} and {CLOSE}")
    for row in report.rows:
        part = f" {row.part}" if row.part else ""
        where = f" ({row.where})" if row.where else ""
        say(f"\nsample {row.index}{part}{where}: {row.tokens} tokens, {row.trained_tokens} trained")
        if styled:
            text = Text()
            for piece, on in row.pieces:
                text.append(piece, style="bold green" if on else "dim")
            console.print(text, highlight=False)
        else:
            say(row.marked())


def run_data(options: DataOptions) -> int:
    """``finetune data``: check the recipe, read its data, print the report (or its JSON); the exit code."""
    from rich.console import Console

    loaded = load_recipe(options.recipe, options.overrides)
    problems = check_files(loaded)
    if problems:
        raise RecipeError(problems)
    report = inspect_data(loaded, options.show)
    if options.as_json:
        print(json.dumps(report.as_json(), indent=2, ensure_ascii=False))
    else:
        print_report(report, Console(highlight=False, soft_wrap=True))
    return 0
