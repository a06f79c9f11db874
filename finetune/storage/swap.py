"""Putting a finished directory in place by renames, so that a reader never sees it half written.

``finetune merge`` (the merged model) and the trainer's checkpointer (each ``step-N``) write into a hidden
sibling directory, then call :func:`swap_in`. A run's final model shares output.dir with the run's other
files, so it is written into a hidden directory inside it and its files are moved in by :func:`move_in`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a filesystem that cannot fsync a directory is let be)."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def move_in(staged: Path, final: Path, *, last: Iterable[str] = (), stale: Iterable[str] = ()) -> list[str]:
    """Move everything in the finished directory ``staged`` into the directory ``final`` (on the same filesystem),
    durably: every file is fsynced, then renamed over its namesake (a directory is swapped in whole), the names
    in ``last`` after the others (what a reader looks for first, such as config.json), and ``final`` is fsynced;
    then the files of ``final`` matching a glob of ``stale`` that the new set does not replace are removed (an
    earlier model's extra shards), and ``staged`` itself. Each file is whole or absent at every moment. Returns
    the names moved in."""
    names = sorted(p.name for p in staged.iterdir())
    for p in staged.rglob("*"):
        if p.is_file():
            fsync_path(p)
    fsync_path(staged)
    late = set(last)
    for name in [n for n in names if n not in late] + [n for n in names if n in late]:
        src, dst = staged / name, final / name
        if src.is_dir():
            swap_in(src, dst)
        else:
            os.replace(src, dst)
    fsync_path(final)
    for pattern in stale:
        for old in final.glob(pattern):
            if old.name not in names and old.is_file():
                old.unlink()
    shutil.rmtree(staged, ignore_errors=True)
    return names


def swap_in(staged: Path, final: Path, aside_prefix: str | None = None) -> None:
    """Rename the finished directory ``staged`` to ``final`` (a sibling on the same filesystem).

    An existing ``final`` is first renamed into a fresh hidden directory beside it (named ``aside_prefix``
    followed by random characters; ``.<final's name>.old-`` by default), because a directory cannot be
    renamed over a non-empty one, and deleted once ``staged`` has taken its place. A crash between the two
    renames leaves the old directory there, under that hidden name, for the caller's clean-up to find.
    """
    if not final.exists():
        os.rename(staged, final)
        return
    prefix = aside_prefix if aside_prefix is not None else f".{final.name}.old-"
    aside = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
    os.rename(final, aside / "old")
    os.rename(staged, final)
    shutil.rmtree(aside, ignore_errors=True)
