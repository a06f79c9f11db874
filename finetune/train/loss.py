"""The training objective, shared by the trainer and the planner's activation tracer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shifted_labels(batch: dict[str, Any]) -> torch.Tensor:
    """Labels shifted one position left: position t holds the token that logits at t must predict.

    For packed rows (position_ids given, no attention mask) the first token of a document is not a
    target of the previous document's last token.
    """
    labels = batch["labels"]
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if batch.get("position_ids") is not None and batch.get("attention_mask") is None:
        starts = batch["position_ids"][:, 1:] == 0
        shifted[:, :-1][starts] = IGNORE_INDEX
    return shifted


def count_target_tokens(batch: dict[str, Any]) -> int:
    """How many tokens of ``batch`` count in the loss (the normaliser, known before the forward pass)."""
    return int((shifted_labels(batch) != IGNORE_INDEX).sum())


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over the label tokens of ``batch``, and how many tokens were counted.

    The labels are shifted (not the logits) so the (B, T, V) logits are never copied; the loss is
    computed in fp32 whatever the compute dtype. Returning the *sum* lets the trainer normalise by the
    number of label tokens in the whole global batch, so that gradient accumulation and data parallelism
    give exactly the single-process result.
    """
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        position_ids=batch.get("position_ids"),
        use_cache=False,
    )
    logits = out.logits
    shifted = shifted_labels(batch)
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (shifted != IGNORE_INDEX).sum()
