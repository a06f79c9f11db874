"""Fault injection for the tests, installed in every run of the suite through $FINETUNE_HOOKS (conftest.py).

Each fault is switched on by an environment variable, so a test asks for it per run (also in the worker
processes torch.distributed.run starts):
  FINETUNE_FAIL_RANK=R, FINETUNE_FAIL_AT_STEP=S  rank R raises InjectedFailure when step S starts
  FINETUNE_TEST_NAN_AT_STEP="3,5"                 those steps' loss and gradients become NaN
  FINETUNE_TEST_KILL_AT_STEP="R:S"                rank R SIGKILLs itself in step S (first torchrun attempt only)
  FINETUNE_TEST_STEP_SLEEP=SECONDS                sleep after every step (so a test can signal a run mid-way)
  FINETUNE_TEST_HOLD_UNTIL=PATH                   after step 1, wait (at most 600 s) until PATH exists: the run is
                                                  certainly alive while a test does something beside it
  FINETUNE_TEST_SIGNAL_AT_STEP="SIG:S"            after step S, the process sends itself SIG (e.g. USR1:2),
                                                  as SLURM does ahead of a time limit (first attempt only)
  FINETUNE_TEST_CHECKPOINT_SLEEP="STEP:SECONDS"   stall the checkpoint of STEP half-written (tensors, no meta.json)
  FINETUNE_TEST_DISK_FULL_AT_STEP=STEP            the checkpoint of STEP fails half-written with ENOSPC
  FINETUNE_TEST_TOKENIZE_SLEEP=SECONDS            sleep before tokenizing each source the cache does not hold
  FINETUNE_TEST_TOKENIZE_LOG=PATH                 append "RANK SOURCE" to PATH for each source tokenized
"""

from __future__ import annotations

import errno
import os
import signal
import time

import torch

from finetune.train.hooks import TrainerHooks


class InjectedFailure(RuntimeError):
    """Raised by the failure hook."""


class FaultHooks(TrainerHooks):
    """The faults the environment asks for (see the module docstring)."""

    def before_step(self, step: int, rank: int) -> None:
        """Raise on the asked rank and step."""
        fail_rank, at = os.environ.get("FINETUNE_FAIL_RANK"), os.environ.get("FINETUNE_FAIL_AT_STEP")
        if fail_rank is not None and at is not None and int(fail_rank) == rank and int(at) == step:
            raise InjectedFailure(f"injected failure at step {step} (FINETUNE_FAIL_RANK={fail_rank})")

    def after_backward(self, step: int, params: list[torch.Tensor], loss_sum: torch.Tensor) -> torch.Tensor:
        """SIGKILL or NaN as asked."""
        kill = os.environ.get("FINETUNE_TEST_KILL_AT_STEP")
        if kill and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
            rank, _, at = kill.partition(":")
            if int(rank) == int(os.environ.get("RANK", "0")) and int(at) == step:
                os.kill(os.getpid(), signal.SIGKILL)
        nan_steps = os.environ.get("FINETUNE_TEST_NAN_AT_STEP")
        if nan_steps and step in {int(s) for s in nan_steps.split(",") if s.strip()}:
            for p in params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            return loss_sum * float("nan")
        return loss_sum

    def after_step(self, step: int) -> None:
        """Signal this process, or sleep, as asked."""
        asked = os.environ.get("FINETUNE_TEST_SIGNAL_AT_STEP")
        if asked and os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0"):
            name, _, at = asked.partition(":")
            if int(at) == step:
                os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
        delay = os.environ.get("FINETUNE_TEST_STEP_SLEEP")
        if delay:
            time.sleep(float(delay))
        hold = os.environ.get("FINETUNE_TEST_HOLD_UNTIL")
        if hold and step == 1:
            deadline = time.monotonic() + 600
            while not os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.1)

    def checkpoint_half_written(self, step: int) -> None:
        """Stall, or fail as a full disk does, as asked."""
        full = os.environ.get("FINETUNE_TEST_DISK_FULL_AT_STEP")
        if full and int(full) == step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "meta.json")
        spec = os.environ.get(CHECKPOINT_SLEEP)
        if spec:
            at, _, seconds = spec.partition(":")
            if int(at) == step:
                time.sleep(float(seconds))

    def before_tokenizing(self, source: str) -> None:
        """Note the source, and sleep, as asked: a data set that takes long to tokenize."""
        log = os.environ.get(TOKENIZE_LOG)
        if log:
            with open(log, "a") as f:
                f.write(f"{os.environ.get('RANK', '0')} {source}\n")
        delay = os.environ.get(TOKENIZE_SLEEP)
        if delay:
            time.sleep(float(delay))


CHECKPOINT_SLEEP = "FINETUNE_TEST_CHECKPOINT_SLEEP"
TOKENIZE_SLEEP = "FINETUNE_TEST_TOKENIZE_SLEEP"
TOKENIZE_LOG = "FINETUNE_TEST_TOKENIZE_LOG"
