"""Tensor parallelism in the planner: the per-rank model of a TP degree, what it may be, what it sends.

Under ``distributed.tp: N`` the trainer splits every decoder block's linear layers over N ranks of a node as
transformers' ``config.base_model_tp_plan`` says (q/k/v and gate/up column-wise, o_proj and down_proj
row-wise; finetune/train/parallel.py). One rank then holds exactly the block of a model with ``heads / N``
attention heads, ``kv_heads / N`` KV heads and ``intermediate / N`` MLP features, at the same hidden size
and head dimension, while embeddings, norms and the head stay whole (replicated). So the planner's
inventory and its activation traces use that model, :func:`tp_config`: parameters, gradients, optimizer
state and the activations TP splits shrink; the residual stream, norms, embeddings and the head, which TP
replicates, do not (no sequence parallelism).

Communication: each block all-reduces its attention output and its MLP output in forward (B x T x hidden
values each) and the gradients of their inputs in backward: 2 + 2 all-reduces per block per micro-batch,
and 2 more in backward when activation checkpointing recomputes the forward; over the intra-node link.
"""

from __future__ import annotations

import copy
from typing import Any

# The config keys TP divides (Llama, Qwen2, Mistral, Gemma, ... : every architecture whose
# base_model_tp_plan splits q/k/v/o and gate/up/down)
HEADS, KV_HEADS, INTERMEDIATE = "num_attention_heads", "num_key_value_heads", "intermediate_size"
DEGREES = (2, 4, 8, 16)


def head_dim(config: Any) -> int:
    """Per-head width (explicit in the config, else hidden / heads)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // getattr(config, HEADS))


def tp_problem(config: Any, tp: int) -> str | None:
    """Why ``config``'s model cannot be split over ``tp`` ranks (one sentence with the numbers), or None."""
    if tp == 1:
        return None
    arch = (getattr(config, "architectures", None) or [type(config).__name__.replace("Config", "")])[0]
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return (
            f"distributed.tp: {arch} has no tensor-parallel plan in transformers (config.base_model_tp_plan); "
            "set distributed.tp: 1 and shard it with fsdp instead"
        )
    if any(kind not in ("colwise", "rowwise") for kind in plan.values()):
        return (
            f"distributed.tp: {arch}'s tensor-parallel plan uses styles other than colwise/rowwise, which "
            "finetune does not apply; set distributed.tp: 1"
        )
    for key, what in ((HEADS, "attention heads"), (KV_HEADS, "KV heads"), (INTERMEDIATE, "MLP features")):
        n = getattr(config, key, None)
        if n is None:
            return f"distributed.tp: the model's config has no {key}, so tensor parallelism cannot split it; set distributed.tp: 1"
        if n % tp:
            fit = [
                d
                for d in (1, *DEGREES)
                if n % d == 0 and all(getattr(config, k) % d == 0 for k in (HEADS, KV_HEADS))
            ]
            return (
                f"distributed.tp: {tp} does not divide the model's {n} {what} ({key}); "
                f"use a tp that divides it, e.g. {max(fit)}"
            )
    return None


def tp_config(config: Any, tp: int) -> Any:
    """The config whose decoder block is one rank's share of ``config``'s under ``tp``-way TP."""
    if tp == 1:
        return config
    cfg = copy.deepcopy(config)
    cfg.head_dim = head_dim(config)
    for key in (HEADS, KV_HEADS, INTERMEDIATE):
        setattr(cfg, key, getattr(config, key) // tp)
    return cfg


def degrees(config: Any, per_node: int) -> list[int]:
    """The TP degrees worth trying: powers of two up to the GPUs of a node that split the model."""
    return [d for d in DEGREES if d <= per_node and per_node % d == 0 and tp_problem(config, d) is None]


def tp_comm_bytes(
    config: Any,
    tp: int,
    *,
    seq_len: int,
    micro_batch_size: int,
    grad_accum_steps: int,
    compute_bytes: int,
    checkpointing: bool,
) -> int:
    """Bytes each rank sends per optimizer step for TP's all-reduces (ring: 2 (tp-1)/tp of the tensor)."""
    if tp == 1:
        return 0
    per = micro_batch_size * seq_len * config.hidden_size * compute_bytes
    count = (4 + (2 if checkpointing else 0)) * config.num_hidden_layers * grad_accum_steps
    return int(2 * (tp - 1) / tp * per * count)
