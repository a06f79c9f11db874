"""Tokens per second and the model FLOPs utilisation (MFU) of a run's steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from finetune.train.state import StepResult

if TYPE_CHECKING:
    from finetune.plan.flops import Utilisation


@dataclass
class Throughput:
    """Tokens, seconds and row widths summed over steps (what tokens/s and MFU are computed from)."""

    tokens: int = 0
    seconds: float = 0.0
    width_tokens: int = 0  # this rank's sum of (padded row width x real tokens)
    local_tokens: int = 0

    def add(self, step: StepResult, seconds: float) -> None:
        """Count one step."""
        self.tokens += step.input_tokens
        self.seconds += seconds
        self.width_tokens += step.row_widths[0]
        self.local_tokens += step.row_widths[1]

    @property
    def mean_width(self) -> float:
        """The token-weighted mean row width (0 before any token)."""
        return self.width_tokens / self.local_tokens if self.local_tokens else 0.0


def row_widths(micro: list[dict[str, torch.Tensor]]) -> tuple[int, int]:
    """This rank's (sum of padded row width x real tokens, real tokens) over its micro-batches: attention FLOPs
    per token grow with the row a token sits in, so MFU takes the token-weighted row width."""
    return (
        sum(mb["input_ids"].shape[1] * int(mb["num_tokens"]) for mb in micro),
        sum(int(mb["num_tokens"]) for mb in micro),
    )


class MfuMeter:
    """The model FLOPs utilisation of a throughput, against the peak of the run's GPUs.

    ``gpu_type`` names the GPUs (``hardware.gpu_type``, else the detected one), ``dtype`` the matmul dtype
    whose peak counts (finetune leaves TF32 off, torch's default, so fp32 matmuls run at the fp32 peak). On CPU
    (``device_type`` other than cuda) and on a GPU whose peak is not known there is nothing to compare with:
    None. The model's FLOPs per token are counted once, on first use, from the model as built; under a
    pipeline (``whole``: the model's config and adapter), where this rank holds only its stages' layers, from the
    whole model built on the meta device, as the planner counts it.
    """

    def __init__(
        self, model: torch.nn.Module, gpu_type: str | None, dtype: str, world_size: int, device_type: str,
        whole: tuple[Any, Any] | None = None,
    ) -> None:
        self.model, self.gpu_type, self.dtype = model, gpu_type, dtype
        self.world_size, self.device_type, self.whole = world_size, device_type, whole
        self._flops: tuple[float, float] | None = None  # model FLOPs per token: at width 0, per token of width

    def flops_per_token(self, row_width: float) -> float:
        """The whole model's training FLOPs per token in rows ``row_width`` tokens wide."""
        from finetune.model.adapters import prompt_tokens
        from finetune.plan.flops import config_flops_per_token, training_flops_per_token

        if prompt_tokens(self.model):  # virtual positions of their own: not linear in the row width
            return training_flops_per_token(self.model, seq_len=row_width).per_token
        if self._flops is None:  # linear in the row width
            if self.whole is not None:
                config, adapter = self.whole
                at = [config_flops_per_token(config, seq_len=w, adapter=adapter).per_token for w in (0, 1)]
            else:
                at = [training_flops_per_token(self.model, seq_len=w).per_token for w in (0, 1)]
            self._flops = (at[0], at[1] - at[0])
        zero, per_width = self._flops
        return zero + per_width * row_width

    def __call__(self, tokens_per_s: float, row_width: float) -> Utilisation | None:
        """The MFU of ``tokens_per_s`` (all ranks) in rows ``row_width`` tokens wide (None: see the class)."""
        if self.device_type != "cuda" or tokens_per_s <= 0 or row_width <= 0:
            return None
        from finetune.plan.flops import mfu

        return mfu(tokens_per_s, self.flops_per_token(row_width), self.gpu_type, self.dtype, self.world_size)
