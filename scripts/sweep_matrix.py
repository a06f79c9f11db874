"""Sweep the configuration matrix: every cell must train or be refused by `finetune validate`.

A cell is one point of method x strategy x tensor parallelism x optimizer x precision x compile x attention x
packing x activation checkpointing. For each cell the sweep writes a two-step recipe on the built-in tiny model
(random init, the shipped synthetic data), runs `finetune validate` on it and, when validate accepts it,
`finetune run RECIPE --overwrite` with a time limit, then reads the step losses from `metrics.jsonl`.

A cell is classified as

- trained: the run exits 0 and logs two finite losses;
- refused: validate exits 2 with an `error:` line and no traceback;
- refused-late: validate accepted the cell, then the run exited 2 with an `error:` line and no traceback
  (a refusal that came after loading started: a failure);
- crashed: anything else (a traceback, another exit status, a non-finite loss, a run past the time limit).

    python scripts/sweep_matrix.py --sample 40 --seed 1 --markdown docs/matrix.md
    python scripts/sweep_matrix.py --only-fixed
    python scripts/sweep_matrix.py --cells full/fsdp/tp1/adamw/fp32/sdpa,lora/ddp/tp1/adamw/bf16/eager+packing
    python scripts/sweep_matrix.py --all --jobs 2

A cell's name is `method/strategy/tpN/optimizer/precision/attention`, followed by `+compile`, `+packing` and
`+ac` (activation checkpointing) when those are on. The exit status is 1 when any cell crashed or was refused
late. tests/e2e/test_matrix.py runs the FIXED cells that no other slow test trains, and a seeded sample,
through these functions.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "recipes" / "data" / "reverse"

METHODS = ("full", "lora", "qlora4", "qlora8", "dora", "rslora", "pissa", "olora", "prefix", "prefix-text", "adapter",
           "prompt", "prompt-text")
STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp")
TPS = (1, 2)
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure")
COMPILES = (False, True)
ATTENTIONS = ("sdpa", "eager", "flex_attention")
PACKINGS = (False, True)
CHECKPOINTINGS = (False, True)

CLASSES = ("trained", "refused", "refused-late", "crashed")
MACHINE = "2-core CPU, gloo"
DEFAULT_TIMEOUT = 240.0


@dataclass(frozen=True)
class Cell:
    """One point of the configuration matrix."""

    method: str
    strategy: str
    tp: int = 1
    optimizer: str = "adamw"
    precision: str = "fp32"
    compile: bool = False
    attn: str = "sdpa"
    packing: bool = False
    ac: bool = False

    @property
    def name(self) -> str:
        """The cell's name: `method/strategy/tpN/optimizer/precision/attention[+compile][+packing][+ac]`."""
        base = f"{self.method}/{self.strategy}/tp{self.tp}/{self.optimizer}/{self.precision}/{self.attn}"
        flags = [f for f, on in (("compile", self.compile), ("packing", self.packing), ("ac", self.ac)) if on]
        return base + "".join(f"+{f}" for f in flags)

    @property
    def nproc(self) -> int:
        """Processes the cell runs: 2 for a data- or tensor-parallel cell, 1 for a single-process one."""
        return 2 if self.strategy != "single" or self.tp > 1 else 1


def parse_cell(name: str) -> Cell:
    """The cell a name written by :attr:`Cell.name` stands for; ValueError for a malformed name."""
    base, *flags = name.strip().split("+")
    parts = base.split("/")
    if len(parts) != 6:
        raise ValueError(f"cell `{name}`: expected method/strategy/tpN/optimizer/precision/attention[+flag...]")
    method, strategy, tp, optimizer, precision, attn = parts
    checks = (
        ("method", method, METHODS), ("strategy", strategy, STRATEGIES), ("optimizer", optimizer, OPTIMIZERS),
        ("precision", precision, PRECISIONS), ("attention", attn, ATTENTIONS),
        ("tp", tp, tuple(f"tp{t}" for t in TPS)), ("flag", None, ("compile", "packing", "ac")),
    )
    for what, value, allowed in checks:
        for v in (flags if what == "flag" else [value]):
            if v not in allowed:
                raise ValueError(f"cell `{name}`: {what} `{v}` is not one of {', '.join(map(str, allowed))}")
    return Cell(
        method, strategy, int(tp[2:]), optimizer, precision,
        compile="compile" in flags, attn=attn, packing="packing" in flags, ac="ac" in flags,
    )


