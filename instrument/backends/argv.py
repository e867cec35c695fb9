"""``sys.argv`` swapped for the redacted command line while W&B reads it (`WandbBackend.open`).

W&B (``Settings._args``) takes the command line from ``sys.argv`` and has no setting to pass another, so the
swap lasts only for ``wandb.init`` on the writer thread, under a lock. A child forked during a swap gets a new
lock and the command line as it was.
"""

import contextlib
import os
import sys
import threading
from typing import Iterator, List, Optional, Sequence

__all__ = ["redacted_argv"]

_ARGV_LOCK = threading.Lock()
_ARGV_SAVED: List[List[str]] = []  # sys.argv before a swap in flight (`_after_fork_in_child`)


def _after_fork_in_child() -> None:
    """A child forked during a swap gets a new lock (the held one would stop its own wandb.init) and its argv."""
    global _ARGV_LOCK
    _ARGV_LOCK = threading.Lock()
    if _ARGV_SAVED:
        sys.argv[:] = _ARGV_SAVED[0]
        _ARGV_SAVED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def redacted_argv(argv: Optional[Sequence[str]]) -> Iterator[None]:
    """``sys.argv`` replaced by ``argv`` (the redacted command line) while W&B reads it, when they differ."""
    if argv is None or list(argv) == sys.argv:
        yield
        return
    with _ARGV_LOCK:
        saved = sys.argv[:]
        _ARGV_SAVED.append(saved)
        sys.argv[:] = list(argv)
        try:
            yield
        finally:
            sys.argv[:] = saved
            _ARGV_SAVED.clear()
