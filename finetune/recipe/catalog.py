"""Public config facts of popular models, for planning without weights or network access.

Each entry holds only what ``AutoConfig.for_model`` needs to build the architecture on the meta device:
sizes, vocabulary, attention layout, tying; for a mixture of experts also the experts, how many a token is
routed to, the shared experts and the dense layers before the first expert layer. Weights are never involved.
``finetune.recipe.locate.model_config`` builds the config of a resolved ``model.path`` from these facts when it
names a catalog entry. Each family's comment says where its facts and its published parameter count come
from (``tests/plan/test_catalog.py`` builds every entry on the meta device and checks the count within 2%).
"""

from __future__ import annotations

from typing import Any

_LLAMA31 = {"model_type": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 131072, "tie_word_embeddings": False}
_QWEN25 = {"model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768}
_GEMMA2 = {"model_type": "gemma2", "vocab_size": 256000, "tie_word_embeddings": True, "sliding_window": 4096,
           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "max_position_embeddings": 8192}
# Qwen3 (Qwen3 Technical Report, 2025; the Qwen/Qwen3-* model cards' config.json): 128-wide heads with
# q/k norms, 40960 positions; the three smallest tie the head to the embeddings.
_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "max_position_embeddings": 40960, "dtype": "bfloat16"}
# Qwen3's mixtures of experts (same report and model cards): every layer routes each token to 8 of 128
# experts, softmax over the chosen 8 renormalised (norm_topk_prob), no shared expert, no dense layer.
_QWEN3_MOE = {**_QWEN3, "model_type": "qwen3_moe", "tie_word_embeddings": False, "num_experts": 128,
              "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "router_aux_loss_coef": 0.001}
# gpt-oss (OpenAI's gpt-oss-120b & gpt-oss-20b model card, 2025, and the openai/gpt-oss-* config.json):
# attention with biases and learned sinks, alternating 128-token sliding and full layers, YaRN x32 over 4096;
# a router with a bias picking 4 experts per token, experts with biases (swiglu clamped at 7). The hub ships
# the experts in MXFP4; these entries are the bf16 layout a fine-tune trains (no quantization_config).
_GPT_OSS = {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_experts_per_tok": 4,
            "sliding_window": 128, "max_position_embeddings": 131072, "tie_word_embeddings": False,
            "attention_bias": True, "router_aux_loss_coef": 0.9, "swiglu_limit": 7.0, "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}}
# Gemma 3 (Gemma 3 Technical Report, 2025, Table 1: embedding + non-embedding parameters of the text model;
# google/gemma-3-*-pt config.json's text_config): five 1024-token sliding layers per full one, linear RoPE x8 on
# the full layers, tied head, 262k vocabulary. Text only (gemma3_text): the 417M vision encoder is not counted.
_GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 262208, "head_dim": 256, "query_pre_attn_scalar": 256,
           "sliding_window": 1024, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": True, "dtype": "bfloat16",
           "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}}
# OLMo 2 (2 OLMo 2 Furious, 2025; allenai/OLMo-2-1124-7B, -1124-13B, -0325-32B config.json): q/k norms over
# the whole projection, norms after each sublayer, 100352-token vocabulary, 4096 positions.
_OLMO2 = {"model_type": "olmo2", "vocab_size": 100352, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
          "max_position_embeddings": 4096, "tie_word_embeddings": False, "dtype": "bfloat16"}

_LLAMA4 = {"model_type": "llama4_text", "vocab_size": 202048, "head_dim": 128, "intermediate_size_mlp": 16384,
           "num_experts_per_tok": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "use_qk_norm": True,
           "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "tie_word_embeddings": False,
           "dtype": "bfloat16"}


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
    # Llama 3.3 (meta-llama/Llama-3.3-70B-Instruct's model card: 70B, the Llama 3.1 70B architecture; 70.55B)
    "llama-3.3-70b": _m(_LLAMA31, 8192, 28672, 80, 64, 8, dtype="bfloat16"),
    "qwen2.5-0.5b": _m(_QWEN25, 896, 4864, 24, 14, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": _m(_QWEN25, 1536, 8960, 28, 12, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": _m(_QWEN25, 2048, 11008, 36, 16, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": _m(_QWEN25, 3584, 18944, 28, 28, 4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": _m(_QWEN25, 5120, 13824, 48, 40, 8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": _m(_QWEN25, 5120, 27648, 64, 40, 8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-72b": _m(_QWEN25, 8192, 29568, 80, 64, 8, vocab_size=152064, tie_word_embeddings=False),
    # Qwen3 dense (model cards: 0.6B, 1.7B, 4.0B, 8.2B, 14.8B, 32.8B)
    "qwen3-0.6b": _m(_QWEN3, 1024, 3072, 28, 16, 8, tie_word_embeddings=True),
    "qwen3-1.7b": _m(_QWEN3, 2048, 6144, 28, 16, 8, tie_word_embeddings=True),
    "qwen3-4b": _m(_QWEN3, 2560, 9728, 36, 32, 8, tie_word_embeddings=True),
    "qwen3-8b": _m(_QWEN3, 4096, 12288, 36, 32, 8, tie_word_embeddings=False),
    "qwen3-14b": _m(_QWEN3, 5120, 17408, 40, 40, 8, tie_word_embeddings=False),
    "qwen3-32b": _m(_QWEN3, 5120, 25600, 64, 64, 8, tie_word_embeddings=False),
    # Qwen3 MoE (model cards: 30.5B total / 3.3B active; 235B / 22B): intermediate_size is the (unused) dense
    # width the config carries; every layer's experts are moe_intermediate_size wide
    "qwen3-30b-a3b": _m(_QWEN3_MOE, 2048, 6144, 48, 32, 4, moe_intermediate_size=768),
    "qwen3-235b-a22b": _m(_QWEN3_MOE, 4096, 12288, 94, 64, 4, moe_intermediate_size=1536),
    # gpt-oss (model card: 20.91B total / 3.61B active with 32 experts; 116.83B / 5.13B with 128)
    "gpt-oss-20b": {**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32},
    "gpt-oss-120b": {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128},
    # DeepSeek-V3 (DeepSeek-V3 Technical Report, 2024: 671B total, 37B active; the hub's 685B adds the 14B
    # multi-token-prediction module, which fine-tuning does not train: num_mtp_layers 0). Multi-head latent
    # attention (q rank 1536, kv rank 512, 128 + 64 rope key dims); 3 dense layers, then 58 of 256 routed
    # experts (8 per token, from 4 of 8 groups, sigmoid scores scaled by 2.5) plus one shared expert. The
    # router's weight and its score-correction bias stay fp32 (the model class keeps them so); the hub's FP8
    # block-quantized weights are stored bf16 here, as a fine-tune trains them.
    "deepseek-v3": _m({"model_type": "deepseek_v3", "vocab_size": 129280, "rms_norm_eps": 1e-6,
                       "tie_word_embeddings": False, "max_position_embeddings": 163840, "dtype": "bfloat16",
                       "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                           "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
                      7168, 18432, 61, 128, 128, moe_intermediate_size=2048, n_routed_experts=256,
                      n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
                      norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_mtp_layers=0),
    # Llama 4 text models (Meta's Llama 4 model card, 2025: Scout 17B active / 109B total with 16 experts,
    # Maverick 17B active / 400B total with 128 experts, both counts with the vision encoder, which these text
    # entries leave out; meta-llama/Llama-4-*-17B-*E config.json's text_config): 48 layers, 40 heads over 8 KV
    # heads, q/k norms, RoPE left out of every fourth layer, 8192-token attention chunks; each token goes to one
    # routed expert (8192 wide) plus a shared one. Scout routes in every layer; Maverick in every second, the
    # others dense (16384 wide).
    "llama-4-scout": _m(_LLAMA4, 5120, 8192, 48, 40, 8, num_local_experts=16, interleave_moe_layer_step=1,
                        max_position_embeddings=10485760),
    "llama-4-maverick": _m(_LLAMA4, 5120, 8192, 48, 40, 8, num_local_experts=128, interleave_moe_layer_step=2,
                           max_position_embeddings=1048576),
    "mistral-7b": _m({"model_type": "mistral", "vocab_size": 32768, "rope_theta": 1000000.0, "sliding_window": None,
                      "tie_word_embeddings": False, "max_position_embeddings": 32768}, 4096, 14336, 32, 32, 8, head_dim=128),
    # Mistral Small 3.1 (mistralai/Mistral-Small-3.1-24B-Base-2503: 24B with its vision encoder; its text model,
    # config.json's text_config, is Mistral Small 3's: 23.57B in mistralai/Mistral-Small-24B-Base-2501's weights)
    "mistral-small-3.1-24b": _m({"model_type": "mistral", "vocab_size": 131072, "rope_theta": 1000000000.0,
                                 "sliding_window": None, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
                                 "max_position_embeddings": 131072, "dtype": "bfloat16"},
                                5120, 32768, 40, 32, 8, head_dim=128),
    "gemma-2-2b": _m(_GEMMA2, 2304, 9216, 26, 8, 4, head_dim=256, query_pre_attn_scalar=256),
    "gemma-2-9b": _m(_GEMMA2, 3584, 14336, 42, 16, 8, head_dim=256, query_pre_attn_scalar=256),
    "gemma-2-27b": _m(_GEMMA2, 4608, 36864, 46, 32, 16, head_dim=128, query_pre_attn_scalar=144),
    # Gemma 3 text (Table 1: 675M + 3,209M; 1,012M + 10,759M; 1,416M + 25,600M)
    "gemma-3-4b": _m(_GEMMA3, 2560, 10240, 34, 8, 4),
    "gemma-3-12b": _m(_GEMMA3, 3840, 15360, 48, 16, 8),
    "gemma-3-27b": _m(_GEMMA3, 5376, 21504, 62, 32, 16, head_dim=128, query_pre_attn_scalar=168),
    "phi-3-mini": _m({"model_type": "phi3", "vocab_size": 32064, "tie_word_embeddings": False,
                      "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}, 3072, 8192, 32, 32, 32),
    # Phi-4 (Phi-4 Technical Report, 2024; microsoft/phi-4's config.json: the Phi-3 architecture with fused
    # qkv and gate/up projections, 40 heads over 10 KV heads, a 100352-token vocabulary; 14.7B)
    "phi-4": _m({"model_type": "phi3", "vocab_size": 100352, "tie_word_embeddings": False, "rope_theta": 250000.0,
                 "max_position_embeddings": 16384, "original_max_position_embeddings": 16384, "rms_norm_eps": 1e-5,
                 "dtype": "bfloat16"}, 5120, 17920, 40, 40, 10),
    # OLMo 2 (model cards: 7.30B, 13.7B, 32.2B)
    "olmo-2-7b": _m(_OLMO2, 4096, 11008, 32, 32, 32),
    "olmo-2-13b": _m(_OLMO2, 5120, 13824, 40, 40, 40),
    "olmo-2-32b": _m(_OLMO2, 5120, 27648, 64, 40, 8),
    # SmolLM3 (the SmolLM3 blog post and HuggingFaceTB/SmolLM3-3B's config.json: RoPE left out of every fourth
    # layer (NoPE), 16 heads over 4 KV heads, tied head; 3.08B)
    "smollm3-3b": _m({"model_type": "smollm3", "vocab_size": 128256, "rope_theta": 5000000.0,
                      "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                      "no_rope_layer_interval": 4, "dtype": "bfloat16"}, 2048, 11008, 36, 16, 4),
}

# The hub ids and a few other spellings people use for the same models (hub ids are matched lower-case;
# ``-instruct``, ``-it``, ``-base`` and ``-pt`` suffixes are dropped when the rest is an entry).
ALIASES = {
    "meta-llama/llama-3.1-8b": "llama-3.1-8b", "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/llama-3.1-405b": "llama-3.1-405b", "meta-llama/llama-3.2-1b": "llama-3.2-1b",
    "meta-llama/llama-3.2-3b": "llama-3.2-3b", "mistralai/mistral-7b-v0.3": "mistral-7b",
    "google/gemma-2-2b": "gemma-2-2b", "google/gemma-2-9b": "gemma-2-9b", "google/gemma-2-27b": "gemma-2-27b",
    "microsoft/phi-3-mini-4k-instruct": "phi-3-mini", "huggyllama/llama-65b": "llama-65b",
    "meta-llama/llama-3.3-70b": "llama-3.3-70b",
    "openai/gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-120b": "gpt-oss-120b",
    "deepseek-ai/deepseek-v3": "deepseek-v3", "deepseek-ai/deepseek-v3-0324": "deepseek-v3",
    "google/gemma-3-4b": "gemma-3-4b", "google/gemma-3-12b": "gemma-3-12b", "google/gemma-3-27b": "gemma-3-27b",
    "mistralai/mistral-small-3.1-24b": "mistral-small-3.1-24b",
    "mistralai/mistral-small-3.1-24b-instruct-2503": "mistral-small-3.1-24b",
    "mistralai/mistral-small-3.1-24b-base-2503": "mistral-small-3.1-24b",
    "microsoft/phi-4": "phi-4",
    "allenai/olmo-2-1124-7b": "olmo-2-7b", "allenai/olmo-2-1124-13b": "olmo-2-13b",
    "allenai/olmo-2-0325-32b": "olmo-2-32b",
    "huggingfacetb/smollm3-3b": "smollm3-3b",
    "meta-llama/llama-4-scout-17b-16e": "llama-4-scout", "meta-llama/llama-4-maverick-17b-128e": "llama-4-maverick",
    # Qwen3's 2507 updates: the same architectures
    "qwen3-30b-a3b-instruct-2507": "qwen3-30b-a3b", "qwen3-30b-a3b-thinking-2507": "qwen3-30b-a3b",
    "qwen3-235b-a22b-instruct-2507": "qwen3-235b-a22b", "qwen3-235b-a22b-thinking-2507": "qwen3-235b-a22b",
}


def catalog_name(name: str) -> str | None:
    """The catalog key for ``name`` (case-insensitive, hub ids and -instruct/-base suffixes accepted), or None."""
    key = name.strip().lower()
    if key.startswith("qwen/"):
        key = key[len("qwen/"):]
    for suffix in ("-instruct", "-it", "-base", "-pt"):
        if key.endswith(suffix) and ALIASES.get(key[: -len(suffix)], key[: -len(suffix)]) in CATALOG:
            key = key[: -len(suffix)]
    key = ALIASES.get(key, key)
    return key if key in CATALOG else None
