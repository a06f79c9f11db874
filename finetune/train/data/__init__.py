"""Training data: sources -> rows -> token ids with labels (cached) -> packed rows -> a deterministic batch stream.

    load_data(loaded, tokenizer) -> TaskData(train, eval, eval_prompts, stats)
    BatchStream(train, global_batch_size, seed, pad_id).micro_batches(epoch, step, rank=, world_size=, micro_batch_size=)

Modules: ``sources`` (reading files and cached Hugging Face datasets), ``formats`` (text / instruction /
chat / tokenized -> ids and labels), ``cache`` (tokenizing into the cache), ``batches`` (packing, collation, the
batch stream).

Tokenization runs through ``datasets.map`` (progress bar, ``data.num_proc`` processes, by default one per core)
into Arrow files whose name is a hash of the source's content, the tokenizer and every data setting that changes
the result, so a second run with the same inputs reads them back instead of tokenizing again (and does not read
an unchanged file at all). The samples are built from the Arrow columns, their ids as :class:`TokenIds`.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.objectives.loss import IGNORE_INDEX
from finetune.recipe.locate import DataLocation
from finetune.recipe.schema import LoadedRecipe
from finetune.train.data.batches import BatchStream, Example, TokenIds, collate, pack
from finetune.train.data.cache import (
    CACHE_VERSION,
    default_cache_dir,
    digests_dir,
    tokenize_source,
    tokenizer_fingerprint,
)
from finetune.train.data.formats import (
    BAD,
    DROPPED_LONG,
    NO_LABELS,
    PROMPT_TEMPLATE,
    PROMPT_TEMPLATE_NO_INPUT,
    TRUNCATED,
    Encoder,
)
from finetune.train.data.sources import WHERE_COLUMN, Source, read_hf, read_sources

__all__ = [
    "CACHE_VERSION",
    "PROMPT_TEMPLATE",
    "PROMPT_TEMPLATE_NO_INPUT",
    "BatchStream",
    "EvalPrompt",
    "Example",
    "SourceStats",
    "TaskData",
    "TokenIds",
    "collate",
    "default_cache_dir",
    "load_data",
    "pack",
    "tokenizer_fingerprint",
]



@dataclass
class EvalPrompt:
    """A prompt for greedy generation and the exact answer expected."""

    prompt_ids: Sequence[int]
    answer: str


@dataclass
class TaskData:
    """Everything the trainer needs from the data.

    ``stats``: train (rows: packed rows with packing), train_samples, eval, eval_prompts, tokens (in train),
    trained_tokens (the train samples' tokens that are targets of the loss), truncated, dropped (drop_long, or
    no label token left after truncation), skipped_bad_rows, padding_fraction (packed rows, else 0: it depends
    on the micro-batch, see BatchStream.padding_fraction), cached_sources (sources read back from the
    tokenization cache). ``notes``: one sentence per thing the user should know (truncation, skipped rows with
    the first reason), each said once. ``samples`` are the training samples before packing, ``where`` the row
    each came from (``file:line``), ``sources`` each source's counts and ``bad`` every bad row's error;
    ``mixture``: the keys of a mixture's sources (empty when data.train is not one).
    """

    train: list[Example]
    eval: list[Example] = field(default_factory=list)
    eval_prompts: list[EvalPrompt] = field(default_factory=list)
    stats: dict[str, int | float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    samples: list[Example] = field(default_factory=list)
    where: list[str] = field(default_factory=list)
    sources: list[SourceStats] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)
    train_prompts: list[EvalPrompt] = field(default_factory=list)  # each training row's prompt and answer (grpo)
    mixture: list[str] = field(default_factory=list)  # a mixture's source keys (Example.sources indexes them)
    stream: Any = None  # data.streaming: the stream.StreamSpec the trainer reads (``train`` is then empty)


@dataclass
class SourceStats:
    """One source's rows: ``rows`` read = ``rows_used`` (training samples) + ``held_out`` (by data.eval_fraction) +
    ``dropped`` (too long under drop_long, or no target left after truncation) + ``bad`` (bad rows, skipped);
    ``tokens`` and ``trained_tokens`` count the used samples, ``truncated`` the usable ones (used or held out)
    that were longer than data.max_seq_len. A data.eval source's ``rows_used`` are
    the samples evaluated (eval.max_samples may leave the others out). In a mixture (``weight`` set) ``rows_used``
    counts the samples drawn from the source, a row drawn twice twice, and the rows not drawn are in no count."""

    key: str  # the recipe key that names it: data.train, data.train.1, data.eval
    name: str  # its file, or `dataset [split]`
    weight: float | None = None  # a mixture's source: its weight (rows_used: the samples drawn from it)
    rows: int = 0
    rows_used: int = 0
    held_out: int = 0
    dropped: int = 0
    bad: int = 0
    truncated: int = 0
    tokens: int = 0
    trained_tokens: int = 0

    def count(self, example: Example) -> None:
        """Count ``example`` as one of the source's used samples."""
        self.rows_used += 1
        self.tokens += len(example.input_ids)
        self.trained_tokens += trained_tokens(example)


