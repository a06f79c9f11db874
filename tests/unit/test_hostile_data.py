"""Data that cannot crash the reader: whatever a row holds (bytes that are not UTF-8, an integer longer than Python
converts, JSON nested 10^5 deep, a CSV field over csv's limit, token ids or labels the model's embeddings have no
row for) is a bad row with its file:line, stopping the run under ``data.on_bad_row: error`` and counted and left
out under ``skip``; the good rows around it are read as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from finetune.cli import app
from finetune.errors import UserError
from finetune.recipe.schema import recipe_from_dict
from finetune.train.data import load_data
from tests.support import TINY_MODEL, micro_model_dir, tiny_recipe, write_recipe

GOOD = [{"instruction": "Rev", "input": "ab", "output": "ba"}, {"instruction": "Up", "input": "cd", "output": "CD"}]
HOSTILE_LINES = {
    "not UTF-8": b'{"instruction": "R\xffv", "input": "ab", "output": "ba"}',
    "an integer of 5000 digits": b'{"instruction": "Rev", "output": "ba", "n": ' + b"7" * 5000 + b"}",
    "JSON nested 10^5 deep": b'{"instruction": "Rev", "output": "ba", "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a lone surrogate": b'{"instruction": "Rev \\udc80", "input": "ab", "output": "ba"}',
}
SAYS = {
    "not UTF-8": "not valid UTF-8 (byte 0xff at column 19); save the file as UTF-8",
    "an integer of 5000 digits": "holds an integer too long to read (over 4300 digits); write it as a string",
    "JSON nested 10^5 deep": "nested too deeply to read",
    "a lone surrogate": "holds \\udc80, half of a UTF-16 pair, which is no character; fix its escape",
}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama's tokenizer (264 tokens) on a model of 300 embedding rows: ids 264..299 are the model's."""
    return micro_model_dir(tmp_path_factory.mktemp("wide"), vocab_size=300)


def _load(tmp: Path, tok, model: Path = TINY_MODEL, **data):
    data.setdefault("cache_dir", str(tmp / "cache"))
    raw = {"model": {"path": str(model)}, "data": data, "train": {"seed": 0}}
    return load_data(recipe_from_dict(raw, base_dir=tmp), tok)


def _bad(tmp: Path, tok, **data) -> str:
    with pytest.raises(UserError) as info:
        _load(tmp, tok, **data)
    return str(info.value)


def _lines(path: Path, middle: bytes) -> Path:
    rows = [json.dumps(r).encode() for r in GOOD]
    path.write_bytes(b"\n".join([rows[0], middle, *rows * 3]) + b"\n")
    return path


@pytest.mark.parametrize("kind", sorted(HOSTILE_LINES))
def test_a_hostile_jsonl_line_is_one_bad_row(tmp_path: Path, tok, kind: str) -> None:
    f = _lines(tmp_path / "d.jsonl", HOSTILE_LINES[kind])
    message = _bad(tmp_path, tok, train=str(f))
    assert message.startswith(f"{f}:2: ") and SAYS[kind] in message, message
    assert message.endswith("fix the data, or set data.on_bad_row: skip to leave bad rows out")
    skipped = _load(tmp_path, tok, train=str(f), on_bad_row="skip")
    assert skipped.stats["skipped_bad_rows"] == 1 and skipped.stats["train"] == 7
    assert skipped.bad[0].startswith(f"{f}:2: ")


@pytest.mark.parametrize("kind", sorted(HOSTILE_LINES))
def test_a_hostile_line_of_a_stream_is_one_bad_row(tmp_path: Path, tok, kind: str) -> None:
    """data.streaming reads its .jsonl while training: the same line is the same bad row there."""
    from finetune.train.data.stream import StreamingBatches

    f = _lines(tmp_path / "d.jsonl", HOSTILE_LINES[kind])

    def drawn(on_bad_row: str) -> tuple[list, StreamingBatches]:
        raw = {"model": {"path": str(TINY_MODEL)}, "train": {"seed": 0, "max_steps": 4},
               "data": {"train": str(f), "streaming": True, "shuffle_buffer": 2, "on_bad_row": on_bad_row}}
        data = load_data(recipe_from_dict(raw, base_dir=tmp_path), tok)
        assert data.stream is not None
        stream = StreamingBatches(data.stream, 16, 0, tok.pad_token_id, 4)  # two passes over the 8 lines at least
        return stream.global_rows(0, 0), stream

    with pytest.raises(UserError) as info:
        drawn("error")
    assert str(info.value).startswith(f"{f}:2: ") and SAYS[kind] in str(info.value), str(info.value)
    rows, stream = drawn("skip")
    assert len(rows) == 16 and stream.counts.bad >= 2 and f"{f}:2" not in stream.where
    assert {w.rsplit(":", 1)[1] for w in stream.where} <= {"1", "3", "4", "5", "6", "7", "8"}


