"""Ending a run cleanly when the process ends: SIGTERM, SIGINT, an uncaught exception, or plain exit.

Every live `Logger` is registered here (weakly). What happens:

- SIGTERM with no handler of Python's before ours (the default action): every live logger writes and flushes
  what was handed over, calls ``backend.on_exit("killed")`` and closes its backends (bounded by ``TIMEOUT``
  seconds per logger); then the default action is re-delivered so the process still ends by the signal. A
  logger whose close is under way (also on the main thread the signal interrupted) is waited for, within the
  same bound. During a session's start on the main thread (`starting`: backends opening) the signal is
  raised there instead, as Ctrl-C is, so the start ends what it opened ``"killed"`` and puts its run folder
  back; the signal is then delivered again.
- SIGTERM with a Python handler installed before ours (a preemption handler that sets a flag, submitit's,
  Lightning's): every live logger flushes what was handed over (at most ``TIMEOUT`` seconds each), the runs
  are marked ``"killed"``, and that handler runs. If it returns, training goes on with its loggers open:
  closing them first would lose every step the loop still commits before it stops, break a checkpoint
  saved in the open step, and, under a process group, leave this rank out of the commits' collectives
  while the others wait in them. If it raises (``sys.exit``), the loggers are closed as above before the
  exception goes on. A handler that ends the process with ``os._exit`` leaves them flushed but not closed.
- SIGINT: every live logger flushes (at most ``INTERRUPT_TIMEOUT`` seconds each), then the previous handler
  runs (by default it raises `KeyboardInterrupt`, so ``with`` blocks and ``finally`` clauses still run). A
  KeyboardInterrupt that ends the process marks the run ``"killed"``, and so does anything else that handler
  raises (``sys.exit``). Where SIGINT's action was the default one (``SIG_DFL``, which a launcher may set),
  which ends the process at once, every logger is closed ``"killed"`` first, as for SIGTERM.
- An uncaught exception (``sys.excepthook``) marks every live logger's run ``"failed"``; the exit closes it. A
  hook installed after ours that does not call the one before it (a crash reporter's) is caught at exit: the
  interpreter sets ``sys.last_value`` before it calls any hook (not in an interactive session, where an error at
  the prompt does not end it).
- ``atexit``: every logger still open is closed (with ``on_exit(status)`` when a status was marked). atexit
  runs its hooks last registered first, and an SDK registers its own teardown when a backend opens (W&B
  stops its service process): an open that registered an exit hook moves this hook behind it
  (`keep_first_at_exit`), so the loggers are closed, and every committed step written, before any SDK a
  backend opened is torn down. Hooks registered otherwise (a user's own) keep their order.
- ``os.fork``: the child does not inherit the loggers' writer threads, so it disowns every logger it inherits
  (a call on one raises, saying to create a Logger in the child); its exit closes nothing of the parent's.
- A multiprocessing child (fork or spawn, a ``Process``, a ``Pool`` worker, ``torch.multiprocessing.spawn``)
  never calls ``sys.excepthook`` and a forked one ends with ``os._exit`` (no atexit hooks): a Logger created in
  one is closed by a multiprocessing finalizer instead (`_close_in_child`). It runs while the target's
  exception is still in flight (``Process._bootstrap`` runs the finalizers in a ``finally``), and takes the
  status from it: KeyboardInterrupt ``"killed"``, ``SystemExit`` with a code other than None or 0 and any
  other exception ``"failed"`` (``torch.multiprocessing.spawn`` turns an exception into ``sys.exit(1)``, and
  swallows a KeyboardInterrupt). A ``Pool`` worker catches its tasks' exceptions: a task that raised leaves
  its run to close as finished when the worker ends.
- A failure or an interruption is known at exit only where Python says so: an uncaught exception (through
  ``sys.excepthook``, or in flight when a multiprocessing child ends), a signal, Ctrl-C. In the main process
  ``sys.exit(4)`` reaches no hook with its code: a run ended that way outside ``with Instrumentation(...)``
  closes as finished (pass ``close("failed")`` yourself, or use ``with``).

Handlers are installed once, from the main thread only (Python allows no other), and chain whatever handler
was installed before; a signal that was ignored (``SIG_IGN``) stays ignored.
"""

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Dict, Iterator, Optional

__all__ = ["register", "unregister", "mark", "install", "keep_first_at_exit", "exit_hooks", "interrupted",
           "starting", "TIMEOUT"]

log = logging.getLogger("instrument")

