"""GPT-2 (Conv1D, tied head) vs Llama under bf16 autocast: finetune's training step against a plain
transformers step (model(...).loss, backward, AdamW) on the same batch; peak tensor memory by MemTracker.

    python scripts/bench_gpt2_bf16.py
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from finetune.objectives.loss import causal_lm_loss
from finetune.train.metrics.memory import PeakMemory

B, T, V = 4, 256, 8192


def peak(arch: str, ours: bool) -> int:
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=V, n_embd=256, n_layer=4, n_head=4, n_positions=T)
    else:
        cfg = LlamaConfig(vocab_size=V, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, V, (B, T))
    pk = PeakMemory("cpu", modules=(model,), optimizer=opt)
    with pk:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if ours:
                loss = causal_lm_loss(model, {"input_ids": ids, "labels": ids})[0]
            else:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return pk.measured_peak_bytes


if __name__ == "__main__":
    torch.set_num_threads(1)
    for arch in ("gpt2", "llama-tied"):
        plain, ours = peak(arch, False), peak(arch, True)
        print(f"{arch:10s} transformers step {plain / 2**20:8.2f} MiB | finetune step {ours / 2**20:8.2f} MiB | "
              f"ratio {ours / plain:.3f}")
