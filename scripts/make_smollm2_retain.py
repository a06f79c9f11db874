"""Write recipes/data/retain/smollm2-135m-instruct.jsonl: SmolLM2's own greedy answers to generic prompts.

    python scripts/get_smollm2.py            # the converted model, once
    python scripts/make_smollm2_retain.py [--model DIR] [--max-new-tokens 28]

A retain set (``eval.retain``) for runs that fine-tune SmolLM2-135M-Instruct: before any fine-tuning the model
answers each of these prompts exactly as written here, so the retain exact match starts at 100% and the
retain loss is the model's own; a fine-tune that changes how it answers everyday questions shows as a drop.
Each answer is the greedy completion the run's evaluation would generate (the chat template, the same greedy
loop, finetune.model.generation.greedy_tokens); prompts whose answer does not end within ``--max-new-tokens``
tokens (the shipped SmolLM2 recipes' eval.max_new_tokens) are left out, so a run compares whole answers.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "recipes" / "data" / "retain" / "smollm2-135m-instruct.jsonl"

PROMPTS = [
    "What is the capital of France?", "What is 2 + 2?", "Name a primary color.", "What color is the sky on a clear day?",
    "How many days are in a week?", "What is the opposite of hot?", "Say hello.", "What is the largest planet?",
    "How many legs does a spider have?", "What is water made of?", "Name a fruit that is yellow.",
    "What do bees make?", "What is the freezing point of water in Celsius?", "Who wrote Romeo and Juliet?",
    "What is the capital of Japan?", "How many continents are there?", "What is 10 times 10?",
    "Translate 'thank you' into Spanish.", "What language is spoken in Brazil?", "What is the square root of 9?",
    "Name an animal that can fly.", "What is the chemical symbol for gold?", "How many hours are in a day?",
    "What gas do plants absorb?", "What is the capital of Italy?", "Give a synonym for happy.",
    "What is the boiling point of water in Celsius?", "How many sides does a triangle have?",
    "What is the first letter of the alphabet?", "Which ocean is the largest?", "What is 5 minus 3?",
    "Name a musical instrument.", "What is the capital of Germany?", "What do cows drink?",
    "What is the tallest animal?", "Which planet is known as the Red Planet?", "What is H2O?",
    "How many minutes are in an hour?", "What is the capital of Spain?", "Name a day of the week.",
    "What is the color of grass?", "Complete: one, two, three, ...", "What is the plural of mouse?",
    "Who painted the Mona Lisa?", "What is the smallest prime number?", "What is the capital of Canada?",
    "Name a season of the year.", "What shape has four equal sides?", "What is 7 plus 8?",
    "What is the main language of the United States?", "Spell the word cat backwards.",
    "What is the capital of England?", "How many months are in a year?", "What is ice made of?",
]


def main() -> None:
    """Generate the answers and write the rows that end within the token limit."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.model.generation import greedy_tokens, left_padded
    from finetune.train.data.formats import Encoder

    sys.path.insert(0, str(ROOT / "scripts"))
    from get_smollm2 import default_dest

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_dest(), help="the converted model (get_smollm2.py)")
    ap.add_argument("--max-new-tokens", type=int, default=28)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    columns = {"text": "text", "instruction": "instruction", "input": "input", "output": "output",
               "messages": "messages", "input_ids": "input_ids", "labels": "labels"}
    encoder = Encoder(tok, "chat", columns, 512, chat_template=tok.chat_template)
    prompts = [
        encoder.encode({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": ""}]}).prompt_ids
        for p in PROMPTS
    ]
    rows = []
    for start in range(0, len(prompts), 8):
        ids, mask = left_padded(prompts[start : start + 8], tok.pad_token_id)
        out = greedy_tokens(model, ids, mask, args.max_new_tokens, nullcontext).tolist()
        for prompt, tokens in zip(PROMPTS[start : start + 8], out, strict=True):
            if tok.eos_token_id not in tokens:
                continue  # no end within the limit: a run would compare a cut answer
            answer = tok.decode(tokens[: tokens.index(tok.eos_token_id)], skip_special_tokens=True).strip()
            rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} of {len(PROMPTS)} prompts answered within {args.max_new_tokens} tokens -> {OUT}")


if __name__ == "__main__":
    main()