def all_cells() -> list[Cell]:
    """Every cell of the matrix, in a fixed order."""
    axes = (METHODS, STRATEGIES, TPS, OPTIMIZERS, PRECISIONS, COMPILES, ATTENTIONS, PACKINGS, CHECKPOINTINGS)
    return [Cell(*values) for values in itertools.product(*axes)]


def sample_cells(n: int, seed: int, exclude: Iterable[Cell] = ()) -> list[Cell]:
    """``n`` distinct cells drawn at random with ``seed`` (without replacement), leaving out ``exclude``."""
    left = set(exclude)
    pool = [c for c in all_cells() if c not in left]
    return random.Random(seed).sample(pool, min(n, len(pool)))


# The most-used configurations (tests/e2e/test_matrix.py runs those no other slow test trains: about 40 s per
# 2-process cell on a quiet 2-core machine, so the list stays short; LoRA's variants and ZeRO-1 are left to the
# sampled cells).
FIXED: tuple[Cell, ...] = (
    Cell("full", "single"),
    Cell("lora", "ddp", precision="bf16"),
    Cell("qlora4", "single"),
    Cell("qlora4", "fsdp"),
    Cell("full", "fsdp"),
    Cell("full", "zero2", optimizer="adamw8bit"),
    Cell("prefix", "single"),
    Cell("adapter", "ddp"),
    Cell("full", "fsdp", tp=2),
)


def recipe_for(cell: Cell, out_dir: Path, with_eval: bool = False) -> dict[str, Any]:
    """The two-step recipe of ``cell`` on the built-in tiny model, writing its outputs to ``out_dir``."""
    method = {"qlora4": "qlora", "qlora8": "qlora", "prefix-text": "prefix", "prompt-text": "prompt"}.get(
        cell.method, cell.method
    )
    if method in ("dora", "rslora", "pissa", "olora"):
        method = "lora"
    recipe: dict[str, Any] = {
        "model": {"path": "tiny-llama", "init": "random", "attn_implementation": cell.attn},
        "method": method,
        "data": {
            "train": str(DATA / "train.jsonl"), "format": "instruction", "max_seq_len": 64,
            "packing": cell.packing,
        },
        "train": {
            "max_steps": 2, "global_batch_size": 4, "micro_batch_size": 2, "lr": 1.0e-3, "warmup_steps": 0,
            "seed": 0, "optimizer": cell.optimizer, "compile": cell.compile,
            "activation_checkpointing": cell.ac,
        },
        "precision": cell.precision,
        "distributed": {"strategy": cell.strategy, "nproc": cell.nproc, "tp": cell.tp},
        "eval": {"at_start": False, "every": 0},
        "output": {"dir": str(out_dir), "log_every": 1, "save_every": 0},
    }
    if with_eval:
        recipe["data"]["eval"] = str(DATA / "eval.jsonl")
        recipe["eval"].update({"max_samples": 2, "max_new_tokens": 2, "batch_size": 2})
    if method in ("lora", "qlora"):
        recipe["lora"] = {"r": 4, "alpha": 8}
        if cell.method == "dora":
            recipe["lora"]["use_dora"] = True
        elif cell.method == "rslora":
            recipe["lora"]["use_rslora"] = True
        elif cell.method in ("pissa", "olora"):
            recipe["lora"]["init"] = cell.method
    if method == "qlora":
        recipe["quantization"] = {"bits": 8 if cell.method == "qlora8" else 4}
    if method == "prefix":
        recipe["prefix"] = {"num_virtual_tokens": 4}
        if cell.method == "prefix-text":
            recipe["prefix"].update({"init": "text", "init_text": "Reverse the letters of the word."})
    if method == "adapter":
        recipe["adapter"] = {"reduction_factor": 4}
    if method == "prompt":
        recipe["prompt"] = {"num_virtual_tokens": 4}
        if cell.method == "prompt-text":
            recipe["prompt"].update({"init": "text", "init_text": "Reverse the letters of the word."})
    return recipe


@dataclass
class Result:
    """What one cell did."""

    cell: Cell
    status: str  # one of CLASSES
    seconds: float
    detail: str = ""  # the refusal sentence, or the crash's last error line
    raised_in: str = ""  # for a crash with a traceback: the innermost frame, and the innermost in finetune/
    losses: list[float] = field(default_factory=list)
    validate_seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        """The result as a JSON-ready dict (the cell's settings, class, time and detail)."""
        return {
            "cell": self.cell.name, **{k: getattr(self.cell, k) for k in self.cell.__dataclass_fields__},
            "status": self.status, "seconds": round(self.seconds, 1), "detail": self.detail,
            "raised_in": self.raised_in, "losses": self.losses,
        }


