"""The local files and folders this process's open backends write (`Backend.writes_to`), held from open to close.

`check_apart` keeps two backends of one logger off one path; this keeps two sessions of one process apart. Two
open sessions that write one place mix their runs there: TensorBoard shows both runs' steps in one folder as one
run (every step twice), two JSONL writers interleave their lines, and one's resume cuts or hides the other's
steps. So a logger's writer thread takes a backend's paths here just before it opens the backend, for that
logger (the ``holder``), and a backend of another logger that names one of them is refused with a
`ConfigurationError` (at start, through the logger's report of backends that could not open). Its paths are
let go when it closes (the logger's close, `Logger.close_backend`, or the close of a start that failed) and when
its open fails. A close that gave up on a hung backend call lets them go only once that call returns and the
writer has written the rest and closed the backends, since it writes them until then. A backend instance given
to a later run holds that run's paths for that run's logger; one instance open for one session is refused to
another, whatever its paths (`_open`).

A session dropped without ``close()`` (a notebook cell that raised) keeps its paths until the process ends: its
writer thread, and a system monitor, may still write them.

A forked child inherits no open backend, but its parent's writer threads go on writing the parent's paths and
the child cannot tell when they stop: the child keeps the paths its parent held at the fork as taken (it never
lets them go) and refuses a backend of its own that names one, saying so. Processes that share a path without
one having forked the other are not checked here (the run folder's lock, `instrument.session.run_lock`, keeps
two processes out of one run folder).
"""

import os
import threading
from typing import Any, Dict, NamedTuple, Optional

from instrument.backends.base import Backend, RunInfo
from instrument.errors import ConfigurationError

__all__ = ["hold", "let_go"]


class _Hold(NamedTuple):
    holder: Any  # the logger's writer that opened the backend
    backend: Backend
    pid: int  # the process that took it: another one's (a forked child's parent) is never let go here


_held: Dict[str, _Hold] = {}  # resolved path -> who writes it
# id(backend) -> who has it open, whatever it writes: an instance without a path of its own (JsonlBackend(),
# TensorBoardBackend()) names another folder for each run, so two sessions sharing it hold no path in common,
# yet its second open took its file (or writer) from the first, whose records then went into the second run.
_open: Dict[int, _Hold] = {}
_lock = threading.Lock()  # the writer threads of several sessions open backends at once


def hold(holder: Any, backend: Backend, run: RunInfo) -> None:
    """Take ``backend`` and every path of ``backend.writes_to(run)`` for ``holder``, or nothing: a
    `ConfigurationError` when another holder has this backend open, or another open backend holds one path."""
    paths = backend.writes_to(run)
    with _lock:
        other = _open.get(id(backend))
        # (a forked child's copy of an instance its parent has open is another object: its paths are checked)
        if other is not None and other.backend is backend and other.holder is not holder and other.pid == os.getpid():
            raise _refusal(backend, None, other, same_session=False)
        for path in paths:
            other = _held.get(path)
            if other is not None and (other.holder is not holder or other.backend is not backend):
                raise _refusal(backend, path, other, same_session=other.holder is holder)
        taken = _Hold(holder, backend, os.getpid())
        _open[id(backend)] = taken
        for path in paths:
            _held[path] = taken


def let_go(holder: Any, backend: Optional[Backend] = None) -> None:
    """Let go of ``backend`` and the paths ``holder`` took for it (None: of every backend it holds)."""
    with _lock:
        for table in (_held, _open):
            for key in [key for key, held in table.items()
                        if held.holder is holder and (backend is None or held.backend is backend)]:
                del table[key]


def _refusal(backend: Backend, path: Optional[str], other: _Hold, same_session: bool) -> ConfigurationError:
    named = repr(backend) if backend.name == type(backend).__name__ else f"{backend.name} ({backend!r})"
    if path is None:  # this very instance is open for another session (`_open`)
        return ConfigurationError(
            f"{named} is already open for another session in this process: one backend object "
            f"writes one run at a time (its file or writer would be taken from that session, whose records would "
            f"go into this run). Give this session a backend object of its own (a {type(backend).__name__} made "
            f"anew for it), or close the other session first (inst.close())."
        )
    why = ("(expected one open writer per file or folder: two runs written into one place are mixed there, "
           "TensorBoard showing both runs' steps as one run, JSONL interleaving their lines, and one's resume "
           "would cut or hide the other's steps; a TensorBoardBackend also writes the folder 'system' in its "
           "log_dir)")
    own = "Give this run its own path (e.g. JsonlBackend(path='eval.jsonl'), TensorBoardBackend(log_dir='runs/tb2'))"
    if other.pid != os.getpid():
        return ConfigurationError(
            f"{named} would write {path}, which {other.backend!r} of a session of process {other.pid} wrote "
            f"when this process was forked from it (or from a child of it); its writer may still write there, and "
            f"this process cannot tell when it stops, so the path stays taken here for as long as this process runs "
            f"{why}. {own}, or close the parent's session before forking."
        )
    return ConfigurationError(
        f"{named} would write {path}, which {other.backend!r} of {'this' if same_session else 'another'} session "
        f"in this process still writes {why}. {own}, or close the other session first (inst.close()); once it is "
        f"closed, a later session may write the path (a run resumed in a new session, say). A session you no "
        f"longer hold (a notebook cell that raised before close()) keeps writing until the process ends: give "
        f"this run another path, or restart the process; `with instrument.Instrumentation(...) as inst:` closes "
        f"a session also when its block raises."
    )


def _fresh_lock_in_child() -> None:
    """Another thread may have held the lock at the fork. The parent's paths stay, as the parent's (`_Hold.pid`)."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_child)
