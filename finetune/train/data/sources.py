"""Where rows come from: local files (.jsonl, .json, .csv, .parquet; globs; directories) and cached Hugging Face datasets.

Local files are read here, row by row, so that every row keeps where it came from (``file:line`` or
``file: row N``) for error messages, and so that a value of the wrong type is reported for its row instead
of failing a whole-file schema inference. Each row is kept as a JSON string (types preserved exactly);
the tokenizer step parses it back. A Hugging Face dataset is used as it is: its rows are named by index.

A file is read once, as a stream: its SHA-256 (the tokenization cache's key) is computed from the bytes as they
are parsed, and its rows go into Arrow columns a few thousand at a time, never into one list of Python strings.
The digest is remembered beside the cache under the file's identity (device, inode, size, modification and change
times): when the file is unchanged, the digest is had without reading it, and the rows are read only if the
tokenized data is not in the cache.

Whatever a row holds cannot stop the reader: any failure while reading one row (bytes that are not UTF-8, an
integer longer than Python converts, JSON nested deeper than it parses, a CSV field over csv's size limit) makes
that row a bad row with its ``file:line`` (:func:`unreadable`), which ``data.on_bad_row`` stops at or skips.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from finetune.errors import UserError
from finetune.recipe.locate import DATA_SUFFIXES as SUFFIXES
from finetune.recipe.locate import DataLocation

ROW_COLUMN = "__row__"
WHERE_COLUMN = "__where__"

#: Rows gathered in Python before they go into an Arrow chunk.
CHUNK_ROWS = 8192
#: Bytes of a file hashed at a time where it is not hashed as it is parsed.
HASH_BLOCK = 1 << 20


class Source:
    """One input: a local file or a Hugging Face dataset split, its rows as a ``datasets.Dataset``.

    Local files give the columns ``__row__`` (the row as JSON) and ``__where__`` (``file:line``);
    a Hugging Face dataset keeps its own columns. ``bad_rows`` lists rows that could not even be read
    (invalid JSON, not an object); ``fingerprint`` identifies the content for the tokenization cache.
    A file whose digest was remembered is read only when ``dataset`` or ``bad_rows`` is first asked for
    (``read`` does it), so that a source whose tokens are cached is never read.
    """

    def __init__(
        self, name: str, dataset: Any, fingerprint: str, is_json_rows: bool, bad_rows: list[str] | None = None, *,
        read: Callable[[], tuple[Any, list[str]]] | None = None,
    ) -> None:
        self.name, self.fingerprint, self.is_json_rows = name, fingerprint, is_json_rows
        self._dataset, self._bad, self._read = dataset, list(bad_rows or []), read

    @property
    def is_read(self) -> bool:
        """Whether the rows are read (a source read later reads them when first asked for)."""
        return self._read is None

    @property
    def dataset(self) -> Any:
        """The rows (read now if they are not yet)."""
        self._load()
        return self._dataset

    @property
    def bad_rows(self) -> list[str]:
        """The rows that could not be read, each as ``file:line: what`` (read now if they are not yet)."""
        self._load()
        return self._bad

    def _load(self) -> None:
        if self._read is not None:
            self._dataset, self._bad = self._read()
            self._read = None


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


class _Columns:
    """Rows (as JSON text) and where each is, gathered into Arrow chunks of :data:`CHUNK_ROWS`."""

    def __init__(self) -> None:
        self.rows: list[str] = []
        self.where: list[str] = []
        self.chunks: list[tuple[Any, Any]] = []

    def add(self, row: str, where: str) -> None:
        self.rows.append(row)
        self.where.append(where)
        if len(self.rows) >= CHUNK_ROWS:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.rows:
            self.chunks.append((pa.array(self.rows, pa.string()), pa.array(self.where, pa.string())))
            self.rows, self.where = [], []

    def dataset(self) -> Any:
        """The rows as a ``datasets.Dataset`` held in Arrow memory."""
        import datasets
        import pyarrow as pa

        self._flush()
        table = pa.Table.from_arrays(
            [pa.chunked_array([c[0] for c in self.chunks], pa.string()),
             pa.chunked_array([c[1] for c in self.chunks], pa.string())],
            names=[ROW_COLUMN, WHERE_COLUMN],
        )
        self.chunks = []
        return datasets.Dataset(datasets.table.InMemoryTable(table))


class _Hashing(io.RawIOBase):
    """A binary file that feeds every byte read from it to a hash, so a text reader over it hashes the file as it
    parses it."""

    def __init__(self, raw: io.BufferedReader, digest: Any) -> None:
        self.raw, self.digest = raw, digest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.raw.readinto(buffer)
        if n:
            self.digest.update(memoryview(buffer)[:n])
        return n or 0


def _rows_jsonl(path: Path, bad: list[str], out: _Columns, digest: Any) -> None:
    with path.open("rb") as f:
        for i, raw in enumerate(f, 1):
            digest.update(raw)
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
            out.add(line.strip(), f"{path}:{i}")


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _rows_json(path: Path, bad: list[str], out: _Columns, digest: Any) -> None:
    raw = path.read_bytes()  # one document: json reads it whole
    digest.update(raw)
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
    del raw
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            bad.append(f"{path}: row {i}: expected a JSON object, got {type(row).__name__}")
            continue
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")  # every string a real text (no lone surrogate)
            text = json.dumps(row, default=_json_default)
        except Exception as exc:
            bad.append(f"{path}: row {i}: {unreadable(exc)}")
            continue
        out.add(text, f"{path}: row {i}")


def _rows_csv(path: Path, bad: list[str], out: _Columns, digest: Any) -> list[str]:
    """A CSV file's rows; the columns of its header. It is read with no field size limit and with undecodable bytes
    kept as surrogates, so that a long field or a bad byte is the problem of its own row (csv's limit, then UTF-8,
    checked per row) rather than the end of the file; any other failure of a row is that row's, too."""
    limit = csv.field_size_limit(sys.maxsize)
    try:
        with path.open("rb") as binary, io.TextIOWrapper(
            io.BufferedReader(_Hashing(binary, digest)), encoding="utf-8", errors="surrogateescape", newline=""
        ) as f:
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
                out.add(json.dumps(dict(zip(columns, values, strict=False))), f"{path}:{start}")
            while f.buffer.read(HASH_BLOCK):  # the whole file is hashed, whatever stopped the reader
                pass
    finally:
        csv.field_size_limit(limit)
    return columns


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


