"""grpo's rollouts on a rank: its prompts' completions sampled with the KV cache, their rewards and advantages,
and the old policy's and the reference's log-probabilities, as the micro-batches of the next optimizer steps.

A global batch is ``train.global_batch_size`` completions: ``P = global_batch_size / grpo.num_generations``
prompts, each sampled ``G`` times. Each data-parallel rank takes ``P / dp`` whole prompts (a strided share of the
prompt stream's batch, so a group never spans ranks and its advantages are computed where it was sampled;
``scale_rewards: batch`` reduces the batch's standard deviation over the ranks). One batch of completions serves
``grpo.num_iterations`` optimizer steps; the first step's policy is the one that sampled them (their ``old``
log-probabilities are computed then, when there is more than one step).

Generation is :func:`finetune.model.generation.greedy_tokens` with the nucleus sampling of ``finetune chat``, each row
drawing its own number per token (:func:`~finetune.model.generation.row_sampler`) from a generator seeded by
(train.seed, epoch, batch) that every rank runs over the whole global batch: a run samples the same completions
again, and a prompt's completions do not depend on how many ranks share the batch (up to the last bits of the
logits). When several ranks run, each generates exactly ``max_completion_length`` tokens (under FSDP every forward is a collective, as
in evaluation); a single process stops once every completion has ended. A completion ends at its first end of
sequence token, which it keeps (it is scored: the policy learns to stop).

This module is the seam for another rollout engine (vLLM where installed): :meth:`Rollouts.sample` is the only
part that generates, taking prompt ids and returning completion ids.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from finetune.errors import UserError
from finetune.model.generation import Pick, greedy_tokens, left_padded, row_sampler
from finetune.objectives.grpo import GrpoSettings, advantages, count_of, token_logps
from finetune.objectives.loss import IGNORE_INDEX
from finetune.objectives.rewards import Rewards
from finetune.train.data import EvalPrompt
from finetune.train.data.batches import BatchStream, Example, collate, to_device
from finetune.train.parallel.distributed import DistContext, raise_agreed

#: ``batch -> per-token log-probs`` of a reference policy (the frozen copy, or the base with its adapters off).
Reference = Callable[[dict[str, Any]], torch.Tensor]


class PromptStream(BatchStream):
    """grpo's prompts in the order of :class:`~finetune.train.data.batches.BatchStream` (a pure function of the
    seed and the epoch), ``P`` prompts a batch, each batch serving ``num_iterations`` optimizer steps."""

    def __init__(self, prompts: list[EvalPrompt], settings: GrpoSettings, global_batch_size: int, seed: int, pad_id: int) -> None:
        per_step = global_batch_size // settings.num_generations
        if len(prompts) < per_step:
            raise UserError(
                f"train.global_batch_size: {global_batch_size} completions need {per_step} prompts a step "
                f"({settings.num_generations} completions each), but data.train has {len(prompts)}; lower it"
            )
        super().__init__([Example(p.prompt_ids, []) for p in prompts], per_step, seed, pad_id)
        self.prompts, self.settings = prompts, settings
        self.batches_per_epoch = len(prompts) // per_step
        self.steps_per_epoch = self.batches_per_epoch * settings.num_iterations

    def rank_prompts(self, epoch: int, step_in_epoch: int, *, rank: int, world_size: int) -> list[EvalPrompt]:
        """The prompts of the batch optimizer step ``step_in_epoch`` of ``epoch`` trains on, ``rank``'s share."""
        p = self.global_batch_size
        if p % world_size:
            raise UserError(
                f"train.global_batch_size / grpo.num_generations: {p} prompts a step do not divide over the "
                f"{world_size} data-parallel ranks (each samples whole groups); make it a multiple of {world_size}"
            )
        batch = step_in_epoch // self.settings.num_iterations
        per_rank = p // world_size
        start = batch * p + rank * per_rank
        return [self.prompts[i] for i in self.order(epoch)[start : start + per_rank]]

    def fingerprint(self) -> str:
        """:meth:`BatchStream.fingerprint` with the group settings that shape the steps."""
        s = self.settings
        extra = f"{super().fingerprint()}/{s.num_generations}/{s.num_iterations}"
        return hashlib.sha256(extra.encode()).hexdigest()[:16]


