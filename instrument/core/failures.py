"""One failure ledger for every plug-in: observers, backends and RL components.

A plug-in that raises must never stop training or cost another plug-in its step. The ledger is the one place
that decides what happens then: the first failure of a name is reported with its traceback (one message per
plug-in, not one per step), later ones are counted quietly at DEBUG, and the counts are what
``Instrumentation.failures`` shows. Safe to use from several threads (the training thread and the logger's
writer thread record into the same ledger).

    ledger = FailureLedger("backend")
    ok = ledger.call("TensorBoardBackend", "write", backend.write, record)   # False: raised, reported

Only ``Exception`` is caught by default: ``KeyboardInterrupt`` and ``SystemExit`` propagate. The backends'
ledger catches every ``BaseException`` (``catch=``): its calls run on the logger's writer thread, where a
backend's ``sys.exit``, or an ``asyncio.CancelledError`` or ``KeyboardInterrupt`` an SDK lets out, would
otherwise cost the backends after it their step, uncounted (no signal reaches that thread, so nothing there is
the user's own Ctrl-C).
"""

import logging
import threading
from typing import Any, Callable, Dict, Optional, Set, Tuple, Type

__all__ = ["FailureLedger", "BACKEND_CONSEQUENCE", "BACKEND_CONSEQUENCES"]

log = logging.getLogger("instrument")

# What a failure in each of a backend's methods costs it (the backends' ledger, `instrument.logger.Logger`): a
# write or a system record that raised is followed by the next record, but a method called once is not retried.
_GO_ON = "training and the other backends go on"
BACKEND_CONSEQUENCE = f"it gets the next record again; {_GO_ON}"
BACKEND_CONSEQUENCES = {
    "log_hyperparams": f"they are not sent to it again; {_GO_ON}",
    "flush": f"what it holds may not be saved yet; it gets the next record and is flushed again; {_GO_ON}",
    "on_exit": f"how the run ended may not be recorded by it; it is closed next; {_GO_ON}",
    "close": f"it is not closed again and gets no more records (what it had not saved may be lost); {_GO_ON}",
}

_LOCK_WAIT = 0.5  # seconds `record` waits for the lock (it is held for a few bytecodes at a time)


class FailureLedger:
    """Counts failures per plug-in name and reports the first of each once.

    Args:
        kind: what the plug-ins are, used in messages (``"observer"``, ``"backend"``, ``"RL component"``).
        consequence: what happens to the failing plug-in, appended to the first report.
        consequences: the consequence of a failure in a given method where it differs (a call that is not
            retried must not be reported as one the plug-in gets again).
    """

    def __init__(self, kind: str, consequence: str = "training and the others go on",
                 catch: Tuple[Type[BaseException], ...] = (Exception,),
                 consequences: Optional[Dict[str, str]] = None) -> None:
        self.kind = kind
        self.catch = catch
        self.consequence = consequence
        self.consequences = dict(consequences or {})
        self._counts: Dict[str, int] = {}
        self._reported: Set[str] = set()  # names whose first failure was reported
        self._lock = threading.Lock()
        # The call under way, ``(name, method)``, else None: for whoever gives up waiting for it to say which
        # plug-in held it up (a logger's close that timed out). Two plain stores per call.
        self.running: Optional[Tuple[str, str]] = None

    def call(self, name: str, method: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Run ``fn(*args, **kwargs)``; True if it returned, False if it raised (recorded and reported)."""
        self.running = (name, method)
        try:
            fn(*args, **kwargs)
            return True
        except self.catch as exc:
            self.record(name, method, exc)
            return False
        finally:
            self.running = None

    def record(self, name: str, method: str, exc: Optional[BaseException] = None,
               consequence: Optional[str] = None, quiet: bool = False) -> int:
        """Count one failure of ``name`` in ``method``; report it if it is the first reported one (with
        ``consequence``, when it differs from the ledger's). ``quiet``: counted only, the caller said what
        happened itself (a step dropped for a backend that fell behind); a later failure is still reported
        first. Returns the count."""
        # Never an unbounded wait: the training thread may hold this lock when a signal arrives, and the
        # handler then waits for the logger's writer thread (closing it), which may be recording here. Past
        # the bound the count is taken without the lock (at worst one lost count), never a deadlock.
        locked = self._lock.acquire(timeout=_LOCK_WAIT)
        try:
            count = self._counts.get(name, 0) + 1
            self._counts[name] = count
            first = not quiet and name not in self._reported
            if first:
                self._reported.add(name)
        finally:
            if locked:
                self._lock.release()
        if quiet:
            log.debug("instrument: %s %r: %s counted as a failure (%d failures)", self.kind, name, method, count)
        elif first:
            log.error(
                "instrument: %s %r failed in %s(); %s", self.kind, name, method,
                consequence or self.consequences.get(method, self.consequence),
                exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None,
            )
        else:
            log.debug("instrument: %s %r failed again in %s() (%d failures)", self.kind, name, method, count)
        return count

    def counts(self) -> Dict[str, int]:
        """Name -> number of failures so far (a copy)."""
        with self._lock:
            return dict(self._counts)

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)