def trained_tokens(example: Example) -> int:
    """How many of a sample's tokens are targets of the loss (the first never is: nothing predicts it)."""
    labels = example.labels
    return len(labels) - labels.count(IGNORE_INDEX) - int(bool(labels) and labels[0] != IGNORE_INDEX)


@dataclass
class EncodedRows:
    """The usable samples of one or more sources, with their eval prompts, rows (``file:line``) and counts;
    ``origin[i]``: the index in ``sources`` of the source of ``examples[i]``."""

    examples: list[Example] = field(default_factory=list)
    prompts: list[EvalPrompt | None] = field(default_factory=list)
    truncated: int = 0
    dropped: int = 0
    bad: list[str] = field(default_factory=list)
    cached: int = 0
    where: list[str] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)
    sources: list[SourceStats] = field(default_factory=list)

    def extend(self, other: EncodedRows) -> None:
        self.examples += other.examples
        self.prompts += other.prompts
        self.truncated += other.truncated
        self.dropped += other.dropped
        self.bad += other.bad
        self.cached += other.cached
        self.where += other.where
        self.origin += [len(self.sources) + i for i in other.origin]
        self.sources += other.sources

    def keep(self, chosen: list[int]) -> EncodedRows:
        """The samples at the indices ``chosen``, with their prompts, rows and sources (the counts stay here)."""
        return EncodedRows(
            examples=[self.examples[i] for i in chosen], prompts=[self.prompts[i] for i in chosen],
            where=[self.where[i] for i in chosen], origin=[self.origin[i] for i in chosen], sources=self.sources,
        )


def encode_source(
    src: Source, encoder: Encoder, cache_dir: Path, num_proc: int | None, recipe_key: str = "data.train",
    on_miss: Callable[[str], None] | None = None,
) -> EncodedRows:
    """Tokenize one source into the cache (or read it back: finetune/train/data/cache.py), then collect its samples
    (``recipe_key``: the recipe key that names the source, for its counts; ``on_miss``: called before tokenizing).

    The cache key holds the source's name too: error messages in the cached rows name its file. The samples'
    ids come from the Arrow columns a batch of rows at a time, as :class:`TokenIds`, never as one Python list of
    the whole set's ids.
    """
    done = tokenize_source(src, encoder, _features(), cache_dir, "tokenized", num_proc, encoder.settings(), on_miss)
    stats = SourceStats(recipe_key, src.name, rows=done.rows + len(done.bad_rows), bad=len(done.bad_rows))
    out = EncodedRows(bad=list(done.bad_rows), cached=int(done.hit), sources=[stats])
    index = 0
    for batch in done.batches():
        ids, prompt_ids = token_rows(batch.column("input_ids")), token_rows(batch.column("prompt_ids"))
        labels = shared_rows(ids, token_rows(batch.column("labels")))
        status, error, answer = (batch.column(c).to_pylist() for c in ("status", "error", "answer"))
        where = batch.column(WHERE_COLUMN).to_pylist() if src.is_json_rows else None
        for i, state in enumerate(status):
            if state == BAD:
                out.bad.append(error[i])
                stats.bad += 1
            elif state in (DROPPED_LONG, NO_LABELS):
                out.dropped += 1
                stats.dropped += 1
            else:
                out.truncated += state == TRUNCATED
                stats.truncated += state == TRUNCATED
                out.examples.append(Example(ids[i], labels[i]))
                out.prompts.append(EvalPrompt(prompt_ids[i], answer[i]) if prompt_ids[i] else None)
                out.where.append(where[i] if where is not None else f"{src.name}: row {index + i}")
                out.origin.append(0)
        index += len(status)
    return out


