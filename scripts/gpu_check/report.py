"""What the check records and how, so that a call stopped at any moment still brings back what it measured.

Each section writes ``WORK/sections/<name>.json`` after every figure; its output goes to ``WORK/logs/<name>.log``.
After every section the supervisor (or the worker) folds every section's JSON into ``$OUT/summary.json`` and
packs the logs and the JSONs into ``$OUT/logs.tar.gz`` (each through a temporary file and a rename): ``$OUT``
holds those two files alone, well under the 8 files a lent machine returns.

A section's record::

    {"section", "mode": "gpu" | "dry-run", "status": "ok" | "failed" | "timed out" | "skipped" | "running",
     "reason": one line (why it failed or was skipped), "measures", "estimate_s", "limit_s" (the limit it ran
     under), "started_at", "seconds", "cpu_seconds" (the section's own), "figures": {...},
     "checks": [{"name", "ok", "detail"}], "notes": [preconditions and other facts that fail nothing], "log",
     and when it did not end ok: "error" (the traceback's tail), "exit_code", "log_tail"}

A section fails when it raises or when one of its checks is false; its figures are kept either way.
"""

from __future__ import annotations

import json
import os
import tarfile
import time
from pathlib import Path
from typing import Any

from scripts.gpu_check.registry import Section

STATUSES = ("ok", "failed", "timed out", "skipped")


class Skip(Exception):
    """Raised by a section that cannot run here: status ``skipped`` with this reason."""


def sections_dir(work: Path) -> Path:
    """Where the sections' JSONs are written."""
    return work / "sections"


def logs_dir(work: Path) -> Path:
    """Where the sections' logs are written."""
    return work / "logs"