TIMEOUT = 30.0  # seconds SIGTERM or exit waits for one logger's backends
INTERRUPT_TIMEOUT = 5.0  # seconds SIGINT waits for one logger's flush (a second Ctrl-C skips the wait)

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
# Re-entrant: the signal handler runs on the main thread between any two bytecodes, also while that thread
# holds this lock (in `register`, `unregister`, `install`), and takes it again (`_loggers`, `unregister`).
_lock = threading.RLock()
_previous: Dict[int, Any] = {}
_state: Dict[str, Any] = {
    "installed": False, "atexit": False, "excepthook": None, "interrupting": False,
    "exiting": False,  # the interpreter is shutting down: the atexit hook is no longer moved
    "exited": False,  # the atexit hook ran (it runs once)
    "starting": 0,  # sessions starting on the main thread (`starting`), nested
}


class _Terminated(BaseException):
    """SIGTERM, raised into a start on the main thread (`starting`) as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum} arrived while the session was starting")
        self.signum = signum


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is Ctrl-C or a SIGTERM that cut a start short: what did open then ends ``"killed"``."""
    return isinstance(exc, (KeyboardInterrupt, _Terminated))


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """Around a start that opens backends (which may take seconds: W&B's service, an MLflow store). On the main
    thread a SIGTERM whose action is the default one is raised here instead of ending the process at once, so
    the start's own cleanup ends what it opened ``"killed"`` and removes the run folder it made (a claimed
    folder left behind would block its ``run_name``). Leaving the outermost start, the signal is delivered
    again: the other loggers are closed and the process ends by it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    install()
    signum = None
    _state["starting"] += 1
    try:
        yield
    except _Terminated as exc:
        signum = exc.signum
        raise
    finally:
        _state["starting"] -= 1
        if signum is not None and not _state["starting"]:
            os.kill(os.getpid(), signum)  # handled at once, on this thread: the default action ends the process


def register(logger: Any) -> None:
    """Track ``logger`` (weakly) and install the handlers if this is the main thread and they are not yet."""
    with _lock:
        _live.add(logger)
    install()
    _close_in_child()


def _close_in_child() -> None:
    """In a multiprocessing child, also close the loggers when multiprocessing ends the process.

    A forked child (``multiprocessing`` with the fork start method, a ``Pool`` worker) ends with ``os._exit``:
    atexit hooks never run there, so a Logger created in it and not closed would lose what its writer had not
    written yet. multiprocessing runs its own finalizers first (``util._exit_function``): one of them closes
    the loggers as the atexit hook does (once: whichever runs first), with the status of the target's ending
    (`_at_child_exit`). Registered once per process.
    """
    pid = os.getpid()
    if _state.get("finalizer_pid") == pid:
        return
    mp = sys.modules.get("multiprocessing")
    if mp is None or mp.parent_process() is None:
        return
    _state["finalizer_pid"] = pid
    try:
        from multiprocessing import util

        # before multiprocessing's own (queues, pools: 10-15)
        util.Finalize(None, _at_child_exit, exitpriority=100)
    except Exception:  # never fail a Logger over this
        log.debug("instrument: could not register a multiprocessing finalizer", exc_info=True)


def _at_child_exit() -> None:
    """multiprocessing's finalizer in a child (`_close_in_child`): mark how the target ended, then close as at
    exit.

    A child never calls ``sys.excepthook``: ``Process._bootstrap`` catches what ``run`` raised, prints it and
    turns it into the exit code. It runs the finalizers (``util._exit_function``) in a ``finally`` around
    ``run``, so that exception is still in flight here and ``sys.exc_info()`` holds it (checked on CPython
    3.11, fork and spawn). A ``Pool`` worker catches its tasks' exceptions: none is in flight when it ends.
    """
    exc = sys.exc_info()[1]
    if exc is not None and interrupted(exc):
        mark("killed")
    elif exc is not None and not (isinstance(exc, SystemExit) and _finished_code(exc.code)):
        mark("failed")
    _at_exit()


def _finished_code(code: Any) -> bool:
    """Whether ``sys.exit(code)`` ends a multiprocessing child with exit code 0 (``Process._bootstrap``'s rule)."""
    return code is None or (isinstance(code, int) and code == 0)


def unregister(logger: Any) -> None:
    with _lock:
        _live.discard(logger)


def mark(status: str) -> None:
    """Set the exit status (``"killed"``/``"failed"``) every live logger reports when it closes."""
    for logger in _loggers():
        if logger._exit_status is None:
            logger._exit_status = status


def install() -> None:
    """Install the signal handlers, the excepthook and the atexit hook once (signals: main thread only)."""
    with _lock:
        if not _state["atexit"]:
            atexit.register(_at_exit)
            _note_shutdown_start()
            previous_hook = sys.excepthook
            _state["excepthook"] = previous_hook
            _state["seen_error"] = _last_error()  # one from before (a REPL's): not this run's end
            sys.excepthook = _excepthook
            _state["atexit"] = True
        if _state["installed"]:
            return
        if threading.current_thread() is not threading.main_thread():
            if not _state.get("said_thread"):
                _state["said_thread"] = True
                log.warning(
                    "instrument: a Logger was made on thread %r, not the main thread, so no SIGTERM/SIGINT handler "
                    "is installed (Python allows them on the main thread only): until a Logger is made on the main "
                    "thread, a SIGTERM ends the process without closing this one, and what it has queued is not "
                    "written. Make the first Logger (or Instrumentation) on the main thread, or close() this one "
                    "yourself before the process ends. (Said once.)", threading.current_thread().name)
            return
        _state["installed"] = True
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                current = signal.getsignal(signum)
                if current is signal.SIG_IGN or current is None:
                    continue  # ignored on purpose, or installed outside Python: leave it alone
                _previous[signum] = current
                signal.signal(signum, _on_signal)
            except (ValueError, OSError) as exc:  # e.g. an embedded interpreter
                log.debug("instrument: could not install a handler for signal %d: %s", signum, exc)


def keep_first_at_exit() -> None:
    """Move the atexit hook to the end of atexit's list, so that it runs before every hook registered so far.

    Called on a writer thread when a backend's open registered an exit hook (`exit_hooks`), or opened a backend
    whose SDK has one (`Backend.sdk_exit_hook`, W&B): an SDK registers its own
    atexit teardown when first used (W&B's service process at the first ``wandb.init``), and atexit runs hooks
    last registered first. Without this, a Logger created before the SDK was first used (any earlier Logger
    installs the hook) is closed at exit after the SDK was torn down, and its last steps are lost. Once the
    interpreter shuts down (``threading``'s shutdown, which runs before any atexit hook, or this hook itself started)
    nothing is moved: a hook moved while atexit runs its list would never run. Never raises.
    """
    # A bounded wait: on a writer thread, the main thread may hold the lock when a signal arrives, and the
    # handler then waits for that writer (closing its logger). Not moved then, rather than a deadlock.
    if not _lock.acquire(timeout=0.1):
        return
    try:
        if not _state["atexit"] or _state["exiting"] or _state["exited"] or sys.is_finalizing():
            return
        atexit.unregister(_at_exit)
        atexit.register(_at_exit)
    except Exception:  # never fail a backend's open over the order of exit hooks
        log.debug("instrument: could not move the atexit hook", exc_info=True)
    finally:
        _lock.release()


def exit_hooks() -> Optional[int]:
    """How many atexit hooks are registered (CPython's ``atexit._ncallbacks``), None where that is unknown:
    the writer compares it around a backend's ``open`` to see whether the open registered one."""
    count = getattr(atexit, "_ncallbacks", None)
    return count() if callable(count) else None


def _note_shutdown_start() -> None:
    """Have ``threading`` say, under `_lock`, when the interpreter starts shutting down: its exit callbacks run
    on the main thread before it joins the threads and before any atexit hook, so a `keep_first_at_exit` on a
    writer thread either finished before or sees ``"exiting"`` (no hook moved while atexit runs its list)."""
    register_threading_exit = getattr(threading, "_register_atexit", None)  # CPython >= 3.9, private
    if register_threading_exit is None:
        return
    try:
        register_threading_exit(_on_shutdown_start)
    except RuntimeError:  # the interpreter is already shutting down (a Logger created in an atexit hook)
        _state["exiting"] = True


def _on_shutdown_start() -> None:
    with _lock:
        _state["exiting"] = True


def _loggers() -> list:
    with _lock:
        return list(_live)


def _on_signal(signum: int, frame: Optional[Any]) -> None:
    loggers = _loggers()
    previous = _previous.get(signum)
    if signum == signal.SIGINT and callable(previous):
        if not _state["interrupting"]:
            _state["interrupting"] = True
            try:
                for logger in loggers:
                    try:
                        logger.flush(INTERRUPT_TIMEOUT)
                    except Exception:
                        log.exception("instrument: flushing a logger on SIGINT failed")
            finally:
                _state["interrupting"] = False
        try:
            previous(signum, frame)
        except KeyboardInterrupt:  # Python's own handler: where it ends the process, the excepthook marks it
            raise
        except BaseException:  # a handler of the user's that ends the process (sys.exit): the run was killed
            mark("killed")
            raise
        return
    if callable(previous):
        _chain_terminate(signum, frame, loggers)
        return
    if _state["starting"]:
        raise _Terminated(signum)  # `starting` undoes the start, then delivers the signal again
    # The default action (SIGTERM's, or SIGINT's where SIG_DFL was set before us) ends the process at once:
    # close every logger first, then restore it and deliver the signal again, so the process ends by it.
    for logger in loggers:
        _close_within(logger, "killed", commit=False, why=f"on signal {signum}")
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _chain_terminate(signum: int, frame: Optional[Any], loggers: list) -> None:
    """SIGTERM with a Python handler installed before ours (module docstring): flush, mark, run it; close only
    when it raises."""
    for logger in loggers:
        try:
            logger.flush(TIMEOUT)
        except Exception:  # a disowned logger (forked child) or one closing: its close or exit handles it
            log.debug("instrument: flushing a logger on signal %d failed", signum, exc_info=True)
    mark("killed")
    try:
        _previous[signum](signum, frame)
    except BaseException:  # it ends the process (sys.exit, an exception): close first, as without it
        for logger in _loggers():
            _close_within(logger, "killed", commit=False, why=f"on signal {signum}")
        raise


def _excepthook(exc_type, exc, tb) -> None:
    _state["seen_error"] = exc
    mark("killed" if issubclass(exc_type, (KeyboardInterrupt, _Terminated)) else "failed")
    previous = _state["excepthook"] or sys.__excepthook__
    previous(exc_type, exc, tb)


def _after_fork_in_child() -> None:
    """A forked child inherits every logger but none of their writer threads, and maybe a lock some other
    thread held at the fork: each inherited logger is disowned (`Logger._disown`), so a
    call on it in the child says what is wrong instead of waiting forever, and the child's exit or signal
    leaves the parent's backends alone."""
    global _lock
    _lock = threading.RLock()
    loggers = list(_live)
    _live.clear()
    for logger in loggers:
        try:
            logger._disown()
        except Exception:  # never break a child (a DataLoader worker, a multiprocessing pool) over a logger
            log.debug("instrument: disowning an inherited logger in a forked child failed", exc_info=True)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _last_error() -> Optional[BaseException]:
    """The exception the interpreter last reported as uncaught: it sets ``sys.last_value`` (``sys.last_exc``)
    before it calls ``sys.excepthook``, whichever hook that is."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def _uncaught_unseen() -> Optional[BaseException]:
    """An uncaught exception that ends the process without reaching `_excepthook`: a hook installed after ours
    that does not call the one before it (a crash reporter's). Not in an interactive session, where an error
    at the prompt is reported and the session goes on."""
    error = _last_error()
    if error is None or error is _state.get("seen_error"):
        return None
    if hasattr(sys, "ps1") or sys.flags.interactive or sys.flags.inspect or "IPython" in sys.modules:
        return None
    return error


def _at_exit() -> None:
    with _lock:
        if _state["exited"]:
            return
        _state["exiting"] = _state["exited"] = True
    error = _uncaught_unseen()
    if error is not None:  # as `_excepthook` marks it: the run ended by an error, not FINISHED
        mark("killed" if isinstance(error, (KeyboardInterrupt, _Terminated)) else "failed")
    for logger in _loggers():
        _close_within(logger, None, commit=True, why="at exit")


def _close_within(logger: Any, status: Optional[str], commit: bool, why: str) -> None:
    """``logger._shutdown`` within ``TIMEOUT`` seconds, waited for again when an exception cut the wait short.

    Another signal's handler may raise on this thread while it waits for the writer: when a process group is
    sent SIGTERM, the DataLoader workers die too and torch's SIGCHLD handler raises "DataLoader worker ... is
    killed by signal" into this wait. Going on to the default action then would end the process with the
    close half done (the last steps lost, an MLflow run left RUNNING): the close already queued is waited
    for again, until it is done or the time is up.
    """
    deadline = time.monotonic() + TIMEOUT
    said = False
    while True:
        try:
            logger._shutdown(status, max(0.0, deadline - time.monotonic()), commit=commit)
            return
        except Exception as exc:
            if not said:
                said = True
                log.warning("instrument: closing a logger %s was interrupted by %r; waiting for the close again "
                            "(at most %.0f s in all)", why, exc, TIMEOUT)
            if time.monotonic() >= deadline or not logger._closed:
                log.exception("instrument: closing a logger %s failed", why)
                return
            commit = False  # the close is queued: what is left is to wait for it
