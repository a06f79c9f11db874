"""GRPO (group relative policy optimisation) with verifiable rewards: the advantages of a group of sampled
completions and the clipped policy loss, shared by the trainer and the planner.

Each prompt gets ``G`` completions (``grpo.num_generations``), each completion a reward (finetune/objectives/rewards.py).
A completion's advantage is its reward minus its group's mean, divided by the group's standard deviation (+1e-4)
when ``scale_rewards`` is ``group``, by the whole batch's when ``batch``, not at all when ``none``.

Per completion token ``t``, with ``logp`` the policy's log-probability of the sampled token (of the logits
divided by the sampling temperature), ``old`` the same under the policy that sampled (the policy of the step
the rollouts were made at; ``logp`` itself, detached, while the rollouts are fresh), ``ref`` the reference's
and ``A`` the completion's advantage:

    ratio = exp(logp - old)
    loss_t = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta ratio (exp(ref - logp) - (ref - logp) - 1)

(the KL estimate weighted by the ratio, so that its gradient is the unbiased reverse-KL gradient, as TRL's
default ``use_bias_correction_kl``; the ratio is differentiable, so this changes the gradient at a ratio of 1 too).

The loss of a batch, by ``loss_type`` (TRL's GRPOTrainer's definitions):

    grpo     the mean over completions of each completion's mean token loss
    dr_grpo  the sum of the token losses over (completions x max_completion_length)
    dapo     the sum of the token losses over the batch's completion tokens

:func:`summed_loss` returns the *sum* that the trainer divides by the whole global batch's count
(:func:`count_of`: completions for grpo and dr_grpo, completion tokens for dapo), as the SFT loss is divided
by the global batch's target tokens: gradient accumulation and data parallelism give the one-process update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from finetune.model import attention, router
from finetune.objectives.loss import IGNORE_INDEX, known_documents, shifted_labels

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
#: The step's figures (metrics.jsonl columns) besides the rewards': the KL to the reference (mean per completion
#: token), the share of completion tokens whose ratio was clipped, the mean completion length in tokens.
METRICS = ("kl", "clip_ratio", "completion_length")


@dataclass(frozen=True)
class GrpoSettings:
    """The recipe's ``grpo`` section as the rollouts and the loss read it."""

    num_generations: int = 8
    max_completion_length: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    num_iterations: int = 1

    @classmethod
    def of(cls, grpo: Any) -> GrpoSettings:
        """From the recipe's ``grpo`` section (epsilon_high defaults to epsilon)."""
        high = grpo.epsilon_high if grpo.epsilon_high is not None else grpo.epsilon
        return cls(
            num_generations=int(grpo.num_generations), max_completion_length=int(grpo.max_completion_length),
            temperature=float(grpo.temperature), top_p=float(grpo.top_p), beta=float(grpo.beta),
            epsilon=float(grpo.epsilon), epsilon_high=float(high), loss_type=str(grpo.loss_type),
            scale_rewards=str(grpo.scale_rewards), num_iterations=int(grpo.num_iterations),
        )

    @property
    def uses_reference(self) -> bool:
        """Whether the loss has the KL term (beta above 0), which needs the reference's log-probabilities."""
        return self.beta != 0.0


