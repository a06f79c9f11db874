"""One run at a time in an output directory: an exclusive lock held from the launcher's preflight to its exit.

Two runs writing one ``output.dir`` (started twice by mistake, or a scheduler's requeue while the old job still
runs) would replace each other's checkpoints, prune each other's, and write the same final files. The launcher
that prepares the run (node 0's: it clears, resumes and writes the run files) takes :class:`OutputLock` before
it touches anything there: ``fcntl.flock`` on ``output.dir/.finetune.lock``, with the holder's pid, host and
start time written in the file. The kernel releases a flock when its process dies, so a lock file left by a
killed run is simply taken over; a held one is refused in one sentence naming its holder. Where a filesystem
cannot flock, the written holder decides: a live process on this host, or any process on another host (whose
liveness cannot be seen from here), keeps the directory; a dead process on this host is stale and taken over.
The file is emptied on release, never removed: removing it would let a run that opened it just before lock a
file no one else can see.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from finetune.errors import UserError

LOCK_NAME = ".finetune.lock"


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        return True
    return True


def _holder(fd: int) -> dict[str, Any]:
    """What the lock file says about its holder ({} when empty or unreadable)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 4096).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    pid, host, since = holder.get("pid", "?"), holder.get("host", "?"), holder.get("started", "?")
    here = " (this host)" if host == socket.gethostname() else ""
    return f"pid {pid} on {host}{here}, since {since}"


class OutputLock:
    """``with OutputLock(out_dir):`` this process holds ``out_dir`` exclusively (see the module's docstring)."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise the one-sentence :class:`UserError` naming its holder."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise UserError(
                f"output.dir: cannot create {self.path} ({exc.strerror}); choose a writable directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UserError(
                f"output.dir: {self.out_dir} is in use by another run ({_describe(holder)}; lock file {self.path}); "
                "wait for it to finish or stop it, or choose another output.dir"
            ) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            self._without_flock(fd)  # this filesystem has no flock: the written holder decides
        self.fd = fd
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(mine) + "\n").encode())
        os.fsync(fd)

    def _without_flock(self, fd: int) -> None:
        holder = _holder(fd)
        pid, host = holder.get("pid"), holder.get("host")
        if not isinstance(pid, int) or pid == os.getpid():
            return
        if host != socket.gethostname() or _alive(pid):
            os.close(fd)
            where = "" if host == socket.gethostname() else "; it is on another host, so if that run is over, remove the file"
            raise UserError(
                f"output.dir: {self.out_dir} is in use by another run ({_describe(holder)}; lock file {self.path}"
                f"{where}); wait for it to finish or stop it, or choose another output.dir"
            )

    def release(self) -> None:
        """Empty the lock file and let go of it."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing the last descriptor releases the flock
        self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
