"""Where rows come from: local files (.jsonl, .json, .csv, .parquet; globs; directories) and cached Hugging Face datasets.

Local files are read here, row by row, so that every row keeps where it came from (``file:line`` or
``file: row N``) for error messages, and so that a value of the wrong type is reported for its row instead
of failing a whole-file schema inference. Each row is kept as a JSON string (types preserved exactly);
the tokenizer step parses it back. A Hugging Face dataset is used as it is: its rows are named by index.

Whatever a row holds cannot stop the reader: any failure while reading one row (bytes that are not UTF-8, an
integer longer than Python converts, JSON nested deeper than it parses, a CSV field over csv's size limit) makes
that row a bad row with its ``file:line`` (:func:`unreadable`), which ``data.on_bad_row`` stops at or skips.
"""

from __future__ import annotations

import csv
import hashlib
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.recipe.locate import DATA_SUFFIXES as SUFFIXES
from finetune.recipe.locate import DataLocation

ROW_COLUMN = "__row__"
WHERE_COLUMN = "__where__"


@dataclass
class Source:
    """One input: a local file or a Hugging Face dataset split, read into a ``datasets.Dataset``.

    Local files give the columns ``__row__`` (the row as JSON) and ``__where__`` (``file:line``);
    a Hugging Face dataset keeps its own columns. ``bad_rows`` lists rows that could not even be read
    (invalid JSON, not an object); ``fingerprint`` identifies the content for the tokenization cache.
    """

    name: str
    dataset: Any
    fingerprint: str
    is_json_rows: bool
    bad_rows: list[str] = field(default_factory=list)


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


#: The largest CSV field read (csv's own default ``field_size_limit``): a longer one is a bad row.
CSV_FIELD_LIMIT = 128 * 1024


def unreadable(exc: BaseException) -> str:
    """What is wrong with a row that failed to read or encode, in words (the ``file:line:`` goes before it)."""
    if isinstance(exc, UnicodeDecodeError):
        return _not_utf8(exc.object[exc.start], exc.start + 1)
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON ({exc.msg} at column {exc.colno})"
    if isinstance(exc, UnicodeEncodeError):  # a JSON escape of half a UTF-16 pair: no character at all
        return f"holds \\u{ord(exc.object[exc.start]):04x}, half of a UTF-16 pair, which is no character; fix its escape"
    if isinstance(exc, RecursionError):
        return "nested too deeply to read (lists or objects inside each other thousands of levels deep)"
    if isinstance(exc, ValueError) and "integer string conversion" in str(exc):
        return "holds an integer too long to read (over 4300 digits); write it as a string"
    text = str(exc).strip().splitlines()
    return f"cannot be read ({type(exc).__name__}{': ' + text[0][:200] if text else ''})"


def _not_utf8(byte: int, column: int) -> str:
    return f"not valid UTF-8 (byte 0x{byte:02x} at column {column}); save the file as UTF-8"


def _rows_jsonl(path: Path, bad: list[str]) -> tuple[list[str], list[str]]:
    rows, where = [], []
    with path.open("rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                row = json.loads(line)
                json.dumps(row, ensure_ascii=False).encode("utf-8")  # every string a real text (no lone surrogate)
            except Exception as exc:  # whatever the line holds, it is that row's problem
                bad.append(f"{path}:{i}: {unreadable(exc)}")
                continue
            if not isinstance(row, dict):
                bad.append(f"{path}:{i}: expected a JSON object ({{...}}) per line, got {type(row).__name__}")
                continue
            rows.append(line.strip())
            where.append(f"{path}:{i}")
    return rows, where


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _rows_json(path: Path, bad: list[str]) -> tuple[list[str], list[str]]:
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except UnicodeDecodeError as exc:  # one document: the file is the unit that cannot be read
        column = exc.start - raw.rfind(b"\n", 0, exc.start)
        raise UserError(f"{path}:{_line_of(raw, exc.start)}: {_not_utf8(raw[exc.start], column)}") from None
    except Exception as exc:
        raise UserError(f"{path}: {unreadable(exc)}; a .json file is read whole, so no row of it is used") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]} style
    if not isinstance(data, list):
        raise UserError(
            f"{path}: expected a JSON array of objects (or a .jsonl file with one object per line)"
        )
    rows, where = [], []
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            bad.append(f"{path}: row {i}: expected a JSON object, got {type(row).__name__}")
            continue
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")  # every string a real text (no lone surrogate)
            rows.append(json.dumps(row, default=_json_default))
        except Exception as exc:
            bad.append(f"{path}: row {i}: {unreadable(exc)}")
            continue
        where.append(f"{path}: row {i}")
    return rows, where