@dataclass
class Rollout:
    """One batch of completions on this rank: host micro-batches (ids, labels, ``advantages``, ``old_logps`` /
    ``ref_logps`` where needed, ``count``: the loss's normaliser share), and the batch's figures over every rank."""

    micro: list[dict[str, Any]]
    figures: dict[str, float]


class Rollouts:
    """Makes this rank's :class:`Rollout` for a step, and keeps it for the steps that reuse it."""

    def __init__(
        self, settings: GrpoSettings, rewards: Rewards, stream: PromptStream, tokenizer: Any, ctx: DistContext,
        autocast: Callable[[], Any], seed: int, reference: Reference | None = None,
    ) -> None:
        self.settings, self.rewards, self.stream, self.tokenizer = settings, rewards, stream, tokenizer
        self.ctx, self.autocast, self.seed, self.reference = ctx, autocast, seed, reference
        self.current: tuple[tuple[int, int], Rollout] | None = None

    def for_step(self, model: torch.nn.Module, epoch: int, in_epoch: int, micro_batch_size: int) -> Rollout:
        """The rollout optimizer step (``epoch``, ``in_epoch``) trains on: sampled at the first step of its
        batch, kept for the next ``num_iterations - 1`` (a resumed run samples it again at its first step)."""
        batch = (epoch, in_epoch // self.settings.num_iterations)
        if self.current is None or self.current[0] != batch:
            self.current = None  # the previous batch's tensors go before this one's are made
            self.current = (batch, self.make(model, epoch, in_epoch, micro_batch_size))
        return self.current[1]

    def sample(self, model: torch.nn.Module, prompts: list[list[int]], pick: Pick | None) -> list[list[int]]:
        """Each prompt's sampled completion (token ids, up to and including its first end of sequence), each next
        token chosen by ``pick`` (:func:`~finetune.model.generation.row_sampler`; None: the argmax)."""
        s, tok = self.settings, self.tokenizer
        ids, mask = left_padded(prompts, tok.pad_token_id)
        ids, mask = to_device(ids, self.ctx.device), to_device(mask, self.ctx.device)
        eos = tok.eos_token_id
        ended = torch.zeros(len(prompts), dtype=torch.bool, device=ids.device)

        def on_step(nxt: torch.Tensor) -> bool:
            ended.logical_or_(nxt.reshape(-1) == eos)
            # several ranks: every rank runs every step (FSDP's forwards are collectives), as evaluation does
            return self.ctx.world_size == 1 and bool(ended.all())

        tokens = greedy_tokens(
            model, ids, mask, s.max_completion_length, self.autocast,
            pick=pick, on_step=on_step,
        )
        out = []
        for row in tokens.tolist():
            out.append(row[: row.index(eos) + 1] if eos in row else row)
        return out

    @torch.no_grad()
    def make(self, model: torch.nn.Module, epoch: int, in_epoch: int, micro_batch_size: int) -> Rollout:
        """Sample, score and batch this rank's completions of the step's prompts."""
        from finetune.train.model.reference import reshard

        s, ctx, tok = self.settings, self.ctx, self.tokenizer
        layout = ctx.layout
        prompts = self.stream.rank_prompts(epoch, in_epoch, rank=layout.dp_rank, world_size=layout.dp)
        rows = [p for p in prompts for _ in range(s.num_generations)]
        batch_index = in_epoch // s.num_iterations
        # one generator for the whole global batch, every rank drawing every row's numbers and using its own rows':
        # the completions of a prompt are the same on any number of ranks (finetune/model/generation.py)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 10_007 + batch_index)
        pick = row_sampler(s.temperature, s.top_p, generator, rows=len(rows) * layout.dp, first=layout.dp_rank * len(rows))
        was_training = model.training
        model.eval()
        try:
            completions = self.sample(model, [list(p.prompt_ids) for p in rows], pick)
        finally:
            model.train(was_training)
            reshard(model)
        texts = [tok.decode([t for t in c if t != tok.eos_token_id], skip_special_tokens=True) for c in completions]
        prompt_texts = [tok.decode(p.prompt_ids, skip_special_tokens=True) for p in rows]
        total, each = score_agreed(self.rewards, prompt_texts, texts, [p.answer for p in rows])
        rewards = torch.tensor(total, dtype=torch.float64)
        if s.scale_rewards == "batch":  # the std of the whole global batch, over the ranks
            adv = advantages(rewards, s.num_generations, "none") / (self._global_std(rewards) + 1e-4)
        else:
            adv = advantages(rewards, s.num_generations, s.scale_rewards)
        figures = self._figures(rewards, each, completions)
        examples = [
            Example([*p.prompt_ids, *c], [IGNORE_INDEX] * len(p.prompt_ids) + c)
            for p, c in zip(rows, completions, strict=True)
        ]
        micro = []
        for i in range(0, len(examples), micro_batch_size):
            mb = collate(examples[i : i + micro_batch_size], tok.pad_token_id)
            del mb["attention_mask"]  # right-padded: the causal kernel, as the trainer's rows
            mb["advantages"] = adv[i : i + micro_batch_size].float()
            mb["count"] = torch.tensor(count_of(s, mb["labels"][:, 1:] != IGNORE_INDEX))
            micro.append(mb)
        self._log_probs(model, micro)
        return Rollout(micro, figures)

    def _log_probs(self, model: torch.nn.Module, micro: list[dict[str, Any]]) -> None:
        """The old policy's (more than one step per batch) and the reference's (the KL term) per-token
        log-probabilities of every micro-batch, on the host."""
        from finetune.train.model.reference import reshard

        s = self.settings
        if s.num_iterations == 1 and self.reference is None:
            return
        was_training = model.training
        model.eval()
        try:
            for mb in micro:
                dev = {k: to_device(v, self.ctx.device) for k, v in mb.items() if k in ("input_ids", "labels")}
                with self.autocast():
                    if s.num_iterations > 1:
                        mb["old_logps"] = token_logps(model, dev, s.temperature)[0].cpu()
                    if self.reference is not None:
                        mb["ref_logps"] = self.reference(dev).cpu()
        finally:
            model.train(was_training)
            reshard(model)

    def _global_std(self, rewards: torch.Tensor) -> float:
        n, total, sq = self.ctx.data_sum(
            torch.tensor([float(rewards.numel()), float(rewards.sum()), float((rewards**2).sum())], dtype=torch.float64)
        ).tolist()
        mean = total / max(n, 1.0)
        return math.sqrt(max(sq - n * mean * mean, 0.0) / max(n - 1.0, 1.0))

    def _figures(
        self, rewards: torch.Tensor, each: dict[str, list[float]], completions: list[list[int]]
    ) -> dict[str, float]:
        """reward, reward_std (over the whole global batch), reward/NAME (means) and completion_length (tokens)."""
        names = list(each)
        local = [float(rewards.numel()), float(rewards.sum()), float((rewards**2).sum()),
                 float(sum(len(c) for c in completions))]
        local += [float(sum(each[n])) for n in names]
        summed = self.ctx.data_sum(torch.tensor(local, dtype=torch.float64)).tolist()
        n, total, sq, length = summed[:4]
        mean = total / max(n, 1.0)
        out = {
            "reward": mean, "reward_std": math.sqrt(max(sq - n * mean * mean, 0.0) / max(n - 1.0, 1.0)),
            "completion_length": length / max(n, 1.0),
        }
        out.update({f"reward/{name}": v / max(n, 1.0) for name, v in zip(names, summed[4:], strict=True)})
        return out


def score_agreed(
    rewards: Rewards, prompts: list[str], completions: list[str], answers: list[str | None]
) -> tuple[list[float], dict[str, list[float]]]:
    """:meth:`Rewards.score` on this rank's completions, the ranks agreeing on a failure before anything else:
    a reward function that raises (or returns no number) on one rank stops every rank with its sentence, instead
    of leaving the others waiting in the step's next collective."""
    error = None
    try:
        scored = rewards.score(prompts, completions, answers)
    except UserError as err:
        error, scored = str(err), ([], {})
    raise_agreed(error)
    return scored


def rollout_reference(spec: Any, policy: torch.nn.Module, frozen: torch.nn.Module | None, temperature: float) -> Reference:
    """The reference's per-token log-probabilities: the frozen copy (full fine-tuning), or the policy with its
    adapters switched off (an adapter method's base)."""
    from finetune.model.methods import training_of
    from finetune.train.parallel.parallelize import unwrap

    if frozen is not None:
        ref: Any = frozen

        def copy(batch: dict[str, Any]) -> torch.Tensor:
            out = token_logps(ref, batch, temperature)[0]
            if hasattr(ref, "reshard"):
                ref.reshard()
            return out

        return copy
    training = training_of(spec)

    def base(batch: dict[str, Any]) -> torch.Tensor:
        with training.base_only(unwrap(policy)):
            return token_logps(policy, batch, temperature)[0]

    return base


@dataclass
class GrpoRun:
    """What a grpo run adds to the trainer: the loss, the prompt stream, the rollouts, the frozen reference
    (full fine-tuning with the KL term; None otherwise) and the rewards (for eval_reward too)."""

    objective: Any
    stream: PromptStream
    rollouts: Rollouts
    reference: torch.nn.Module | None
    rewards: Rewards

    def figures(self, rollout: Rollout) -> dict[str, float]:
        """The step's figures: the rollout's, and the loss's kl and clip_ratio as means over the global batch's
        completion tokens."""
        sums = self.objective.take()
        out = dict(rollout.figures)
        if sums:
            kl, clip, tokens = self.rollouts.ctx.data_sum(
                torch.stack([sums["kl"], sums["clip_ratio"], sums["tokens"]]), on_device=True
            ).cpu().tolist()
            out["kl"], out["clip_ratio"] = kl / max(tokens, 1.0), clip / max(tokens, 1.0)
        return out


def setup_grpo(
    loaded: Any, spec: Any, model: torch.nn.Module, data: Any, tokenizer: Any, ctx: DistContext,
    autocast: Callable[[], Any],
) -> GrpoRun:
    """grpo's parts for the trainer (``spec.grpo``): the rewards are loaded first (a user function's file is
    imported here, before any step), then the reference where the KL term needs one."""
    from finetune.objectives.grpo import GrpoObjective
    from finetune.train.model.reference import build_reference_model

    r = loaded.recipe
    settings = GrpoSettings.of(r.grpo)
    rewards = Rewards.of(r.grpo, loaded.base_dir)
    if not data.train_prompts:
        raise UserError(f"data.train: grpo needs prompts, but no row of `{r.data.train}` has one")
    stream = PromptStream(data.train_prompts, settings, r.train.global_batch_size, r.train.seed, tokenizer.pad_token_id)
    frozen = build_reference_model(loaded, spec, ctx) if spec.reference == "model" else None
    reference = rollout_reference(spec, model, frozen, settings.temperature) if spec.reference != "none" else None
    rollouts = Rollouts(settings, rewards, stream, tokenizer, ctx, autocast, r.train.seed, reference)
    return GrpoRun(GrpoObjective(settings), stream, rollouts, frozen, rewards)
