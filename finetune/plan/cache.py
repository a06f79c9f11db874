"""The planner's disk cache: JSON files under ``$FINETUNE_CACHE`` (default ~/.cache/finetune), one folder per
kind (traces, inventories, flops), each file named by a digest of what it was computed from and the versions
of the libraries that computed it. A plan made once is made again without building or tracing a model."""

from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import version
from pathlib import Path
from typing import Any


def cache_file(kind: str, key: Any, *extra: Any) -> Path | None:
    """``$FINETUNE_CACHE/<kind>/<digest>.json`` for ``key`` (its ``repr``) with torch's, transformers' and
    peft's versions and ``extra`` (a format version, settings the result depends on); None when there is no
    cache directory."""
    try:
        versions = (version("torch"), version("transformers"), version("peft"), *extra)
        digest = hashlib.sha256(repr((key, versions)).encode()).hexdigest()[:32]
        root = Path(os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune") / kind
        return root / f"{digest}.json"
    except Exception:  # no home, odd environment: no disk cache
        return None


def read_json(path: Path | None) -> Any:
    """The JSON value in ``path`` (None when there is no path, no file, or it is not JSON)."""
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path | None, value: Any) -> None:
    """Write ``value`` to ``path`` atomically (concurrent planners never read half a file); a read-only cache
    directory is skipped silently."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError:
        pass
