"""User-facing errors: one clear sentence, no traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix (bad input, missing file, impossible setting).

    The CLI prints ``str(err)`` as one line and exits with ``exit_code``; no traceback.
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