def _rows_csv(path: Path, bad: list[str]) -> tuple[list[str], list[str], list[str]]:
    """A CSV file's rows. It is read with no field size limit and with undecodable bytes kept as surrogates, so
    that a long field or a bad byte is the problem of its own row (csv's limit, then UTF-8, checked per row)
    rather than the end of the file; any other failure of a row is that row's, too."""
    rows, where = [], []
    limit = csv.field_size_limit(sys.maxsize)
    try:
        with path.open(encoding="utf-8", errors="surrogateescape", newline="") as f:
            reader = csv.reader(f)
            try:
                columns = next(reader, [])
            except Exception as exc:
                raise UserError(f"{path}:1: the header {unreadable(exc)}") from None
            problem = _field_problem(columns, [f"column {k + 1}" for k in range(len(columns))])
            if problem:
                raise UserError(f"{path}:1: the header: {problem}")
            line = reader.line_num
            while True:
                start = line + 1
                try:
                    values = next(reader)
                except StopIteration:
                    break
                except Exception as exc:  # csv.Error (a NUL byte...), or anything else: this row's
                    line = reader.line_num
                    bad.append(f"{path}:{start}: {unreadable(exc)}")
                    continue
                line = reader.line_num
                if not values:
                    continue
                if len(values) > len(columns):
                    bad.append(f"{path}:{start}: has more values than the header has columns")
                    continue
                problem = _field_problem(values, columns)
                if problem:
                    bad.append(f"{path}:{start}: {problem}")
                    continue
                rows.append(json.dumps(dict(zip(columns, values, strict=False))))
                where.append(f"{path}:{start}")
    finally:
        csv.field_size_limit(limit)
    return rows, where, columns


def _field_problem(values: list[str], names: list[str]) -> str | None:
    """What makes a CSV row's fields unusable: one over :data:`CSV_FIELD_LIMIT`, or bytes that were not UTF-8
    (read as surrogates); None when there is nothing."""
    for value, name in zip(values, names, strict=False):
        if len(value) > CSV_FIELD_LIMIT:
            return (
                f"field `{name}` is {len(value) // 1024} KiB, over the {CSV_FIELD_LIMIT // 1024} KiB a CSV field may "
                "hold (csv's field_size_limit); write long texts as .jsonl"
            )
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            byte = ord(value[exc.start]) - 0xDC00  # surrogateescape keeps byte b as U+DC00 + b
            return f"field `{name}` is {_not_utf8(byte, exc.start + 1).replace('column', 'its character')}"
    return None


def _rows_parquet(path: Path, bad: list[str]) -> tuple[list[str], list[str], list[str]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise UserError(f"{path}: not a Parquet file this tool can read ({unreadable(exc)})") from None
    rows, where = [], []
    for i, r in enumerate(table.to_pylist()):
        try:
            rows.append(json.dumps(r, default=_json_default))
        except Exception as exc:
            bad.append(f"{path}: row {i}: {unreadable(exc)}")
            continue
        where.append(f"{path}: row {i}")
    return rows, where, list(table.column_names)


def read_file(path: Path, required: list[str]) -> Source:
    """Read one local data file into a :class:`Source`; a tabular file without a ``required`` column is an error."""
    import datasets

    bad: list[str] = []
    columns: list[str] | None = None
    if path.suffix == ".jsonl":
        rows, where = _rows_jsonl(path, bad)
    elif path.suffix == ".json":
        rows, where = _rows_json(path, bad)
    elif path.suffix == ".csv":
        rows, where, columns = _rows_csv(path, bad)
    else:
        rows, where, columns = _rows_parquet(path, bad)
    if columns is not None:
        missing = [c for c in required if c not in columns]
        if missing:
            raise UserError(
                f"{path}: field `{missing[0]}`: no such column (the columns are {', '.join(columns) or 'none'}); "
                "rename it or set data.columns"
            )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:24]
    ds = datasets.Dataset.from_dict({ROW_COLUMN: rows, WHERE_COLUMN: where})
    return Source(str(path), ds, digest, True, bad)


@contextmanager
def _offline() -> Iterator[None]:
    """Hugging Face libraries in offline mode: only the local cache is used, no network retries."""
    import datasets
    import huggingface_hub.constants as hub

    saved = (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def read_hf(name: str, split: str, key: str, required: list[str]) -> Source:
    """A split of a Hugging Face dataset from the local cache (nothing is downloaded)."""
    import datasets

    try:
        with _offline():
            ds = datasets.load_dataset(name, split=split)
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise UserError(
                f"{key}: the Hugging Face dataset `{name}` has no split `{split}` ({exc})"
            ) from None
        raise UserError(_not_cached(key, name)) from None
    except Exception:
        raise UserError(_not_cached(key, name)) from None
    missing = [c for c in required if c not in ds.column_names]
    if missing:
        raise UserError(
            f"{key}: dataset `{name}` split `{split}`: field `{missing[0]}`: no such column (the columns are "
            f"{', '.join(ds.column_names)}); set data.columns"
        )
    return Source(f"{name} [{split}]", ds, ds._fingerprint, False, [])


def _not_cached(key: str, name: str) -> str:
    return (
        f"{key}: `{name}` is not a local file or directory, nor a Hugging Face dataset in the local cache "
        "(`finetune run` downloads a Hub dataset unless HF_HUB_OFFLINE=1 or --offline); give a local "
        ".jsonl/.json/.csv/.parquet path, or run online"
    )


def read_sources(location: DataLocation, key: str, split: str, required: list[str]) -> list[Source]:
    """Every :class:`Source` a resolved data spec names (files, or a split of a Hugging Face dataset)."""
    if location.kind == "dataset":
        return [read_hf(location.value, split, key, required)]
    if location.kind == "missing" and Path(location.value).suffix not in SUFFIXES and not location.value.startswith((".", "/", "~")):
        raise UserError(_not_cached(key, location.value))
    return [read_file(f, required) for f in location.files(key)]