def _rows_parquet(path: Path, bad: list[str], out: _Columns, digest: Any) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = path.read_bytes()  # read once: hashed, then parsed from memory
    digest.update(raw)
    try:
        table = pq.read_table(pa.BufferReader(raw))
    except Exception as exc:
        raise UserError(f"{path}: not a Parquet file this tool can read ({unreadable(exc)})") from None
    del raw
    i = 0
    for batch in table.to_batches(max_chunksize=CHUNK_ROWS):
        for r in batch.to_pylist():
            try:
                out.add(json.dumps(r, default=_json_default), f"{path}: row {i}")
            except Exception as exc:
                bad.append(f"{path}: row {i}: {unreadable(exc)}")
            i += 1
    return list(table.column_names)


def _read(path: Path, required: list[str]) -> tuple[Any, list[str], str]:
    """One local file's rows as a ``datasets.Dataset``, its bad rows and its digest, in one pass over the file."""
    bad: list[str] = []
    out = _Columns()
    digest = hashlib.sha256()
    columns: list[str] | None = None
    if path.suffix == ".jsonl":
        _rows_jsonl(path, bad, out, digest)
    elif path.suffix == ".json":
        _rows_json(path, bad, out, digest)
    elif path.suffix == ".csv":
        columns = _rows_csv(path, bad, out, digest)
    else:
        columns = _rows_parquet(path, bad, out, digest)
    if columns is not None:
        missing = [c for c in required if c not in columns]
        if missing:
            raise UserError(
                f"{path}: field `{missing[0]}`: no such column (the columns are {', '.join(columns) or 'none'}); "
                "rename it or set data.columns"
            )
    return out.dataset(), bad, digest.hexdigest()[:24]


def _identity(path: Path) -> list[int]:
    """What changes when a file's content may have: device, inode, size, modification and change times."""
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _memo(path: Path, digests: Path) -> Path:
    return digests / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]}.json"


def remembered_digest(path: Path, digests: Path) -> str | None:
    """The digest :func:`read_file` remembered for ``path`` under ``digests``, if the file is unchanged since."""
    try:
        memo = json.loads(_memo(path, digests).read_text())
        if memo["path"] == str(path.resolve()) and memo["identity"] == _identity(path):
            return str(memo["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _remember_digest(path: Path, digest: str, identity: list[int], digests: Path) -> None:
    """Write the memo for :func:`remembered_digest` (a temporary name renamed into place: readers see all or none)."""
    try:
        digests.mkdir(parents=True, exist_ok=True)
        memo = _memo(path, digests)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": str(path.resolve()), "identity": identity, "digest": digest}))
        os.replace(tmp, memo)
    except OSError:  # a cache that cannot be written costs a read next time, nothing more
        pass


def read_file(path: Path, required: list[str], digests: Path | None = None) -> Source:
    """One local data file as a :class:`Source`; a tabular file without a ``required`` column is an error.

    ``digests``: where the files' digests are remembered (beside the tokenization cache); with one, a file
    unchanged since it was last read is not read now (its :class:`Source` reads it if its rows are asked for).
    """
    if digests is not None:
        known = remembered_digest(path, digests)
        if known is not None:

            def later() -> tuple[Any, list[str]]:
                dataset, bad, digest = _read(path, required)
                if digest != known:
                    raise UserError(f"{path}: the file changed while it was being read; run again")
                return dataset, bad

            return Source(str(path), None, known, True, read=later)
    identity = _identity(path)
    dataset, bad, digest = _read(path, required)
    if digests is not None and _identity(path) == identity:  # not changed while it was read
        _remember_digest(path, digest, identity, digests)
    return Source(str(path), dataset, digest, True, bad)


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


def read_sources(
    location: DataLocation, key: str, split: str, required: list[str], digests: Path | None = None
) -> Iterator[Source]:
    """Every :class:`Source` a resolved data spec names (files, or a split of a Hugging Face dataset), one at a
    time: a file's rows are read when its turn comes and let go when the caller is done with it. ``digests``: as
    :func:`read_file` takes it."""
    if location.kind == "dataset":
        yield read_hf(location.value, split, key, required)
        return
    if location.kind == "missing" and Path(location.value).suffix not in SUFFIXES and not location.value.startswith((".", "/", "~")):
        raise UserError(_not_cached(key, location.value))
    for f in location.files(key):
        yield read_file(f, required, digests)
