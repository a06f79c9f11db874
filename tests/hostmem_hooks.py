"""Per-rank peak anonymous memory (RssAnon of /proc/self/status) of a run's phases, for the sharding tests and
scripts/bench_sharded.py; installed like the fault hooks, through $FINETUNE_HOOKS=this_file.py:HostMemoryHooks.

A thread samples RssAnon every millisecond. The phases are the Trainer's own methods, wrapped when the hooks are
created (they exist under the same names in the code before sharded loading, so the benchmark measures both):
``load`` (Trainer._setup_model: build, load, wrap), ``checkpoint`` (RunCheckpoints.save, the largest of its saves)
``final`` (Trainer.save), ``resume`` (RunCheckpoints.start: loading a checkpoint when resuming) and ``step``
(Trainer.train_step, the largest of the steps). Each rank writes ``$FINETUNE_HOSTMEM_DIR/rank<R>.json``:
``{phase: {"start": bytes at its start, "peak": highest bytes during it, "seconds": its duration}}``, with
``run``: the hooks' start and the highest bytes from there to the end of the last phase, and ``environment``:
the CUDA allocator variables the process started with (the launcher sets them for its workers).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from finetune.train.hooks import TrainerHooks


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class _Sampler:
    def __init__(self) -> None:
        self.start = self.peak = self.highest = rss_anon()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            now = rss_anon()
            self.peak = max(self.peak, now)
            self.highest = max(self.highest, now)
            time.sleep(0.001)

    def reset(self) -> int:
        now = rss_anon()
        self.peak = now
        return now


_PHASES: dict[str, dict[str, int]] = {}
_SAMPLER: _Sampler | None = None


def _record(phase: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        assert _SAMPLER is not None
        start, t0 = _SAMPLER.reset(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            peak = max(_SAMPLER.peak, rss_anon())
            old = _PHASES.get(phase)
            if old is None or old["peak"] - old["start"] < peak - start:
                _PHASES[phase] = {"start": start, "peak": peak, "seconds": time.perf_counter() - t0}
            _SAMPLER.highest = max(_SAMPLER.highest, peak)
            _PHASES["run"] = {"start": _SAMPLER.start, "peak": _SAMPLER.highest, "seconds": 0.0}
            out = Path(os.environ["FINETUNE_HOSTMEM_DIR"])
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(_PHASES))

    return wrapper


class HostMemoryHooks(TrainerHooks):
    """The phase probes (installed once per process)."""

    def __init__(self) -> None:
        global _SAMPLER
        if _SAMPLER is not None:
            return
        _SAMPLER = _Sampler()
        _PHASES["environment"] = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        from finetune.train import trainer
        from finetune.train.checkpoint import resume

        trainer.Trainer._setup_model = _record("load", trainer.Trainer._setup_model)
        trainer.Trainer.save = _record("final", trainer.Trainer.save)
        trainer.Trainer.train_step = _record("step", trainer.Trainer.train_step)
        resume.RunCheckpoints.save = _record("checkpoint", resume.RunCheckpoints.save)
        resume.RunCheckpoints.start = _record("resume", resume.RunCheckpoints.start)
