"""Every form an allocation failure takes when it reaches Python is recognised as running out of memory (and
says what failed), and errors that merely resemble one are not: real exception objects of the types torch raises,
with the texts torch, cuBLAS, cuDNN and NCCL write."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from finetune.train.runtime.preflight import DEBUG_MEMORY_HISTORY, failed_allocation, is_oom
from tests.train.oom_hooks import NCCL_CALLOC

NCCL_HEAD = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, {what}, NCCL version 2.21.5\n"
)
NCCL_CUDA = NCCL_HEAD.format(what="unhandled cuda error (run with NCCL_DEBUG=INFO for details)") + (
    "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n{last}"
)
NCCL_SYSTEM = NCCL_HEAD.format(what="unhandled system error (run with NCCL_DEBUG=INFO for details)") + (
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. \n"
    "Last error:\n{last}"
)


def _cpu_allocation_failure() -> RuntimeError:
    """The error torch's CPU allocator really raises for an allocation no host can serve (2**52 bytes)."""
    try:
        torch.empty(2**52, dtype=torch.uint8)
    except RuntimeError as err:
        return err
    raise AssertionError("a 2**52-byte allocation succeeded")


def _chained() -> RuntimeError:
    """An error raised while handling an out-of-memory error (as a checkpoint writer or a collective does)."""
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("checkpoint writer failed on rank 0") from inner
    except RuntimeError as outer:
        return outer


OOM = {
    "torch CUDA allocator": (torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.06 GiB "
        "is free."), " (an allocation of 2.00 GiB)"),
    "torch ROCm allocator": (torch.OutOfMemoryError("HIP out of memory. Tried to allocate 512.00 MiB."),
                             " (an allocation of 512.00 MiB)"),
    "CUDA runtime": (torch.AcceleratorError(
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, so "
        "the stacktrace below might be incorrect."), ""),
    "CPU allocator": (_cpu_allocation_failure(), " (an allocation of 4096.0 TiB)"),
    "Python MemoryError": (MemoryError(), ""),
    "cuBLAS": (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
               " (in cuBLAS)"),
    "cuDNN 8": (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), " (in cuDNN)"),
    "cuDNN 9 device": (RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),
                       " (in cuDNN)"),
    "cuDNN 9 host": (RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"), " (in cuDNN)"),
    "NCCL calloc": (dist.DistBackendError(NCCL_CALLOC), " (an allocation of 6.0 MiB in NCCL)"),
    "NCCL calloc async": (dist.DistBackendError(NCCL_CUDA.format(last="Failed to CUDA calloc async 2432 bytes")),
                          " (an allocation of 2.4 KiB in NCCL)"),
    "NCCL malloc": (dist.DistBackendError(NCCL_CUDA.format(last="Failed to CUDA malloc 536870912 bytes")),
                    " (an allocation of 512.0 MiB in NCCL)"),
    "NCCL CUDA failure": (dist.DistBackendError(NCCL_CUDA.format(last="Cuda failure 'out of memory'")),
                          " (in NCCL)"),
    "NCCL CUDA failure, before 2.19": (dist.DistBackendError(NCCL_CUDA.format(last="Cuda failure 2 'out of memory'")),
                                       " (in NCCL)"),
    "NCCL host malloc": (dist.DistBackendError(NCCL_SYSTEM.format(last="Failed to malloc 1048576 bytes")),
                         " (an allocation of 1.0 MiB in NCCL)"),
    "raised from an OOM": (_chained(), ""),
}

NOT_OOM = {
    "NCCL peer gone": dist.DistBackendError(NCCL_HEAD.format(what="remote process exited or there was a network "
                                            "error") + "ncclRemoteError: A call failed possibly due to a network "
                                            "error or a remote process exiting prematurely.\nLast error:\nsocket "
                                            "closed"),
    "NCCL aborted": dist.DistBackendError("NCCL communicator was aborted on rank 1. "),
    "NCCL without its last error": dist.DistBackendError(NCCL_CUDA.split("\nLast error")[0]),
    "cuDNN bad parameter": RuntimeError("cuDNN error: CUDNN_STATUS_BAD_PARAM"),
    "cuBLAS execution": RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle)`"),
    "a malloc outside NCCL": RuntimeError("Failed to malloc 1048576 bytes"),
    "a shape error": RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
}


@pytest.mark.parametrize("name", list(OOM))
def test_each_allocation_failure_is_out_of_memory_and_says_what_failed(name: str) -> None:
    err, said = OOM[name]
    assert is_oom(err)
    assert failed_allocation(str(err)) == said


@pytest.mark.parametrize("name", list(NOT_OOM))
def test_errors_that_resemble_one_are_not_out_of_memory(name: str) -> None:
    assert not is_oom(NOT_OOM[name])


def test_debug_memory_records_python_stacks_with_this_torchs_arguments() -> None:
    """``--debug-memory``'s call binds to torch's own signature (a renamed argument fails here, not on a GPU)."""
    bound = inspect.signature(torch.cuda.memory._record_memory_history).bind(**DEBUG_MEMORY_HISTORY)
    assert bound.arguments["stacks"] == "python" and bound.arguments["enabled"] == "all"
