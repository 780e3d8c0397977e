"""Exclusive locks on files, held for as long as a process needs a directory to itself (a training's save dir,
a preparation's output)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


class LockHeld(Exception):
    """The lock file is held by another process; ``owner`` is the pid it wrote (or "unknown")."""

    def __init__(self, owner: str) -> None:
        super().__init__(owner)
        self.owner = owner


def lock_file(path: str | os.PathLike, mode: int) -> int | None:
    """Take an exclusive, non-blocking ``flock`` on ``path`` (created with ``mode``) and write this process's pid
    into it: the open descriptor, to keep open while the lock is held (the system drops the lock when the process
    ends, however it ends). :class:`LockHeld` with the holder's pid where another process has it; None (no lock) on
    a file system without ``flock``."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise LockHeld(owner) from None
    except OSError as exc:  # e.g. a network file system without flock
        os.close(fd)
        log.debug("%s: not locked (%s)", path, exc)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
