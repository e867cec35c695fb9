"""The run folder's writer lock: one process at a time writes a run, new or resumed.

Rank 0 holds an exclusive ``flock`` on `LOCK_FILE` in the run folder from the start of a session until its
close. A second process that starts or resumes the same run while the first still writes it is refused: its
``on_resume`` would cut the live process's JSONL under it and hide its TensorBoard steps. The kernel drops the
lock when the holding process dies however it dies (SIGKILL, a crash), so a crashed run can be resumed at
once; nothing stale is left to delete by hand.

A forked child inherits the descriptor but not the lock's ownership: it closes its copy on arrival (closing a
copy never unlocks the parent's, an ``LOCK_UN`` would), and its own close leaves the lock alone.
"""

import contextlib
import logging
import os
from pathlib import Path
from typing import Dict, Optional, Tuple

from instrument.session import dropped

try:
    import fcntl
except ImportError:  # not POSIX: no lock, as before it existed
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "lock", "unlock"]

log = logging.getLogger("instrument")

LOCK_FILE = ".instrument-lock"  # holds the pid of the process writing the run, for the refusal's message

_held: Dict[Path, Tuple[int, int]] = {}  # run folder -> (descriptor, pid of the process that took it)


def lock(run_dir: Path) -> Optional[str]:
    """Take the run folder's lock for this process: None when held (or when it cannot be taken at all: no
    folder, no ``flock`` there, which is said once), else the refusal naming the process that writes it."""
    if fcntl is None:
        return None
    if run_dir in _held:
        return _refusal(run_dir, os.getpid())
    path = run_dir / LOCK_FILE
    for _ in range(10):  # a lock file unlinked by its releaser between our open and our lock: open it again
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError:
            return None  # no folder to write in: the backends say why
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            return _refusal(run_dir, pid)
        except OSError as exc:  # a file system without flock: run unguarded rather than not at all
            os.close(fd)
            log.warning("instrument: could not lock %s (%s); a second process resuming run %r at the same time "
                        "would not be refused", path, exc, run_dir.name)
            return None
        if _same_file(fd, path):
            with contextlib.suppress(OSError):  # the pid is for people; a full disk leaves it out
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _held[run_dir] = (fd, os.getpid())
            return None
        os.close(fd)
    return None


def unlock(run_dir: Path) -> None:
    """Release the lock this process took on ``run_dir`` (none held, or taken by a parent before a fork: nothing).

    The file is removed first, while still locked, so the folder is left as the run wrote it; a process that
    opened it just before sees, once it gets the lock, that it is no longer the folder's file (`lock`)."""
    fd, pid = _held.pop(run_dir, (None, None))
    if fd is None or pid != os.getpid():
        return
    path = run_dir / LOCK_FILE
    with contextlib.suppress(OSError):
        if _same_file(fd, path):
            path.unlink()
    os.close(fd)  # drops the lock


def _same_file(fd: int, path: Path) -> bool:
    try:
        held, named = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _read_pid(fd: int) -> Optional[int]:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


def _refusal(run_dir: Path, pid: Optional[int]) -> str:
    where = f"run {run_dir.name!r} in {str(run_dir.parent)!r}"
    if pid == os.getpid() and dropped.was_dropped(run_dir):
        who = (f"this process (pid {pid}) still writes {where}: an Instrumentation of that run was dropped without "
               f"close() (a notebook cell run again, say), so nothing can close it now; its steps are written and "
               f"its files closed when the process exits. Choose another run_name, or restart the process (the "
               f"kernel) to resume this run; next time close the session first (inst.close(), or `with "
               f"instrument.Instrumentation(...) as inst:`)")
    elif pid == os.getpid():
        who = (f"this process (pid {pid}) still writes {where}: an Instrumentation of that run was not closed, "
               f"or its close(timeout=...) gave up while a backend call was still running (its writer holds the "
               f"run until that call returns). Close it (inst.close(), without a timeout) before starting or "
               f"resuming the run again")
    else:
        who = (f"another process{f' (pid {pid})' if pid else ''} is writing {where} (it holds "
               f"{run_dir / LOCK_FILE}); two processes would cut, hide and interleave each other's steps. Wait "
               f"for it to end, or stop it, then resume; to start a separate run, choose another run_name")
    return who + ". (The lock ends with the process that holds it, however it ends, so a crashed run can be resumed.)"


def _forget_in_child() -> None:
    """A forked child writes none of its parent's runs: close the inherited descriptors (the parent keeps its
    lock: only an explicit unlock or the last close of the shared file drops it)."""
    for fd, _ in list(_held.values()):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
