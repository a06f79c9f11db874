"""The training objective, shared by the trainer and the planner's activation tracer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over the label tokens of ``batch``, and how many tokens were counted.

    The labels are shifted left (not the logits) so the (B, T, V) logits are never copied; the loss is
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
    labels = batch["labels"]
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if "position_ids" in batch and batch.get("attention_mask") is None:
        # Packed rows: the token after the last one of a document belongs to the next document.
        starts = batch["position_ids"][:, 1:] == 0
        shifted[:, :-1][starts] = IGNORE_INDEX
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    n_tokens = (shifted != IGNORE_INDEX).sum()
    return loss_sum, n_tokens