def token_rows(column: Any) -> list[TokenIds]:
    """Each row of a list column of token ids (a pyarrow array or chunked array) as :class:`TokenIds`, copied from
    the column's values without making a Python int of any."""
    import numpy as np

    rows = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    offsets = rows.offsets.to_numpy()
    offsets = offsets - offsets[0]
    values = np.ascontiguousarray(rows.flatten().to_numpy(zero_copy_only=False), dtype=np.int32).data.cast("B")
    out = []
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        row = TokenIds()
        row.frombytes(values[4 * a : 4 * b])
        out.append(row)
    return out


def shared_rows(ids: list[TokenIds], labels: list[TokenIds]) -> list[TokenIds]:
    """``labels``, each row that equals its ``ids`` row replaced by it (one object for both: a text's labels are
    its ids), so that the two take the memory of one."""
    return [i if label == i else label for i, label in zip(ids, labels, strict=True)]


def _features() -> Any:
    import datasets

    ids = datasets.List(datasets.Value("int64"))
    return datasets.Features(
        {
            "input_ids": ids,
            "labels": ids,
            "prompt_ids": ids,
            "answer": datasets.Value("string"),
            "status": datasets.Value("string"),
            "error": datasets.Value("string"),
        }
    )


@contextmanager
def local_rank_zero_first() -> Iterator[None]:
    """In a multi-process run, local rank 0 tokenizes (and fills the cache) before the other ranks read it.

    The others wait in the wait group (finetune/train/parallel/distributed.py): tokenising a large data set may take
    longer than the training group's timeout.
    """
    import torch.distributed as dist

    from finetune.train.parallel.distributed import wait_barrier

    active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if active and not first:
        wait_barrier()
    try:
        yield
    finally:
        if active and first:
            wait_barrier()


def resolve_chat_template(loaded: LoadedRecipe, tokenizer: Any) -> str:
    """The chat template of a chat-format run: data.chat_template (text or a file), else the tokenizer's."""
    spec = loaded.recipe.data.chat_template
    if spec is None:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                f"data.chat_template: the tokenizer of `{loaded.recipe.model.path}` has no chat template; set "
                "data.chat_template to a Jinja template or the path of a .jinja file"
            )
        return tokenizer.chat_template
    if "{" not in spec:
        path = loaded.resolve_input(spec)
        if not path.is_file():
            raise UserError(
                f"data.chat_template: no template file at `{spec}` (a template itself contains {{% or {{{{)"
            )
        return path.read_text()
    return spec


def chat_template_name(loaded: LoadedRecipe) -> str:
    """Which chat template a chat-format run renders with, in words for messages."""
    spec = loaded.recipe.data.chat_template
    if spec is None:
        return f"the chat template of `{loaded.recipe.model.path}`"
    return f"data.chat_template `{spec}`" if "{" not in spec else "data.chat_template"


def embedding_rows(loaded: LoadedRecipe) -> int | None:
    """The rows of the model's token embeddings (its config's vocab_size): every token id and label of the data
    must be below it. None when the config cannot say (the tokenizer's length is used then)."""
    from finetune.recipe.locate import model_config

    inputs = loaded.inputs
    if inputs is None or inputs.model.problem() is not None:
        return None
    try:
        config = model_config(inputs.model, loaded.recipe.model.trust_remote_code)[0]
    except (OSError, ValueError, UserError):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text, "vocab_size", None)
    return int(rows) if isinstance(rows, int) and rows > 0 else None


