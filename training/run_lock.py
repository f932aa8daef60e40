"""One live process per run directory: `<run_dir>/.lock`, held with flock for the run's life.

The main process (rank 0) takes it before it writes anything in the run directory:

    lock = RunLock(run_dir).acquire()   # RunLockedError if another live process holds it
    ...                                 # the run
    lock.release()                      # or let the process end: the kernel drops a flock with the process

A second process that tries the same directory gets RunLockedError naming the PID, host and start time of the
holder. The lock dies with its process (exit, crash, kill -9), so a stale .lock file never blocks a resume. flock is
per open file: a child forked while the lock is held (a data-loader worker) shares it until it exits too. On a
network file system flock may be local to each host (docs/robustness.md).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunLockedError(RuntimeError):
    """The run directory is held by another live process."""


class RunLock:
    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock or raise RunLockedError at once (it never waits)."""
        if self._fd is not None:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockedError(
                f"run directory {self.run_dir} is in use by another process ({holder}); wait for it to finish, "
                f"stop it, or train under another name (name=<new name>)") from None
        except BaseException:
            os.close(fd)
            raise
        # the holder's identity, for the error a second process gets (the file is never removed: removing it would
        # let a third process lock a new file while the second still waits on the old one)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:  # noqa: PYI034 (a final class: acquire() returns this lock)
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on host {info['host']}, since {info['started']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown: the lock file names no process"
