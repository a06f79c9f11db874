"""The training objective, shared by the trainer and the planner's activation tracer."""

from __future__ import annotations

from typing import Any

import torch

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


# Cross-entropy runs over chunks of about this many bytes of fp32 logits, in one autograd node that keeps
# only the logits and the targets for backward and computes the gradient chunk by chunk into one buffer of the
# logits' dtype. torch's cross_entropy keeps an fp32 log-softmax of the whole (B, T, V) block and makes an
# fp32 copy of it too: for Llama 3's 128k vocabulary at 4096 tokens that is 4 GiB more per sample.
LOSS_CHUNK_BYTES = 256 * 2**20


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over the label tokens of ``batch``, and how many tokens were counted.

    The labels are shifted (not the logits) so the (B, T, V) logits are never copied; the loss is
    computed in fp32 whatever the compute dtype, chunk by chunk (:data:`LOSS_CHUNK_BYTES`). Returning the
    *sum* lets the trainer normalise by the number of label tokens in the whole global batch, so that
    gradient accumulation and data parallelism give exactly the single-process result.
    """
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        position_ids=batch.get("position_ids"),
        use_cache=False,
    )
    logits = out.logits
    shifted = shifted_labels(batch)
    rows = max(1, LOSS_CHUNK_BYTES // (4 * logits.shape[-1]))
    loss_sum = _ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), rows)
    return loss_sum, (shifted != IGNORE_INDEX).sum()


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of (N, V) logits against (N,) targets (IGNORE_INDEX rows count nothing), in fp32,
    ``rows`` rows at a time. Backward: softmax minus one-hot, chunk by chunk, times the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)  # kept: N floats
        for start in range(0, logits.shape[0], rows):
            x = logits[start : start + rows].float()
            y = targets[start : start + rows]
            keep = y != IGNORE_INDEX
            picked = x.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            lse[start : start + rows] = torch.logsumexp(x, dim=-1)
            total = total + torch.where(keep, lse[start : start + rows] - picked, 0.0).sum()
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        out = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            p = logits[start:end].to(torch.float32, copy=True)  # a copy also for fp32 logits: edited in place
            p = p.sub_(lse[start:end].unsqueeze(1)).exp_()  # softmax, from the forward's log-sum-exp
            y = targets[start:end]
            keep = (y != IGNORE_INDEX).unsqueeze(1)
            p.scatter_add_(1, y.clamp(min=0).unsqueeze(1), keep.to(p.dtype).neg())
            out[start:end] = p.mul_(grad).masked_fill_(~keep, 0.0)  # ignored rows: exactly 0, even at inf
        return out, None, None
