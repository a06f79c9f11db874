"""The commands scripts/gpu_check.sh calls (from the repository root, ``python3 -m scripts.gpu_check ...``):

    check --out OUT --work WORK [--dry-run] [--only a,b]   the supervisor: runs the sections, writes
                                                           OUT/summary.json and OUT/logs.tar.gz, prints the table
    worker --work WORK --sections a,b,... [--dry-run]      runs sections in order in this process (the
                                                           supervisor starts it; not for direct use)
    sections [--only a,b]                                  the table: name, estimate, limit (GPU seconds)
    slim-wheel WHEEL --keep cuda13                         drops the other CUDA versions' binaries from
                                                           bitsandbytes' wheel (scripts/gpu_wheels.sh)

The supervisor imports no torch. It starts one worker process, which runs the sections one after another (one
interpreter, one import of torch for all of them); it watches the running section's record, and when the
section passes its limit it kills the worker (and its children) and marks the section ``timed out``; when
the worker dies inside a section (a crash, a CUDA abort) the section is ``failed`` with the exit code. Either
way a new worker carries on with the next section. After every section the summary and the packed logs are
rewritten, so a call stopped at any moment keeps everything measured until then.

``GPU_CHECK_FAIL=name[:exit|:hang],...`` makes sections fail on purpose (raise; exit without finishing; sleep
past the limit), to show that the others still run; ``GPU_CHECK_LIMITS=name=seconds,...`` overrides limits;
``GPU_CHECK_BUDGET=seconds`` lowers the budget.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from scripts.gpu_check.registry import (
    BY_NAME,
    DRY_BUDGET_S,
    RESERVE_S,
    Section,
    budget_s,
    limit_of,
    planned_s,
    selected,
)
from scripts.gpu_check.report import (
    STATUSES,
    Check,
    Skip,
    logs_dir,
    record_death,
    section_record,
    sections_dir,
    summarize,
    table,
    write_skipped,
)


def _inject_failure(name: str) -> None:
    """GPU_CHECK_FAIL: fail this section on purpose (before anything heavy is imported)."""
    for item in os.environ.get("GPU_CHECK_FAIL", "").split(","):
        target, _, how = item.strip().partition(":")
        if target != name:
            continue
        if how == "exit":
            os._exit(3)  # dies without finishing its record, as a crash would
        if how == "hang":
            time.sleep(10**6)
        raise RuntimeError(f"GPU_CHECK_FAIL={item.strip()} made this section fail")


def _deadline(dry_run: bool) -> float:
    """The epoch second the sections must end by: the script's start (GPU_CHECK_STARTED) plus the budget."""
    started = float(os.environ.get("GPU_CHECK_STARTED") or time.time())
    return started + (DRY_BUDGET_S if dry_run else budget_s())


