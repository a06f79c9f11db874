"""Trainer hooks that raise an allocation failure as a library raises it, for the out-of-memory tests.

``FINETUNE_TEST_OOM_AT_STEP=S`` and ``FINETUNE_TEST_OOM_KIND=K`` (a key of :data:`ERRORS`): when step S starts,
the hook raises the exception K, an object of the type and with the text the library gives it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from finetune.train.hooks import TrainerHooks

#: torch's "NCCL error in: ..." message (NCCLUtils.cpp) with NCCL's own last error (alloc.h).
NCCL_CALLOC = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error (run "
    "with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\nncclUnhandledCudaError: Call to CUDA function "
    "failed.\nLast error:\nFailed to CUDA calloc 6291456 bytes"
)

ERRORS: dict[str, Callable[[], BaseException]] = {
    "nccl": lambda: dist.DistBackendError(NCCL_CALLOC),
    "cublas": lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    "cuda": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                           "capacity of 79.11 GiB of which 1.06 GiB is free."),
}


class RaiseOOM(TrainerHooks):
    """Raise ``FINETUNE_TEST_OOM_KIND``'s error when step ``FINETUNE_TEST_OOM_AT_STEP`` starts."""

    def before_step(self, step: int, rank: int) -> None:
        """Raise the asked error at the asked step."""
        if step == int(os.environ.get("FINETUNE_TEST_OOM_AT_STEP", "0")):
            raise ERRORS[os.environ["FINETUNE_TEST_OOM_KIND"]]()
