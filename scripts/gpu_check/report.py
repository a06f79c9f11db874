"""What a section records and how: ``$OUT/<section>.json``, written after every figure (so a section stopped
by its time limit leaves what it had measured), and the summary of a part.

A section's JSON::

    {"section", "part", "mode": "gpu" | "dry-run", "status": "ok" | "failed" | "timed out" | "skipped" | "running",
     "reason": one line (why it failed or was skipped), "measures": what it measures, "limit_s", "estimate_s",
     "seconds", "cpu_seconds" (this process and its children), "figures": {...},
     "checks": [{"name", "ok", "detail"}], "error": the traceback's tail, "log": its log file,
     "exit_code" and "log_tail" (the log's last lines) when it did not end ok}

A section fails when it raises or when one of its checks is false; its figures are kept either way.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from scripts.gpu_check.registry import Section, limit_of

STATUSES = ("ok", "failed", "timed out", "skipped")


class Skip(Exception):
    """Raised by a section that cannot run here: status ``skipped`` with this reason."""


class Check:
    """The record of one section while it runs: its figures and checks, written to ``$OUT/<section>.json``.

    ``work``: a scratch directory of the section (outside ``$OUT``: only the JSON and the logs come back).
    """

    def __init__(self, section: Section, out: Path, dry_run: bool, work: Path) -> None:
        self.section, self.out, self.dry_run, self.work = section, out, dry_run, work
        self.started = time.perf_counter()
        self.data: dict[str, Any] = {
            "section": section.name,
            "part": section.part,
            "mode": "dry-run" if dry_run else "gpu",
            "status": "running",
            "reason": None,
            "measures": section.measures,
            "limit_s": limit_of(section, dry_run),
            "estimate_s": section.estimate_s,
            "seconds": 0.0,
            "figures": {},
            "checks": [],
            "log": f"logs/{section.name}.log",
        }

    @property
    def path(self) -> Path:
        """``$OUT/<section>.json``."""
        return self.out / f"{self.section.name}.json"

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

    def say(self, text: str) -> None:
        """A line in the section's log (stdout, which the script sends to the log)."""
        elapsed = time.perf_counter() - self.started
        print(f"[{self.section.name} {elapsed:6.1f}s] {text}", flush=True)

    def finish(self, status: str, reason: str | None = None, error: str | None = None) -> None:
        """Set the final status (a false check turns ok into failed) and write the JSON."""
        failed = [c["name"] for c in self.data["checks"] if not c["ok"]]
        if status == "ok" and failed:
            status, reason = "failed", f"check(s) failed: {', '.join(failed)}"
        self.data["status"], self.data["reason"] = status, reason
        if error:
            self.data["error"] = error
        self.save()

    def save(self) -> None:
        """Write the JSON atomically (a reader never sees half a file)."""
        import resource

        self.data["seconds"] = round(time.perf_counter() - self.started, 2)
        used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        self.data["cpu_seconds"] = round(sum(u.ru_utime + u.ru_stime for u in used), 2)
        write_json(self.path, self.data)


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


def record_end(
    section: Section, out: Path, dry_run: bool, rc: int, seconds: float, skipped: str | None = None
) -> dict[str, Any]:
    """After the section's process ended with ``rc``: its JSON completed with what only the script knows.

    ``timeout`` exits 124 (137 after its kill): status ``timed out``, the figures written so far kept. A
    process that died without its final JSON (a crash, a kill, a CUDA error that aborts) is ``failed`` with
    its exit code. The log's tail goes into the JSON of a section that did not end ok or skipped. ``skipped``:
    the section was not started (its reason).
    """
    path = out / f"{section.name}.json"
    data = read_json(path) or {
        "section": section.name, "part": section.part, "mode": "dry-run" if dry_run else "gpu",
        "status": "running", "reason": None, "measures": section.measures, "figures": {}, "checks": [],
        "log": f"logs/{section.name}.log",
    }
    data["limit_s"] = limit_of(section, dry_run)
    data["estimate_s"] = section.estimate_s
    data["seconds"] = round(seconds, 2)
    data["exit_code"] = rc
    if skipped:
        data["status"], data["reason"] = "skipped", skipped
    elif rc in (124, 137):
        data["status"] = "timed out"
        data["reason"] = f"stopped at its limit of {data['limit_s']} s; the figures are those written before"
    elif data.get("status") not in STATUSES or (rc != 0 and data.get("status") == "ok"):
        data["status"] = "failed"
        data["reason"] = data.get("reason") or f"the section's process exited with code {rc} before its end"
    if data["status"] not in ("ok", "skipped"):
        data["log_tail"] = log_tail(out / "logs" / f"{section.name}.log")
    write_json(path, data)
    return data


def summarize(out: Path, sections: list[Section], dry_run: bool, part: str) -> dict[str, Any]:
    """``$OUT/summary.json`` over ``sections`` and the table printed at the end of a part."""
    rows = []
    for s in sections:
        data = read_json(out / f"{s.name}.json") or {"status": "failed", "reason": "no JSON was written"}
        rows.append(
            {
                "section": s.name,
                "part": s.part,
                "status": data.get("status"),
                "reason": data.get("reason"),
                "seconds": data.get("seconds"),
                "limit_s": limit_of(s, dry_run),
                "estimate_s": s.estimate_s,
                "headline": headline(s.name, data.get("figures") or {}),
            }
        )
    summary = {
        "mode": "dry-run" if dry_run else "gpu",
        "part": part,
        "ok": all(r["status"] in ("ok", "skipped") for r in rows),
        "sections": rows,
    }
    write_json(out / "summary.json", summary)
    return summary


def headline(name: str, figures: dict[str, Any]) -> str:
    """A section's one-line result for the table (its figures' ``headline``, else nothing)."""
    value = figures.get("headline")
    return str(value) if value else ""


def table(summary: dict[str, Any]) -> str:
    """The summary as a fixed-width table."""
    lines = [
        f"GPU check ({summary['mode']}, part {summary['part']}): "
        + ("every section ok or skipped" if summary["ok"] else "some section failed or timed out"),
        f"{'section':15s} {'status':28s} {'s':>6s} {'limit':>6s} {'est.':>5s}  result",
    ]
    for r in summary["sections"]:
        status = r["status"] or "?"
        if status == "skipped" and r["reason"]:
            status = f"skipped: {r['reason']}"
        secs = f"{r['seconds']:.0f}" if isinstance(r["seconds"], (int, float)) else "-"
        detail = r["headline"] if r["status"] == "ok" else (r["reason"] or "")
        lines.append(
            f"{r['section']:15s} {status[:28]:28s} {secs:>6s} {r['limit_s']:>6d} {r['estimate_s']:>5d}  {detail}"
        )
    return "\n".join(lines)
