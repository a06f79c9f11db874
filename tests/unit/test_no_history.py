"""The repository speaks of the product, not of how it was made: no issue numbers, work sessions, rounds of
work, earlier results or machine-load readings in the README, the docs, the recipes, the code, the tests, the scripts
or CI. Measurements belong in docs/benchmarks.md with their command, machine and date."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (pattern, what it names); case-insensitive. Each is development history, never product wording: "an earlier
# run" in output.dir (what --overwrite replaces) is the product, "in an earlier run" or "the earlier run" a
# result of the project's own past.
PATTERNS: list[tuple[str, str]] = [
    (r"\bissues? #?\d+\b", "an issue number"),
    (r"\bissue \"", "an issue's title"),
    (r"\bsession\s+\d+\b|\bthis\s+session\b|\b(previous|last|earlier)\s+session\b", "a work session"),
    (r"\brounds? of work\b|\bround \d+ of\b", "a round of work"),
    (r"\bload\s+average", "a machine-load reading"),
    (r"\b(in|from) an earlier (run|trial|one)\b|\bthe earlier (run|trial|\d)", "an earlier result"),
    (r"\bearlier (trial|results?|figures?|measurements?)\b", "an earlier result"),
    (r"\(it was [^)]*\bbefore\)|\bwas [-+]?\d[\d.]*%? before\b", "a figure from before a change"),
    (r"\bquiet (machine|cores)\b|\bmachine was (quiet|busy|loaded)\b", "how busy the machine was"),
    (r"(^|[.;]\s+)before, |\(before, (?![\w.]+[,)])|\bbefore this change\b", "what the code did before a change"),
    (r"\bused to (fail|die|break|crash|hang|delete|wait)\b", "what the code did before a change"),
]

# What is searched: the user's and the developer's text, never the data.
SEARCHED = ["README.md", "docs", "recipes", "finetune", "tests", "scripts", ".ci"]
SUFFIXES = {".md", ".py", ".yaml", ".yml", ".sh", ".toml", ""}
SKIPPED_DIRS = {"data", "__pycache__", "venv", ".venv"}


def searched_files() -> list[Path]:
    """Every text file under SEARCHED, less the data folders, virtual environments and this file."""
    files: list[Path] = []
    for name in SEARCHED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for p in candidates:
            rel = p.relative_to(ROOT)
            if SKIPPED_DIRS & set(rel.parts[:-1]) or p.suffix not in SUFFIXES or p == Path(__file__).resolve():
                continue
            if p.suffix == "" and p.parent.name != ".ci":
                continue
            files.append(p)
    return files


def history_hits(text: str, rel: str) -> list[str]:
    """``file:line: what`` for every line of ``text`` that one of PATTERNS matches."""
    hits = []
    compiled = [(re.compile(pattern, re.IGNORECASE), what) for pattern, what in PATTERNS]
    for number, line in enumerate(text.splitlines(), 1):
        for regex, what in compiled:
            found = regex.search(line)
            if found:
                hits.append(f"{rel}:{number}: {what} ({found.group(0)!r})")
    return hits


def test_patterns_catch_history_and_spare_the_product() -> None:
    history = [
        "see iss" "ue 15 for why",
        "as in iss" "ue #3",
        "(issue \"One way through the code\")",
        "decided in this " "session",
        "from the second round of work",
        "a load " "average of 3.1",
        "88% in an earlier one, cause unknown",
        "so what made the earlier 88% is not known",
        "(it was -9.2% before)",
        "2m26s on a quiet machine",
        "(before, only fsdp switched the storage)",
        "gathered. Before, weights were gathered to rank 0",
        "planning phi-3-mini used to fail",
    ]
    product = [
        "output.dir holds the metrics.jsonl of an earlier run (no checkpoint to resume)",
        "--force only replaces an earlier merge",
        "an earlier run's shards would mix with these",
        "rounds the weight through bf16",
        "issues a warning",
        "taken before, from the fp32 ones",
        "Before training, the plan is checked",
        "zip(before, params, strict=True)",
    ]
    assert all(history_hits(line, "x") for line in history), [line for line in history if not history_hits(line, "x")]
    assert not any(history_hits(line, "x") for line in product), [h for p in product for h in history_hits(p, "x")]


def test_no_development_history_in_the_repository() -> None:
    files = searched_files()
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".yaml" for p in files)
    hits = [h for p in files for h in history_hits(p.read_text(errors="replace"), str(p.relative_to(ROOT)))]
    assert not hits, "development history (say what the product does; measurements go to docs/benchmarks.md):\n" + (
        "\n".join(hits)
    )
