"""Every source type, every bad-row message (file, line or row, field), skipping, and the tokenization cache."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from finetune.errors import UserError
from finetune.recipe.schema import check_files, recipe_from_dict
from tests.support import CONVERSATION, TINY_MODEL, load, write_jsonl

ROWS = [
    {"instruction": "Rev", "input": "ab", "output": "ba"},
    {"instruction": "Up", "input": "cd", "output": "CD"},
    {"instruction": "Rev", "input": "xyz", "output": "zyx"},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


def write_csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def ids_of(data) -> list[list[int]]:
    return [e.input_ids for e in data.train]


def test_jsonl_json_csv_parquet_give_the_same_examples(tmp_path, tok):
    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS, indent=1))
    write_csv(tmp_path / "d.csv", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    want = ids_of(load(tmp_path, tok, train=str(jsonl)))
    assert len(want) == 3
    for name in ("d.json", "d.csv", "d.parquet"):
        assert ids_of(load(tmp_path, tok, train=name)) == want, name  # relative to the recipe's directory


def test_glob_directory_and_list(tmp_path, tok):
    d = tmp_path / "parts"
    d.mkdir()
    write_jsonl(d / "a.jsonl", ROWS[:1])
    write_jsonl(d / "b.jsonl", ROWS[1:])
    (d / "notes.txt").write_text("ignored: not a data file")
    one = ids_of(load(tmp_path, tok, train=str(write_jsonl(tmp_path / "all.jsonl", ROWS))))
    assert ids_of(load(tmp_path, tok, train="parts/*.jsonl")) == one
    assert ids_of(load(tmp_path, tok, train="parts")) == one
    assert ids_of(load(tmp_path, tok, train=["parts/b.jsonl", "parts/a.jsonl"])) == one[1:] + one[:1]
    with pytest.raises(UserError, match=r"data.train: the glob `nothing/\*.jsonl` matches no files"):
        load(tmp_path, tok, train="nothing/*.jsonl")


def fake_hf_cache(tmp_path: Path, monkeypatch) -> None:
    """Put `someone/tiny` (splits train, validation; a text column) in a fresh Hugging Face datasets cache,
    laid out as `load_dataset` leaves a downloaded dataset."""
    import shutil

    import datasets

    cache = tmp_path / "hf" / "datasets"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    files = {
        s: str(write_jsonl(tmp_path / f"{s}.jsonl", [{"text": f"{s} {i}"} for i in range(n)]))
        for s, n in (("train", 4), ("validation", 2))
    }
    datasets.load_dataset("json", data_files=files, cache_dir=str(tmp_path / "build"))
    built = next(p for p in (tmp_path / "build" / "json").glob("*/*/*") if p.is_dir())
    dest = cache / "someone___tiny" / "default" / "0.0.0" / "abc"
    shutil.copytree(built, dest)
    for f in dest.glob("json-*.arrow"):
        f.rename(dest / f.name.replace("json-", "tiny-"))


def test_hf_dataset_from_the_local_cache(tmp_path, tok, monkeypatch):
    fake_hf_cache(tmp_path, monkeypatch)
    data = load(tmp_path, tok, train="someone/tiny", eval="validation", format="text")
    assert [e.input_ids[:-1] for e in data.train] == [tok(f"train {i}")["input_ids"] for i in range(4)]
    assert data.stats["eval"] == 2
    raw = {"model": {"path": str(TINY_MODEL)}, "data": {"train": "someone/tiny", "eval": "validation"}}
    assert check_files(recipe_from_dict(raw, base_dir=tmp_path)) == []
    with pytest.raises(
        UserError, match=r"data.train: the Hugging Face dataset `someone/tiny` has no split `test`"
    ):
        load(tmp_path, tok, train="someone/tiny", split="test", format="text")
    with pytest.raises(
        UserError,
        match=r"data.train: dataset `someone/tiny` split `train`: field `instruction`: no such column",
    ):
        load(tmp_path, tok, train="someone/tiny")


def test_hf_dataset_not_in_cache_is_a_clear_error(tmp_path, tok, monkeypatch):
    fake_hf_cache(tmp_path, monkeypatch)
    with pytest.raises(UserError) as err:
        load(tmp_path, tok, train="someone/not-cached-dataset")
    assert str(err.value).startswith(
        "data.train: `someone/not-cached-dataset` is not a local file or directory, nor a Hugging Face dataset "
        "in the local cache (`finetune run` downloads a Hub dataset unless HF_HUB_OFFLINE=1 or --offline)"
    )
    raw = {"model": {"path": str(TINY_MODEL)}, "data": {"train": "someone/not-cached-dataset"}}
    assert check_files(recipe_from_dict(raw, base_dir=tmp_path)) == []  # a run downloads it (tests/train/test_hub.py)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problems = check_files(recipe_from_dict(raw, base_dir=tmp_path))
    assert [p.key for p in problems] == ["data.train"]


def test_eval_file_and_eval_fraction(tmp_path, tok):
    rows = [{"text": f"row {i}"} for i in range(20)]
    f = write_jsonl(tmp_path / "t.jsonl", rows)
    data = load(tmp_path, tok, train=str(f), format="text", eval_fraction=0.25)
    assert (data.stats["train"], data.stats["eval"]) == (15, 5)
    seen = {tuple(e.input_ids) for e in data.train} | {tuple(e.input_ids) for e in data.eval}
    assert len(seen) == 20  # a split, nothing lost or duplicated
    again = load(tmp_path, tok, train=str(f), format="text", eval_fraction=0.25)
    assert [e.input_ids for e in again.eval] == [e.input_ids for e in data.eval]  # chosen by train.seed


# ------------------------------------------------------------------------------------------ bad rows


def bad_load(tmp_path, tok, **data) -> str:
    with pytest.raises(UserError) as err:
        load(tmp_path, tok, **data)
    return str(err.value)


def test_invalid_json_names_file_and_line(tmp_path, tok):
    f = tmp_path / "d.jsonl"
    f.write_text(
        json.dumps(ROWS[0]) + "\n\n" + '{"instruction": "x", "output": }\n' + json.dumps(ROWS[1]) + "\n"
    )
    msg = bad_load(tmp_path, tok, train=str(f))
    assert msg.startswith(f"{f}:3: not valid JSON (Expecting value at column 32)")
    assert msg.endswith("fix the data, or set data.on_bad_row: skip to leave bad rows out")


def test_missing_field_names_file_line_and_field(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"instruction": "Rev", "input": "ab"}, ROWS[1]])
    assert bad_load(tmp_path, tok, train=str(f)).startswith(
        f"{f}:2: field `output`: missing (set data.columns if your data names it differently)"
    )


def test_missing_csv_column_names_file_and_field(tmp_path, tok):
    f = write_csv(tmp_path / "d.csv", [{"instruction": "a", "answer": "b"}])
    assert bad_load(tmp_path, tok, train=str(f)) == (
        f"{f}: field `output`: no such column (the columns are instruction, answer); rename it or set data.columns"
    )


def test_wrong_type_names_row_and_field(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], ROWS[1], {"instruction": "Rev", "output": 5}])
    assert bad_load(tmp_path, tok, train=str(f)).startswith(
        f"{f}:3: field `output`: expected a string, got a number (5)"
    )
    (tmp_path / "d.json").write_text(json.dumps([{"instruction": ["x"], "output": "y"}]))
    assert bad_load(tmp_path, tok, train="d.json").startswith(
        f"{tmp_path / 'd.json'}: row 0: field `instruction`: expected a string, got a list"
    )
    t = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, "2"]}])
    assert bad_load(tmp_path, tok, train=str(t), format="tokenized").startswith(
        f"{t}:1: field `input_ids[1]`: expected a non-negative integer token id, got a string ('2')"
    )


def test_chat_errors_name_the_message(tmp_path, tok):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}, {"messages": []}])
    assert bad_load(tmp_path, tok, train=str(f), format="chat").startswith(
        f"{f}:2: field `messages`: the conversation is empty"
    )
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    tool = [*CONVERSATION[:2], call, {"role": "tool", "content": "42"}, *CONVERSATION[2:]]
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": tool}])
    assert bad_load(tmp_path, tok, train=str(f), format="chat").startswith(
        f"{f}:1: field `messages[3].role`: the chat template of `{TINY_MODEL}` refuses this message (role `tool`: "
        "unknown role: tool)"
    )
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": None}]}])
    assert bad_load(tmp_path, tok, train=str(f), format="chat").startswith(
        f"{f}:1: field `messages[0].content`: expected a string, got null"
    )


def test_every_bad_row_is_counted_and_skip_reports_them(tmp_path, tok):
    f = tmp_path / "d.jsonl"
    lines = [json.dumps(ROWS[0]), "not json", json.dumps({"instruction": "x"}), json.dumps(ROWS[1]), "[1, 2]"]
    f.write_text("\n".join(lines) + "\n")
    msg = bad_load(tmp_path, tok, train=str(f))
    assert "(and 2 more bad rows)" in msg
    data = load(tmp_path, tok, train=str(f), on_bad_row="skip")
    assert data.stats["skipped_bad_rows"] == 3 and data.stats["train"] == 2
    assert data.notes == [
        f"3 bad rows were skipped (data.on_bad_row: skip); the first: {f}:2: not valid JSON "
        "(Expecting value at column 1)"
    ]


# ------------------------------------------------------------------------------------------- cache


def test_tokenization_is_cached_and_keyed_on_settings(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", ROWS * 50)
    first = load(tmp_path, tok, train=str(f))
    assert first.stats["cached_sources"] == 0
    assert len(list((tmp_path / "cache").glob("tokenized-*.arrow"))) == 1
    second = load(tmp_path, tok, train=str(f))
    assert second.stats["cached_sources"] == 1
    assert ids_of(second) == ids_of(first)
    # another setting that changes the tokens is another cache entry; so is other content
    assert load(tmp_path, tok, train=str(f), max_seq_len=16).stats["cached_sources"] == 0
    write_jsonl(f, ROWS * 49)
    assert load(tmp_path, tok, train=str(f)).stats["cached_sources"] == 0


def test_num_proc_gives_the_same_examples(tmp_path, tok):
    """Two processes write two files, read back whatever the processes of the run that reads them."""
    f = write_jsonl(tmp_path / "d.jsonl", ROWS * 20)
    one = load(tmp_path, tok, train=str(f))
    two = load(tmp_path, tok, train=str(f), num_proc=2, cache_dir=str(tmp_path / "cache2"))
    assert ids_of(two) == ids_of(one)
    assert len(list((tmp_path / "cache2").glob("tokenized-*_of_00002.arrow"))) == 2
    again = load(tmp_path, tok, train=str(f), num_proc=1, cache_dir=str(tmp_path / "cache2"))
    assert again.stats["cached_sources"] == 1 and ids_of(again) == ids_of(one)


def test_the_default_processes_are_the_cores_for_a_large_set_and_one_for_a_small_one():
    from finetune.train.data.cache import AUTO_MAX_PROCESSES, ROWS_PER_PROCESS, tokenizing_processes
    from finetune.train.parallel.distributed import available_cores

    cores = available_cores()
    assert tokenizing_processes(None, 10**7) == min(cores, AUTO_MAX_PROCESSES)
    assert tokenizing_processes(None, ROWS_PER_PROCESS - 1) == 1
    assert tokenizing_processes(None, 2 * ROWS_PER_PROCESS) == min(cores, 2)
    assert tokenizing_processes(4, 3) == 3 and tokenizing_processes(4, 10**6) == 4  # data.num_proc as set
    assert tokenizing_processes(None, 0) == 1


def test_a_file_is_hashed_as_it_is_read_in_every_format(tmp_path):
    """The digest of one pass over the file is the SHA-256 of its bytes, whatever the format."""
    import hashlib

    from finetune.train.data.sources import read_file

    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS * 3000)  # larger than the CSV reader's first buffer
    (tmp_path / "d.json").write_text(json.dumps(ROWS, indent=1))
    write_csv(tmp_path / "d.csv", ROWS * 3000)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    for f in (jsonl, tmp_path / "d.json", tmp_path / "d.csv", tmp_path / "d.parquet"):
        src = read_file(f, [])
        assert src.fingerprint == hashlib.sha256(f.read_bytes()).hexdigest()[:24], f.name
        assert len(src.dataset) == (len(ROWS) * 3000 if f.suffix in (".jsonl", ".csv") else len(ROWS)), f.name


def test_an_unchanged_file_whose_tokens_are_cached_is_not_read_again(tmp_path, tok):
    """The second run takes the digest from the memo and the rows' counts, bad rows and file:line from the cache's
    manifest: the file is never read (its Source reads it only if its rows are asked for); the same data comes
    back. A change of content, even of the same size, is a new read and a new entry."""
    from finetune.train.data.cache import digests_dir
    from finetune.train.data.sources import read_file

    rows = [*ROWS, {"instruction": "Rev", "output": 5}, *ROWS]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    with f.open("a") as out:
        out.write("{not json\n")
    first = load(tmp_path, tok, train=str(f), on_bad_row="skip")
    digests = digests_dir(tmp_path / "cache")
    src = read_file(f, [], digests)
    assert not src.is_read and src.fingerprint == read_file(f, []).fingerprint
    second = load(tmp_path, tok, train=str(f), on_bad_row="skip")
    assert second.stats["cached_sources"] == 1
    assert (ids_of(second), second.where, second.bad) == (ids_of(first), first.where, first.bad)
    assert second.where[3] == f"{f}:5"
    assert second.bad == [  # the reader's bad rows first (from the manifest), then the tokenizer's
        f"{f}:8: not valid JSON (Expecting property name enclosed in double quotes at column 2)",
        f"{f}:4: field `output`: expected a string, got a number (5)",
    ]
    counts = [[(s.rows, s.bad, s.rows_used) for s in d.sources] for d in (first, second)]
    assert counts == [[(8, 2, 6)], [(8, 2, 6)]]
    assert src.dataset is not None and src.is_read  # asked for: read now
    f.write_text(f.read_text().replace("Rev", "Inv"))  # the same size, another content
    changed = load(tmp_path, tok, train=str(f), on_bad_row="skip")
    assert changed.stats["cached_sources"] == 0 and ids_of(changed) != ids_of(first)


def test_samples_hold_their_ids_in_four_bytes(tmp_path, tok):
    from finetune.train.data import TokenIds

    f = write_jsonl(tmp_path / "d.jsonl", ROWS)
    data = load(tmp_path, tok, train=str(f))
    sample = data.train[0]
    assert isinstance(sample.input_ids, TokenIds) and isinstance(sample.labels, TokenIds)
    assert sample.input_ids.itemsize == 4 and sample.input_ids == list(sample.input_ids)
    assert sample.labels != sample.input_ids  # the instruction's prompt is not trained on
    text = load(tmp_path, tok, train=str(write_jsonl(tmp_path / "t.jsonl", [{"text": "abc"}])), format="text")
    assert text.train[0].labels is text.train[0].input_ids  # a text's labels are its ids: one object for both


@pytest.mark.slow  # a CLI subprocess
def test_cli_reports_bad_row_without_traceback(tmp_path, finetune_cmd):
    """`finetune run` stops before training with the one-line message (exit 2, no traceback)."""
    f = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"instruction": "Rev", "output": 5}] + ROWS * 4)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{path: {TINY_MODEL}, init: random}}\n"
        f"data: {{train: {f}, max_seq_len: 32, cache_dir: {tmp_path / 'cache'}}}\n"
        f"train: {{max_steps: 1, global_batch_size: 4, micro_batch_size: 4}}\n"
        f"precision: fp32\ndistributed: {{strategy: single}}\noutput: {{dir: {tmp_path / 'out'}}}\n"
    )
    res = subprocess.run([*finetune_cmd, "run", str(recipe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert f"{f}:2: field `output`: expected a string, got a number (5)" in res.stderr
    assert "Traceback" not in res.stderr


def test_csv_cells_hold_lists_as_json(tmp_path, tok):
    """A .csv cannot hold a list: conversations and token ids are read from JSON text in the cell."""
    f = write_csv(tmp_path / "c.csv", [{"messages": json.dumps(CONVERSATION)}])
    from_csv = load(tmp_path, tok, train=str(f), format="chat")
    from_jsonl = load(
        tmp_path,
        tok,
        train=str(write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])),
        format="chat",
    )
    assert from_csv.train == from_jsonl.train
    k = write_csv(tmp_path / "k.csv", [{"input_ids": "[5, 6, 2]", "labels": "[-100, 6, 2]"}])
    data = load(tmp_path, tok, train=str(k), format="tokenized")
    assert (data.train[0].input_ids, data.train[0].labels) == ([5, 6, 2], [-100, 6, 2])