class _Redirect:
    """This process's stdout and stderr (file descriptors 1 and 2, so its child processes' too) into a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = (os.dup(1), os.dup(2))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)


def run_section(section: Section, work: Path, dry_run: bool, limit: float) -> str:
    """Run one section in this process, its output in its log; returns its status."""
    if not section.target.startswith("harness:") and "scripts.gpu_check.harness" in sys.modules:
        sys.modules["scripts.gpu_check.harness"].release()
    scratch = work / "scratch" / section.name
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    with _Redirect(logs_dir(work) / f"{section.name}.log"):
        check = Check(section, work, dry_run, scratch, limit)
        check.save()
        check.say(f"{section.measures} (limit {limit:.0f} s)")
        try:
            _inject_failure(section.name)
            module, _, function = section.target.partition(":")
            getattr(importlib.import_module(f"scripts.gpu_check.{module}"), function)(check)
            check.finish("ok")
        except Skip as skip:
            check.finish("skipped", str(skip))
        except Exception as exc:
            text = traceback.format_exc()
            print(text, flush=True)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            check.finish("failed", f"{type(exc).__name__}: {first}"[:300], "\n".join(text.splitlines()[-25:]))
        check.say(check.data["status"] + (f": {check.data['reason']}" if check.data["reason"] else ""))
    shutil.rmtree(scratch, ignore_errors=True)  # the next sections' room (models, checkpoints)
    if "torch" in sys.modules:  # and the device's: what this section cached is not the next one's
        import gc

        gc.collect()
        if sys.modules["torch"].cuda.is_initialized():
            sys.modules["torch"].cuda.empty_cache()
    return str(check.data["status"])


def worker(names: list[str], work: Path, dry_run: bool) -> None:
    """Run ``names`` in order: a section that no longer fits the budget is skipped with the seconds left."""
    deadline = _deadline(dry_run)
    for name in names:
        section = BY_NAME[name]
        left = deadline - time.time() - RESERVE_S
        need = min(section.estimate_s, limit_of(section, dry_run)) if not dry_run else 1
        if left < need:
            write_skipped(work, section, dry_run,
                          f"not started: {max(left, 0):.0f} s of the {_budget_text(dry_run)} left, it needs ~{need} s")
            continue
        run_section(section, work, dry_run, min(limit_of(section, dry_run), left))
        print(f"{name}: {(section_record(work, section) or {}).get('status')}", flush=True)


def _budget_text(dry_run: bool) -> str:
    return f"dry run's {DRY_BUDGET_S} s budget" if dry_run else f"{budget_s()} s budget"


def _kill(proc: subprocess.Popen) -> None:
    """End the worker and every process it started (its own session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def supervise(sections: list[Section], out: Path, work: Path, dry_run: bool) -> dict:
    """Run ``sections`` through workers (see the module's docstring); the final summary."""
    started = float(os.environ.get("GPU_CHECK_STARTED") or time.time())
    budget, planned = budget_s(), planned_s(sections)
    shutil.rmtree(sections_dir(work), ignore_errors=True)  # another check's records must not stand for this one's
    logs_dir(work).mkdir(parents=True, exist_ok=True)
    for s in sections:
        (logs_dir(work) / f"{s.name}.log").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    summarize(out, work, sections, dry_run, budget, started, planned)
    pending = list(sections)
    attempt = 0
    while pending:
        attempt += 1
        cmd = [sys.executable, "-m", "scripts.gpu_check", "worker", "--work", str(work),
               "--sections", ",".join(s.name for s in pending), *(["--dry-run"] if dry_run else [])]
        with open(logs_dir(work) / "worker.log", "a") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        timed_out: Section | None = None
        seen: set[str] = set()
        while proc.poll() is None:
            time.sleep(0.25)
            for s in pending:
                data = section_record(work, s)
                if data is None:
                    break
                if data.get("status") in STATUSES:
                    if s.name not in seen:
                        seen.add(s.name)
                        summarize(out, work, sections, dry_run, budget, started, planned)
                        print(f"{s.name}: {data['status']} after {data.get('seconds', 0):.0f} s"
                              + (f" ({data['reason']})" if data.get("reason") else ""), flush=True)
                    continue
                if time.time() > data.get("started_at", time.time()) + data.get("limit_s", 0) + 2:
                    timed_out = s
                break
            if timed_out is not None:
                _kill(proc)
                break
        rc = proc.wait()
        finished = [s for s in pending if (section_record(work, s) or {}).get("status") in STATUSES]
        rest = [s for s in pending if s not in finished]
        if rest:
            current = rest[0]
            data = record_death(work, current, None if timed_out is current else rc, timed_out is current)
            print(f"{current.name}: {data['status']} ({data['reason']})", flush=True)
            rest = rest[1:]
        pending = rest
        summarize(out, work, sections, dry_run, budget, started, planned)
    return summarize(out, work, sections, dry_run, budget, started, planned)


def slim_wheel(wheel: Path, keep: list[str]) -> None:
    """Rewrite bitsandbytes' wheel in place without the native libraries of the CUDA/ROCm versions not in
    ``keep`` (their RECORD lines go too); the CPU library stays. The wheel carries one library per CUDA
    version (~40 MB together), of which the lent machine loads one."""
    import zipfile

    tmp = wheel.with_suffix(".slim")
    dropped = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        def wanted(name: str) -> bool:
            base = name.rsplit("/", 1)[-1]
            if not base.startswith("libbitsandbytes_") or base.startswith("libbitsandbytes_cpu"):
                return True
            return any(k in base for k in keep)

        for info in src.infolist():
            if not wanted(info.filename):
                dropped += 1
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if wanted(line.split(",", 1)[0])) + "\n").encode()
            dst.writestr(info, data)
    tmp.replace(wheel)
    print(f"{wheel.name}: dropped {dropped} native libraries, {wheel.stat().st_size / 2**20:.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--only")
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("worker")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--sections", required=True)
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("sections")
    p.add_argument("--only")
    p = sub.add_parser("slim-wheel")
    p.add_argument("wheel", type=Path)
    p.add_argument("--keep", action="append", required=True)
    args = ap.parse_args()

    if args.command in ("check", "sections"):
        try:
            chosen = selected(args.only)
        except ValueError as err:
            sys.exit(f"gpu_check: --only: {err}")
    if args.command == "check":
        summary = supervise(chosen, args.out.resolve(), args.work.resolve(), args.dry_run)
        print(table(summary))
        sys.exit(0 if summary["ok"] else 1)
    elif args.command == "worker":
        worker([n for n in args.sections.split(",") if n], args.work, args.dry_run)
        sys.stdout.flush()
        sys.stderr.flush()
        # Every record is written: skip the interpreter's teardown (process groups, CUDA, compile workers),
        # which can hang after a failure and would then turn a finished section into a timed-out one.
        os._exit(0)
    elif args.command == "sections":
        for s in chosen:
            print(s.name, s.estimate_s, s.limit_s)
        print(f"planned {planned_s(chosen)} s of the {budget_s()} s budget")
    elif args.command == "slim-wheel":
        slim_wheel(args.wheel, args.keep)


if __name__ == "__main__":
    main()
