"""Generate the synthetic instruction tasks shipped under recipes/data/ (deterministic).

    python scripts/make_data.py

Each task's answer can be checked exactly, so exact-match accuracy measures what a model learned:
- reverse:   "Reverse the letters." + a made-up word  -> the word reversed
- uppercase: "Write in capitals."  + a made-up word  -> the word in upper case
Every task has train.jsonl and a held-out eval.jsonl whose words never occur in train.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "recipes" / "data"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TASKS = {
    "reverse": ("Reverse the letters.", lambda w: w[::-1]),
    "uppercase": ("Write in capitals.", lambda w: w.upper()),
}
N_TRAIN, N_EVAL = 4000, 200


def make_words(rng: random.Random, n: int, lo: int = 3, hi: int = 7) -> list[str]:
    """``n`` distinct random lowercase words of length lo..hi."""
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi))))
    return sorted(words)


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    """Write rows as JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    """Write train.jsonl and eval.jsonl for every task."""
    for seed, (name, (instruction, answer)) in enumerate(TASKS.items()):
        rng = random.Random(1234 + seed)
        words = make_words(rng, N_TRAIN + N_EVAL)
        rng.shuffle(words)
        rows = [{"instruction": instruction, "input": w, "output": answer(w)} for w in words]
        write_jsonl(OUT / name / "train.jsonl", rows[:N_TRAIN])
        write_jsonl(OUT / name / "eval.jsonl", rows[N_TRAIN:])
        print(f"{name}: {N_TRAIN} train, {N_EVAL} eval -> {OUT / name}")


if __name__ == "__main__":
    main()
