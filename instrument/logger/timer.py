"""Per-logger timers: wall time on the CPU, CUDA events on a GPU, no sync until commit.

A timer accumulates every interval measured between two commits and reports mean, min, max and count in
``StepRecord.timings[name]`` (``timing/<name>/<stat>`` for scalar-only backends). Timers belong to one
`Logger`; there is no global registry.

Memory stays bounded however long nothing commits (``log_interval=0``, a long interval, a Logger used without
commits): every `FOLD_AT` spans the spans measured so far are folded into their count, sum, min and max (CUDA
spans once their events have run: a query, never a wait). Kept one by one, a million spans a day held about
30 MB on a CPU, and on a GPU two CUDA events each.

A failed step's spans are dropped (`Logger.mark` / `Logger.discard_staged`) without any work at a step's start:
a mark only bumps the logger's mark number (`_marks`), and a timer notes where it stood (`_at`) at its first
span after it, so a step costs its timers nothing more than their spans, however many are pending.
"""

import functools
import math
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import torch

from instrument.errors import ConfigurationError, InvalidValueError

__all__ = ["FOLD_AT", "Timer", "elapsed", "timing_stats"]

F = TypeVar("F", bound=Callable)
FOLD_AT = 1024  # spans kept one by one before they are folded into count, sum, min and max (module docstring)
Folded = Optional[Tuple[int, float, float, float]]  # (count, sum, min, max) of the spans folded so far
_NO_MARKS = [0]  # a timer outside a logger: never marked


