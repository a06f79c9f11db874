"""Evaluation: held-out loss, and exact match of greedy generations.

Work is split across ranks, and every rank runs the *same number* of forward passes (prompt batches are
padded to equal counts and generation always runs ``max_new_tokens`` steps), because under FSDP every
forward is a collective: a rank that stopped early would leave the others waiting forever.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from finetune.errors import UserError
from finetune.model.generation import greedy_tokens, left_padded
from finetune.objectives.loss import IGNORE_INDEX, causal_lm_loss, shifted_labels
from finetune.train.data import EvalPrompt, Example, collate
from finetune.train.data.batches import to_device
from finetune.train.data.retain import RetainData
from finetune.train.parallel.distributed import DistContext, raise_agreed

if TYPE_CHECKING:
    from finetune.train.parallel.pipeline import StagedForward


@dataclass
class EvalResult:
    """Eval loss (mean over target tokens) and exact-match accuracy over the eval prompts, and the same two
    figures over the retain set (``eval.retain``) when the recipe names one."""

    loss: float | None
    exact_match: float | None
    n_prompts: int
    samples: list[tuple[str, str]]  # (expected, generated) for a few prompts, rank 0's
    retain_loss: float | None = None
    retain_exact_match: float | None = None
    retain_prompts: int = 0
    preference: dict[str, float] | None = None  # dpo, simpo, orpo: rewards/*, logps/* over the eval pairs
    reward: float | None = None  # grpo: the mean reward of the greedy completions of the eval prompts


def _shard(items: list[Any], ctx: DistContext, batch_size: int) -> tuple[list[Any], int]:
    """This rank's strided share of ``items`` and the number of batches every rank must run."""
    layout = ctx.layout  # the ranks that read one batch slice (a TP group, a pipeline) run the same rows
    mine = items[layout.dp_rank :: layout.dp]
    per_rank = math.ceil(len(items) / layout.dp)
    return mine, math.ceil(per_rank / batch_size)


def summed_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], stages: StagedForward | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, target tokens) of a batch: the model's (:func:`~finetune.objectives.loss.causal_lm_loss`), or through
    a pipeline's stages (``stages``), whose last stage computes it as ``causal_lm_loss`` does."""
    if stages is None:
        return causal_lm_loss(model, batch)
    shifted = shifted_labels(batch)
    s = stages.with_targets(
        batch["input_ids"], shifted, attention_mask=batch.get("attention_mask"), position_ids=batch.get("position_ids")
    )
    return s, (shifted != IGNORE_INDEX).sum()


@torch.no_grad()
def eval_loss(
    model: torch.nn.Module, examples: list[Example], ctx: DistContext, batch_size: int, pad_id: int, autocast: Any,
    stages: StagedForward | None = None,
) -> float | None:
    """Mean next-token loss over the target tokens of ``examples`` (all ranks together); ``stages``: a pipeline's
    forward, each batch through its stages (:func:`summed_loss`)."""
    if not examples:
        return None
    mine, n_batches = _shard(examples, ctx, batch_size)
    total = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    for b in range(n_batches):
        chunk = mine[b * batch_size : (b + 1) * batch_size] or examples[:1]  # dummy batch keeps ranks in step
        batch = {k: to_device(v, ctx.device) for k, v in collate(chunk, pad_id).items()}
        with autocast():
            s, n = summed_loss(model, batch, stages)
        if mine[b * batch_size : (b + 1) * batch_size]:
            total += s.double().cpu()
            count += n.double().cpu()
    total = ctx.data_sum(total)
    count = ctx.data_sum(count)
    return float(total / count) if count > 0 else None


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_id: int, device: torch.device,
    autocast: Any, stages: StagedForward | None = None,
) -> list[list[int]]:
    """Greedy continuation of each prompt (left-padded batch, KV cache), ``max_new_tokens`` steps exactly;
    ``stages``: through a pipeline's stages, one forward of the whole sequence per token (no KV cache)."""
    ids, mask = left_padded(prompts, pad_id)
    forward: Any = model if stages is None else stages
    out_tokens = greedy_tokens(
        forward, to_device(ids, device), to_device(mask, device), max_new_tokens, autocast, cache=stages is None
    )
    result = []
    for row in out_tokens.tolist():
        result.append(row[: row.index(eos_id)] if eos_id in row else row)
    return result


