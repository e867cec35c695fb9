"""What the session hands the user: `StepScope` (``with inst.step(n) as s``) and `WatchHandle` (``inst.watch``).

Both are thin: they call back into their `Instrumentation`, which owns the lifecycle. A non-logging step's
scope does nothing on enter and exit but a mark of what the logger holds (so a step that raises drops what it
staged) and taking the session's one step slot (what `Instrumentation.log` logs at), under a lock: of two
threads entering steps of one session at once, one gets in and the other is refused, never both.
"""

import os
import threading
from typing import TYPE_CHECKING, Optional

from instrument.errors import ConfigurationError
from instrument.probes import record

if TYPE_CHECKING:
    from instrument.probes.embedded import ProbeSet
    from instrument.probes.hooks import StateWatch
    from instrument.session.instrumentation import Instrumentation

__all__ = ["StepScope", "WatchHandle"]

# Checks a session's step slot and takes it in one go (any session: it is held for a few bytecodes).
_slot_lock = threading.Lock()


class WatchHandle:
    """Returned by `Instrumentation.watch`; ``remove()`` unwatches (idempotent), also as a context manager."""

    def __init__(
        self, session: "Instrumentation", watch: "Optional[StateWatch]", probes: "Optional[ProbeSet]" = None
    ) -> None:
        self._session = session
        self.watch = watch
        self.probes = probes

    def remove(self) -> None:
        if self.watch is not None:
            self.watch.detach(report=False)  # unwatched mid-step: not a step that missed it
            if self.watch in self._session._watches:
                self._session._watches.remove(self.watch)
        if self.probes is not None and self.probes in self._session._probe_sets:
            self._session._probe_sets.remove(self.probes)
            # a probe another watched set holds too (a model and a submodule of it, or another session's watch of
            # it) stays on for the rest of that set's step
            self.probes.off()

    def __enter__(self) -> "WatchHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class StepScope:
    """What ``with inst.step(step) as s`` yields.

    Attributes:
        step: the training step.
        active: whether this is a logging step.
        observer: on a logging step, the callable an explicit evolver calls once per rollout iteration,
            ``s.observer(StepContext(previous, next))``: the session's `Dispatcher` (``instrument.core.dispatch``),
            which runs every observer's ``observe`` under ``no_grad`` and isolates their failures, after a check
            that the state was not delivered already by a watched module's hook. None on a non-logging step, so
            ``if s.observer is not None:`` skips building the context entirely.
    """

    __slots__ = ("step", "active", "observer", "_session", "_mark", "_thread")

    def __init__(self, session: "Instrumentation", step: int, active: bool) -> None:
        self.step = step
        self.active = active
        self.observer = session._observe if active else None
        self._session = session
        self._mark: Optional[tuple] = None
        self._thread: Optional[int] = None

    def __enter__(self) -> "StepScope":
        session = self._session
        try:
            with _slot_lock:  # checked and taken at once: two threads never both hold the slot
                self._refuse_to_open()
                self._thread = threading.get_ident()
                session._scope = self  # what `Instrumentation.log` logs at
            if self.active:
                session._begin(self)
            else:
                # What this step stages is dropped if its body raises (with log_interval=0 too: what the block
                # hands to inst.logger itself is still written, and a failed block's values must not reach a later
                # commit). Taken after the slot: a refused thread's mark would replace the open step's.
                self._mark = session.logger.mark()
        except BaseException:  # refused, a start that failed, or Ctrl-C in it: no block runs, no __exit__ frees it
            if session._scope is self:
                session._scope = None
            raise
        return self

    def _refuse_to_open(self) -> None:
        session = self._session
        if session._closed:  # a scope made before close() and entered after it
            raise ConfigurationError("this Instrumentation is closed; create a new one for another run.")
        open_scope = session._scope
        if open_scope is None:
            return
        if open_scope._thread != threading.get_ident():
            raise ConfigurationError(
                f"inst.step({self.step}) was entered on thread {threading.current_thread().name!r} while step "
                f"{open_scope.step} is open on another thread: one session runs one step at a time, and its "
                f"observers, hooks and inst.log belong to that step. Give each thread its own Instrumentation, or "
                f"log from this thread without a step block: inst.logger.log_metrics(metrics, step=n) may be "
                f"called from any thread."
            )
        # whichever of the two is a logging step
        raise ConfigurationError(
            f"inst.step({self.step}) entered while step {open_scope.step} is still open; steps do not nest."
        )

    def __exit__(self, exc_type, exc, tb) -> None:
        session = self._session
        try:
            if self.active and session._current is self:  # not ended already (`close()` inside the block)
                interrupt = record.take_interrupt()  # Ctrl-C in observers called from TorchScript code (`record`)
                try:
                    session._end(self, failed=exc_type is not None or interrupt is not None)
                finally:
                    if interrupt is not None:
                        raise interrupt
            elif exc_type is not None and self._mark is not None:
                session._discard(self)
        finally:
            # Freed once the step has ended (its observers' log, its commit or its discard), whatever interrupts
            # that: another thread's step let in before would stage into this step's commit or replace its mark.
            if session._scope is self:
                session._scope = None


def _fresh_lock_in_child() -> None:
    """A thread of the parent may have held the lock at the fork."""
    global _slot_lock
    _slot_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_child)
