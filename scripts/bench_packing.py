"""Packed vs padded batches on a mixed-length dataset: padding waste and training tokens/s, and their ratio.

    python scripts/bench_packing.py [--samples 2000] [--max-seq-len 256] [--batch 8] [--steps 8] [--attn sdpa]

Writes a text dataset whose lengths are spread like real data (many short samples, a few long ones), loads it
twice through the real pipeline (finetune.train.data.load_data: data.packing false, then true), and trains the
tiny Llama (random init, fp32) for the same number of steps on each, counting only real (non-padding) tokens.
Padded micro-batches are padded to their longest sample; packed rows hold several samples each.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "models" / "tiny-llama"


def write_dataset(path: Path, n: int, max_len: int, seed: int = 0) -> None:
    """``n`` texts, lengths log-uniform between 8 and ``max_len`` characters (one token per byte)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            length = round(8 * (max_len / 8) ** rng.random()) - 1
            f.write(
                json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(max(length, 1)))}) + "\n"
            )


def train_steps(model, stream, steps: int, batch: int) -> tuple[int, float]:
    """Real tokens and seconds for ``steps`` optimizer steps (the first step is a warm-up, not timed)."""
    import torch

    from finetune.objectives.loss import causal_lm_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens, seconds = 0, 0.0
    for step in range(steps + 1):
        at = step % stream.steps_per_epoch
        (mb,) = stream.micro_batches(0, at, rank=0, world_size=1, micro_batch_size=batch)
        start = time.perf_counter()
        loss_sum, n = causal_lm_loss(model, mb)
        (loss_sum / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:
            seconds += time.perf_counter() - start
            tokens += sum(len(r.input_ids) for r in stream.rank_rows(0, at, rank=0, world_size=1))
    return tokens, seconds


def main() -> None:
    """Run both, print one line each and the ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="micro-batch = global batch (rows or samples)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from finetune.recipe.schema import recipe_from_dict
    from finetune.train.data import BatchStream, load_data

    tok = AutoTokenizer.from_pretrained(TINY)
    config = LlamaConfig(**json.loads((TINY / "config.json").read_text()))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_file = Path(tmp) / "mixed.jsonl"
        write_dataset(data_file, args.samples, args.max_seq_len)
        for packing in (False, True):
            raw = {
                "model": {"path": str(TINY)},
                "data": {
                    "train": str(data_file),
                    "format": "text",
                    "max_seq_len": args.max_seq_len,
                    "packing": packing,
                    "cache_dir": str(Path(tmp) / "cache"),
                },
            }
            data = load_data(recipe_from_dict(raw), tok)
            stream = BatchStream(data.train, args.batch, seed=0, pad_id=tok.pad_token_id)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation=args.attn, dtype=torch.float32
            )
            tokens, seconds = train_steps(model, stream, args.steps, args.batch)
            waste = stream.padding_fraction(args.batch)
            name = "packed" if packing else "padded"
            results[name] = tokens / seconds
            print(
                f"{name}: {data.stats['train']} rows of {data.stats['train_samples']} samples, padding waste "
                f"{100 * waste:.1f}%, {tokens} real tokens in {seconds:.2f}s = {tokens / seconds:,.0f} tokens/s"
            )
    print(f"packed / padded tokens/s: {results['packed'] / results['padded']:.2f}x")


if __name__ == "__main__":
    main()