@torch.no_grad()
def exact_match(
    model: torch.nn.Module, prompts: list[EvalPrompt], tokenizer: Any, ctx: DistContext, batch_size: int,
    max_new_tokens: int, autocast: Any, stages: StagedForward | None = None, rewards: Any = None,
) -> tuple[float | None, list[tuple[str, str]]]:
    """Fraction of prompts whose greedy completion equals the expected answer (whitespace-trimmed). With
    ``rewards`` (grpo's :class:`~finetune.objectives.rewards.Rewards`) the mean reward of those completions is kept in
    ``rewards.last_mean``."""
    if not prompts:
        return None, []
    mine, n_batches = _shard(prompts, ctx, batch_size)
    hits = 0
    reward_sum = 0.0
    failure: str | None = None  # a reward function's error: scoring stops, generation goes on (collectives)
    samples: list[tuple[str, str]] = []
    for b in range(n_batches):
        chunk = mine[b * batch_size : (b + 1) * batch_size]
        real = len(chunk)
        chunk = chunk or prompts[:1]
        gens = greedy_generate(
            model, [list(p.prompt_ids) for p in chunk], max_new_tokens, tokenizer.pad_token_id, tokenizer.eos_token_id,
            ctx.device, autocast, stages,
        )
        for p, g in list(zip(chunk, gens, strict=True))[:real]:
            text = tokenizer.decode(g, skip_special_tokens=True).strip()
            hits += int(text == p.answer.strip())
            if rewards is not None and failure is None:
                try:
                    total, _ = rewards.score(
                        [tokenizer.decode(p.prompt_ids, skip_special_tokens=True)], [text], [p.answer]
                    )
                    reward_sum += total[0]
                except UserError as err:
                    failure = str(err)
            if len(samples) < 3:
                samples.append((p.answer, text))
    if rewards is not None:
        raise_agreed(failure)  # every rank stops with the sentence before the sum that would wait for it
        rewards.last_mean = float(ctx.data_sum(reward_sum)) / len(prompts)
    total_hits = ctx.data_sum(hits)
    return float(total_hits) / len(prompts), samples


def evaluate(
    model: torch.nn.Module, eval_examples: list[Example], eval_prompts: list[EvalPrompt], tokenizer: Any,
    ctx: DistContext, *, batch_size: int, max_new_tokens: int, autocast: Any, retain: RetainData | None = None,
    task: bool = True, objective: Any = None, stages: StagedForward | None = None,
    measure: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None, rewards: Any = None,
) -> EvalResult:
    """Eval loss and exact match, with the model in eval mode (restored to train mode after); with ``retain``,
    also the retain set's loss and exact match. ``task=False``: the retain set only (the run's measurement
    before training when ``eval.at_start`` is off). ``stages``: a pipeline's forward over its stages, which
    every forward of the evaluation goes through (``model`` is then this rank's stage model).
    ``measure(phase)``: a context around the loss pass (``evaluation``) and the generation (``generation``),
    the memory probe's. ``rewards``: grpo's, scored on the greedy completions of the eval prompts (eval_reward)."""
    phase = measure or (lambda _: contextlib.nullcontext())
    was_training = model.training
    model.eval()
    loss = em = None
    samples: list[tuple[str, str]] = []
    try:
        prefs = None
        if task and objective is not None:  # preference pairs: the objective's loss and figures
            from finetune.train.model.reference import preference_eval

            with phase("evaluation"):
                loss, prefs = preference_eval(
                    model, eval_examples, ctx, batch_size, tokenizer.pad_token_id, autocast, objective  # type: ignore[arg-type]
                )
        elif task:
            with phase("evaluation"):
                loss = eval_loss(model, eval_examples, ctx, batch_size, tokenizer.pad_token_id, autocast, stages)
        if task:
            with phase("generation"):
                em, samples = exact_match(
                    model, eval_prompts, tokenizer, ctx, batch_size, max_new_tokens, autocast, stages, rewards
                )
        reward = rewards.last_mean if task and rewards is not None and eval_prompts else None
        result = EvalResult(loss, em, len(eval_prompts) if task else 0, samples, preference=prefs, reward=reward)
        if retain is not None:
            result.retain_loss = eval_loss(
                model, retain.examples, ctx, batch_size, tokenizer.pad_token_id, autocast, stages
            )
            result.retain_exact_match, _ = exact_match(
                model, retain.prompts, tokenizer, ctx, batch_size, max_new_tokens, autocast, stages
            )
            result.retain_prompts = len(retain.prompts)
    finally:
        model.train(was_training)
    return result