def test_csv_long_field_bad_bytes_and_cells_that_cannot_be_read(tmp_path: Path, tok) -> None:
    f = tmp_path / "d.csv"
    f.write_bytes(
        b"instruction,input,output\n"
        b"Rev,ab,ba\n"
        b"Rev,\"" + b"x" * (200 * 1024) + b"\",ba\n"  # line 3: over csv's 128 KiB field limit
        b"R\xffv,ab,ba\n"  # line 4: not UTF-8
        b"Up,cd,CD\n"
        b"Up,\"multi\nline\",CD\n"  # lines 6-7: one row
        b"Rev,ef,fe\n"
    )
    message = _bad(tmp_path, tok, train=str(f))
    assert message.startswith(
        f"{f}:3: field `input` is 200 KiB, over the 128 KiB a CSV field may hold (csv's field_size_limit); write long "
        "texts as .jsonl (and 1 more bad rows)"
    ), message
    skipped = _load(tmp_path, tok, train=str(f), on_bad_row="skip")
    assert skipped.bad[1] == (
        f"{f}:4: field `instruction` is not valid UTF-8 (byte 0xff at its character 2); save the file as UTF-8"
    )
    assert skipped.stats["skipped_bad_rows"] == 2 and skipped.stats["train"] == 4
    assert skipped.where == [f"{f}:2", f"{f}:5", f"{f}:6", f"{f}:8"]  # the rows after them keep their lines

    cells = tmp_path / "ids.csv"
    cells.write_text(
        'input_ids\n"[1, 2, 3]"\n"' + "[" * 50_000 + "]" * 50_000 + '"\n"[' + "9" * 5000 + ']"\n"[4, 5, 6]"\n'
    )
    skipped = _load(tmp_path, tok, train=str(cells), format="tokenized", on_bad_row="skip")
    assert [b.split(": ", 1)[0] for b in skipped.bad] == [f"{cells}:3", f"{cells}:4"]
    assert "nested too deeply" in skipped.bad[0] and "over 4300 digits" in skipped.bad[1]
    assert skipped.stats["train"] == 2


def test_a_json_file_that_cannot_be_read_is_one_sentence_naming_it(tmp_path: Path, tok) -> None:
    f = tmp_path / "d.json"
    f.write_bytes(b'[\n{"instruction": "Rev", "output": "ba"},\n{"instruction": "R\xffv", "output": "ba"}\n]')
    assert _bad(tmp_path, tok, train=str(f)) == f"{f}:3: not valid UTF-8 (byte 0xff at column 19); save the file as UTF-8"
    f.write_text('[{"instruction": "Rev", "output": "ba", "n": ' + "[" * 100_000 + "]" * 100_000 + "}]")
    assert _bad(tmp_path, tok, train=str(f)).startswith(f"{f}: nested too deeply to read")


def test_ids_and_labels_are_checked_against_the_models_embeddings(tmp_path: Path, tok, wide_model: Path) -> None:
    """Not the tokenizer's length: 280 is beyond tiny-llama's tokenizer but a row of this model's embeddings, 300 is
    beyond both; labels too (a label past the vocabulary is an index error in the loss, on a GPU a device assert)."""
    f = tmp_path / "t.jsonl"
    rows = [
        {"input_ids": [1, 280, 3]},
        {"input_ids": [1, 300, 3]},
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 300]},
        {"input_ids": [1, 2, 3], "labels": [-100, -7, 3]},
        {"input_ids": [4, 5, 6]},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    message = _bad(tmp_path, tok, model=wide_model, train=str(f), format="tokenized")
    assert message.startswith(f"{f}:2: field `input_ids[1]`: token id 300 is not in the model's embeddings of 300 "
                              "(and 2 more bad rows)"), message
    skipped = _load(tmp_path, tok, model=wide_model, train=str(f), format="tokenized", on_bad_row="skip")
    assert skipped.bad[1:] == [
        f"{f}:3: field `labels[2]`: token id 300 is not in the model's embeddings of 300",
        f"{f}:4: field `labels[1]`: expected a non-negative integer token id, got a number (-7)",
    ]
    assert [e.input_ids for e in skipped.train] == [[1, 280, 3], [4, 5, 6]]
    # the same rows on tiny-llama (264 embedding rows): 280 is beyond them too
    skipped = _load(tmp_path, tok, train=str(f), format="tokenized", on_bad_row="skip", cache_dir=str(tmp_path / "c2"))
    assert skipped.bad[0] == f"{f}:1: field `input_ids[1]`: token id 280 is not in the model's embeddings of 264"


def test_a_tokenizer_larger_than_the_models_vocabulary_makes_its_rows_bad(tmp_path: Path, tok) -> None:
    small = micro_model_dir(tmp_path / "small", vocab_size=100)  # the tokenizer gives ids up to 263
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in GOOD))
    message = _bad(tmp_path, tok, model=small, train=str(f))
    assert message.startswith(f"{f}:1: the tokenizer gives token id ") and (
        "which is not in the model's embeddings of 100: the tokenizer does not belong to the model" in message
    ), message


def test_finetune_data_says_it_in_one_line(tmp_path: Path) -> None:
    """``finetune data`` reads every row: exit 2, one sentence with file:line, no traceback, nothing written
    (``validate`` reads no rows: tests/e2e/test_hostile_cli.py)."""
    f = _lines(tmp_path / "d.jsonl", HOSTILE_LINES["JSON nested 10^5 deep"])
    r = tiny_recipe(tmp_path / "out", data={"train": str(f), "eval": None, "max_seq_len": 48,
                                            "cache_dir": str(tmp_path / "cache")})
    path = write_recipe(tmp_path / "r.yaml", r)
    res = CliRunner().invoke(app, ["data", str(path)])
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error")]
    assert errors == [
        f"error: {f}:2: nested too deeply to read (lists or objects inside each other thousands of levels deep); fix "
        "the data, or set data.on_bad_row: skip to leave bad rows out"
    ], res.output
    assert "Traceback" not in res.output and not (tmp_path / "out").exists()