_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_RICH_TRACEBACK = "Traceback (most recent call last) ─"
_RICH_FRAME = re.compile(r"^│ (\S+\.py):(\d+) in (\S+)")


def _short_path(path: str) -> str:
    for marker in ("site-packages/", str(REPO) + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def error_lines(output: str) -> list[str]:
    """The `error: ...` lines of a command's output, without the prefix."""
    return [ln.strip()[len("error:"):].strip() for ln in output.splitlines() if ln.strip().startswith("error:")]


def last_exception(output: str) -> tuple[str, str]:
    """The last traceback's exception line and where it was raised (innermost frame; innermost in finetune/),
    or two empty strings when the output holds no traceback."""
    start = output.rfind(_TRACEBACK)
    boxed = output.rfind(_RICH_TRACEBACK)  # a single-process run's traceback, drawn by rich
    if max(start, boxed) < 0:
        return "", ""
    frames: list[str] = []
    exc = ""
    if boxed > start:
        lines = output[boxed:].splitlines()[1:]
        for i, ln in enumerate(lines):
            m = _RICH_FRAME.match(ln)
            if m:
                frames.append(f"{_short_path(m.group(1))}:{m.group(2)} ({m.group(3)})")
            elif ln.startswith("╰"):
                exc = next((x.strip() for x in lines[i + 1 :] if x.strip()), "")
                break
    for ln in output[start:].splitlines()[1:] if start > boxed else []:
        m = _FRAME.match(ln)
        if m:
            frames.append(f"{_short_path(m.group(1))}:{m.group(2)} ({m.group(3)})")
        elif ln and not ln[0].isspace() and not ln.startswith(("^", "~")):
            exc = ln.strip()
            if not ln.startswith(("During handling", "The above exception")):
                break
    own = [f for f in frames if f.startswith("finetune/")]
    where = frames[-1] if frames else ""
    if own and own[-1] != where:
        where = f"{where}, from {own[-1]}"
    return exc, where


def read_losses(out_dir: Path) -> list[float]:
    """The step losses logged in ``out_dir/metrics.jsonl`` (empty when there is no such file)."""
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    losses = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "loss" in row:
            losses.append(float(row["loss"]))
    return losses


def _run(argv: list[str], log: Path, timeout: float, env: dict[str, str]) -> tuple[int | None, str, float]:
    """Run ``argv`` in its own process group, output to ``log``; (exit status or None on timeout, output, s)."""
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=log.parent, env=env,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and the workers it started
            proc.wait()
            code = None
    return code, log.read_text(errors="replace"), time.monotonic() - t0


def finetune_command() -> list[str]:
    """How to invoke the CLI: the `finetune` script beside this interpreter, else `python -m finetune`."""
    script = Path(sys.executable).parent / "finetune"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "finetune"]


def run_cell(cell: Cell, workdir: Path, timeout: float = DEFAULT_TIMEOUT, threads: int | None = None,
             with_eval: bool = False) -> Result:
    """Validate and (when accepted) train ``cell`` in ``workdir/<cell>``; classify what happened."""
    cell_dir = workdir / re.sub(r"[^A-Za-z0-9_.-]+", "_", cell.name)
    cell_dir.mkdir(parents=True, exist_ok=True)
    out_dir = cell_dir / "out"
    recipe = cell_dir / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(recipe_for(cell, out_dir, with_eval), sort_keys=False))
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_COLOR="1", TERM="dumb")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cli = finetune_command()
    t0 = time.monotonic()

    code, output, v_s = _run([*cli, "validate", str(recipe)], cell_dir / "validate.log", timeout, env)
    errors = error_lines(output)
    exc, where = last_exception(output)
    if code == 2 and errors and not exc:
        return Result(cell, "refused", time.monotonic() - t0, _unlocated(errors[0]), validate_seconds=v_s)
    if code != 0:
        detail = exc or (errors[-1] if errors else _last_line(output)) or f"validate exited {code}"
        if code is None:
            detail = f"validate ran past {timeout:.0f} s"
        return Result(cell, "crashed", time.monotonic() - t0, f"validate: {detail}", where, validate_seconds=v_s)

    argv = [*cli, "run", str(recipe), "--nproc", str(cell.nproc), "--overwrite"]
    code, output, _ = _run(argv, cell_dir / "run.log", timeout, env)
    seconds = time.monotonic() - t0
    errors = error_lines(output)
    exc, where = last_exception(output)
    losses = read_losses(out_dir)
    if code is None:
        steps = [ln.strip() for ln in output.splitlines() if re.match(r"\s*step \d+/\d+", ln)]
        reached = f"; last line: {steps[-1].split(' | ')[0]}" if steps else "; no step finished"
        return Result(cell, "crashed", seconds, f"ran past {timeout:.0f} s{reached}", where, losses, v_s)
    if code == 2 and errors and not exc:
        return Result(cell, "refused-late", seconds, _unlocated(errors[0]), "", losses, v_s)
    if code == 0 and len(losses) >= 2 and all(math.isfinite(x) for x in losses):
        return Result(cell, "trained", seconds, "", "", losses, v_s)
    if code == 0:
        detail = f"exit 0 but losses {losses} (expected 2 finite)"
    else:
        detail = exc or (errors[-1] if errors else _last_line(output)) or f"exit {code}"
        if exc and errors and exc not in errors[-1] and len(errors[-1]) < 200:
            detail = f"{exc} [{errors[-1]}]"
    return Result(cell, "crashed", seconds, detail, where, losses, v_s)


