"""How the loss is cut into chunks: sizes :mod:`finetune.objectives.loss` reads (as its own module globals, which tests
and benchmarks set there) and the planner's trace cache is keyed by. No torch import: a warm `finetune plan`
reads them without importing torch."""

from __future__ import annotations

import os

#: Cross-entropy runs over chunks of about this many bytes of fp32 logits, in one autograd node that keeps
#: only the logits and the targets for backward and computes the gradient chunk by chunk into one buffer of
#: the logits' dtype. torch's cross_entropy keeps an fp32 log-softmax of the whole (B, T, V) block and makes an
#: fp32 copy of it too: for Llama 3's 128k vocabulary at 4096 tokens that is 4 GiB more per sample.
LOSS_CHUNK_BYTES = 256 * 2**20

#: The fused head + loss holds no (B, T, V) buffer, only a chunk's logits and their fp32 temporaries (a few
#: times this), so its chunks are smaller: 64 MiB of fp32 logits is 130 rows of Llama 3's 128k vocabulary,
#: still a matmul large enough to run at full speed.
FUSED_CHUNK_BYTES = 64 * 2**20

#: Whether causal_lm_loss fuses the head into the loss; FINETUNE_FUSED_HEAD=0 turns it off (benchmarks, and
#: comparing plans with and without it).
FUSED_HEAD = os.environ.get("FINETUNE_FUSED_HEAD", "1") != "0"
