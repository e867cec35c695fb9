"""Opening a logger's backends on its writer (or a remote backend's lane), and opening them again later.

A backend opens on the thread that will call it, never on the training thread: the writer's, or its own lane's
(`instrument.logger.lane`). One whose open fails is left out of the run, unless it `Backend.reopens` (a tracking
server that did not answer): then it stays, and its next records try to open it again (`reopening_call`).
"""

from typing import Any, Callable

from instrument.backends.base import Backend
from instrument.backends.held import hold, let_go
from instrument.errors import InstrumentError
from instrument.logger import shutdown

__all__ = ["open_backend", "reopening_call"]


def open_backend(writer: Any, backend: Backend, *args: Any, lane: Any = None) -> bool:
    """``backend.open``, and the backend joins the active ones (a remote one's ``lane`` opens it on its own
    thread; it is active already). A failure is kept in `open_errors` for the
    logger to raise at start, and reported through the ledger only when nobody is waiting to raise it
    (``report_open``). A backend that ``reopens`` joins anyway, unless the failure was instrument's own
    error (a bad option, a missing extra), which would only repeat. The files it writes (`Backend.writes_to`)
    are this writer's from just before its open until it closes or is left out (`instrument.backends.held`)."""
    where = writer.ledger if lane is None else lane
    where.running = (backend.name, "open")
    try:
        hooks = shutdown.exit_hooks()
        hold(writer, backend, *args)  # its files: refused if another session's open backend writes one
        backend.open(*args)
        if getattr(backend, "sdk_exit_hook", False) or hooks is None or shutdown.exit_hooks() != hooks:
            shutdown.keep_first_at_exit()  # so that the loggers are closed before that hook runs
        if lane is None:
            writer._active.append(backend)
        return True
    except BaseException as exc:  # on this thread a SystemExit or CancelledError is the backend's failure too
        writer.open_errors.append((backend, exc))
        again = getattr(backend, "reopens", False) and not isinstance(exc, InstrumentError)
        if again and lane is not None:
            lane.unopened = True
        elif again:
            writer._active.append(backend)
            writer._unopened.append(backend)
        else:  # left out: its files are free again
            let_go(writer, backend)
        if writer.report_open:
            consequence = (
                "it stays in the run and tries to open again at its next record (bounded by its own "
                "timeouts); the records before it opens are not written to it; training and the other "
                "backends go on"
                if again
                else "it is left out of this run and gets no steps; training and the other backends go on"
            )
            writer.ledger.record(backend.name, "open", exc, consequence)
        return False
    finally:
        where.running = None


def reopening_call(writer: Any, name: str, method: str, call: Callable[[], bool]) -> bool:
    """``call()``, a call to backend ``name`` whose open failed and which opens itself on its next call
    (`Backend.reopens`); True once it has opened. Once a close with a time bound is queued (SIGTERM's, a failed
    start's) it is not called at all: a try to open may take the backend's whole timeout, which the steps still
    queued for the other backends must not wait for. The call missed is a failure either way (the caller
    counts it)."""
    if writer.closing_bounded():
        writer.ledger.record(name, method)
        return False
    return call()
