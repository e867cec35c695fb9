"""The logger's start and end as a user sees them: backends that fail to open, calls after close.

Kept apart from the logger's hot path: these run once per run (or once per mistake).
"""

import inspect
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

from instrument.checks import check_number
from instrument.errors import ConfigurationError
from instrument.logger import shutdown

__all__ = ["LoggerEnd", "closed_use", "open_backends", "say_gave_up"]

log = logging.getLogger("instrument")


def closed_use(logger: Any, what: str) -> bool:
    """A call on a closed logger. After an explicit `close` it raises; after a signal or the process exit
    closed the logger (training may still be winding down on another thread) it warns once and the value is
    dropped. Returns False (the value is not accepted)."""
    if logger._closed_by == "fork":
        raise ConfigurationError(
            f"{what} was logged in a forked child process (pid {os.getpid()}) through a Logger its parent created: "
            f"that logger's writer thread and backends stay with the parent, so nothing logged here could be "
            f"written. Create the Logger (or Instrumentation) in the child, or start the child with the 'spawn' "
            f"start method of multiprocessing."
        )
    if logger._closed_by == "close":
        raise ConfigurationError(
            f"{what} was logged after this logger was closed (Instrumentation.close / Logger.close); it would "
            f"not be written. Log before closing, or start a new Instrumentation for another run."
        )
    if not logger._warned_closed:
        logger._warned_closed = True
        log.warning("instrument: %s was logged after the run was closed at process shutdown; it is not written "
                    "(further values are dropped silently)", what)
    return False


