"""Fan-out from one rollout iteration to every observer, with the session's guarantees.

The dispatcher is what ``s.observer`` is on a logging step. It calls each observer under ``torch.no_grad()``
(observers must not build autograd graph: under gradient checkpointing that would change the number of saved
tensors), never during checkpoint recomputation in backward, and isolates failures: an observer that raises is
reported once and skipped for the rest of the step.
"""

import copy
import logging
from threading import get_ident
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor

from instrument.core.context import StepContext
from instrument.core.failures import FailureLedger
from instrument.core.observer import Observer
from instrument.core.recompute import RecomputeGuard, in_recompute
from instrument.errors import NonFiniteError

__all__ = ["Dispatcher", "observer_name"]

log = logging.getLogger("instrument")

# The threads whose observers run now, in any session: a watched module such a thread calls meanwhile is an observer's
# own call (`Dispatcher.own_call`) for every session that watches it, not only for the one whose observer called it.
_observing_threads: Set[int] = set()

ObserverLike = Union[Observer, Callable[[StepContext], None]]


def observer_name(observer: ObserverLike) -> str:
    return getattr(observer, "name", None) or getattr(observer, "__name__", None) or type(observer).__name__


class Dispatcher:
    """Calls observers for one logging step: ``begin`` -> ``__call__`` per iteration -> ``end``."""

    def __init__(self, observers: Sequence[ObserverLike]) -> None:
        self.observers: List[ObserverLike] = list(observers)
        # The name each observer's failures and timings are kept under: two callables of one name (two lambdas)
        # are told apart as ``<lambda>#2``, so one's first failure is not taken for the other's.
        self.names: List[str] = []
        for observer in self.observers:
            name, number = observer_name(observer), 2
            while name in self.names:
                name, number = f"{observer_name(observer)}#{number}", number + 1
            self.names.append(name)
        self._skipped: Set[int] = set()
        # (index, name, observe) of the observers not skipped, built once per logging step (and again after a
        # failure): the per-iteration call then does no attribute lookups or name resolution per observer.
        self._observing: Optional[List[Tuple[int, str, Callable[[StepContext], Any]]]] = None
        self.ledger = FailureLedger(
            "observer", "it is skipped for the rest of this step; training and the other observers go on"
        )
        self.calls = 0
        self.guard = RecomputeGuard("s.observer", lambda: [observer_name(o) for o in self.observers])
        # Set by the session during a logging step with embedded probes: each call hands the observers the
        # probe values recorded since the previous call (``recorder.drain()``).
        self.recorder = None
        # Set by the session during a logging step (`instrument.core.overhead.OverheadMeter`): each observer
        # call is timed. None otherwise, and then nothing is timed.
        self.clock = None
        # A watched module called by a thread in `_observing_threads` (an observer's lookahead,
        # ``rule(context.next_state)``) is the observer's own call, not an iteration (`own_call`).
        self._said_own_call = False

    @property
    def failures(self) -> Dict[str, int]:
        """Observer name -> number of failures so far."""
        return self.ledger.counts()

    def begin(self, modules: Sequence[Any] = ()) -> None:
        """A logging step starts: each observer's ``reset()``, then ``attach(modules)`` (the watched modules)."""
        self._skipped.clear()
        self._observing = None
        self.calls = 0
        self.guard.begin()
        for index, observer in enumerate(self.observers):
            reset = getattr(observer, "reset", None)
            if reset is not None:
                self._run(index, observer, "reset", reset)
            attach = getattr(observer, "attach", None)
            if attach is not None and index not in self._skipped:
                self._run(index, observer, "attach", attach, list(modules))

    def finish(self) -> None:
        """The logging step is over (also when it raised): each observer's ``detach()``, before ``log``. Every
        observer detaches, also after one raised Ctrl-C (raised once they all have): its hooks would stay."""
        interrupted: Optional[BaseException] = None
        for index, observer in enumerate(self.observers):
            detach = getattr(observer, "detach", None)
            if detach is not None:
                name, clock = self.names[index], self.clock
                start = clock.mark() if clock is not None else None
                try:
                    if not self.ledger.call(name, "detach", detach):
                        self._skip(index)
                except BaseException as exc:  # not caught by the ledger: KeyboardInterrupt, SystemExit
                    self._skip(index)
                    interrupted = interrupted or exc
                if clock is not None:
                    clock.stop(name, start)
                    clock.hooks(name, getattr(observer, "hook_seconds", 0.0))  # its own hooks, in the forward
        if interrupted is not None:
            raise interrupted

    def __call__(self, context: StepContext) -> None:
        if in_recompute():
            self.guard.skipped()
            return
        self.calls += 1
        clock = self.clock
        start = clock.call_start() if clock is not None else None
        if self.recorder is not None:
            recorded = self.recorder.drain()
            if recorded:
                # The caller's context is theirs: observers get a shallow copy that adds the recorded probe
                # values (the caller's own probes win on a name clash); the tensors are shared, not copied.
                context = _with_probes(context, {**recorded, **context.probes})
        observing = self._observing if self._observing is not None else self._build_observing()
        # What torch.no_grad() does, without its context manager's Python overhead (a few us per call, paid
        # on every iteration of every logging step). torch._C._set_grad_enabled is what the public
        # torch.set_grad_enabled calls; called directly it is about 1.4 us cheaper per pair of calls.
        grad_was, thread = torch.is_grad_enabled(), get_ident()
        torch._C._set_grad_enabled(False)
        entered = thread not in _observing_threads  # (not when an observer calls s.observer itself)
        _observing_threads.add(thread)
        try:
            if clock is None:
                for index, name, observe in observing:
                    try:
                        observe(context)
                    except Exception as exc:
                        self._failed(index, name, exc)
            else:
                # Two clock reads fewer per iteration: the first observer's span begins where the fan-out's does
                # (unless probe values were handed over first), and the fan-out ends where the last span does.
                begun = start if self.recorder is None else clock.mark()
                for index, name, observe in observing:
                    try:
                        observe(context)
                    except Exception as exc:
                        self._failed(index, name, exc)
                    begun = clock.lap(name, begun)  # this observer's span ends where the next one's begins
                clock.call_stop(start, begun)
        finally:
            if entered:
                _observing_threads.discard(thread)
            torch._C._set_grad_enabled(grad_was)

    def own_call(self, module: str) -> bool:
        """Whether a watched module's call comes from an observer (this thread is inside the fan-out): such a call
        is not an iteration. Each one would otherwise be delivered from inside the fan-out, whose observers then
        called it again: the rollout's iterations were counted over and over, out of order. Said once."""
        if not _observing_threads or get_ident() not in _observing_threads:
            return False
        if not self._said_own_call:
            self._said_own_call = True
            log.info("instrument: watched module %s was called by an observer while it observed an iteration; such "
                     "calls are the observer's own: not counted as iterations, not observed, and the probe values "
                     "they record are dropped. (Said once.)", module)
        return True

    def end(self, logger, step: int, gradients: Optional[Mapping[str, List[Tensor]]] = None) -> None:
        self.guard.end(self.calls)
        with torch.no_grad():
            if gradients:
                for index, observer in enumerate(self.observers):
                    observe_gradients = getattr(observer, "observe_gradients", None)
                    if observe_gradients is not None and index not in self._skipped:
                        self._run(index, observer, "observe_gradients", observe_gradients, gradients)
            for index, observer in enumerate(self.observers):
                log_fn = getattr(observer, "log", None)
                if log_fn is not None and index not in self._skipped:
                    self._run(index, observer, "log", log_fn, logger, step)

    def committed(self, record: Any) -> None:
        """After the logger's commit: each observer's ``committed(record)``. `NonFiniteError` propagates (the
        user asked ``NonFinite`` to stop training); any other failure is reported and skipped as usual."""
        for index, observer in enumerate(self.observers):
            committed = getattr(observer, "committed", None)
            if committed is None or index in self._skipped:
                continue
            try:
                committed(record)
            except NonFiniteError:
                raise
            except Exception as exc:
                self.ledger.record(self.names[index], "committed", exc)
                self._skip(index)

    def close(self) -> None:
        """The session closed: each observer's ``close()``."""
        for observer, name in zip(self.observers, self.names, strict=True):
            close = getattr(observer, "close", None)
            if close is not None:
                self.ledger.call(name, "close", close)

    def _run(self, index: int, observer: ObserverLike, method: str, fn: Callable, *args) -> None:
        name, clock = self.names[index], self.clock
        if clock is None:
            if not self.ledger.call(name, method, fn, *args):
                self._skip(index)
            return
        start = clock.mark()
        try:
            if not self.ledger.call(name, method, fn, *args):
                self._skip(index)
        finally:
            clock.stop(name, start)

    def _build_observing(self) -> List[Tuple[int, str, Callable[[StepContext], Any]]]:
        self._observing = [
            (index, self.names[index], observe)
            for index, observer in enumerate(self.observers)
            if index not in self._skipped and (observe := _observe_of(observer)) is not None
        ]
        return self._observing

    def _skip(self, index: int) -> None:
        self._skipped.add(index)
        self._observing = None

    def _failed(self, index: int, name: str, exc: Exception) -> None:
        """An ``observe`` call raised: reported (first time), and the observer is skipped for the step."""
        self.ledger.record(name, "observe", exc)
        self._skip(index)


def _observe_of(observer: ObserverLike) -> Optional[Callable[[StepContext], Any]]:
    """What a logging step calls per iteration: ``observe``, or the observer itself when it is a plain callable
    or an `Observer` that defines ``__call__`` only; None for an `Observer` that reads no iterations (its
    ``observe`` is the base class's no-op)."""
    observe = getattr(observer, "observe", None)
    if observe is None:
        return observer
    if getattr(observe, "__func__", None) is Observer.observe:
        return observer if type(observer).__call__ is not Observer.__call__ else None
    return observe


def _with_probes(context: StepContext, probes: Dict[str, Tensor]) -> StepContext:
    """A shallow copy of ``context`` whose ``probes`` is ``probes``; ``context`` itself is left as it was."""
    if type(context) is StepContext:  # copying the slots directly is ~4x cheaper than copy.copy
        copied = StepContext.__new__(StepContext)
        for name in StepContext.__slots__:
            setattr(copied, name, getattr(context, name))
    else:
        copied = copy.copy(context)
    copied._probes = probes
    return copied
