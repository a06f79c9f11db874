"""The planner against GPU peaks others published: litgpt's resource tables (LoRA and QLoRA on one A100).

Each row pins the publisher's settings in a `finetune plan` of the same model on the same GPU and compares the
plan's tensor memory (its total less the runtime overhead: what ``torch.cuda.max_memory_allocated`` measures,
which litgpt prints as "Max GPU RAM", in GB of 1e9 bytes) with the published figure. No GPU and no weights: the
models are their configs.

litgpt's resource tables (tutorials/resource-tables.md, 10/20/2023, commit 8641822; A100-SXM4-40GB, PyTorch
2.1.0, bitsandbytes 0.41.1): ``finetune/lora.py`` with ``--precision bf16-true`` (every tensor bf16, the adapters
too: precision bf16-pure with lora.dtype bf16 here), LoRA r 8, alpha 16, dropout 0.05 on the query and value
projections, a minibatch of 128 (gradient accumulation), no activation checkpointing, rows as long as Alpaca's
longest (1044 tokens for phi-1.5, 1304 for Llama 2). QLoRA: ``--quantize bnb.nf4`` (no double quantization) or
``bnb.nf4-dq``. Where the two tools differ, the plan is of this tool's run: litgpt's bitsandbytes plugin
quantizes the output head too (this tool keeps it in bf16: +0.19 GB on Llama 2 7B) and its loss materialises
the logits (this tool's fused head does not).

    python scripts/published_peaks.py                 # the table, median and worst |error|
    python scripts/published_peaks.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = {
    "phi-1.5": {"model_type": "phi", "vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192,
                "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
                "partial_rotary_factor": 0.5, "max_position_embeddings": 2048, "hidden_act": "gelu_new",
                "layer_norm_eps": 1e-5, "tie_word_embeddings": False, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attention_dropout": 0.0, "rope_theta": 10000.0},
    "llama-2-7b": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                   "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    "llama-2-13b": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824,
                    "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
                    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
}
TOKENS = {"phi-1.5": 1044, "llama-2-7b": 1304, "llama-2-13b": 1304}

# (model, quantization: None | nf4 | nf4-dq, micro-batch, published Max GPU RAM in GB)
LITGPT = [
    ("phi-1.5", None, 1, 4.82), ("phi-1.5", "nf4", 1, 3.78), ("phi-1.5", "nf4-dq", 1, 3.72),
    ("phi-1.5", None, 2, 6.76), ("phi-1.5", None, 4, 10.68),
    ("llama-2-7b", None, 1, 21.30), ("llama-2-7b", "nf4", 1, 14.14), ("llama-2-7b", "nf4-dq", 1, 13.84),
    ("llama-2-7b", None, 2, 29.07),
    ("llama-2-13b", None, 1, 38.12), ("llama-2-13b", "nf4", 1, 23.14), ("llama-2-13b", "nf4-dq", 1, 22.55),
]


def row_name(model: str, quant: str | None, mbs: int) -> str:
    """The table's label of a row."""
    return f"litgpt {model} {'lora' if quant is None else 'qlora ' + quant} mb{mbs}"


def plan_row(model: str, quant: str | None, mbs: int, root: Path) -> int:
    """The plan's tensor bytes (total less overhead) for one row of litgpt's table."""
    from finetune.plan.command import PlanOptions, build_plan

    d = root / model
    if not d.exists():
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(MODELS[model]))
    sets = [
        "lora.r=8", "lora.alpha=16", "lora.dropout=0.05", "lora.target_modules=[q_proj,v_proj]", "lora.dtype=bf16",
        "train.activation_checkpointing=false", "train.optimizer=adamw", "distributed.strategy=single",
    ]
    if quant is not None:
        sets += ["quantization.bits=4", "quantization.quant_type=nf4",
                 f"quantization.double_quant={'true' if quant == 'nf4-dq' else 'false'}"]
    plan = build_plan(PlanOptions(
        model=str(d), overrides=tuple(sets), method="lora" if quant is None else "qlora", precision="bf16-pure",
        seq_len=TOKENS[model], micro_batch_size=mbs, global_batch_size=128, gpus=1, gpu_memory="40GiB",
        gpu_type="a100-40gb", host_memory="1TiB",
    ))
    m = plan.chosen.memory
    return int(m.total - m.overhead)


def run(rows: list[tuple[str, str | None, int, float]] = LITGPT) -> list[dict]:
    """Every row's plan against its published peak."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, quant, mbs, published in rows:
            pred = plan_row(model, quant, mbs, Path(tmp))
            out.append({"row": row_name(model, quant, mbs), "predicted_gb": pred / 1e9, "published_gb": published,
                        "error": (pred / 1e9 - published) / published})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = run()
    for r in rows:
        print(f"{r['row']:36s} plan {r['predicted_gb']:6.2f} GB  published {r['published_gb']:6.2f} GB  "
              f"error {100 * r['error']:+6.1f}%", flush=True)
    errs = [abs(r["error"]) for r in rows]
    print(f"\n{len(rows)} rows: median |error| {100 * statistics.median(errs):.1f}%, worst {100 * max(errs):.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
