"""Preference tuning: the DPO, IPO, SimPO and ORPO losses on chosen/rejected pairs, shared by the trainer and the
planner's activation tracer.

A micro-batch of ``B`` pairs is one batch of ``2B`` rows, the chosen rows first (finetune/train/data/preference.py).
One forward pass gives every row's summed log-probability of its completion tokens (:func:`sequence_logps`:
the policy's log-softmax over the vocabulary, in fp32, at the label positions); the reference policy's come
from the same function on the reference (the frozen copy, or the base with its adapters off, under the same
autocast), or precomputed with the data. Per pair, with ``c``/``r`` the chosen/rejected sums, ``n`` their token
counts and ``beta``, ``gamma``, ``lambda`` the recipe's ``dpo`` section:

  dpo, sigmoid   -(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m),  m = (c - c_ref) - (r - r_ref)
                 (eps: label_smoothing, conservative DPO; 0 is the DPO paper's loss)
  dpo, ipo       ((c - c_ref) / n_c - (r - r_ref) / n_r - 1 / (2 beta))^2    (length-normalised, as TRL's)
  simpo          -log sigmoid(beta (c / n_c - r / n_r) - gamma)              (no reference)
  orpo           -c / n_c - lambda log sigmoid(log odds(c / n_c) - log odds(r / n_r)),
                 odds(p) = e^p / (1 - e^p)                                   (no reference)

The rewards reported are ``beta (c - c_ref)`` and ``beta (r - r_ref)`` for dpo, ``beta c / n_c`` (simpo) and
``lambda c / n_c`` (orpo); the reward accuracy counts a pair whose chosen reward is higher as 1 and a tie as
1/2 (so a policy equal to its reference scores 50%), the margin is the chosen minus the rejected reward.

The loss returned is the *sum* over the micro-batch's pairs: the trainer divides by the pairs of the whole
global batch, as it divides the SFT loss by the global batch's tokens, so accumulation and data parallelism
give the single-process update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from finetune.model import attention
from finetune.objectives.loss import IGNORE_INDEX, known_documents, shifted_labels

#: The metrics a preference step and evaluation report (metrics.jsonl columns; ``eval_`` prefixed for evaluation)
METRICS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "logps/chosen", "logps/rejected",
)


@dataclass(frozen=True)
class PreferenceSettings:
    """The objective and the recipe's ``dpo`` section, as the loss reads them."""

    objective: str = "dpo"  # dpo | simpo | orpo
    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid | ipo
    label_smoothing: float = 0.0
    gamma: float = 0.5
    lam: float = 0.1

    @classmethod
    def of(cls, objective: str, dpo: Any) -> PreferenceSettings:
        """From train.objective and the recipe's ``dpo`` section."""
        return cls(
            objective=objective, beta=float(dpo.beta), loss_type=str(dpo.loss_type),
            label_smoothing=float(dpo.label_smoothing), gamma=float(dpo.gamma), lam=float(dpo.lambda_),
        )

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares with a reference policy (dpo)."""
        return self.objective == "dpo"


def sequence_logps(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its label tokens (fp32, shape (rows,)) and how many there are.

    The logits are materialised (the rows' log-softmax is needed per row, which the fused SFT head does not
    keep) and the log-softmax is taken in fp32 whatever the compute dtype. A batch without an attention mask
    or position ids (the trainer's: right-padded rows) is one document per row, which transformers' mask code
    is told (:func:`~finetune.objectives.loss.known_documents`) instead of reading the position ids on the host: no device
    sync, and the causal kernel without a (B, 1, T, T) mask, on real and fake tensors alike."""
    shifted = shifted_labels(batch)
    if not getattr(model, attention.MARK, False):
        attention.enable(model)
    with known_documents(batch):  # a training batch has no mask: the causal kernel, no (B, 1, T, T) mask
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"), use_cache=False,
        ).logits
    logits = logits[:, -shifted.shape[1] :]  # prompt-learning adapters may prepend virtual positions
    per_token = -F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(shifted.shape)
    return per_token.sum(-1), (shifted != IGNORE_INDEX).sum(-1)