class LoggerEnd:
    """Mixin of `Logger`: its close, from the user, a signal handler, atexit or a fork."""

    def before_close(self, hook: Callable[..., Any]) -> None:
        """Run ``hook()`` once, before this logger closes, however it closes (`close`, SIGTERM, the process exit
        after an uncaught exception or without a close): a `SystemMonitor` stops there, so the samples it
        buffered are handed over before the backends close. A hook that takes one argument is called
        ``hook(prompt)``: ``prompt`` is True when the close runs from a signal handler or at exit, where it must
        not wait for another thread (which may be waiting for a lock the interrupted code holds, a commit's).
        One that takes two is called ``hook(prompt, timeout)``: the seconds it may take, what is left of the
        close's ``timeout`` (None: no bound). Hooks run in the order registered; one that raises is reported and
        the close goes on."""
        try:
            takes = min(2, len(inspect.signature(hook).parameters))
        except (TypeError, ValueError):  # no signature to read (a builtin): called without an argument
            takes = 0
        self._before_close.append((hook, takes))

    def close_backend(self, backend: Any, timeout: Optional[float] = None) -> bool:
        """Close one backend (``backend.close()`` on the writer thread) once every record handed over before is
        written to it, and write nothing more to it; wait at most ``timeout`` seconds (None: until done). True
        once it is closed; False when ``timeout`` passed first (it still closes when the writer gets there), or
        it is not one of this logger's open backends. A progress bar closes this way, so its last line shows the
        final count while the run goes on."""
        timeout = check_timeout("close_backend", timeout)
        if backend not in self.backends:
            return False
        seq = self._writer.call("close", backend=backend)  # 0: the logger is closed, and closed it
        return seq > 0 and self._writer.wait(seq, timeout)

    def _run_before_close(self, prompt: bool = False, timeout: Optional[float] = None) -> None:
        hooks, self._before_close = self._before_close, []
        started = time.monotonic()
        for hook, takes in hooks:
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
            try:
                hook(*(prompt, left)[:takes])
            except Exception:
                log.exception("instrument: a hook run before the logger closes (%r) failed", hook)

    def close(self, status: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """Commit what is still staged, write and flush everything, then close every backend (on the writer
        thread) and stop it. ``status`` ``"killed"``/``"failed"`` calls `Backend.on_exit` first. Idempotent;
        failures are reported, never raised.

        The commit lock is held for the last commit only, not while waiting for the writer: a backend or a
        logging handler that commits from the writer thread meanwhile (its values are refused: the logger is
        closed) must not wait for a lock whose holder waits for it. The last commit never waits for room in
        a full queue: the close right behind it is bounded by ``timeout`` alone. The `before_close` hooks run
        first (a system monitor hands over its buffered samples)."""
        timeout = asked = check_timeout("close", timeout)
        started = time.monotonic()
        if not self._closed:
            self._run_before_close(timeout=timeout)
        locked = self._gate("close()", "the logger closes without a last commit: what is staged is not written",
                            timeout)  # bounded too: the commit holding the lock may wait for a backend for ever
        if timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - started))
        try:
            if self._closed:
                closing = False
            else:
                closing = self._final = True
                if locked:
                    try:
                        self.commit()  # also when nothing is staged: it closes the logger under the staging lock
                    except Exception:
                        log.exception("instrument: the final commit failed while closing the logger")
                with self._lock:
                    self._closed = True
                    self._closed_by = self._closed_by or "close"
        finally:
            if locked:
                self._commit_lock.release()
        # a second close waits for the first one's; a close that gives up names the whole bound it was given
        self._writer.close(status or self._exit_status, timeout, asked=asked)
        if closing:
            shutdown.unregister(self)

    def _disown(self) -> None:
        """In a forked child (`instrument.logger.shutdown`): this logger is its parent's. Closed (calls raise,
        see `closed_use`), with new locks (another thread of the parent may have held one at the fork) and a
        writer that takes nothing more."""
        self._lock, self._commit_lock = threading.RLock(), threading.RLock()
        self._closed, self._closed_by = True, "fork"
        self._writer.disown()

    def when_stopped(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once this logger's writer thread has stopped: at once after a close that finished;
        after one that gave up (``close(timeout=...)``), when the backend call it gave up on returns and the
        rest is written (on that thread). The session releases its run folder's lock this way."""
        self._writer.when_stopped(callback)

    def keep_on_shutdown(self, step: Optional[int]) -> None:
        """A checkpoint counted ``step`` as committed while its block was still open (`Instrumentation.state_dict`
        inside ``with inst.step(step)``): a close by a signal or at exit commits it, if it safely can, since
        the run resumed from that checkpoint starts after it and never writes it again. None forgets it (the
        block raised: its step is discarded, and a later close must not write the values before it there)."""
        self._checkpointed = step

    def _commit_checkpointed(self) -> bool:
        """In `_shutdown`: commit the step a checkpoint counted as committed (`keep_on_shutdown`), with what was
        staged for it, and close the logger with that commit. True when done.

        Only when that is safe: never under a process group (a commit there is a collective), never when the
        signal interrupted instrument's own staging or commit on this thread (the staged table may be half
        updated), and only when the commit and staging locks are free within a moment (another thread holding
        them may wait for this one). Otherwise one warning says the step is not written."""
        step = self._checkpointed
        last, pending = self._last_step, self._pending_step
        if step is None or (last is not None and last >= step):
            return False
        if pending is not None and pending > step:  # that step's block raised (discarded) and later ones ran
            return False
        locks = (self._commit_lock, self._lock)
        taken = []
        try:
            group = self.reducer.active()
            if not group and not any(_owned_here(lock) for lock in locks):
                for lock in locks:
                    if not lock.acquire(timeout=_LOCK_WAIT):
                        break
                    taken.append(lock)
            if len(taken) < len(locks):
                why = ("under a process group its commit is a collective, which a stopping process cannot make"
                       if group else "the process was stopped while instrument was staging or committing a value, "
                       "and a half-staged step is never written")
                log.warning("instrument: step %d, which a checkpoint saved inside its `with inst.step(%d)` block "
                            "counts as written, is not written: %s. Resuming from that checkpoint leaves step %d "
                            "out; resume from the one before it to write it again", step, step, why, step)
                return False
            self._final = True  # the last commit: it closes the logger and never waits for room in the queue
            try:
                self.commit(step)
            except Exception:
                log.exception("instrument: committing step %d (saved in a checkpoint) at shutdown failed", step)
            with self._lock:
                self._closed = True
            return True
        finally:
            for lock in reversed(taken):
                lock.release()

    def _shutdown(self, status: Optional[str], timeout: float, commit: bool) -> None:
        """Close from a signal handler or atexit: bounded wait, and no commit while a step may be half staged.

        A close already under way (on another thread, or on this one: the signal handler runs on the main
        thread, which may be inside `close`) is waited for, at most ``timeout`` seconds, through the writer
        alone: this thread may hold the logger's locks, so it must not wait for them.
        """
        if self._closed:
            self._writer.close(status or self._exit_status, timeout)  # its own close if none was queued yet
            return
        self._run_before_close(prompt=True)  # e.g. a system monitor's buffered samples, handed over here
        self._closed_by = "shutdown"
        if self._commit_checkpointed():  # closed the logger: what was staged went with it
            commit = False
        if commit and not self.reducer.active():
            self.close(status, timeout)
            return
        self._closed = True
        self._writer.close(status or self._exit_status, timeout)
        shutdown.unregister(self)


OPEN_POLICIES = ("raise", "warn")
_LOCK_WAIT = 0.5  # seconds a shutdown waits for another thread's staging or commit (`_commit_checkpointed`)


def _owned_here(lock: Any) -> bool:
    """Whether this thread holds ``lock`` (an RLock, which it could otherwise take again in the middle of its
    own half-done use); True where that cannot be told."""
    owned = getattr(lock, "_is_owned", None)
    return owned() if callable(owned) else True


def say_gave_up(timeout: Optional[float], running: Optional[Any], queued: int, lane: Optional[Any] = None) -> None:
    """A close that timed out returns with steps unwritten (`Writer.close`): say how many, and which backend call
    (``running``: the ledger's ``(name, method)``, or None) held it; ``lane``: ``(name, method, waiting, in_call)``
    of a remote backend's call under way on its own thread (holding ``in_call`` records: several, a lane's
    `Backend.write_many`), whose records the other backends have."""
    if running is None and lane is not None:
        name, method, waiting, in_call = lane
        log.warning(
            "instrument: closing the logger gave up after %gs: remote backend %r was still in %s()%s on its own "
            "thread, and %d record(s) waiting for it alone were not written to it yet (the other backends have "
            "them). They are written if that call returns, while this process runs (the run folder stays locked "
            "until then); a process that ends first loses them. Pass a longer timeout to close() (or none, to "
            "wait) to keep them.",
            timeout, name, method, f" with {in_call} record(s)" if in_call > 1 else "", waiting + in_call,
        )
        return
    held = (f"backend {running[0]!r} was still in {running[1]}()" if running is not None
            else "the writer was still busy")
    log.warning(
        "instrument: closing the logger gave up after %gs: %s, and %d committed step(s) queued behind it were "
        "not written yet. They are written if that call returns, while this process runs (the run folder stays "
        "locked, and the files its backends write taken, until then); a process that ends first loses them, and "
        "backends that did not get to their flush and close may hold less than was committed. Pass a longer "
        "timeout to close() (or none, to wait) to keep them.", timeout, held, queued,
    )


def check_timeout(what: str, timeout: Any) -> Optional[float]:
    """``timeout`` for ``flush``/``close``: None (wait until done) or seconds >= 0; inf is None. Checked before
    anything is queued, so a bad value never leaves a close half done."""
    seconds = check_number(f"{what}: timeout", timeout, least=0, none=True, noun="a number of seconds",
                           why="how long to wait for the logger's writer thread",
                           fix=f"pass e.g. {what}(timeout=30.0), or timeout=None to wait until it is done")
    return wait_seconds(seconds)


def wait_seconds(seconds: Optional[float]) -> Optional[float]:
    """``seconds`` as a thread's wait takes it: None (no limit) from ``threading.TIMEOUT_MAX`` on (about 292
    years; inf too), where ``Lock.acquire`` and ``Condition.wait`` raise OverflowError instead of waiting."""
    return None if seconds is None or seconds >= threading.TIMEOUT_MAX else seconds


def check_open_policy(policy: Any, timeout: Any) -> str:
    if policy not in OPEN_POLICIES:
        raise ConfigurationError(
            f"on_backend_error must be one of {OPEN_POLICIES}, got {policy!r}: 'raise' stops at start when a "
            f"backend cannot open, 'warn' goes on without it."
        )
    check_number("open_timeout", timeout, above=0, noun="a number of seconds",
                 why="how long the start waits for the backends to open",
                 fix="bind e.g. Instrumentation.open_timeout = 60.0")
    return policy


def open_backends(logger: Any, policy: Any, timeout: Any) -> None:
    """Open the logger's backends on its writer thread and wait for them (`await_opens`).

    Whatever stops the start here (a bad option, a backend that cannot open, Ctrl-C while waiting) leaves no
    writer running: it is closed, ending what did open ``"failed"`` (``"killed"`` for Ctrl-C), at most
    ``open_timeout`` seconds, so that the session can then remove the run folder this start created.
    """
    writer = logger._writer
    try:
        writer.report_open = check_open_policy(policy, timeout) == "warn"
        timeout = wait_seconds(timeout)
        opened = [writer.call("open", logger.run, backend=backend) for backend in logger.backends]
        if opened:
            await_opens(logger, opened[-1], policy, timeout)
        writer.report_open = True  # a backend added later (add_backend) is reported if it cannot open
    except BaseException as exc:
        if not logger._closed:  # await_opens closes the writer itself before raising an open failure
            logger._closed, logger._closed_by = True, "close"
            wait = timeout if isinstance(timeout, (int, float)) and timeout > 0 else 60.0
            writer.close("killed" if shutdown.interrupted(exc) else "failed", wait)
        raise


def await_opens(logger: Any, seq: int, policy: str, timeout: Optional[float]) -> None:
    """Wait (at most ``timeout`` s) until the writer has opened every backend; under ``"raise"``, raise a
    `ConfigurationError` for those that failed, after closing the ones that opened."""
    writer = logger._writer
    if not writer.wait(seq, timeout):
        writer.report_open = True  # a failure after this is reported by the writer, as under "warn"
        log.warning("instrument: the backends did not finish opening within open_timeout=%ss; the run starts "
                    "anyway and they are written once open (a backend that fails to open is reported then)",
                    timeout)
        return
    if policy != "raise" or not writer.open_errors:
        return
    logger._closed, logger._closed_by = True, "close"
    writer.close("failed", timeout)  # end what did open (e.g. an MLflow run) as failed, not finished
    said = "; ".join(describe_open_error(b, e) for b, e in writer.open_errors)
    raise ConfigurationError(
        "could not open " + said + ("" if said.endswith(".") else ".") + " To run without a backend that cannot "
        "open, pass on_backend_error='warn' (gin: Instrumentation.on_backend_error = 'warn')."
    ) from writer.open_errors[0][1]


def describe_open_error(backend: Any, exc: Exception) -> str:
    """``Name: what went wrong (fix)``, the fix read from the error where it says one."""
    from instrument.errors import InstrumentError, MissingExtraError

    text = f"{backend.name}: {type(exc).__name__}: {exc}"
    if isinstance(exc, MissingExtraError) or isinstance(exc, InstrumentError):
        return text  # these already say how to fix it
    if isinstance(exc, BrokenPipeError):  # a ConnectionError, but of a local pipe: the console's reader left
        return text + f" (fix: {backend.name} writes to a pipe whose reader has exited; keep it open or point " \
                      f"the backend at another stream)"
    if isinstance(exc, (ConnectionError, TimeoutError)) or "API request to" in str(exc):
        return text + " (fix: start the server or correct its address, e.g. the backend's tracking_uri)"
    return text + f" (fix: check {backend.name}'s options and that its directory is writable)"