def data_encoder(loaded: LoadedRecipe, tokenizer: Any) -> Encoder:
    """The :class:`Encoder` of the recipe's data.train and data.eval (its format, columns and settings)."""
    d = loaded.recipe.data
    chat = d.format == "chat"
    return Encoder(
        tokenizer, d.format, d.columns.model_dump(), d.max_seq_len, d.drop_long, d.train_on_prompt,
        resolve_chat_template(loaded, tokenizer) if chat else None, reasoning=d.reasoning,
        assistant_turns=d.assistant_turns, template_name=chat_template_name(loaded) if chat else "",
        embedding_rows=embedding_rows(loaded),
    )


def cache_dir_of(loaded: LoadedRecipe) -> Path:
    """Where the recipe's tokenized data is cached: data.cache_dir, else :func:`default_cache_dir`."""
    d = loaded.recipe.data
    return Path(os.path.expanduser(d.cache_dir)) if d.cache_dir else default_cache_dir()


def _encode_spec(
    location: DataLocation, key: str, loaded: LoadedRecipe, encoder: Encoder, split: str,
    on_miss: Callable[[str], None] | None = None,
) -> EncodedRows:
    d = loaded.recipe.data
    cache_dir = cache_dir_of(loaded)
    out = EncodedRows()
    for src in read_sources(location, key, split, encoder.required_columns(), digests_dir(cache_dir)):
        out.extend(encode_source(src, encoder, cache_dir, d.num_proc, key, on_miss))
    return out


def check_bad_rows(enc: EncodedRows, on_bad_row: str) -> None:
    if enc.bad and on_bad_row == "error":
        more = f" (and {len(enc.bad) - 1} more bad rows)" if len(enc.bad) > 1 else ""
        raise UserError(
            f"{enc.bad[0]}{more}; fix the data, or set data.on_bad_row: skip to leave bad rows out"
        )


