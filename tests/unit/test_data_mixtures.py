"""Data mixtures (data.train as {path, weight} sources) and data.streaming, without a model: the recipe's checks,
the capability rows, the mixture's draw and counts (`finetune data --json`), and the stream's batches, ranks,
bounded buffer and exact resume from its saved position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from finetune.cli import app
from finetune.errors import UserError
from finetune.recipe.capabilities import Cell, refusals
from finetune.recipe.schema import RecipeError, recipe_from_dict
from finetune.train.data import draw_mixture, mixture_counts
from finetune.train.data.formats import Encoder
from finetune.train.data.stream import StreamingBatches, StreamSource, StreamSpec
from tests.support import TINY_MODEL, write_jsonl, write_recipe


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


def _rows(word: str, n: int) -> list[dict]:
    return [{"text": f"{word} {i} {word}"} for i in range(n)]


def _problem(train: object) -> str:
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({"model": {"path": "tiny-llama"}, "data": {"train": train}})
    return str(info.value)


def test_a_bad_source_is_one_sentence_naming_data_train_and_its_index() -> None:
    weight = "weight {} is not a number above 0 and at most 1e+06"
    assert f"data.train: source 1 (`b.jsonl`): {weight.format('-1')}" in _problem(
        [{"path": "a.jsonl", "weight": 1}, {"path": "b.jsonl", "weight": -1}]
    )
    for bad, shown in ((float("inf"), "inf"), (float("nan"), "nan"), (2e6, "2000000.0"), ("x", "'x'"), (True, "True")):
        assert weight.format(shown) in _problem([{"path": "a.jsonl", "weight": bad}, {"path": "b", "weight": 1}])
    assert "source 0 (`a.jsonl`): weight None" in _problem([{"path": "a.jsonl"}, {"path": "b.jsonl", "weight": 1}])
    assert "data.train: source 1 is 'b.jsonl'; in a mixture every source is {path: ..., weight: ...}" in _problem(
        [{"path": "a.jsonl", "weight": 3}, "b.jsonl"]
    )
    assert "source 0: unknown key `wieght`" in _problem([{"path": "a.jsonl", "wieght": 3}])
    assert "source 0: path must be a file" in _problem([{"path": "", "weight": 3}])
    assert "data.shuffle_buffer" in _problem_data({"shuffle_buffer": 10**9})


def _problem_data(data: dict) -> str:
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({"model": {"path": "tiny-llama"}, "data": {"train": "a.jsonl", **data}})
    return str(info.value)


def test_the_capability_rows_of_streaming_and_mixtures() -> None:
    def said(**cell: object) -> list[str]:
        return [str(r) for r in refusals(Cell(**cell))]  # type: ignore[arg-type]

    assert said(streaming=True, max_steps=False) == [
        "data.streaming: a stream's length is not known before it is read, so train.epochs cannot give the number "
        "of steps (nor the learning-rate schedule's length); set train.max_steps (the stream starts over at its end)"
    ]
    assert said(streaming=True, packing=True)[0].startswith("data.streaming: packing fits samples into rows")
    assert said(streaming=True, eval_fraction=True)[0].startswith("data.streaming: holding out a fraction")
    assert said(mixture=True, objective="dpo", data_format="preference")[0].startswith(
        "data.train: a mixture of {path, weight} sources is drawn for sft's samples, not for dpo's pairs or prompts"
    )
    assert said(streaming=True) == said(mixture=True) == []
    recipe = recipe_from_dict({"model": {"path": "tiny-llama"}, "data": {"train": "a.jsonl", "streaming": True}})
    assert Cell.of_recipe(recipe.recipe).streaming and not Cell.of_recipe(recipe.recipe).max_steps


def test_the_mixture_shares_samples_by_weight_every_row_once_before_any_twice() -> None:
    assert mixture_counts([0.75, 0.25], 80) == [60, 20]
    assert mixture_counts([1, 1, 1], 10) == [4, 3, 3]  # the remainder to the earlier source
    assert sum(mixture_counts([0.3, 0.7, 2.0], 1001)) == 1001
    pools = [list(range(40)), list(range(40, 80))]
    drawn = draw_mixture(pools, [0.75, 0.25], seed=3)
    assert drawn == draw_mixture(pools, [0.75, 0.25], seed=3) != draw_mixture(pools, [0.75, 0.25], seed=4)
    first = [i for i in drawn if i < 40]
    assert len(first) == 60 and sorted(first[:40]) == pools[0]  # upsampled: a whole pass, then 20 again
    second = [i for i in drawn if i >= 40]
    assert len(second) == 20 and len(set(second)) == 20  # subsampled: 20 different rows


def test_finetune_data_json_reports_rows_used_in_the_weights_proportions(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", _rows("apple", 50))
    write_jsonl(tmp_path / "b.jsonl", _rows("berry", 30))
    recipe = write_recipe(tmp_path / "mix.yaml", {
        "model": {"path": str(TINY_MODEL)},
        "data": {"train": [{"path": "a.jsonl", "weight": 0.75}, {"path": "b.jsonl", "weight": 0.25}],
                 "format": "text", "max_seq_len": 32, "cache_dir": str(tmp_path / "cache")},
    })
    out = CliRunner().invoke(app, ["data", str(recipe), "--json", "--show", "0"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    used = {s["key"]: s["rows_used"] for s in report["sources"]}
    assert used == {"data.train.0": 60, "data.train.1": 20}
    assert abs(used["data.train.0"] / sum(used.values()) - 0.75) <= 0.03
    assert [s["weight"] for s in report["sources"]] == [0.75, 0.25]
    assert report["train"]["samples"] == 80
    assert "mixture: data.train.0 60 samples (weight 0.75, 1.20 of its rows), data.train.1 20 samples (weight " \
        "0.25, 0.67 of its rows)" in report["notes"]


def _stream(tok, tmp_path: Path, *, buffer: int = 8, weights: tuple[float, ...] | None = None,
            on_bad_row: str = "error", batch: int = 4) -> StreamingBatches:
    sources = [StreamSource("data.train", [write_jsonl(tmp_path / "a.jsonl", _rows("apple", 13)),
                                           write_jsonl(tmp_path / "b.jsonl", _rows("berry", 7))])]
    if weights is not None:
        sources = [StreamSource(f"data.train.{i}", [f], w) for i, (f, w) in enumerate(zip(sources[0].files, weights, strict=True))]
    spec = StreamSpec(sources, Encoder(tok, "text", {"text": "text"}, 32), buffer, on_bad_row, "fp")
    return StreamingBatches(spec, batch, seed=0, pad_id=0, total_steps=100)


def _texts(tok, rows) -> list[str]:
    return [tok.decode(r.input_ids, skip_special_tokens=True) for r in rows]


def test_a_stream_resumed_from_its_saved_position_draws_the_same_rows(tok, tmp_path: Path) -> None:
    whole = _stream(tok, tmp_path)
    batches = [_texts(tok, whole.global_rows(0, s)) for s in range(9)]  # 36 samples of 20 rows: passes 2
    assert len(whole.buffer) == 8 - 1  # bounded: the buffer (less the row just drawn), never the file
    assert {t for b in batches[:3] for t in b} <= {f"{w} {i} {w}" for w in ("apple", "berry") for i in range(13)}
    first = _stream(tok, tmp_path)
    for s in range(4):
        first.global_rows(0, s)
    saved = json.loads(json.dumps(first.position_state(0, 4)))  # as meta.json holds it
    assert len(saved["stream"]["buffer"]) == 7 and saved["stream"]["cursors"][0][0] in (0, 1)
    resumed = _stream(tok, tmp_path)
    assert resumed.restore_position(saved) == (0, 4)
    assert [_texts(tok, resumed.global_rows(0, s)) for s in range(4, 9)] == batches[4:]
    with pytest.raises(UserError, match="the stream cannot be resumed exactly"):
        _stream(tok, tmp_path, batch=2).restore_position(saved)


def test_each_rank_takes_its_slice_of_the_same_global_batch(tok, tmp_path: Path) -> None:
    one = _stream(tok, tmp_path)
    ranks = [_stream(tok, tmp_path) for _ in range(2)]
    for s in range(3):
        whole = _texts(tok, one.rank_rows(0, s, rank=0, world_size=1))
        parts = [_texts(tok, r.rank_rows(0, s, rank=i, world_size=2)) for i, r in enumerate(ranks)]
        assert parts[0] + parts[1] == whole and parts[0] != parts[1]


def test_a_streamed_mixture_draws_by_weight_and_counts_by_source(tok, tmp_path: Path) -> None:
    stream = _stream(tok, tmp_path, weights=(3.0, 1.0), batch=20)
    counts = [stream.source_counts(0, s, ["data.train.0", "data.train.1"]) for s in range(10)]
    apples = sum(c["samples/data.train.0"] for c in counts)
    assert sum(c["samples/data.train.1"] for c in counts) + apples == 200
    assert 0.65 < apples / 200 < 0.85  # a random draw by weight (3:1), through a buffer of 8
    assert all(t.startswith("apple") for t, r in zip(_texts(tok, stream.last), stream.last, strict=True) if r.sources == (0,))


def test_a_bad_streamed_row_names_its_file_and_line(tok, tmp_path: Path) -> None:
    stream = _stream(tok, tmp_path, buffer=1)
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n\n{"text": 3}\n')
    stream.spec.sources[0].files = [tmp_path / "a.jsonl"]
    with pytest.raises(UserError) as info:
        stream.global_rows(0, 0)
    assert str(info.value).startswith(f"{tmp_path / 'a.jsonl'}:3: field `text`")
    assert str(info.value).endswith("; fix the data, or set data.on_bad_row: skip to leave bad rows out")
    skipping = _stream(tok, tmp_path, buffer=1, on_bad_row="skip")
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\nnot json\n')
    skipping.spec.sources[0].files = [tmp_path / "a.jsonl"]
    assert _texts(tok, skipping.global_rows(0, 0)) == ["fine"] * 4 and skipping.counts.bad == 3


def test_a_mixture_takes_a_cached_hub_dataset_and_keeps_weights_when_one_becomes_files(
    tmp_path: Path, tok, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support import load
    from tests.unit.test_data_sources import fake_hf_cache

    fake_hf_cache(tmp_path, monkeypatch)  # someone/tiny: 4 train rows
    write_jsonl(tmp_path / "a.jsonl", _rows("apple", 4))
    data = load(tmp_path, tok, train=[{"path": "someone/tiny", "weight": 1}, {"path": "a.jsonl", "weight": 3}],
                format="text")
    assert [(s.key, s.name, s.rows, s.rows_used) for s in data.sources] == [
        ("data.train.0", "someone/tiny [train]", 4, 2), ("data.train.1", str(tmp_path / "a.jsonl"), 4, 6),
    ]
    assert sum(1 for e in data.train if e.sources == (0,)) == 2
    # a Hub id downloaded into several files (finetune.recipe.locate.fetch_hub_inputs) stays one source, with its weight
    d = recipe_from_dict({"model": {"path": "tiny-llama"}, "data": {"train": [
        {"path": "org/set", "weight": 2}, {"path": "b.jsonl", "weight": 1}]}}).recipe.data
    d.set_train_specs([["/hub/train-0.parquet", "/hub/train-1.parquet"], ["/abs/b.jsonl"]])
    assert [(t.key, t.spec, t.source, t.weight) for t in d.train_specs()] == [
        ("data.train.0", "/hub/train-0.parquet", 0, 2.0), ("data.train.0", "/hub/train-1.parquet", 0, 2.0),
        ("data.train.1", "/abs/b.jsonl", 1, 1.0),
    ]
    assert d.describe_train() == "/hub/train-0.parquet (weight 2), /hub/train-1.parquet (weight 2), /abs/b.jsonl (weight 1)"


def test_finetune_data_on_a_stream_shows_the_first_samples_drawn_and_reads_no_more(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", _rows("apple", 30))
    recipe = write_recipe(tmp_path / "stream.yaml", {
        "model": {"path": str(TINY_MODEL)}, "train": {"max_steps": 10},
        "data": {"train": "a.jsonl", "format": "text", "streaming": True, "shuffle_buffer": 5},
    })
    out = CliRunner().invoke(app, ["data", str(recipe), "--json", "--show", "2"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["notes"] == ["streaming 1 .jsonl file, tokenized while training through a shuffle buffer of 5 rows"]
    assert [s["key"] for s in report["sources"]] == ["data.train"] and report["train"]["samples"] == 0
    lines = [int(r["where"].rsplit(":", 1)[1]) for r in report["rows"]]
    assert len(lines) == 2 and all(1 <= n <= 6 for n in lines)  # from the first buffer (5 rows, then the 6th)
    assert [r["text"] for r in report["rows"]] == [f"apple {n - 1} apple</s>" for n in lines]