class Check:
    """The record of one section while it runs: its figures, checks and notes.

    ``work``: the section's scratch directory (models, runs); ``root``: the check's work directory, whose
    ``sections/`` holds the JSON."""

    def __init__(self, section: Section, root: Path, dry_run: bool, work: Path, limit_s: float) -> None:
        self.section, self.root, self.dry_run, self.work = section, root, dry_run, work
        self.started = time.perf_counter()
        self.cpu_started = _cpu_seconds()  # the worker's so far: it may have run sections before this one
        self.data: dict[str, Any] = {
            "section": section.name,
            "mode": "dry-run" if dry_run else "gpu",
            "status": "running",
            "reason": None,
            "measures": section.measures,
            "estimate_s": section.estimate_s,
            "limit_s": round(limit_s, 1),
            "started_at": time.time(),
            "seconds": 0.0,
            "figures": {},
            "checks": [],
            "notes": [],
            "log": f"logs/{section.name}.log",
        }

    @property
    def path(self) -> Path:
        """``WORK/sections/<section>.json``."""
        return sections_dir(self.root) / f"{self.section.name}.json"

    @property
    def figures(self) -> dict[str, Any]:
        """The section's measurements (JSON values)."""
        return self.data["figures"]

    def figure(self, key: str, value: Any) -> Any:
        """Record one figure (and write the JSON, so that a timeout keeps it); returns ``value``."""
        self.figures[key] = value
        self.save()
        return value

    def expect(self, name: str, ok: bool, detail: Any = None) -> bool:
        """Record a check; a false one fails the section (after it has run to its end)."""
        self.data["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        self.save()
        return bool(ok)

    def note(self, text: str) -> None:
        """Record a fact that fails nothing (a precondition not met, a feature this build lacks)."""
        self.data["notes"].append(text)
        self.save()
        self.say(f"note: {text}")

    def say(self, text: str) -> None:
        """A line in the section's log."""
        elapsed = time.perf_counter() - self.started
        print(f"[{self.section.name} {elapsed:6.1f}s] {text}", flush=True)

    def finish(self, status: str, reason: str | None = None, error: str | None = None) -> None:
        """Set the final status (a false check turns ok into failed) and write the JSON."""
        failed = [c["name"] for c in self.data["checks"] if not c["ok"]]
        if status == "ok" and failed:
            status, reason = "failed", f"check(s) failed: {', '.join(failed)}"[:400]
        self.data["status"], self.data["reason"] = status, reason
        if error:
            self.data["error"] = error
        self.save()

    def save(self) -> None:
        """Write the JSON atomically (a reader never sees half a file)."""
        self.data["seconds"] = round(time.perf_counter() - self.started, 2)
        self.data["cpu_seconds"] = round(_cpu_seconds() - self.cpu_started, 2)
        write_json(self.path, self.data)


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its child processes that have ended, user and system."""
    import resource

    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in used)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as indented JSON at ``path``, through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON at ``path``, or None when there is none (or it is unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log (empty when there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def section_record(work: Path, section: Section) -> dict[str, Any] | None:
    """The section's JSON as written so far (None when it never started)."""
    return read_json(sections_dir(work) / f"{section.name}.json")


def write_skipped(work: Path, section: Section, dry_run: bool, reason: str) -> None:
    """The record of a section that was not started."""
    write_json(sections_dir(work) / f"{section.name}.json", {
        "section": section.name, "mode": "dry-run" if dry_run else "gpu", "status": "skipped", "reason": reason,
        "measures": section.measures, "estimate_s": section.estimate_s, "limit_s": 0, "seconds": 0.0,
        "figures": {}, "checks": [], "notes": [], "log": None,
    })


def record_death(work: Path, section: Section, rc: int | None, timed_out: bool) -> dict[str, Any]:
    """The record of a section whose process ended before the section did: killed at its limit (``timed
    out``, the figures written so far kept) or dead with exit code ``rc`` (a crash, an abort in CUDA)."""
    path = sections_dir(work) / f"{section.name}.json"
    data = read_json(path) or {"section": section.name, "measures": section.measures, "figures": {},
                               "checks": [], "notes": [], "log": f"logs/{section.name}.log"}
    data["exit_code"] = rc
    if "started_at" in data:
        data["seconds"] = round(time.time() - data["started_at"], 2)
    if timed_out:
        data["status"] = "timed out"
        data["reason"] = f"stopped at its limit of {data.get('limit_s')} s; the figures are those written before"
    else:
        data["status"] = "failed"
        data["reason"] = f"the section's process exited with code {rc} before its end"
    data["log_tail"] = log_tail(logs_dir(work) / f"{section.name}.log")
    write_json(path, data)
    return data


def summarize(out: Path, work: Path, sections: list[Section], dry_run: bool, budget: int, started: float,
              planned: int) -> dict[str, Any]:
    """``$OUT/summary.json``: every section's record (a section not reached yet: ``pending``), the budget
    planned for, the seconds spent; then the logs and JSONs packed into ``$OUT/logs.tar.gz``."""
    rows = []
    for s in sections:
        data = section_record(work, s) or {"section": s.name, "status": "pending", "reason": None,
                                           "estimate_s": s.estimate_s, "figures": {}, "checks": [], "notes": []}
        rows.append(data)
    summary = {
        "mode": "dry-run" if dry_run else "gpu",
        "budget_s": budget,
        "planned_s": planned,
        "elapsed_s": round(time.time() - started, 1),
        "ok": all(r["status"] in ("ok", "skipped") for r in rows),
        "sections": rows,
    }
    write_json(out / "summary.json", summary)
    pack(out, work)
    return summary


def pack(out: Path, work: Path) -> None:
    """``$OUT/logs.tar.gz``: ``logs/`` and ``sections/`` of the work directory, replaced atomically."""
    tmp = out / ".logs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for sub in (logs_dir(work), sections_dir(work)):
            if sub.is_dir():
                for f in sorted(sub.iterdir()):
                    if f.is_file() and not f.name.startswith("."):
                        tar.add(f, arcname=f"{sub.name}/{f.name}")
    tmp.replace(out / "logs.tar.gz")


def headline(data: dict[str, Any]) -> str:
    """A section's one-line result for the table."""
    if data.get("status") == "ok":
        return str((data.get("figures") or {}).get("headline") or "")
    return str(data.get("reason") or "")


def table(summary: dict[str, Any]) -> str:
    """The summary as a fixed-width table."""
    lines = [
        f"GPU check ({summary['mode']}; budget {summary['budget_s']} s, planned {summary['planned_s']} s, "
        f"spent {summary['elapsed_s']:.0f} s): "
        + ("every section ok or skipped" if summary["ok"] else "some section failed or timed out"),
        f"{'section':14s} {'status':10s} {'s':>6s} {'est.':>5s}  result",
    ]
    for r in summary["sections"]:
        secs = f"{r['seconds']:.0f}" if isinstance(r.get("seconds"), (int, float)) else "-"
        status = r.get("status") or "?"
        lines.append(f"{r['section']:14s} {status:10s} {secs:>6s} {r.get('estimate_s', 0):>5d}  {headline(r)}"[:220])
    return "\n".join(lines)
