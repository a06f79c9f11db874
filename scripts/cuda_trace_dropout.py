"""LoRA dropout in a GPU plan: what one decoder layer keeps in the planner's trace for a CPU and for a GPU.

CUDA's fused dropout keeps a 1-byte mask per element where the CPU keeps a noise tensor of the input's dtype
(finetune/plan/cuda_trace.py). Llama-2-7B's config, LoRA r 8 on q_proj and v_proj with dropout 0.05, one row of
1304 tokens, with fp32 adapters under bf16 autocast and with bf16 adapters (lora.dtype: bf16) under bf16-pure;
fake tensors only.

    python scripts/cuda_trace_dropout.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LLAMA_2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
TOKENS = 1304


def main() -> int:
    from transformers import AutoConfig

    from finetune.plan.activations import TraceSpec, trace_windows
    from finetune.recipe.schema import LoraConfig
    from finetune.spec import execution_spec

    facts = dict(LLAMA_2_7B)
    cfg = AutoConfig.for_model(facts.pop("model_type"), **facts)
    layers = LLAMA_2_7B["num_hidden_layers"]
    print(f"{'adapters':9s} {'precision':10s} {'CPU - CUDA per layer':>22s} {'per token':>10s} {f'{layers} layers':>10s}")
    for dtype, precision in (("fp32", "bf16"), ("bf16", "bf16-pure")):
        lora = LoraConfig(r=8, alpha=16, dropout=0.05, target_modules=["q_proj", "v_proj"], dtype=dtype)
        spec = execution_spec("lora", "single", precision, checkpointing=False, lora=lora)
        kept = {}
        for device in ("cpu", "cuda"):
            trace = TraceSpec.of(spec, seq_len=TOKENS, packed=False, attn_implementation="sdpa", device=device)
            kept[device] = trace_windows(cfg, trace, 2, 1).layer_acts
        diff = kept["cpu"] - kept["cuda"]
        print(f"{dtype:9s} {precision:10s} {diff:20,d} B {diff / TOKENS / 1024:7.1f} KiB {layers * diff / 1e9:7.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
