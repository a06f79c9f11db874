"""Greedy generation with a KV cache: what evaluation runs for exact match, and what the planner traces for
the memory of evaluation (a shared module, so the planner never imports the trainer)."""

from __future__ import annotations

from typing import Any

import torch


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of ``prompts`` left-padded to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def greedy_tokens(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, autocast: Any
) -> torch.Tensor:
    """The (B, max_new_tokens) greedy continuation of a left-padded batch, with a KV cache.

    The planner traces this function (``finetune.plan.evaluation``) for the memory of generation.

    A prefix-tuned peft model puts its prefix into the cache on every call, so it runs without a KV cache
    across steps (each step sees the whole sequence). Its positions are the tokens' own: peft (0.21) adds the
    virtual tokens to ``position_ids`` itself, which puts them after the prefix as in training, where
    transformers numbers the tokens from the cache's length. Adding them here too shifted every position
    by the prefix length a second time, so evaluation saw positions training never did.
    """
    from finetune.adapters import prefix_tokens

    virtual = prefix_tokens(model)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out_tokens = torch.empty((ids.shape[0], 0), dtype=torch.long, device=ids.device)
    cache = None
    step_ids = ids
    step_pos = positions
    for _ in range(max_new_tokens):
        with autocast():
            if virtual:
                out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, use_cache=False)
            else:
                out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, cache=cache, use_cache=True)
        cache = None if virtual else out.cache
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        del out  # the prompt's (B, T, V) logits must not outlive the step that needs them
        out_tokens = torch.cat([out_tokens, nxt], dim=1)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        if virtual:
            step_ids = torch.cat([step_ids, nxt], dim=1)
            step_pos = torch.cat([step_pos, step_pos[:, -1:] + 1], dim=1)
        else:
            step_ids = nxt
            step_pos = step_pos[:, -1:] + 1
    return out_tokens
