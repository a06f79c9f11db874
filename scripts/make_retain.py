"""Write recipes/data/retain/tiny-llama-reverse.jsonl: the retain set (``eval.retain``) of the quickstart model.

    python scripts/make_retain.py

The quickstart model (recipes/quickstart.yaml) was trained to reverse words; a run that fine-tunes it on
another task (recipes/quickstart-lora.yaml: reversed words in capitals) names this file in ``eval.retain``
to see how much of the reversal it forgets. The rows are the first 64 held-out rows of recipes/data/reverse
(words never seen in training), in the instruction format, so they have answers: the run measures their
loss and their exact match. SmolLM2's retain set is made by scripts/make_smollm2_retain.py.
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "recipes" / "data"
N_ROWS = 64


def main() -> None:
    """Copy the first N_ROWS rows of reverse/eval.jsonl into retain/tiny-llama-reverse.jsonl."""
    rows = (DATA / "reverse" / "eval.jsonl").read_text().splitlines()[:N_ROWS]
    out = DATA / "retain" / "tiny-llama-reverse.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(rows) + "\n")
    print(f"{len(rows)} rows -> {out}")


if __name__ == "__main__":
    main()
