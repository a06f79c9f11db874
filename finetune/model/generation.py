"""Generation with a KV cache: the greedy loop evaluation runs for exact match and the planner traces for the
memory of evaluation (a shared module, so the planner never imports the trainer); ``finetune chat`` runs the
same loop with a sampling rule and a per-step callback for streaming and stopping at end of sequence."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: Chooses the next token of each row from the last position's logits: (B, V) -> (B, 1).
Pick = Callable[[torch.Tensor], torch.Tensor]
#: Called with each step's new tokens (B, 1); returning True ends generation after that step.
OnStep = Callable[[torch.Tensor], bool]


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
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, autocast: Any,
    *, pick: Pick | None = None, on_step: OnStep | None = None, cache: bool = True,
) -> torch.Tensor:
    """The (B, max_new_tokens) greedy continuation of a left-padded batch, with a KV cache.

    The planner traces this function (``finetune.plan.evaluation``) for the memory of generation.
    Evaluation passes neither ``pick`` nor ``on_step``: the argmax, for exactly ``max_new_tokens`` steps (under
    FSDP every forward is a collective, so no rank may stop early). ``pick`` replaces the argmax (sampling,
    :func:`sampler`); ``on_step`` sees each step's tokens and may end the loop early (streaming, stopping
    once every row has ended), so the result then has fewer columns.

    ``cache=False`` runs without a KV cache: each step is a forward of the whole sequence (a pipeline's
    stages, which keep no cache; only the last position's logits are read). A prefix-tuned peft model puts its
    prefix into the cache on every call, so it runs that way too; its positions are the tokens' own: peft
    (0.21) adds the virtual tokens to ``position_ids`` itself, which puts them after the prefix as in training, where
    transformers numbers the tokens from the cache's length. Adding them here too shifted every position
    by the prefix length a second time, so evaluation saw positions training never did.

    A prompt-tuned peft model runs with a KV cache, its virtual tokens before each row at the positions they
    have in training (:func:`prompted_forward`).
    """
    from finetune.model.adapters import prompt_tokens

    with prompted_forward(model, prompt_tokens(model)):
        return _greedy(model, ids, mask, max_new_tokens, autocast, pick, on_step, cache)


def _greedy(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, autocast: Any,
    pick: Pick | None, on_step: OnStep | None, cache: bool,
) -> torch.Tensor:
    from finetune.model.adapters import prefix_tokens
    from finetune.versions import kv_cache_kwarg, output_cache

    virtual = prefix_tokens(model) if cache else 0
    whole = not cache or bool(virtual)  # every step a forward of the whole sequence
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out_tokens = torch.empty((ids.shape[0], 0), dtype=torch.long, device=ids.device)
    kv = None
    step_ids = ids
    step_pos = positions
    for _ in range(max_new_tokens):
        with autocast():
            if whole:
                out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, use_cache=False)
            else:
                out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, use_cache=True,
                            **kv_cache_kwarg(kv))
        kv = None if whole else output_cache(out)
        logits = out.logits[:, -1]
        nxt = logits.argmax(-1, keepdim=True) if pick is None else pick(logits)
        del out, logits  # the prompt's (B, T, V) logits must not outlive the step that needs them
        out_tokens = torch.cat([out_tokens, nxt], dim=1)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        if whole:
            step_ids = torch.cat([step_ids, nxt], dim=1)
            step_pos = torch.cat([step_pos, step_pos[:, -1:] + 1], dim=1)
        else:
            step_ids = nxt
            step_pos = step_pos[:, -1:] + 1
        if on_step is not None and on_step(nxt):
            break
    return out_tokens


@contextmanager
def prompted_forward(model: torch.nn.Module, virtual: int) -> Iterator[None]:
    """Within this context a prompt-tuned peft ``model`` (``virtual`` > 0 virtual tokens; through DDP) takes a
    left-padded batch with its tokens' own positions and a KV cache: the first call puts the virtual tokens'
    embeddings before the rows at positions 0 .. virtual-1 and every token after them, as training sees them
    (rows start at position ``virtual``); later calls feed the new tokens only. peft's own prompt-tuning
    forward drops ``position_ids`` (the left padding then moves every token's position) and prepends the
    virtual tokens on every call (which a cache already holds). The forward is replaced on the instance, so
    the wrappers' hooks (FSDP2 gathering the root unit's embeddings and prompt encoder) run as for any call.
    ``virtual`` 0: nothing changes."""
    if not virtual:
        yield
        return
    from finetune.versions import kv_cache_kwarg, kv_cache_name

    peft_model: Any = getattr(model, "module", model)
    base = peft_model.get_base_model()

    def forward(
        input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, use_cache: bool = True,
        **cached: Any,
    ) -> Any:
        cache = cached.get(kv_cache_name())
        rows = input_ids.shape[0]
        embeds = peft_model.word_embeddings(input_ids)
        if cache is None:
            prompt = peft_model.get_prompt(batch_size=rows).to(embeds.dtype)
            embeds = torch.cat([prompt, embeds], dim=1)
            first = torch.arange(virtual, device=position_ids.device).expand(rows, -1)
            position_ids = torch.cat([first, position_ids + virtual], dim=1)
        else:
            position_ids = position_ids + virtual
        mask = torch.cat([attention_mask.new_ones(rows, virtual), attention_mask], dim=1)
        return base(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, use_cache=use_cache,
                    **kv_cache_kwarg(cache))

    peft_model.forward = forward
    try:
        yield
    finally:
        del peft_model.forward


def _probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The softmax of ``logits / temperature`` (fp32), restricted to the nucleus of ``top_p`` (module users:
    :func:`sampler`, :func:`row_sampler`)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)  # the most likely one always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs


def sampler(temperature: float, top_p: float, generator: torch.Generator) -> Pick | None:
    """The next-token rule of ``finetune chat``: None (the argmax, as evaluation) at temperature 0, else a
    draw from the softmax of logits / temperature, restricted to the smallest set of most likely tokens whose
    probabilities reach ``top_p`` (nucleus sampling; 1.0 keeps every token), from ``generator``."""
    if temperature <= 0:
        return None

    def pick(logits: torch.Tensor) -> torch.Tensor:
        draw = torch.multinomial(_probs(logits, temperature, top_p).cpu(), 1, generator=generator)
        return draw.to(logits.device)

    return pick


def row_sampler(temperature: float, top_p: float, generator: torch.Generator, rows: int, first: int = 0) -> Pick | None:
    """:func:`sampler`'s distribution with each row's draw its own: every step draws one uniform number per row of
    a batch of ``rows`` from ``generator``, and the rows picked here are rows ``first``, ``first + 1``, ... of
    it, each taking the token at which its number falls in the cumulative distribution. A row's tokens depend
    on the seed, its index and its own logits alone, not on which rows share its batch: ranks that each sample
    their share of a batch draw what one process sampling the whole batch draws."""
    if temperature <= 0:
        return None

    def pick(logits: torch.Tensor) -> torch.Tensor:
        probs = _probs(logits, temperature, top_p)
        n = probs.shape[0]
        u = torch.rand(rows, generator=generator, dtype=torch.float64)[first : first + n]
        cdf = probs.cpu().double().cumsum(-1)
        at = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)
        return at.clamp(max=probs.shape[-1] - 1).to(logits.device)

    return pick
