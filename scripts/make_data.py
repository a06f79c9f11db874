"""Generate the synthetic instruction tasks shipped under recipes/data/ (deterministic).

    python scripts/make_data.py

Each task's answer can be checked exactly, so exact-match accuracy measures what a model learned:
- reverse:   "Reverse the letters." + a made-up word  -> the word reversed
- uppercase: "Write in capitals."  + a made-up word  -> the word in upper case
- reverse-upper: "Reverse the letters in capitals." -> the word reversed, in upper case (the LoRA quickstart)
- reverse-reworded: "Spell it backwards." + reverse's own words and split -> the word reversed (the prefix
  quickstart: the skill the quickstart model has, asked in words it does not follow; its held-out words are
  reverse's, never seen by the base or the prefix)
- reverse-these: "Reverse these letters." + reverse's own words and split -> the word reversed (the grpo
  quickstart: a wording the quickstart model half follows, about one answer in five right, so that sampling
  its own answers finds right ones to reinforce; its held-out words are reverse's)
Every task has train.jsonl and a held-out eval.jsonl whose words never occur in train.

The same rows are also written in the other data formats, for the recipes that show each format:
- reverse-chat/:         {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}   (data.format: chat)
- reverse-text/:         {"text": "Reverse the letters: abc -> cba"}                        (data.format: text)
- uppercase-tokenized/:  {"input_ids": [...], "labels": [...]} made with the tiny model's byte tokenizer and
                         the instruction prompt, prompt tokens labelled -100               (data.format: tokenized)
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
    # LoRA quickstart's task: the reversal the quickstart model knows, answered in capitals.
    "reverse-upper": ("Reverse the letters in capitals.", lambda w: w[::-1].upper()),
}
# The prefix quickstart's instruction: the quickstart model answers it 0% of the time (it reverses after
# "Reverse the letters." only), so a prefix must steer the base to the skill it has.
REWORDED = "Spell it backwards."
# The grpo quickstart's instruction: the quickstart model reverses after it about one time in five.
HALF_KNOWN = "Reverse these letters."
N_TRAIN, N_EVAL = 4000, 200
N_TOKENIZED_TRAIN = 1000  # keeps the pre-tokenized copy small; it is a demonstration of the format
TINY_TOKENIZER = OUT.parent / "models" / "tiny-llama" / "tokenizer.json"
PROMPT = "{instruction}\n{input}\nAnswer: "  # finetune.train.data.formats.PROMPT_TEMPLATE
EOS_ID = 2


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
        if name == "reverse":
            write_other_formats(name, rows, chat=True, text=True)
            reworded = [{**r, "instruction": REWORDED} for r in rows]
            write_jsonl(OUT / "reverse-reworded" / "train.jsonl", reworded[:N_TRAIN])
            write_jsonl(OUT / "reverse-reworded" / "eval.jsonl", reworded[N_TRAIN:])
            print(f"reverse-reworded: the same words as reverse -> {OUT / 'reverse-reworded'}")
            these = [{**r, "instruction": HALF_KNOWN} for r in rows]
            write_jsonl(OUT / "reverse-these" / "train.jsonl", these[:N_TRAIN])
            write_jsonl(OUT / "reverse-these" / "eval.jsonl", these[N_TRAIN:])
            print(f"reverse-these: the same words as reverse -> {OUT / 'reverse-these'}")
        if name == "uppercase":
            write_tokenized(name, rows)


def write_other_formats(name: str, rows: list[dict[str, str]], *, chat: bool, text: bool) -> None:
    """The chat and text versions of a task's rows (same words, same split)."""
    splits = {"train.jsonl": rows[:N_TRAIN], "eval.jsonl": rows[N_TRAIN:]}
    for file, part in splits.items():
        if chat:
            write_jsonl(
                OUT / f"{name}-chat" / file,
                [
                    {
                        "messages": [
                            {"role": "user", "content": f"{r['instruction'][:-1]}: {r['input']}"},
                            {"role": "assistant", "content": r["output"]},
                        ]
                    }
                    for r in part
                ],
            )
        if text:
            write_jsonl(
                OUT / f"{name}-text" / file,
                [{"text": f"{r['instruction'][:-1]}: {r['input']} -> {r['output']}"} for r in part],
            )
    print(f"{name}: chat and text versions -> {OUT / (name + '-chat')}, {OUT / (name + '-text')}")


def write_tokenized(name: str, rows: list[dict[str, str]]) -> None:
    """A pre-tokenized copy (input_ids, labels with the prompt masked) made with the tiny model's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_TOKENIZER))
    splits = {"train.jsonl": rows[:N_TOKENIZED_TRAIN], "eval.jsonl": rows[N_TRAIN:]}
    for file, part in splits.items():
        out = []
        for r in part:
            prompt = tok.encode(PROMPT.format(**r), add_special_tokens=False).ids
            answer = [*tok.encode(r["output"], add_special_tokens=False).ids, EOS_ID]
            out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
        write_jsonl(OUT / f"{name}-tokenized" / file, out)
    print(f"{name}: tokenized version -> {OUT / (name + '-tokenized')}")


if __name__ == "__main__":
    main()
