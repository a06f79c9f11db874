"""Public config facts of popular models, for planning without weights or network access.

Each entry holds only what ``AutoConfig.for_model`` needs to build the architecture on the meta device:
sizes, vocabulary, attention layout, tying. Weights are never involved. ``finetune.locate.model_config``
builds the config of a resolved ``model.path`` from these facts when it names a catalog entry.
"""

from __future__ import annotations

from typing import Any

_LLAMA31 = {"model_type": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 131072, "tie_word_embeddings": False}
_QWEN25 = {"model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768}
_GEMMA2 = {"model_type": "gemma2", "vocab_size": 256000, "tie_word_embeddings": True, "sliding_window": 4096,
           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "max_position_embeddings": 8192}


def _m(base: dict[str, Any], h: int, i: int, n: int, heads: int, kv: int, **extra: Any) -> dict[str, Any]:
    return {**base, "hidden_size": h, "intermediate_size": i, "num_hidden_layers": n,
            "num_attention_heads": heads, "num_key_value_heads": kv, **extra}


CATALOG: dict[str, dict[str, Any]] = {
    # LLaMA (2023): the QLoRA paper's 65B
    "llama-65b": _m({"model_type": "llama", "vocab_size": 32000, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                     "tie_word_embeddings": False}, 8192, 22016, 80, 64, 64),
    "llama-3.1-8b": _m(_LLAMA31, 4096, 14336, 32, 32, 8),
    "llama-3.1-70b": _m(_LLAMA31, 8192, 28672, 80, 64, 8),
    "llama-3.1-405b": _m(_LLAMA31, 16384, 53248, 126, 128, 8),
    "llama-3.2-1b": _m(_LLAMA31, 2048, 8192, 16, 32, 8, head_dim=64, tie_word_embeddings=True),
    "llama-3.2-3b": _m(_LLAMA31, 3072, 8192, 28, 24, 8, head_dim=128, tie_word_embeddings=True),
    "qwen2.5-0.5b": _m(_QWEN25, 896, 4864, 24, 14, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": _m(_QWEN25, 1536, 8960, 28, 12, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": _m(_QWEN25, 2048, 11008, 36, 16, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": _m(_QWEN25, 3584, 18944, 28, 28, 4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": _m(_QWEN25, 5120, 13824, 48, 40, 8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": _m(_QWEN25, 5120, 27648, 64, 40, 8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-72b": _m(_QWEN25, 8192, 29568, 80, 64, 8, vocab_size=152064, tie_word_embeddings=False),
    "mistral-7b": _m({"model_type": "mistral", "vocab_size": 32768, "rope_theta": 1000000.0, "sliding_window": None,
                      "tie_word_embeddings": False, "max_position_embeddings": 32768}, 4096, 14336, 32, 32, 8, head_dim=128),
    "gemma-2-2b": _m(_GEMMA2, 2304, 9216, 26, 8, 4, head_dim=256, query_pre_attn_scalar=256),
    "gemma-2-9b": _m(_GEMMA2, 3584, 14336, 42, 16, 8, head_dim=256, query_pre_attn_scalar=256),
    "gemma-2-27b": _m(_GEMMA2, 4608, 36864, 46, 32, 16, head_dim=128, query_pre_attn_scalar=144),
    "phi-3-mini": _m({"model_type": "phi3", "vocab_size": 32064, "tie_word_embeddings": False,
                      "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}, 3072, 8192, 32, 32, 32),
}

# A few spellings people use for the same models.
ALIASES = {
    "meta-llama/llama-3.1-8b": "llama-3.1-8b", "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/llama-3.1-405b": "llama-3.1-405b", "meta-llama/llama-3.2-1b": "llama-3.2-1b",
    "meta-llama/llama-3.2-3b": "llama-3.2-3b", "mistralai/mistral-7b-v0.3": "mistral-7b",
    "google/gemma-2-2b": "gemma-2-2b", "google/gemma-2-9b": "gemma-2-9b", "google/gemma-2-27b": "gemma-2-27b",
    "microsoft/phi-3-mini-4k-instruct": "phi-3-mini", "huggyllama/llama-65b": "llama-65b",
}


def catalog_name(name: str) -> str | None:
    """The catalog key for ``name`` (case-insensitive, hub ids and -instruct suffixes accepted), or None."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key.startswith("qwen/"):
        key = key[len("qwen/"):]
    for suffix in ("-instruct", "-it"):
        if key.endswith(suffix) and key[: -len(suffix)] in CATALOG:
            key = key[: -len(suffix)]
    return key if key in CATALOG else None
