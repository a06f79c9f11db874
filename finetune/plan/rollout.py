"""grpo's rollout memory per rank: what sampling the step's completions and scoring them adds to the step.

A rank samples its share of the global batch's completions (``rows``: micro-batch x accumulation) in one batch
with a KV cache (finetune/train/rollout.py), then scores each micro-batch without gradients for the old policy's
log-probabilities (grpo.num_iterations above 1) and the reference's (grpo.beta above 0), which stay on the device
through the step (rows x width fp32 values each). The rollout's transients, which the step's activations do not
overlap (they are freed before its first forward), are the largest of:

    prefill    the KV cache of every row at its full width, and the prompt's logits (rows x prompt x vocab, in
               the compute dtype, as transformers returns them) with the sampler's fp32 softmax of the last position
    scoring    one micro-batch's logits in the compute dtype and in fp32 (the log-softmax of
               :func:`finetune.objectives.grpo.token_logps`)

``rollout`` in the plan is the kept log-probabilities plus what those transients exceed the step's activations by:
the step's peak is the larger of the two phases. Widths: a prompt of data.max_seq_len tokens at most, then
grpo.max_completion_length.
"""

from __future__ import annotations

from typing import Any


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, None)
    if value is None and getattr(config, "text_config", None) is not None:
        value = getattr(config.text_config, name, None)
    return default if value is None else value


def kv_bytes_per_token(config: Any, compute_bytes: int, tp: int = 1) -> int:
    """Bytes of one token's keys and values over every decoder layer (this TP rank's heads)."""
    layers = int(_cfg(config, "num_hidden_layers", 1))
    heads = int(_cfg(config, "num_attention_heads", 1))
    kv_heads = int(_cfg(config, "num_key_value_heads", heads))
    head_dim = int(_cfg(config, "head_dim", None) or _cfg(config, "hidden_size", heads) // heads)
    return 2 * layers * max(1, kv_heads // max(1, tp)) * head_dim * compute_bytes


def rollout_bytes(
    config: Any, *, rows: int, micro_batch_size: int, prompt_len: int, completion_len: int, compute_bytes: int,
    old_logps: bool, ref_logps: bool, activations: int, tp: int = 1,
) -> int:
    """The plan's ``rollout`` bytes per rank (module docstring)."""
    vocab = int(_cfg(config, "vocab_size", 1))
    width = prompt_len + completion_len
    kv = rows * width * kv_bytes_per_token(config, compute_bytes, tp)
    prefill = kv + rows * prompt_len * vocab * compute_bytes + rows * vocab * 4
    scoring = micro_batch_size * width * vocab * (compute_bytes + 4) if (old_logps or ref_logps) else 0
    kept = rows * width * 4 * (int(old_logps) + int(ref_logps))
    return kept + max(0, max(prefill, scoring) - activations)
