"""Shared fixtures: a private planner cache and the CLI command (helpers the tests import live in support.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Fault injection (failure, NaN, kill, slow steps) lives with the tests; every run of the suite installs it.
os.environ.setdefault("FINETUNE_HOOKS", f"{Path(__file__).resolve().parent / 'fault_hooks.py'}:FaultHooks")


@pytest.fixture(scope="session", autouse=True)
def private_trace_cache(tmp_path_factory: pytest.TempPathFactory):
    """The planner's activation traces go to a directory of this test run ($FINETUNE_CACHE, read when a trace is
    looked up, and inherited by every CLI subprocess), not to ~/.cache/finetune. Under pytest-xdist its workers
    share the one directory (the cache writes each file whole, by rename), so a model traced in one worker is
    not traced again in the other. The SmolLM2 model is found through $FINETUNE_SMOLLM2 or its own path under
    the home directory, which this leaves alone."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above each worker's own
    cache = root / "finetune-cache"
    cache.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FINETUNE_CACHE", str(cache))
        yield


@pytest.fixture
def finetune_cmd() -> list[str]:
    """The real CLI, run as a subprocess with this interpreter."""
    return [sys.executable, "-m", "finetune"]