def load_data(loaded: LoadedRecipe, tokenizer: Any, on_miss: Callable[[str], None] | None = None) -> TaskData:
    """Read, check and tokenize the recipe's train and eval data (every bad row is found before training);
    ``on_miss(source)`` is called before a source that is not in the cache is tokenized (the trainer's hooks)."""
    r = loaded.recipe
    d = r.data
    encoder = data_encoder(loaded, tokenizer)
    inputs = loaded.inputs
    assert inputs is not None, "load_recipe resolves the inputs"
    if d.streaming:
        return _load_streaming(loaded, encoder, on_miss)
    with local_rank_zero_first():
        train = EncodedRows()
        entry_of: list[int] = []  # the data.train entry (a mixture's source) of each of train.sources
        for spec, location in zip(d.train_specs(), inputs.train, strict=True):
            before = len(train.sources)
            train.extend(_encode_spec(location, spec.key, loaded, encoder, d.split, on_miss))
            for counted in train.sources[before:]:
                counted.weight = spec.weight
                entry_of.append(spec.source)
        check_bad_rows(train, d.on_bad_row)
        held = EncodedRows()
        if inputs.eval is not None:
            if inputs.eval.kind == "split":  # another split of the data.train dataset
                src = read_hf(inputs.train[0].value, inputs.eval.value, "data.eval", encoder.required_columns())
                held = encode_source(src, encoder, cache_dir_of(loaded), d.num_proc, "data.eval", on_miss)
            else:
                held = _encode_spec(inputs.eval, "data.eval", loaded, encoder, d.split, on_miss)
            check_bad_rows(held, d.on_bad_row)
    if d.eval_fraction:
        n = len(train.examples)
        k = max(1, round(n * d.eval_fraction))
        if k >= n:
            raise UserError(
                f"data.eval_fraction: {d.eval_fraction} of {n} samples leaves none to train on; lower it"
            )
        chosen = set(random.Random(r.train.seed).sample(range(n), k))
        for i in chosen:
            train.sources[train.origin[i]].held_out += 1
        held = train.keep([i for i in range(n) if i in chosen])
        kept = train.keep([i for i in range(n) if i not in chosen])
        train.examples, train.prompts, train.where, train.origin = kept.examples, kept.prompts, kept.where, kept.origin
    mixture: list[str] = []
    if d.mixture:
        mixture = [spec.key for spec in _first_of_each_source(d.train_specs())]
        weights = [spec.weight or 0.0 for spec in _first_of_each_source(d.train_specs())]
        pools: list[list[int]] = [[] for _ in mixture]
        for i, o in enumerate(train.origin):
            pools[entry_of[o]].append(i)
        for key, pool in zip(mixture, pools, strict=True):
            if not pool:
                raise UserError(f"{key}: no usable training samples in this source of the mixture; fix its data or remove it")
        drawn = draw_mixture(pools, weights, r.train.seed)
        kept = train.keep(drawn)
        train.examples, train.prompts, train.where, train.origin = kept.examples, kept.prompts, kept.where, kept.origin
        train.examples = [
            Example(e.input_ids, e.labels, e.position_ids, (entry_of[o],))
            for e, o in zip(train.examples, train.origin, strict=True)
        ]
    for e, o in zip(train.examples, train.origin, strict=True):
        train.sources[o].count(e)
    if r.eval.max_samples:
        held.examples = held.examples[: r.eval.max_samples]
        held.prompts = held.prompts[: r.eval.max_samples]
        held.origin = held.origin[: r.eval.max_samples]
        held.where = held.where[: r.eval.max_samples]
    if held.sources is not train.sources:  # data.eval's own sources
        for e, o in zip(held.examples, held.origin, strict=True):
            held.sources[o].count(e)
    if not train.examples:
        raise UserError(f"data.train: no usable training samples in `{d.train}`")

    notes: list[str] = []
    samples = train.examples
    rows = pack(samples, d.max_seq_len) if d.packing else samples
    if mixture:
        notes.append(mixture_note(mixture, train.sources, entry_of))
    tokens = sum(len(e.input_ids) for e in samples)
    skipped = len(train.bad) + len(held.bad)
    stats: dict[str, int | float] = {
        "train": len(rows),
        "train_samples": len(samples),
        "eval": len(held.examples),
        "eval_prompts": sum(p is not None for p in held.prompts),
        "tokens": tokens,
        "trained_tokens": sum(s.trained_tokens for s in train.sources),
        "truncated": train.truncated + held.truncated,
        "dropped": train.dropped + held.dropped,
        "skipped_bad_rows": skipped,
        "padding_fraction": round(1 - tokens / (len(rows) * d.max_seq_len), 4) if d.packing else 0.0,
        "cached_sources": train.cached + held.cached,
    }
    if stats["truncated"]:
        notes.append(
            f"{stats['truncated']} samples were longer than data.max_seq_len={d.max_seq_len} and were truncated"
        )
    if stats["dropped"]:
        notes.append(
            f"{stats['dropped']} samples were left out: longer than data.max_seq_len={d.max_seq_len} with "
            "data.drop_long, or no answer token left after truncation"
        )
    if skipped:
        first = (train.bad + held.bad)[0]
        notes.append(f"{skipped} bad rows were skipped (data.on_bad_row: skip); the first: {first}")
    return TaskData(
        train=rows,
        eval=held.examples,
        eval_prompts=[p for p in held.prompts if p is not None],
        train_prompts=[p for p in train.prompts if p is not None],
        stats=stats,
        notes=notes,
        samples=samples,
        where=train.where,
        sources=train.sources + (held.sources if held.sources is not train.sources else []),
        bad=train.bad + held.bad,
        mixture=mixture,
    )


def _load_streaming(loaded: LoadedRecipe, encoder: Encoder, on_miss: Callable[[str], None] | None) -> TaskData:
    """data.streaming: the stream's sources (read while training, finetune/train/data/stream.py) and data.eval,
    read and tokenized now as without streaming."""
    from finetune.train.data.stream import StreamSource, StreamSpec, check_streamable, stream_fingerprint

    d = loaded.recipe.data
    inputs = loaded.inputs
    assert inputs is not None, "load_recipe resolves the inputs"
    by_source: dict[int, StreamSource] = {}
    for spec, location in zip(d.train_specs(), inputs.train, strict=True):
        key = spec.key if d.mixture else "data.train"
        if location.kind == "dataset":
            raise UserError(
                f"{spec.key}: data.streaming reads local .jsonl files, but `{location.value}` is a Hugging Face "
                "dataset in the cache; give its .jsonl files, or set data.streaming: false"
            )
        files = location.files(spec.key)
        check_streamable(files, spec.key)
        source = by_source.setdefault(spec.source if d.mixture else 0, StreamSource(key, [], spec.weight))
        source.files += files
    stream = StreamSpec(list(by_source.values()), encoder, d.shuffle_buffer, d.on_bad_row)
    stream.fingerprint = stream_fingerprint(stream, tokenizer_fingerprint(encoder.tokenizer))
    held = EncodedRows()
    if inputs.eval is not None:
        with local_rank_zero_first():
            held = _encode_spec(inputs.eval, "data.eval", loaded, encoder, d.split, on_miss)
        check_bad_rows(held, d.on_bad_row)
    r = loaded.recipe
    if r.eval.max_samples:
        held.examples, held.prompts = held.examples[: r.eval.max_samples], held.prompts[: r.eval.max_samples]
    n_files = sum(len(s.files) for s in stream.sources)
    note = (
        f"streaming {n_files} .jsonl file{'s' if n_files != 1 else ''}, tokenized while training through a shuffle "
        f"buffer of {d.shuffle_buffer:,} rows"
    )
    return TaskData(
        train=[], eval=held.examples, eval_prompts=[p for p in held.prompts if p is not None],
        stats={  # the training rows are counted as they are read (none yet): `train` is left out
            "train_samples": 0, "eval": len(held.examples), "eval_prompts": sum(p is not None for p in held.prompts),
            "tokens": 0, "trained_tokens": 0, "truncated": held.truncated, "dropped": held.dropped,
            "skipped_bad_rows": len(held.bad), "padding_fraction": 0.0, "cached_sources": held.cached,
        },
        notes=[note], sources=[SourceStats(s.key, ", ".join(map(str, s.files)), weight=s.weight) for s in stream.sources],
        bad=list(held.bad), mixture=[s.key for s in stream.sources] if d.mixture else [], stream=stream,
    )


def _first_of_each_source(specs: list[Any]) -> list[Any]:
    """The first path of each data.train entry (its key and weight are the entry's)."""
    seen: set[int] = set()
    out = []
    for spec in specs:
        if spec.source not in seen:
            seen.add(spec.source)
            out.append(spec)
    return out


def mixture_counts(weights: list[float], total: int) -> list[int]:
    """How many of ``total`` samples each source of a mixture gives: ``total`` x its share of the weights, rounded
    by largest remainder so that the counts add up to ``total`` (ties to the earlier source)."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def draw_mixture(pools: list[list[int]], weights: list[float], seed: int) -> list[int]:
    """A mixture's training samples: as many as all the pools hold, shared out by weight (:func:`mixture_counts`),
    each source's taken from a permutation of its pool chosen by ``seed`` (repeated whole when the source gives
    more samples than it has: every row once before any row twice). A pure function of its arguments."""
    counts = mixture_counts(weights, sum(len(p) for p in pools))
    out: list[int] = []
    for n, (index, pool) in zip(counts, enumerate(pools), strict=True):
        rng = random.Random(f"mixture/{seed}/{index}")
        taken: list[int] = []
        while len(taken) < n:
            order = list(pool)
            rng.shuffle(order)
            taken += order[: n - len(taken)]
        out += taken
    return out


def mixture_note(keys: list[str], sources: list[SourceStats], entry_of: list[int]) -> str:
    """The sentence a run and ``finetune data`` print about a mixture: each source's samples and passes over its
    usable rows."""
    parts = []
    for i, key in enumerate(keys):
        mine = [s for s, e in zip(sources, entry_of, strict=True) if e == i]
        used = sum(s.rows_used for s in mine)
        usable = sum(s.rows - s.bad - s.dropped - s.held_out for s in mine)
        parts.append(f"{key} {used} samples (weight {mine[0].weight:g}, {used / max(usable, 1):.2f} of its rows)")
    return "mixture: " + ", ".join(parts)
