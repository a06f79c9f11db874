"""What can prefix tuning (and prompt tuning) learn on the quickstart model? A small in-process sweep.

Trains peft prefix tuning on recipes/quickstart-prefix.yaml's base and data (run recipes/quickstart.yaml
first) with the trainer's own pieces (finetune.objectives.loss.causal_lm_loss, finetune.model.adapters.inject,
finetune.model.generation.greedy_tokens), AdamW with warmup + cosine like the trainer, and prints the loss curve,
exact match on the held-out words, how many answers are right ignoring case, how many are all capitals,
and a few generations. One line per setting, so settings can be compared side by side:

    python scripts/prefix_probe.py --tokens 16 --projection --lr 1e-2 --steps 150
    python scripts/prefix_probe.py --tokens 32 --lr 5e-2 --steps 100
    python scripts/prefix_probe.py --tokens 16 --lr 1e-2 --init-from-text   # Li & Liang: real tokens' K/V

``--method prompt`` trains prompt tuning's virtual token embeddings (the input only) on the same task instead;
``--init-text TEXT`` starts them from the base's embeddings of TEXT's tokens (prompt.init: text):

    python scripts/prefix_probe.py --method prompt --tokens 32 --lr 1e-1 --steps 300
    python scripts/prefix_probe.py --method prompt --tokens 32 --lr 1e-1 --init-text "Reverse the letters."

On quickstart-lora.yaml's task (reversed words in capitals) pass `--recipe` a copy of the prefix recipe with
data/reverse-upper/. The figures of both tasks are in docs/benchmarks.md ("Prefix tuning").
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import time
import warnings
from typing import Any


def _first_tokens(examples: list[Any], tokens: int) -> list[int]:
    """The first ``tokens`` token ids of the training examples, in order (what --init-from-text starts from)."""
    ids: list[int] = []
    for e in examples:
        ids += list(e.input_ids)
        if len(ids) >= tokens:
            break
    return ids[:tokens]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/quickstart-prefix.yaml")
    ap.add_argument("--tokens", type=int, default=16, help="prefix.num_virtual_tokens")
    ap.add_argument("--projection", action="store_true", help="prefix.projection (2-layer MLP)")
    ap.add_argument("--hidden", type=int, default=256, help="prefix.projection_hidden")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--init-from-text", action="store_true", help="start from real tokens' keys/values")
    ap.add_argument("--method", choices=("prefix", "prompt"), default="prefix")
    ap.add_argument("--init-text", help="prompt: start the virtual tokens from this text's token embeddings")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    import torch
    from transformers import AutoModelForCausalLM

    from finetune.model.adapters import init_prefix_from_text, init_prompt_from_text, prefix_text_ids
    from finetune.model.generation import greedy_tokens, left_padded
    from finetune.model.methods import inject
    from finetune.objectives.loss import causal_lm_loss
    from finetune.recipe.schema import load_recipe
    from finetune.spec import AdapterSpec
    from finetune.train.data import load_data
    from finetune.train.data.batches import collate
    from finetune.train.model.build import load_tokenizer, resolve_model_path

    loaded = load_recipe(args.recipe)
    tok = load_tokenizer(loaded)
    data = load_data(loaded, tok)
    train = list(data.train)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(loaded), dtype=torch.float32)
    if args.method == "prompt":
        spec = AdapterSpec(kind="prompt", num_virtual_tokens=args.tokens, prompt_init_text=args.init_text)
    else:
        spec = AdapterSpec(
            kind="prefix",
            num_virtual_tokens=args.tokens,
            projection=args.projection,
            projection_hidden=args.hidden if args.projection else None,
        )
    model = inject(base, spec)
    if args.method == "prompt" and args.init_text:
        init_prompt_from_text(model, prefix_text_ids(args.init_text, tok, args.tokens, "prompt"))
    if args.init_from_text:
        if args.projection:
            raise SystemExit("--init-from-text sets the prefix itself: use it without --projection")
        init_prefix_from_text(model, _first_tokens(train, args.tokens))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warm = 20

    def schedule(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, args.steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    prompts = data.eval_prompts

    def evaluate() -> tuple[int, int, int, list[tuple[str, str]]]:
        """Exact, right-ignoring-case and all-capitals answers on the held-out words, and a few samples."""
        model.eval()
        exact = ignoring_case = capitals = 0
        samples: list[tuple[str, str]] = []
        for i in range(0, len(prompts), 50):
            chunk = prompts[i : i + 50]
            ids, mask = left_padded([p.prompt_ids for p in chunk], tok.pad_token_id)
            out = greedy_tokens(model, ids, mask, loaded.recipe.eval.max_new_tokens, contextlib.nullcontext)
            for p, row in zip(chunk, out.tolist(), strict=True):
                row = row[: row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
                text, want = tok.decode(row, skip_special_tokens=True).strip(), p.answer.strip()
                exact += text == want
                ignoring_case += text.lower() == want.lower()
                capitals += text.isupper()
                if len(samples) < 4:
                    samples.append((want, text))
        model.train()
        return exact, ignoring_case, capitals, samples

    before = evaluate()[0]
    rng = random.Random(0)
    cpu0, wall0 = time.process_time(), time.time()
    curve = []
    model.train()
    for step in range(args.steps):
        s, n = causal_lm_loss(model, collate(rng.sample(train, args.batch), tok.pad_token_id))
        (s / n).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 25 == 0:
            curve.append(f"{step + 1}:{float(s / n):.3f}")
    cpu, wall = time.process_time() - cpu0, time.time() - wall0
    exact, ignoring_case, capitals, samples = evaluate()
    n = len(prompts)
    init = repr(args.init_text) if args.init_text else "text" if args.init_from_text else "random"
    print(
        f"{args.method} tokens {args.tokens} projection {args.projection} lr {args.lr:g} steps {args.steps} "
        f"init {init} | loss {' '.join(curve)} | exact match {100 * before / n:.1f}% -> "
        f"{100 * exact / n:.1f}% | ignoring case {100 * ignoring_case / n:.1f}% | all capitals "
        f"{100 * capitals / n:.1f}% | cpu {cpu:.0f} s wall {wall:.0f} s | e.g. {samples}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
