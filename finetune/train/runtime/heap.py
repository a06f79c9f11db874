"""glibc's heap in a training process: every block of 1 MiB or more mapped from the OS and given back when freed.

glibc serves a request of at least ``M_MMAP_THRESHOLD`` bytes with a mapping of its own, unmapped on ``free``;
smaller ones come from the heap, which returns memory to the OS only from its top, and only beyond
``M_TRIM_THRESHOLD``. The threshold starts at 128 KiB but follows the largest mapped block freed so far, up to
32 MiB (the trim threshold twice that). A model of a few hundred MB frees such blocks from its first tensors
on: the slices the loader reads, the parameters of a unit FSDP gathered for a forward. From then on every
tensor below the raised threshold is carved from the heap, and the blocks a step frees out of order leave the
heap as high as the step's largest moment plus its fragments, for the rest of the run.

Measured (scripts/bench_load_memory.py, docs/benchmarks.md): LoRA under fsdp on 2 processes of a Llama of 151M
parameters stored in fp32, each rank's peak RssAnon above the same run of the tiny model is 617 to 674 MiB with
the sliding threshold (the whole checkpoint is 577 MiB; the rank's bf16 shards 144 MiB) and 243 to 251 MiB with
the threshold fixed at 1 MiB (fixed at 128 KiB: the same within 10 MiB).

Fixing the threshold (``mallopt``) also stops it from sliding. A process started with
``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` in its environment keeps what it asked for, and an
allocator other than glibc's (jemalloc, tcmalloc through ``LD_PRELOAD``) ignores the call.
"""

from __future__ import annotations

import os
from typing import Any

#: Blocks of this size and more are mapped one by one and unmapped when freed.
MMAP_THRESHOLD = 1 << 20
#: Free memory at the heap's top beyond this goes back to the OS.
TRIM_THRESHOLD = 2 << 20

_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_LIBC: Any = None


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`);
    whether they were set (not where the environment sets them, nor without glibc)."""
    if any(name in os.environ for name in _ENV):
        return False
    libc = _libc()
    if not libc:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def _libc() -> Any:
    """The C library when it has ``mallopt`` (glibc), else False."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.mallopt  # noqa: B018 - raises AttributeError where the C library has none (musl, macOS)
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC
