"""What the session hands the user: `StepScope` (``with inst.step(n) as s``) and `WatchHandle` (``inst.watch``).

Both are thin: they call back into their `Instrumentation`, which owns the lifecycle. A non-logging step's
scope does nothing on enter and exit but a mark of what the logger holds (so a step that raises drops what it
staged) and one attribute store (what `Instrumentation.log` logs at).
"""

from typing import TYPE_CHECKING, Optional

from instrument.errors import ConfigurationError
from instrument.probes import record

if TYPE_CHECKING:
    from instrument.probes.embedded import ProbeSet
    from instrument.probes.hooks import StateWatch
    from instrument.session.instrumentation import Instrumentation

__all__ = ["StepScope", "WatchHandle"]


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
            self.probes.off()
            self._session._probe_sets.remove(self.probes)

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

    __slots__ = ("step", "active", "observer", "_session", "_mark")

    def __init__(self, session: "Instrumentation", step: int, active: bool) -> None:
        self.step = step
        self.active = active
        self.observer = session._observe if active else None
        self._session = session
        self._mark: Optional[tuple] = None

    def __enter__(self) -> "StepScope":
        open_scope = self._session._scope
        if open_scope is not None:  # whichever of the two is a logging step
            raise ConfigurationError(
                f"inst.step({self.step}) entered while step {open_scope.step} is still open; steps do not nest."
            )
        if self.active:
            self._session._begin(self)
            try:
                self._session._scope = self  # what `Instrumentation.log` logs at (one attribute store)
            except BaseException:  # Ctrl-C right after the start: no block runs, so no __exit__ would end it
                self._session._scope = None
                self._session._end(self, failed=True)
                raise
            return self
        if self._session.log_interval:  # what this step stages is dropped if its body raises
            self._mark = self._session.logger.mark()
        self._session._scope = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._session._scope = None
        finally:  # the step is ended whatever interrupts the line above (Ctrl-C): left open, it refused every later one
            if self.active and self._session._current is self:  # not ended already (`close()` inside the block)
                interrupt = record.take_interrupt()  # Ctrl-C in observers called from TorchScript code (`record`)
                try:
                    self._session._end(self, failed=exc_type is not None or interrupt is not None)
                finally:
                    if interrupt is not None:
                        raise interrupt
            elif exc_type is not None and self._mark is not None:
                self._session._discard(self)
