"""The commands scripts/gpu_check.sh calls (from the repository root, ``python3 -m scripts.gpu_check ...``):

    sections --part 1|2|all [--dry-run] [--only a,b]   the part's sections, one "name limit" line each
    run NAME --out DIR [--dry-run]                     one section; writes DIR/NAME.json
    end NAME --out DIR --rc N --seconds S [--skip WHY] [--dry-run]
                                                       completes NAME.json after its process ended (timeout,
                                                       crash), or writes it for a section not started
    summary --out DIR --part P [--dry-run] [--only a,b]  DIR/summary.json and the table on stdout
    slim-wheel WHEEL --keep cuda13                      drops the other CUDA versions' binaries from
                                                        bitsandbytes' wheel (scripts/gpu_wheels.sh)

``GPU_CHECK_FAIL=name[:exit|:hang],...`` makes sections fail on purpose (raise; exit without writing the JSON;
sleep past the limit), to show that the others still run; ``GPU_CHECK_LIMITS=name=seconds,...`` overrides
limits.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from scripts.gpu_check.registry import BY_NAME, Section, limit_of, sections_of
from scripts.gpu_check.report import Check, Skip, record_end, summarize, table


def _selected(part: str, only: str | None) -> list[Section]:
    chosen = sections_of(part)
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            sys.exit(f"gpu_check: --only: unknown section(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
        chosen = [s for s in chosen if s.name in names]
    return chosen


def _inject_failure(name: str) -> None:
    """GPU_CHECK_FAIL: fail this section on purpose (before anything heavy is imported)."""
    for item in os.environ.get("GPU_CHECK_FAIL", "").split(","):
        target, _, how = item.strip().partition(":")
        if target != name:
            continue
        if how == "exit":
            os._exit(3)  # dies without its final JSON, as a crash would
        if how == "hang":
            time.sleep(10**6)
        raise RuntimeError(f"GPU_CHECK_FAIL={item.strip()} made this section fail")


def run_section(name: str, out: Path, dry_run: bool) -> int:
    """Run section ``name``; 0 when it ended ok or skipped, 1 when it failed."""
    section = BY_NAME[name]
    work = Path(os.environ.get("GPU_CHECK_WORK") or tempfile.mkdtemp(prefix="gpu_check-")) / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    check = Check(section, out, dry_run, work)
    check.save()
    check.say(f"{section.measures} (limit {limit_of(section, dry_run)} s)")
    try:
        _inject_failure(name)
        module = importlib.import_module(f"scripts.gpu_check.{section.module}")
        module.run(check)
        check.finish("ok")
    except Skip as skip:
        check.finish("skipped", str(skip))
    except Exception as exc:
        text = traceback.format_exc()
        print(text, flush=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        check.finish("failed", f"{type(exc).__name__}: {first}"[:300], "\n".join(text.splitlines()[-25:]))
    check.say(f"{check.data['status']}" + (f": {check.data['reason']}" if check.data["reason"] else ""))
    return 0 if check.data["status"] in ("ok", "skipped") else 1


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
    p = sub.add_parser("sections")
    p.add_argument("--part", default="all", choices=("1", "2", "all"))
    p.add_argument("--only")
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("run")
    p.add_argument("name", choices=list(BY_NAME))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("end")
    p.add_argument("name", choices=list(BY_NAME))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--skip", help="the section was not started: status skipped with this reason")
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("summary")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part", default="all", choices=("1", "2", "all"))
    p.add_argument("--only")
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("slim-wheel")
    p.add_argument("wheel", type=Path)
    p.add_argument("--keep", action="append", required=True)
    args = ap.parse_args()

    if args.command == "sections":
        for s in _selected(args.part, args.only):
            print(s.name, limit_of(s, args.dry_run))
    elif args.command == "run":
        code = run_section(args.name, args.out, args.dry_run)
        sys.stdout.flush()
        sys.stderr.flush()
        # The JSON is written: skip the interpreter's teardown (process groups, CUDA, compile workers), which
        # can hang after a failure and would then turn a failed section into a timed-out one.
        os._exit(code)
    elif args.command == "end":
        record_end(BY_NAME[args.name], args.out, args.dry_run, args.rc, args.seconds, skipped=args.skip)
    elif args.command == "summary":
        summary = summarize(args.out, _selected(args.part, args.only), args.dry_run, args.part)
        print(table(summary))
        sys.exit(0 if summary["ok"] else 1)
    elif args.command == "slim-wheel":
        slim_wheel(args.wheel, args.keep)


if __name__ == "__main__":
    main()
