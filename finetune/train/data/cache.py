"""The tokenization cache: a source's rows tokenized once through ``datasets.map`` (several processes, a progress
bar) into Arrow files under ``data.cache_dir``, and read back by every later run on the same inputs.

An entry is named by a hash of the source (its name and content digest), the tokenizer and every data setting that
changes the result. A manifest beside its Arrow files, written last under a temporary name and renamed into place,
lists the files, the rows the source had and the rows that could not be read: a hit needs neither the source's
rows (:class:`~finetune.train.data.sources.Source` reads a file only when they are asked for) nor the number of
processes that wrote the entry. The files are read back a record batch at a time into memory that is let go after
it (:meth:`Tokenized.batches`), not memory-mapped: the pages of a mapped file would count in the process's
resident memory as they are read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.train.data.sources import WHERE_COLUMN, Source
from finetune.train.parallel.distributed import available_cores

CACHE_VERSION = "3"  # bump when the encoding or the entry's layout changes

#: data.num_proc unset: at most this many tokenizing processes ...
AUTO_MAX_PROCESSES = 8
#: ... and one for every this many rows, so that a small set is not worth a pool's start.
ROWS_PER_PROCESS = 10_000


def default_cache_dir() -> Path:
    """Where tokenized data goes when ``data.cache_dir`` is not set."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "finetune-tokenized"


def digests_dir(cache_dir: Path) -> Path:
    """Where the data files' digests are remembered, beside the tokenized data (:func:`read_file`'s ``digests``)."""
    return cache_dir / "digests"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable hash of a tokenizer's vocabulary, rules and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = backend.to_str() + json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:24]
    from datasets.fingerprint import Hasher

    return Hasher.hash(tokenizer)


def tokenizing_processes(asked: int | None, rows: int) -> int:
    """The processes that tokenize ``rows`` rows: data.num_proc when set, else one per core this process may run
    on, at most :data:`AUTO_MAX_PROCESSES` and one per :data:`ROWS_PER_PROCESS` rows; never more than the rows."""
    if asked is None:
        asked = min(available_cores(), AUTO_MAX_PROCESSES, rows // ROWS_PER_PROCESS)
    return max(1, min(asked, rows))


@dataclass
class Tokenized:
    """A source's tokenized rows (in the Arrow ``files`` of the cache, in order), how many rows it had (``rows``,
    the unreadable ones not counted), its unreadable rows (``bad_rows``) and whether the cache held it (``hit``)."""

    files: list[Path]
    rows: int
    bad_rows: list[str] = field(default_factory=list)
    hit: bool = False

    def batches(self) -> Iterator[Any]:
        """The tokenized rows as pyarrow record batches (those ``datasets.map`` wrote), read one at a time."""
        import pyarrow as pa

        for f in self.files:
            with pa.OSFile(str(f)) as source, pa.ipc.open_stream(source) as reader:
                yield from reader


def tokenize_source(
    src: Source, encoder: Callable[..., dict[str, Any]], features: Any, cache_dir: Path, prefix: str,
    num_proc: int | None, settings: Any, on_miss: Callable[[str], None] | None = None,
) -> Tokenized:
    """``src`` tokenized by ``encoder`` (a row, its index and ``source=`` its name -> the ``features`` columns),
    from the cache under ``cache_dir`` or now, through ``datasets.map`` in :func:`tokenizing_processes`
    processes. A file's rows keep their ``file:line`` column. ``prefix`` names the kind of entry, ``settings``
    (JSON) are the encoder's; ``on_miss(name)`` is called before tokenizing."""
    import datasets

    key = hashlib.sha256(
        json.dumps(
            [CACHE_VERSION, src.name, src.fingerprint, tokenizer_fingerprint(getattr(encoder, "tokenizer", None)),
             settings],
            sort_keys=True,
        ).encode()
    ).hexdigest()[:32]
    cache_dir.mkdir(parents=True, exist_ok=True)
    manifest = cache_dir / f"{prefix}-{key}.json"
    if src.is_json_rows:
        features = datasets.Features({WHERE_COLUMN: datasets.Value("string"), **features})
    hit = _read_back(manifest, cache_dir)
    if hit is not None:
        return hit
    if on_miss is not None:
        on_miss(src.name)
    rows = src.dataset
    files: list[str] = []
    if len(rows):
        processes = tokenizing_processes(num_proc, len(rows))
        tokenized = rows.map(
            encoder,
            with_indices=True,
            fn_kwargs={"source": src.name},
            remove_columns=[c for c in rows.column_names if not (src.is_json_rows and c == WHERE_COLUMN)],
            features=features,
            num_proc=processes if processes > 1 else None,
            cache_file_name=str(cache_dir / f"{prefix}-{key}.arrow"),
            load_from_cache_file=False,  # a hit is the manifest's; files without one are a run's that stopped
            new_fingerprint=key,  # the key already covers the data, tokenizer and settings: no hashing
            desc=f"Tokenizing {Path(src.name).name}",
        )
        files = [Path(f["filename"]).name for f in tokenized.cache_files]
        del tokenized  # its files are mapped: read back below, a batch at a time
    entry = {"files": files, "rows": len(rows), "bad_rows": src.bad_rows}
    tmp = manifest.with_name(f"{manifest.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, manifest)
    return Tokenized([cache_dir / f for f in files], len(rows), list(src.bad_rows), False)


def _read_back(manifest: Path, cache_dir: Path) -> Tokenized | None:
    """The entry ``manifest`` describes; None when there is none (or a file of it is gone)."""
    try:
        entry = json.loads(manifest.read_text())
        files = [cache_dir / str(name) for name in entry["files"]]
        rows, bad = int(entry["rows"]), [str(b) for b in entry["bad_rows"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(f.is_file() for f in files):
        return None
    return Tokenized(files, rows, bad, True)

