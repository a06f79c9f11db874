"""Graceful stop on SIGTERM, Ctrl-C (SIGINT) and SIGUSR1/SIGUSR2: finish the current step, save a checkpoint,
exit with 128 + the signal's number.

SIGUSR1 and SIGUSR2 are what clusters send ahead of a job's time limit (SLURM's ``sbatch --signal=USR1@120``;
SIGTERM comes at the limit itself and on preemption): the checkpoint is written before the job is killed, and
the exit status (138 for USR1) tells the batch script to requeue the job, which then resumes from it.

The handler only records the signal; the loop asks :meth:`StopRequest.agreed` at the end of every optimizer
step, which sums the flag over all ranks so every rank stops after the same step and joins the same (collective)
checkpoint save. A second Ctrl-C restores the default handler and interrupts at once, except in a worker
started by torchrun: there the agent forwards the terminal's signal once more, so repeats are ignored (the
agent kills the workers itself after TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

#: The signals that stop a run gracefully.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class StopRequest:
    """Records SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 while installed (a context manager); main thread only, else
    inert."""

    def __init__(self, announce: Callable[[str], None] | None = None) -> None:
        self.signum: int | None = None
        self._announce = announce
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and "TORCHELASTIC_RUN_ID" in os.environ:
            return  # the agent's forwarded copy of the signal this worker already has
        if self.signum is not None and signum == signal.SIGINT:
            # Second Ctrl-C: the user does not want to wait for the step and the save.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signum = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, self._handle)
        if self._announce is not None:
            name = signal.Signals(signum).name
            extra = "; press Ctrl-C again to quit without saving" if signum == signal.SIGINT else ""
            self._announce(f"\n{name} received: finishing this step and saving a checkpoint{extra}")
            sys.stdout.flush()

    def agreed(self, all_reduce_sum: Callable[[list[float]], Any]) -> bool:
        """True on every rank when any rank was signalled (a collective: every rank calls each step). Every rank
        then stops as for the same signal, the first of :data:`STOP_SIGNALS` that any rank received, so that
        all of them exit with the same status."""
        mine = [1.0 if self.signum == sig else 0.0 for sig in STOP_SIGNALS]
        received = [float(n) > 0 for n in all_reduce_sum(mine)]
        if not any(received):
            return False
        self.signum = STOP_SIGNALS[received.index(True)]
        return True

    @property
    def exit_code(self) -> int:
        """128 + the signal number (130 for Ctrl-C, 143 for SIGTERM, 138 for SIGUSR1), as a shell reports it."""
        return 0 if self.signum is None else exit_code(self.signum)


def exit_code(signum: int) -> int:
    """The exit status of a run stopped by signal ``signum``, as a shell reports a process it killed."""
    return 128 + int(signum)