def advantages(rewards: torch.Tensor, num_generations: int, scale: str) -> torch.Tensor:
    """Each completion's advantage from the rewards of consecutive groups of ``num_generations`` completions
    (shape (groups x G,)): the reward minus its group's mean, over the group's (``group``) or the batch's
    (``batch``) unbiased standard deviation + 1e-4, or unscaled (``none``)."""
    grouped = rewards.view(-1, num_generations)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "none":
        return centred
    if scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
        return centred / (std + 1e-4)
    std = grouped.std(dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(grouped[:, :1])
    return centred / (std.expand_as(grouped).reshape(-1) + 1e-4)


def token_logps(model: torch.nn.Module, batch: dict[str, Any], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's log-probability of its label token (fp32, (rows, T) as the shifted labels: position t
    scores token t + 1; 0 where there is no label) under ``model``'s logits divided by ``temperature``, and the label mask.

    Rows are right-padded prompt + completion rows without an attention mask (the trainer's convention: the
    causal kernel, one document per row); the log-softmax is taken in fp32 whatever the compute dtype."""
    logps, mask, _ = _token_logps(model, batch, temperature, {})
    return logps, mask


def _token_logps(
    model: torch.nn.Module, batch: dict[str, Any], temperature: float, extra: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """:func:`token_logps`, with ``extra`` keywords for the model's forward, and the model's output."""
    shifted = shifted_labels(batch)
    if not getattr(model, attention.MARK, False):
        attention.enable(model)
    with known_documents(batch):
        out = model(
            input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"), use_cache=False, **extra,
        )
    logits = out.logits[:, -shifted.shape[1] :].float()
    if temperature != 1.0:
        logits = logits / temperature
    per_token = -F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(shifted.shape)
    return per_token, shifted != IGNORE_INDEX, out


def token_losses(
    s: GrpoSettings, logps: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, old: torch.Tensor | None,
    ref: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss (shape of ``logps``; masked positions are not zeroed) and the figures summed over the
    masked tokens: ``kl`` (the KL estimate, 0 without a reference), ``clip_ratio`` (tokens whose ratio was
    clipped: below 1 - epsilon with a negative advantage, above 1 + epsilon_high with a positive one)."""
    old = logps.detach() if old is None else old.to(logps.dtype)
    a = adv.to(logps.dtype).unsqueeze(1)
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - s.epsilon, 1 + s.epsilon_high)
    loss = -torch.min(ratio * a, clipped * a)
    m = mask.to(logps.dtype)
    with torch.no_grad():
        region = ((ratio < 1 - s.epsilon) & (a < 0)) | ((ratio > 1 + s.epsilon_high) & (a > 0))
        figures = {"clip_ratio": (region.to(logps.dtype) * m).sum()}
    if s.beta != 0.0:
        assert ref is not None, "the KL term needs the reference's log-probabilities"
        d = ref.to(logps.dtype) - logps
        kl = (torch.exp(d) - d - 1) * ratio  # importance-weighted: the unbiased reverse-KL gradient
        loss = loss + s.beta * kl
        figures["kl"] = (kl.detach() * m).sum()
    else:
        figures["kl"] = torch.zeros((), dtype=logps.dtype, device=logps.device)
    return loss, figures


def summed_loss(s: GrpoSettings, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The micro-batch's loss as a sum, to be divided by the global batch's :func:`count_of` (module docstring)."""
    m = mask.to(per_token.dtype)
    token_sum = (per_token * m).sum(-1)
    if s.loss_type == "grpo":
        return (token_sum / m.sum(-1).clamp(min=1.0)).sum()
    if s.loss_type == "dr_grpo":
        return token_sum.sum() / s.max_completion_length
    assert s.loss_type == "dapo", f"unknown loss_type {s.loss_type}"
    return token_sum.sum()


def count_of(s: GrpoSettings, mask: torch.Tensor) -> int:
    """What a micro-batch adds to the loss's normaliser: its completions (grpo, dr_grpo) or completion tokens
    (dapo); ``mask`` is its label mask (a host tensor: counted before the forward)."""
    return int(mask.shape[0]) if s.loss_type in ("grpo", "dr_grpo") else int(mask.sum())


@dataclass
class GrpoObjective:
    """The trainer's loss for grpo: ``objective(model, batch) -> (summed loss, count)`` on a micro-batch of
    completions holding ``advantages`` (rows,), and ``old_logps`` / ``ref_logps`` (rows, T, at the shifted label positions) where the
    settings need them. Every call adds its figures to running sums (:meth:`take`), on the device."""

    settings: GrpoSettings
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        # a mixture of experts: its routing counted and its load-balancing loss added per unit of the count, as
        # the sft loss adds it per target token (finetune/model/router.py)
        with router.training_forward(model) as extra:
            logps, mask, out = _token_logps(model, batch, self.settings.temperature, extra)
        per_token, figures = token_losses(
            self.settings, logps, mask, batch["advantages"], batch.get("old_logps"), batch.get("ref_logps")
        )
        figures["tokens"] = mask.sum().to(logps.dtype)
        for k, v in figures.items():
            self.sums[k] = self.sums.get(k, torch.zeros((), dtype=torch.float64, device=v.device)) + v.double()
        count = torch.tensor(count_of(self.settings, mask))
        loss = router.add_aux_loss(model, out, summed_loss(self.settings, per_token, mask), count.to(logps.device))
        return loss, count

    def take(self) -> dict[str, torch.Tensor]:
        """The figures summed since the last call (kl, clip_ratio, tokens), then reset."""
        out, self.sums = self.sums, {}
        return out
