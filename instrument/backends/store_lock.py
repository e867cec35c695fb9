"""A lock between processes (and threads) around opening a local store that several runs share.

MLflow creates and migrates a new sqlite store at its first use. Several processes doing that at once, such as a
sweep's ``multiprocessing.Pool`` workers that share one ``log_dir`` and so MlflowBackend's default
``sqlite:///<log_dir>/mlflow.db``, fail: in a review, two of three workers' starts raised MLflow's "Online
migration expected to match one row" and their runs went without MLflow. `held` serialises that first use with an
exclusive ``flock`` on a file beside the store. The kernel drops the lock when its holder exits however it exits,
so nothing stale is left. Where ``flock`` is not available (not POSIX, or a file system without it) the block runs
unlocked, as before.
"""

import contextlib
import os
import threading
from pathlib import Path
from typing import Iterator, Optional, Set

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["held"]

_open: Set[int] = set()  # the descriptors `held` holds now, in this process
# Held while a descriptor is opened and listed, or unlisted and closed, and by a thread forking (`_before_fork`):
# a child forked between the two steps would get a copy that `_close_in_child` does not know.
_guard = threading.Lock()


@contextlib.contextmanager
def held(path: Optional[Path]) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made if missing) for the block; None, or no ``flock``: no lock. The
    lock is per open file, so two threads of one process each wait for the other too."""
    fd = None
    if path is not None and fcntl is not None:
        try:
            with _guard:
                fd = _opened(path)
                _open.add(fd)
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another process opens the store
        except BaseException as exc:  # no folder to write in (the store says why), no flock there: unlocked
            _release(fd)
            fd = None
            if not isinstance(exc, OSError):  # Ctrl-C while waiting: the descriptor is closed first
                raise
    try:
        yield
    finally:
        _release(fd)


def _opened(path: Path) -> int:
    """The lock file's descriptor: read-only where another user made it (flock needs no write access)."""
    cloexec = getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | cloexec, 0o644)
    except PermissionError:
        return os.open(path, os.O_RDONLY | cloexec)


def _release(fd: Optional[int]) -> None:
    if fd is not None:
        with _guard:
            _open.discard(fd)
            os.close(fd)  # closing the descriptor releases the lock


def _before_fork() -> None:
    _guard.acquire()


def _after_fork_in_parent() -> None:
    _guard.release()


def _close_in_child() -> None:
    """A child forked while a thread of its parent held the lock has a copy of the descriptor, and a flock belongs
    to the open file, not to a process: the copy would keep the store locked after the parent's block ended, for
    as long as the child lives (its own MLflow open, or any other process's, would wait for it). Closing the
    copy leaves the parent's lock as it is."""
    global _guard
    for fd in list(_open):
        try:
            os.close(fd)
        except OSError:
            pass
    _open.clear()
    _guard = threading.Lock()  # the parent's, taken by the forking thread: a new one


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_close_in_child)