def _unlocated(error: str) -> str:
    """An error line without the recipe file's path and line (the same for every cell)."""
    return re.sub(r"^\S+\.yaml(:\d+)?: ", "", error)


def _last_line(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def sweep(cells: Sequence[Cell], workdir: Path, timeout: float = DEFAULT_TIMEOUT, jobs: int = 1,
          with_eval: bool = False, progress: Callable[[Result, int, int], None] | None = None) -> list[Result]:
    """Run every cell (multi-process cells one at a time; single-process ones ``jobs`` at a time, each with
    cores / jobs threads) and return their results in the order of ``cells``."""
    results: dict[Cell, Result] = {}
    total = len(cells)

    def done(res: Result) -> None:
        results[res.cell] = res
        if progress:
            progress(res, len(results), total)

    multi = [c for c in cells if c.nproc > 1 or jobs <= 1]
    single = [c for c in cells if c.nproc == 1 and jobs > 1]
    for cell in multi:
        done(run_cell(cell, workdir, timeout, with_eval=with_eval))
    if single:
        threads = max(1, (os.cpu_count() or 2) // jobs)
        with ThreadPoolExecutor(jobs) as pool:
            for res in pool.map(lambda c: run_cell(c, workdir, timeout, threads, with_eval), single):
                done(res)
    return [results[c] for c in cells]


def counts(results: Sequence[Result]) -> dict[str, int]:
    """How many cells fell in each class."""
    return {k: sum(r.status == k for r in results) for k in CLASSES}


def failures(results: Sequence[Result]) -> list[Result]:
    """The cells that crashed or were refused late."""
    return [r for r in results if r.status in ("crashed", "refused-late")]


def failure_report(results: Sequence[Result]) -> str:
    """One line per failed cell: name, class, error line and where it was raised."""
    return "\n".join(
        f"{r.cell.name}: {r.status}: {r.detail}" + (f" (raised in {r.raised_in})" if r.raised_in else "")
        for r in failures(results)
    )


_COLUMNS = ("method", "strategy", "tp", "optimizer", "precision", "compile", "attention", "packing", "ac",
            "result", "s", "refusal / error")


def _row(r: Result) -> list[str]:
    c = r.cell
    yn = {True: "yes", False: "-"}
    detail = r.detail + (f" (in {r.raised_in})" if r.raised_in else "")
    return [c.method, c.strategy, str(c.tp), c.optimizer, c.precision, yn[c.compile], c.attn, yn[c.packing],
            yn[c.ac], r.status, f"{r.seconds:.0f}", detail]


def summary_line(results: Sequence[Result], seconds: float) -> str:
    """`N cells: a trained, b refused, c refused-late, d crashed in Xm Ys`."""
    n = counts(results)
    m, s = divmod(round(seconds), 60)
    return f"{len(results)} cells: " + ", ".join(f"{n[k]} {k}" for k in CLASSES) + f" in {m}m{s:02d}s"


def timings(results: Sequence[Result]) -> str:
    """Median seconds per cell of each kind: trained on 1 process, trained on 2, refused."""
    groups = {
        "trained, 1 process": [r.seconds for r in results if r.status == "trained" and r.cell.nproc == 1],
        "trained, 2 processes": [r.seconds for r in results if r.status == "trained" and r.cell.nproc > 1],
        "refused": [r.seconds for r in results if r.status == "refused"],
    }
    return ", ".join(
        f"{k} {statistics.median(v):.0f} s (n={len(v)})" for k, v in groups.items() if v
    ) or "no cells"


def text_table(results: Sequence[Result]) -> str:
    """The results as a plain-text table, one row per cell."""
    rows = [list(_COLUMNS)] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS) - 1)]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in rows
    )


