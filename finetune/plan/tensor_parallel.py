"""Tensor parallelism in the planner: the per-rank model of a TP degree, what it may be, what it sends.

Under ``distributed.tp: N`` the trainer splits every decoder block's linear layers over N ranks of a node as
transformers' ``config.base_model_tp_plan`` says (q/k/v and gate/up column-wise, o_proj and down_proj
row-wise; finetune/train/parallel/parallelize.py). One rank then holds exactly the block of a model with ``heads / N``
attention heads, ``kv_heads / N`` KV heads and ``intermediate / N`` MLP features, at the same hidden size
and head dimension, while embeddings, norms and the head stay whole (replicated). So the planner's
inventory and its activation traces use that model, :func:`tp_config`: parameters, gradients, optimizer
state and the activations TP splits shrink; the residual stream, norms, embeddings and the head, which TP
replicates, do not, unless sequence parallelism (``distributed.sequence_parallel``, on by default) splits
them over the sequence: the trace then runs rank 0's share of it (:func:`sequence_parallel_trace`), where
the norms' inputs and outputs, the residual adds, the embeddings' output and the head's rows take 1/tp
while the inputs the column-parallel linears keep for backward (gathered) stay whole.

Communication: each block all-reduces its attention output and its MLP output in forward (B x T x hidden
values each) and the gradients of their inputs in backward: 2 + 2 all-reduces per block per micro-batch,
and 2 more in backward when activation checkpointing recomputes the forward; over the intra-node link.
Sequence parallelism turns each all-reduce into an all-gather and a reduce-scatter of the same tensor: the
same bytes in a ring (:func:`tp_comm_bytes`).
"""

from __future__ import annotations

import copy
from typing import Any

from finetune.plan.config import config_class_name

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
    arch = (getattr(config, "architectures", None) or [config_class_name(config).replace("Config", "")])[0]
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
    sequence_parallel: bool = False,
    head_trained: bool = False,
    layers: int | None = None,
    first: bool = True,
    last: bool = True,
) -> int:
    """Bytes each rank sends per optimizer step for TP's collectives (ring: an all-reduce sends 2 (tp-1)/tp of
    the tensor, an all-gather or a reduce-scatter (tp-1)/tp), over ``layers`` decoder layers (the model's, or a
    pipeline rank's) and the embeddings' and the head's collectives where the rank holds them (``first``,
    ``last``).

    Without sequence parallelism: 4 all-reduces per block per micro-batch (6 with recomputation). With it,
    each all-reduce becomes an all-gather and a reduce-scatter, the same bytes; what it adds is the all-gather
    of the embeddings' output gradient and, when the head is trained, the all-reduce of its fp32 gradient
    (each rank computes it from its own rows), both per micro-batch.
    """
    if tp == 1:
        return 0
    per = micro_batch_size * seq_len * config.hidden_size * compute_bytes
    blocks = config.num_hidden_layers if layers is None else layers
    count = (4 + (2 if checkpointing else 0)) * blocks * grad_accum_steps
    total = 2 * (tp - 1) / tp * per * count
    if sequence_parallel:
        total += (tp - 1) / tp * per * grad_accum_steps if first else 0
        if head_trained and last:
            total += 2 * (tp - 1) / tp * config.vocab_size * config.hidden_size * 4 * grad_accum_steps
    return int(total)


def sequence_parallel_trace(model: Any, ranks: int, seq_len: int) -> Any:
    """Hooks that make a fake-tensor trace of one TP rank's model (:func:`tp_config`) hold what sequence
    parallelism holds on rank 0 of ``ranks``; returns a context that installs them (and the head's
    :class:`~finetune.objectives.loss.SequenceShard`) and removes them after.

    The trainer's layout (finetune/train/parallel/parallelize.py) on plain tensors: the first decoder block's input is cut
    to the rank's ``ceil(seq_len / ranks)`` positions (the embedding's output split over the sequence), so the
    norms and residual adds of every block, the final norm and the fused head and loss run on them; the module
    around the column-parallel linears (attention, MLP) gathers a new whole-sequence tensor (the all-gather,
    which q/k/v and gate/up keep for backward), and each row-parallel linear's output is cut back to the rank's
    positions (the reduce-scatter). The rotary table and the attention see whole sequences, as in the run.
    """
    import contextlib
    import re

    import torch

    from finetune.model.adapters import base_model_of
    from finetune.objectives.loss import SEQUENCE_SHARD, SequenceShard
    from finetune.plan.shapes import decoder_layer_names

    base = base_model_of(model)
    decoder = getattr(base, base.base_model_prefix, base)
    local = -(-seq_len // ranks)
    names = [n for n, _ in decoder.named_modules()]
    colwise_parents, rowwise = set(), set()
    for pattern, kind in (getattr(base.config, "base_model_tp_plan", None) or {}).items():
        rx = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        for n in names:
            if rx.fullmatch(n):
                (colwise_parents.add(n.rpartition(".")[0]) if kind == "colwise" else rowwise.add(n))
    prefix = base.base_model_prefix + "."
    blocks = [n.removeprefix(prefix) for n in decoder_layer_names(base)]

    def cut(x: Any) -> Any:  # this rank's positions, a tensor of their own (DTensor's chunk, made contiguous)
        return x.chunk(ranks, dim=1)[0].contiguous() if x.shape[1] > local else x

    def first_block(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (cut(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": cut(kwargs["hidden_states"])}

    def gather(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def whole(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != local:
                return x
            return torch.cat([x] * ranks, dim=1)[:, :seq_len]

        return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}

    @contextlib.contextmanager
    def installed() -> Any:
        handles = [decoder.get_submodule(blocks[0]).register_forward_pre_hook(first_block, with_kwargs=True)]
        handles += [
            decoder.get_submodule(n).register_forward_pre_hook(gather, with_kwargs=True) for n in colwise_parents
        ]
        handles += [
            decoder.get_submodule(n).register_forward_hook(lambda m, a, out: out[:, :local].clone())
            for n in rowwise
        ]
        # the final norm hands the head the rank's rows inside the loss, the whole sequence to other forwards
        # (the preference objectives' log-probabilities), as SequenceShard.hand_over does in the run
        shard = SequenceShard(rank=0, size=ranks, group=None)
        handles += [
            m.register_forward_hook(lambda m, a, out: out if shard.local else gather(m, (out,), {})[0][0])
            for _, m in decoder.named_children()
            if "Norm" in type(m).__name__
        ]
        head = base.get_output_embeddings()
        setattr(head, SEQUENCE_SHARD, shard)
        try:
            yield
        finally:
            delattr(head, SEQUENCE_SHARD)
            for h in handles:
                h.remove()

    return installed()
