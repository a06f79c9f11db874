"""Generate the preference pairs of recipes/quickstart-dpo.yaml from the reverse task (deterministic).

    python scripts/make_preference_data.py

recipes/data/reverse-preference/{train,eval}.jsonl: one row per word of recipes/data/reverse/{train,eval}.jsonl
(so the held-out words stay held out), ``{"prompt", "chosen", "rejected"}``: the instruction prompt the
quickstart model was trained on, the word reversed (correct, chosen) and a plausible wrong answer (rejected),
one of: the word itself, the reversal with two neighbouring letters swapped, with a letter dropped, with a
letter doubled, or with its last letter changed. Each wrong answer differs from the correct one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "recipes" / "data"
SOURCE, OUT = ROOT / "reverse", ROOT / "reverse-preference"
PROMPT = "{instruction}\n{input}\nAnswer: "  # finetune.train.data.formats.PROMPT_TEMPLATE
LETTERS = "abcdefghijklmnopqrstuvwxyz"
N_TRAIN = 2000  # pairs from the first words of reverse/train.jsonl (enough for the quickstart's steps)


def wrong_answer(word: str, rng: random.Random) -> str:
    """A plausible wrong reversal of ``word`` (never the right one)."""
    right = word[::-1]
    for _ in range(20):
        kind = rng.randrange(5)
        if kind == 0:
            cand = word
        elif kind == 1:
            i = rng.randrange(len(right) - 1)
            cand = right[:i] + right[i + 1] + right[i] + right[i + 2 :]
        elif kind == 2:
            i = rng.randrange(len(right))
            cand = right[:i] + right[i + 1 :]
        elif kind == 3:
            i = rng.randrange(len(right))
            cand = right[: i + 1] + right[i] + right[i + 1 :]
        else:
            cand = right[:-1] + rng.choice([c for c in LETTERS if c != right[-1]])
        if cand and cand != right:
            return cand
    return right + "x"


def pairs(rows: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """The preference pair of every instruction row."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        prompt = PROMPT.format(instruction=row["instruction"], input=row["input"])
        out.append({"prompt": prompt, "chosen": row["output"], "rejected": wrong_answer(row["input"], rng)})
    return out


def read(path: Path) -> list[dict[str, str]]:
    """The rows of a .jsonl file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    """Write the train and eval pairs."""
    OUT.mkdir(parents=True, exist_ok=True)
    for split, rows, seed in (
        ("train", read(SOURCE / "train.jsonl")[:N_TRAIN], 0),
        ("eval", read(SOURCE / "eval.jsonl"), 1),
    ):
        with (OUT / f"{split}.jsonl").open("w") as f:
            for row in pairs(rows, seed):
                f.write(json.dumps(row) + "\n")
        print(f"{OUT / split}.jsonl: {len(rows)} pairs")


if __name__ == "__main__":
    main()