def markdown(results: Sequence[Result], seconds: float, command: str) -> str:
    """The results as a Markdown page: date, command, machine, counts, then one table row per cell."""
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = [
        "# Configuration matrix",
        "",
        "Every recipe is a cell of method x strategy x tensor parallelism x optimizer x precision x compile x",
        "attention x packing x activation checkpointing; each must train or be refused by `finetune validate`",
        "before anything loads. `scripts/sweep_matrix.py` writes a two-step recipe on the built-in tiny model",
        "for each cell, validates it and, when accepted, runs it (2 processes for ddp, zero1, zero2, fsdp and",
        "tp 2). Classes: **trained** (exit 0, two finite losses), **refused** (validate exit 2, one sentence),",
        "**refused-late** (validate accepted it, the run refused it: a failure), **crashed** (anything else).",
        f"The full matrix has {len(all_cells())} cells.",
        "",
        f"- date: {dt.date.today().isoformat()}",
        f"- command: `{command}`",
        f"- machine: {MACHINE}",
        f"- result: {summary_line(results, seconds)}",
        f"- median time per cell: {timings(results)}",
        "",
    ]
    bad = failures(results)
    if bad:
        lines += ["## Failures", ""]
        lines += [f"- `{r.cell.name}`: {r.status}: {esc(r.detail)}" + (f" (raised in `{r.raised_in}`)" if
                  r.raised_in else "") for r in bad]
        lines.append("")
    lines += ["## Cells", "", "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(esc(v) for v in _row(r)) + " |" for r in results]
    return "\n".join(lines) + "\n"


def select(args: argparse.Namespace) -> list[Cell]:
    """The cells the command line asks for."""
    if args.cells:
        return [parse_cell(n) for n in args.cells.split(",") if n.strip()]
    if args.only_fixed:
        return list(FIXED)
    if args.sample:
        return sample_cells(args.sample, args.seed)
    return all_cells()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (1 when a cell crashed or was refused late)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every cell of the matrix (the default)")
    which.add_argument("--sample", type=int, help="a seeded random sample of N cells, without replacement")
    which.add_argument("--cells", help="comma-separated cell names")
    which.add_argument("--only-fixed", action="store_true", help="the FIXED list of most-used cells")
    p.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per cell; past it, a crash")
    p.add_argument("--jobs", type=int, default=1, help="single-process cells run this many at a time")
    p.add_argument("--eval", action="store_true", help="also evaluate at the end on 2 held-out rows")
    p.add_argument("--workdir", help="keep recipes, logs and outputs here (default: a temporary directory)")
    p.add_argument("--markdown", help="also write the table and counts to this Markdown file")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--list", action="store_true", help="print the selected cells' names and stop")
    args = p.parse_args(argv)
    try:
        cells = select(args)
    except ValueError as err:
        p.error(str(err))
    if args.list:
        print("\n".join(c.name for c in cells))
        print(f"{len(cells)} of {len(all_cells())} cells", file=sys.stderr)
        return 0
    command = "python scripts/sweep_matrix.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    def progress(res: Result, i: int, total: int) -> None:
        extra = f"  {res.detail}" if res.detail else ""
        print(f"[{i}/{total}] {res.status:<12} {res.seconds:5.0f}s  {res.cell.name}{extra}", flush=True)

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="finetune-sweep-") as tmp:
        workdir = Path(args.workdir).resolve() if args.workdir else Path(tmp)
        results = sweep(cells, workdir, args.timeout, args.jobs, args.eval, progress)
    seconds = time.monotonic() - t0
    print()
    print(text_table(results))
    print()
    print(summary_line(results, seconds))
    print(f"median time per cell: {timings(results)}")
    if failures(results):
        print("\nfailures:\n" + failure_report(results))
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, seconds, command))
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_json() for r in results], indent=1))
    return 1 if failures(results) else 0


if __name__ == "__main__":
    sys.exit(main())
