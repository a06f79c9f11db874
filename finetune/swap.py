"""Putting a finished directory in place by renames, so that a reader never sees it half written.

``finetune merge`` (the merged model) and the trainer's checkpointer (each ``step-N``) write into a hidden
sibling directory, then call :func:`swap_in`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


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
