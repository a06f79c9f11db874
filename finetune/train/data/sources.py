"""Where rows come from: local files (.jsonl, .json, .csv, .parquet; globs; directories) and cached Hugging Face datasets.

Local files are read here, row by row, so that every row keeps where it came from (``file:line`` or
``file: row N``) for error messages, and so that a value of the wrong type is reported for its row instead
of failing a whole-file schema inference. Each row is kept as a JSON string (types preserved exactly);
the tokenizer step parses it back. A Hugging Face dataset is used as it is: its rows are named by index.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.locate import DATA_SUFFIXES as SUFFIXES
from finetune.locate import DataLocation

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


def _rows_jsonl(path: Path, bad: list[str]) -> tuple[list[str], list[str]]:
    rows, where = [], []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                bad.append(f"{path}:{i}: not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(row, dict):
                bad.append(f"{path}:{i}: expected a JSON object ({{...}}) per line, got {type(row).__name__}")
                continue
            rows.append(line.strip())
            where.append(f"{path}:{i}")
    return rows, where


def _rows_json(path: Path, bad: list[str]) -> tuple[list[str], list[str]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
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
        rows.append(json.dumps(row, default=_json_default))
        where.append(f"{path}: row {i}")
    return rows, where


def _rows_csv(path: Path, bad: list[str]) -> tuple[list[str], list[str], list[str]]:
    rows, where = [], []
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        columns = list(reader.fieldnames or [])
        line = 1
        for row in reader:
            start = line + 1
            line = reader.line_num
            if None in row:
                bad.append(f"{path}:{start}: has more values than the header has columns")
                continue
            rows.append(json.dumps({k: v for k, v in row.items() if v is not None}))
            where.append(f"{path}:{start}")
    return rows, where, columns


def _rows_parquet(path: Path) -> tuple[list[str], list[str], list[str]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    rows = [json.dumps(r, default=_json_default) for r in table.to_pylist()]
    return rows, [f"{path}: row {i}" for i in range(len(rows))], list(table.column_names)


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
        rows, where, columns = _rows_parquet(path)
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
