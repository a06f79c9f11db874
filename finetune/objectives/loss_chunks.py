"""How the loss is cut into chunks, and whether the output head is fused into it: the settings record
:mod:`finetune.objectives.loss` is called with and the planner's trace is made (and its cache keyed) with. No torch
import: a warm `finetune plan` reads them without importing torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

#: Cross-entropy runs over chunks of about this many bytes of fp32 logits, in one autograd node that keeps
#: only the logits and the targets for backward and computes the gradient chunk by chunk into one buffer of
#: the logits' dtype. torch's cross_entropy keeps an fp32 log-softmax of the whole (B, T, V) block and makes an
#: fp32 copy of it too: for Llama 3's 128k vocabulary at 4096 tokens that is 4 GiB more per sample.
LOSS_CHUNK_BYTES = 256 * 2**20

#: The fused head + loss holds no (B, T, V) buffer, only a chunk's logits and their fp32 temporaries (a few
#: times this), so its chunks are smaller: 64 MiB of fp32 logits is 130 rows of Llama 3's 128k vocabulary,
#: still a matmul large enough to run at full speed.
FUSED_CHUNK_BYTES = 64 * 2**20


def _fused_head_from_env() -> bool:
    return os.environ.get("FINETUNE_FUSED_HEAD", "1") != "0"


@dataclass(frozen=True)
class LossChunks:
    """How :func:`finetune.objectives.loss.causal_lm_loss` computes the loss.

    ``logits_bytes``: the chunked cross-entropy's chunk over materialised logits (:data:`LOSS_CHUNK_BYTES`);
    ``fused_bytes``: the fused head + loss's chunk (:data:`FUSED_CHUNK_BYTES`); ``fused_head``: whether the head
    is fused into the loss where the model allows it (default: on; the environment's ``FINETUNE_FUSED_HEAD=0``
    turns it off, for benchmarks and for comparing plans with and without it).
    """

    logits_bytes: int = LOSS_CHUNK_BYTES
    fused_bytes: int = FUSED_CHUNK_BYTES
    fused_head: bool = field(default_factory=_fused_head_from_env)

    def logits_rows(self, vocab: int) -> int:
        """Rows of ``vocab`` fp32 logits in one chunk of the chunked cross-entropy (at least 1)."""
        return max(1, self.logits_bytes // (4 * vocab))

    def fused_rows(self, vocab: int) -> int:
        """Rows of ``vocab`` fp32 logits in one chunk of the fused head + loss (at least 1)."""
        return max(1, self.fused_bytes // (4 * vocab))

    @property
    def key(self) -> tuple[int, int, bool]:
        """What a trace made with these settings is keyed by in the planner's disk cache."""
        return self.logits_bytes, self.fused_bytes, self.fused_head
