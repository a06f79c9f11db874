"""Graceful stop on SIGTERM and Ctrl-C (SIGINT): finish the current step, save a checkpoint, exit.

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

#: Exit status of a run stopped by a signal, as a shell reports it.
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StopRequest:
    """Records SIGINT/SIGTERM while installed (a context manager); main thread only, else inert."""

    def __init__(self, announce: Callable[[str], None] | None = None) -> None:
        self.signum: int | None = None
        self._announce = announce
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
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

    def agreed(self, all_reduce_sum: Callable[[float], Any]) -> bool:
        """True on every rank when any rank was signalled (a collective: every rank calls each step)."""
        stop = float(all_reduce_sum(1.0 if self.signum is not None else 0.0)) > 0
        if stop and self.signum is None:
            self.signum = signal.SIGTERM  # another rank was signalled: stop the same way
        return stop

    @property
    def exit_code(self) -> int:
        """128 + the signal number (130 for Ctrl-C, 143 for SIGTERM), as a shell reports it."""
        if self.signum is None:
            return 0
        return EXIT_CODES.get(signal.Signals(self.signum), 128 + int(self.signum))
