"""grpo's rollout memory per rank: what sampling the step's completions and scoring them adds to the step.

A rank samples its share of the global batch's completions (``rows``: micro-batch x accumulation) in one batch
with a KV cache (finetune/train/rollout.py), then scores each micro-batch without gradients for the old policy's
log-probabilities (grpo.num_iterations above 1) and the reference's (grpo.beta above 0), which stay through the
step (rows x width fp32 values each). The rollout's transients, which the step's activations do not overlap (they
are freed before its first forward), are the larger of:

    generation  the traced peak of the KV-cache generation of ``rows`` prompts (finetune/plan/evaluation.py's
                eval_peak: the cache at its full width, one layer's working set of the prefill, the prompt's
                logits), with the sampler's fp32 softmax of the last position
    scoring     one micro-batch's logits in the compute dtype and in fp32 (the log-softmax of
                :func:`finetune.objectives.grpo.token_logps`)

``rollout`` in the plan is the kept log-probabilities plus what those transients exceed the step's activations by:
the step's peak is the larger of the two phases. Widths: a prompt of data.max_seq_len tokens at most, then
grpo.max_completion_length.

Time (:func:`rollout_seconds`): 2 FLOPs per parameter per token at the time model's compute rate, for every row's
prompt once, each sampled token, and each scoring pass over the whole row; one batch of completions serves
grpo.num_iterations steps, so a step's share is that over num_iterations.
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


def rollout_parts(
    config: Any, *, rows: int, micro_batch_size: int, prompt_len: int, completion_len: int, compute_bytes: int,
    old_logps: bool, ref_logps: bool, generation: int | None = None, tp: int = 1,
) -> tuple[int, int]:
    """(kept, transient) bytes per rank of the rollout (module docstring): the kept log-probabilities, and the
    larger of the generation's and the scoring's transients. ``generation``: the traced generation peak of
    ``rows`` prompts; None counts its KV cache and the prompt's logits alone."""
    vocab = int(_cfg(config, "vocab_size", 1))
    width = prompt_len + completion_len
    if generation is None:
        kv = rows * width * kv_bytes_per_token(config, compute_bytes, tp)
        generation = kv + rows * prompt_len * vocab * compute_bytes
    sampling = generation + rows * vocab * 4
    scoring = micro_batch_size * width * vocab * (compute_bytes + 4) if (old_logps or ref_logps) else 0
    kept = rows * width * 4 * (int(old_logps) + int(ref_logps))
    return kept, max(sampling, scoring)


def rollout_bytes(
    config: Any, *, rows: int, micro_batch_size: int, prompt_len: int, completion_len: int, compute_bytes: int,
    old_logps: bool, ref_logps: bool, activations: int, generation: int | None = None, tp: int = 1,
) -> int:
    """The plan's ``rollout`` bytes per rank (module docstring): the kept log-probabilities and what the
    transients exceed the step's ``activations`` by."""
    kept, transient = rollout_parts(
        config, rows=rows, micro_batch_size=micro_batch_size, prompt_len=prompt_len, completion_len=completion_len,
        compute_bytes=compute_bytes, old_logps=old_logps, ref_logps=ref_logps, generation=generation, tp=tp,
    )
    return kept + max(0, transient - activations)


def rollout_seconds(
    params: int, *, rows: int, prompt_len: int, completion_len: int, scoring_passes: int, num_iterations: int,
    rate: float,
) -> float:
    """A step's share of the rollout's seconds per rank (module docstring): ``params`` the model's parameters
    (a frozen reference copy scores with as many), ``rate`` the FLOP/s the time model assumes."""
    if rate <= 0:
        return 0.0
    width = prompt_len + completion_len
    tokens = rows * width * (1 + scoring_passes)  # generation: the prompt once, then each sampled token
    return 2.0 * params * tokens / rate / max(1, num_iterations)
