"""Sessions dropped without ``close()``: said once, when the next session starts.

A session's logger keeps a writer thread and its backends' files open until it is closed: the thread holds it,
so dropping the last reference to an `Instrumentation` (a notebook cell that makes a new one on every run) does
not free it, and its last staged steps are written only at process exit. Closing it on garbage collection is
not done: whoever kept ``inst.logger`` may still log through it. So a new session says how many earlier ones
were dropped open, and where their runs are, with how to avoid it.
"""

import logging
import threading
import weakref
from typing import Any, List, Tuple

__all__ = ["track", "untrack", "say_dropped", "was_dropped"]

log = logging.getLogger("instrument")

_lock = threading.Lock()
_open: List[Tuple["weakref.ref[Any]", Any, str]] = []  # (the session, weakly; its logger; its run folder)
_said: List[Tuple[Any, str]] = []  # (logger, run folder) of dropped sessions already said: `was_dropped`


def track(session: Any, logger: Any, run_dir: Any) -> None:
    with _lock:
        _open.append((weakref.ref(session), logger, str(run_dir)))


def untrack(session: Any) -> None:
    with _lock:
        _open[:] = [entry for entry in _open if entry[0]() is not session]


def was_dropped(run_dir: Any) -> bool:
    """Whether a session of the run in ``run_dir`` was dropped without close() and still holds it open."""
    with _lock:
        held = [(logger, run) for ref, logger, run in _open if ref() is None] + _said
        return any(run == str(run_dir) and not logger._closed for logger, run in held)


def say_dropped() -> None:
    """Warn once about the sessions whose object is gone while their logger is still open (each said once)."""
    with _lock:
        dropped = [run for ref, logger, run in _open if ref() is None and not logger._closed]
        _said[:] = [entry for entry in _said if not entry[0]._closed]
        _said.extend((logger, run) for ref, logger, run in _open if ref() is None and not logger._closed)
        _open[:] = [entry for entry in _open if entry[0]() is not None and not entry[1]._closed]
    if dropped:
        shown = ", ".join(dropped[:3]) + (f" and {len(dropped) - 3} more" if len(dropped) > 3 else "")
        log.warning(
            "instrument: %d earlier Instrumentation session(s) were dropped without close() (%s); each keeps its "
            "writer thread and open files until the process exits, and its last staged values are written only "
            "then. Close a session before making the next: inst.close(), or `with instrument.Instrumentation(...) "
            "as inst:`.", len(dropped), shown,
        )