def pair_losses(
    s: PreferenceSettings, logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per pair: the loss (shape (B,)) and the reported figures (each (B,)), from the ``2B`` rows' log-probs
    and token counts (chosen rows first) and the reference's (B, 2) log-probs (dpo only)."""
    b = logps.shape[0] // 2
    c, r = logps[:b], logps[b:]
    n_c, n_r = counts[:b].clamp(min=1).to(logps.dtype), counts[b:].clamp(min=1).to(logps.dtype)
    if s.objective == "dpo":
        assert ref is not None, "dpo compares with a reference"
        ref = ref.to(logps.dtype)
        chosen_ratio, rejected_ratio = c - ref[:, 0], r - ref[:, 1]
        if s.loss_type == "ipo":
            delta = chosen_ratio / n_c - rejected_ratio / n_r
            loss = (delta - 1 / (2 * s.beta)) ** 2
        else:
            m = s.beta * (chosen_ratio - rejected_ratio)
            loss = -(1 - s.label_smoothing) * F.logsigmoid(m) - s.label_smoothing * F.logsigmoid(-m)
        chosen_reward, rejected_reward = s.beta * chosen_ratio, s.beta * rejected_ratio
    elif s.objective == "simpo":
        avg_c, avg_r = c / n_c, r / n_r
        loss = -F.logsigmoid(s.beta * (avg_c - avg_r) - s.gamma)
        chosen_reward, rejected_reward = s.beta * avg_c, s.beta * avg_r
    elif s.objective == "orpo":
        avg_c, avg_r = c / n_c, r / n_r
        # log odds(p) = p - log(1 - e^p), for the mean token log-prob p < 0
        log_odds = (avg_c - torch.log1p(-torch.exp(avg_c))) - (avg_r - torch.log1p(-torch.exp(avg_r)))
        loss = -avg_c - s.lam * F.logsigmoid(log_odds)
        chosen_reward, rejected_reward = s.lam * avg_c, s.lam * avg_r
    else:
        raise AssertionError(f"unknown preference objective {s.objective}")
    with torch.no_grad():
        wins = (chosen_reward > rejected_reward).to(logps.dtype) + 0.5 * (chosen_reward == rejected_reward).to(logps.dtype)
        figures = {
            "rewards/chosen": chosen_reward.detach(), "rewards/rejected": rejected_reward.detach(),
            "rewards/accuracy": wins, "rewards/margin": (chosen_reward - rejected_reward).detach(),
            "logps/chosen": c.detach(), "logps/rejected": r.detach(),
        }
    return loss, figures


@dataclass
class PreferenceObjective:
    """The trainer's loss for dpo, simpo and orpo: ``objective(model, batch) -> (summed loss, pairs)``.

    ``reference(batch)``: the reference policy's (B, 2) log-probs when they are not in the batch (dpo with a
    reference model or the adapter-free base; None for the reference-free objectives and precomputed ones).
    Every call adds its pairs' figures to running sums, which :meth:`take` hands over and resets (float64, on
    the batch's device: no host sync inside the step).
    """

    settings: PreferenceSettings
    reference: Callable[[dict[str, Any]], torch.Tensor] | None = None
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        ref = batch.get("ref_logps")
        if ref is None and self.settings.uses_reference:
            assert self.reference is not None, "dpo without precomputed log-probs has a reference"
            with torch.no_grad():
                ref = self.reference(batch)
        logps, counts = sequence_logps(model, batch)
        loss, figures = pair_losses(self.settings, logps, counts, ref)
        for k, v in figures.items():
            self.sums[k] = self.sums.get(k, torch.zeros((), dtype=torch.float64, device=v.device)) + v.double().sum()
        return loss.sum(), torch.tensor(loss.shape[0])

    def take(self) -> dict[str, torch.Tensor]:
        """The figures summed over the pairs since the last call (empty when there were none), then reset."""
        out, self.sums = self.sums, {}
        return out


def pairs_in(batch: dict[str, Any]) -> int:
    """How many pairs ``batch`` holds (the normaliser of the preference loss, known before the forward)."""
    return int(batch["pairs"])


def reference_logps(
    reference: Callable[[dict[str, Any]], tuple[torch.Tensor, torch.Tensor]], batch: dict[str, Any]
) -> torch.Tensor:
    """The (B, 2) log-probs (chosen, rejected) of a ``2B``-row batch under ``reference`` (a
    :func:`sequence_logps` of the reference policy), without gradients."""
    with torch.no_grad():
        logps, _ = reference(batch)
    b = logps.shape[0] // 2
    return torch.stack([logps[:b], logps[b:]], dim=1)