class Timer:
    """Context manager and decorator measuring a named stage.

    With ``cuda=True``, or ``cuda=None`` (the default) once this process has initialised CUDA (it runs on a GPU;
    decided at each span, so a timer made before the model moved to the GPU follows it), it records a pair of
    CUDA events on the current stream of the current device around the stage and reads their elapsed time only
    at commit, on the writer thread: GPU time of the work queued on that stream. Otherwise, and with
    ``cuda=False`` (a host-side stage such as environment steps or data loading, which GPU events would time as
    the GPU's idle catching up), it uses ``time.perf_counter``: a CPU-only run on a machine with a GPU creates
    no CUDA context. Across ranks each statistic is reduced with ``reduce`` (default ``"max"``: a step is as
    slow as its slowest rank).

    One timer may be entered again before it exits (a recursive function decorated with it, nested ``with``
    blocks of one name) and from several threads at once: each thread keeps its own stack of open spans, and
    every span is measured and counted.
    """

    def __init__(self, name: str, cuda: Optional[bool] = None, reduce: str = "max") -> None:
        if not name or not isinstance(name, str):
            raise InvalidValueError(f"Timer needs a non-empty name, got {name!r}.")
        if reduce not in ("mean", "sum", "min", "max", "l2"):
            raise InvalidValueError(f"Timer reduce must be one of mean, sum, min, max, l2; got {reduce!r}.")
        self.name = name
        self.reduce = reduce
        self.cuda = cuda  # None: CUDA events once CUDA is initialised (`_on_gpu`)
        self._seconds: List[float] = []
        self._events: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._folded: Folded = None
        self._takes = 0  # how many `take`s so far: a mark noted before the last one is older than all held
        # The owning logger's mark number (a shared one-element list, `Logger.mark`), the mark this timer last
        # saw at a span, and where it stood then: (takes, folded, CPU spans held, pairs held), for `rewind`.
        self._marks: List[int] = _NO_MARKS
        self._seen = 0
        self._at: Optional[Tuple[int, Folded, int, int]] = None
        self._readable = True  # False from a pair whose time cannot be read until the next take
        self._local = threading.local()  # .starts: this thread's open spans, innermost last
        self._lock = threading.Lock()  # measurements are appended and taken from different threads
        # The owning logger's timers with measurements not taken yet (`named_timer`): each measurement enters its
        # timer there, so that a step's start and a commit visit those alone, not every name ever timed.
        self._pending: Optional[Dict[str, Timer]] = None

    def _starts(self) -> List[object]:
        starts = getattr(self._local, "starts", None)
        if starts is None:
            starts = self._local.starts = []
        return starts

    def _on_gpu(self) -> bool:
        if self.cuda is not None:
            return self.cuda
        return torch.cuda.is_initialized()  # initialised implies available; a flag read, not a device query

    def __enter__(self) -> "Timer":
        if self._on_gpu():
            # blocking: the writer's wait for it yields the CPU instead of spinning on a core
            start = torch.cuda.Event(enable_timing=True, blocking=True)
            start.record()
            self._starts().append(start)
        else:
            self._starts().append(time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        now = time.perf_counter()
        starts = self._starts()
        if not starts:
            raise ConfigurationError(
                f"timer {self.name!r} exited on a thread where it was not entered; use it as `with timer:` or "
                f"as a decorator, so that each span starts and ends on one thread."
            )
        start = starts.pop()
        # Entered in the logger's pending timers under the lock, with the measurement: a commit or a discard that
        # sees this timer not pending reads it after any measurement in flight (`take` and `rewind` take the lock).
        pending = self._pending
        if not isinstance(start, float):  # the span began with a CUDA event: it ends with one
            end = torch.cuda.Event(enable_timing=True, blocking=True)
            end.record()
            with self._lock:
                if self._marks[0] != self._seen:  # the first span since a mark: where the timer stood at it
                    self._note_mark()
                self._events.append((start, end))  # type: ignore[arg-type]
                if len(self._events) >= FOLD_AT:
                    self._fold()
                if pending is not None:
                    pending[self.name] = self
        else:
            with self._lock:
                if self._marks[0] != self._seen:
                    self._note_mark()
                self._seconds.append(now - start)  # type: ignore[operator]
                if len(self._seconds) >= FOLD_AT:
                    self._fold()
                if pending is not None:
                    pending[self.name] = self

    def _note_mark(self) -> None:
        """The first span since the logger's last mark: remember where the timer stands (under the lock)."""
        self._seen = self._marks[0]
        self._at = (self._takes, self._folded, len(self._seconds), len(self._events))

    def cancel(self) -> bool:
        """Drop this thread's innermost open span without measuring it (a stage restarted or abandoned before
        its end, `instrument.rl.StageClock`); returns whether there was one. Nothing is recorded: the span's
        start (a CUDA event on a GPU) is forgotten, and spans opened before it stay open."""
        starts = self._starts()
        if not starts:
            return False
        starts.pop()
        return True

    def _fold(self) -> None:
        """Fold the CPU spans, and the event pairs up to the first that has not run yet, into `_folded` (under the
        lock). Those held at the last mark are folded into where the timer stood at it (`_at`) too, so that
        `rewind` still drops exactly what came after the mark. Pairs that have run are read without a wait, and
        the first that has not stops the walk, so a fold costs a query per pair folded and one more."""
        seconds, self._seconds = self._seconds, []
        events, done = self._events, 0
        while self._readable and done < len(events) and events[done][0].query() and events[done][1].query():
            done += 1
        pairs: List[float] = []
        if done:
            try:
                pairs = [start.elapsed_time(end) / 1000.0 for start, end in events[:done]]
                self._events = events[done:]
            except RuntimeError:  # a span begun on one device and ended on another: left for the commit to report,
                self._readable = False  # and no more tries at every span until then
                done = 0
        at = self._at
        if at is not None and at[0] == self._takes and (at[2] or min(at[3], done)):
            before = min(at[3], done)  # pairs held at the mark that are folded now
            self._at = (at[0], _combined(at[1], seconds[:at[2]] + pairs[:before]), 0, at[3] - before)
        if seconds or pairs:
            self._folded = _combined(self._folded, seconds + pairs)

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return wrapped  # type: ignore[return-value]

    @property
    def count(self) -> int:
        """Spans held (since the last take). Under the lock: a fold moves spans from the lists into `_folded`, and
        a read between the two steps would count them in neither (a commit then skipped the timer)."""
        with self._lock:
            return self._held()

    def _held(self) -> int:
        folded = self._folded
        return (folded[0] if folded is not None else 0) + len(self._seconds) + len(self._events)

    def rewind(self, mark: int) -> int:
        """Forget the measurements taken since the logger's mark number ``mark`` (a failed step's, `Logger.mark`);
        returns how many. A timer not measured since that mark holds nothing newer; after a `take` everything
        now held is newer than the mark."""
        with self._lock:
            at = self._at
            if self._seen != mark or at is None:
                return 0
            before = self._held()
            takes, folded, n_seconds, n_events = at
            if takes == self._takes:
                self._folded = folded
                del self._seconds[n_seconds:]
                del self._events[n_events:]
            else:
                self._folded, self._seconds, self._events = None, [], []
            self._at = (self._takes, self._folded, len(self._seconds), len(self._events))  # a second rewind: none
            return before - self._held()

    def take(self) -> Tuple[Folded, List[float], List[Tuple[torch.cuda.Event, torch.cuda.Event]]]:
        """The measurements since the last take (folded statistics, CPU seconds, CUDA event pairs); empties the
        timer.

        The logger takes them on the training thread at commit and reads them with `timing_stats` on its writer
        thread, so CUDA event times never make the training thread wait.
        """
        with self._lock:  # a span ending on another thread lands in this take or the next, never in neither
            taken = (self._folded, self._seconds, self._events)
            self._folded, self._seconds, self._events = None, [], []
            self._takes += 1
            self._readable = True
        return taken

    def drain(self) -> Optional[Dict[str, float]]:
        """`timing_stats` of the spans measured since the last take; empties the timer."""
        return timing_stats(self.take())


def _combined(folded: Folded, seconds: List[float]) -> Folded:
    """``folded`` with ``seconds`` folded in."""
    if not seconds:
        return folded
    count, total, low, high = folded if folded is not None else (0, 0.0, math.inf, -math.inf)
    return (count + len(seconds), math.fsum([total, *seconds]), min(low, min(seconds)), max(high, max(seconds)))


def timing_stats(taken: Tuple[Folded, List[float], List[Tuple[torch.cuda.Event, torch.cuda.Event]]]
                 ) -> Optional[Dict[str, float]]:
    """A timer's taken measurements as ``{mean, min, max, count}`` (seconds), None when there are none; waits
    for CUDA events to complete."""
    folded, seconds, events = taken
    folded = _combined(folded, elapsed(seconds, events))
    if folded is None:
        return None
    count, total, low, high = folded
    return {"mean": total / count, "min": low, "max": high, "count": float(count)}


def elapsed(seconds: List[float], events: List[Tuple[torch.cuda.Event, torch.cuda.Event]]) -> List[float]:
    """Durations in seconds of taken measurements (waits for CUDA events to complete)."""
    if events:
        for start, end in events:  # spans on other streams (another thread's, a side stream) end in their own order
            # host sync: CUDA event times (on the writer thread, or at a distributed commit). Both events: a span
            # begun on one stream and ended on another has no elapsed time until both have run.
            start.synchronize()
            end.synchronize()
        seconds = seconds + [s.elapsed_time(e) / 1000.0 for s, e in events]
    return seconds


def named_timer(timers: Dict[str, "Timer"], name: str, reduce: Optional[str],
                pending: Optional[Dict[str, "Timer"]] = None, cuda: Optional[bool] = None,
                marks: Optional[List[int]] = None) -> "Timer":
    """``timers[name]``, made with ``reduce`` (default ``"max"``) and ``cuda`` when missing; a different reduce
    raises, a ``cuda`` given sets the timer's. ``pending``: where it enters itself at each measurement;
    ``marks``: the owning logger's mark number (`Logger.mark`)."""
    timer = timers.get(name)
    if timer is None:
        timer = timers[name] = Timer(name, cuda=cuda, reduce=reduce or "max")
        timer._pending = pending
        if marks is not None:
            timer._marks = marks
        return timer
    if reduce is not None and reduce != timer.reduce:
        raise ConfigurationError(f"timer {name!r} already exists with reduce={timer.reduce!r}, asked for {reduce!r}.")
    if cuda is not None:
        timer.cuda = cuda
    return timer
