"""Write the built-in tiny model: a Llama-architecture config.json and a byte-level tokenizer.

    python scripts/make_tiny_model.py            # writes recipes/models/tiny-llama/

The tokenizer is a byte-level BPE with no merges: one token per UTF-8 byte, plus <pad>, <s>, </s>.
Nothing is downloaded; the weights are built from the config and a seed at run time (model.init: random).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

OUT = Path(__file__).resolve().parent.parent / "recipes" / "models" / "tiny-llama"
SPECIALS = ["<pad>", "<s>", "</s>"]

# A chat template for data.format: chat (role: content lines; the assistant turn ends with </s>).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ 'System: ' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    """A byte-level tokenizer: 256 byte tokens after the special tokens, no merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(SPECIALS)
    return tok


def main() -> None:
    """Write config.json, generation_config.json and the tokenizer files."""
    OUT.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(OUT / "tokenizer.json"))
    vocab_size = 264  # 259 tokens, padded to a multiple of 8
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (OUT / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}, indent=2) + "\n"
    )
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (OUT / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2) + "\n"
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
