"""A thread of its own for one remote backend, so that a slow or silent server costs that backend alone.

The logger's writer thread calls the backends one at a time. A backend whose calls wait on a server
(`Backend.remote`: MLflow with a tracking server, W&B online) could hold it for as long as the server takes to
answer or to time out (33 s per call with MLflow's defaults against a server that accepts connections and never
answers); the steps committed meanwhile would wait in the writer's queue, and once it is full, ``on_full="block"``
would make the training thread wait too. So the writer hands such a backend's calls to a `Lane` instead of making
them: the lane makes them on its own thread, in the order the writer handed them over, and the writer goes on
with the next record at once.

Bound: at most ``bound`` records (steps and system samples, the logger's ``queue_size``) wait in a lane. Under
``on_full="block"`` a record that finds its lane full waits for room, so that a backend that keeps up (its
thread only needed a turn at the GIL) loses nothing; but the writer waits for room at most `PATIENCE` seconds
in all, over all its lanes, until the lanes it waited for have written every record waiting in them. Past
that, and at once under ``on_full="drop"``, a record that finds the lane full drops the lane's oldest waiting
record, for that backend alone (the other backends have it already). So servers slower than the steps come,
or stopped answering, hold the writer, and through a full queue the training thread, at most `PATIENCE`
seconds until they catch up, and then cost those backends alone their steps. Each drop counts as a failure of
that backend in the logger's ``failures`` and the first is said once. A periodic flush is not queued right
behind another one. Control calls (open, hyperparameters, an explicit flush, on_exit, close) are never dropped.

Catching up: a backend that overrides `Backend.write_many` (MLflow) gets every step waiting in its lane in one
call, at most `MANY` at a time, instead of one call each, so that a server that takes longer per request than
the steps take to come keeps up (a request per batch) instead of falling behind for good.

Waiting: `Writer.flush` and the logger's start (waiting for the backends to open) wait for a lane to reach the
call they queued (`wait`); the writer's close waits for every lane to close its backend, so a closed logger
has every backend closed, remote ones included.
"""

import collections
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from instrument.backends.base import Backend, PartialWriteError
from instrument.backends.held import let_go
from instrument.logger.opening import open_backend, reopening_call

__all__ = ["Lane", "Lanes", "DROPPABLE", "WriterThread", "batches", "running_writers"]

log = logging.getLogger("instrument")

# Seconds the writer waits for room in one lane, in all, until the lane has caught up: enough for a backend that
# keeps up to get its turn at the GIL, short enough that a dead server barely holds training.
PATIENCE = 0.5
DROPPABLE = ("write", "write_system")  # what a full lane drops (the oldest first); nothing else is dropped
MANY = 1000  # most steps handed to one `Backend.write_many` call
_REOPENING = ("write", "log_hyperparams", "write_system")  # calls with which a backend whose open failed opens


class WriterThread(threading.Thread):
    """The thread type of every `Writer` and `Lane`, so that a failed start can tell whether its writer has
    stopped."""


def running_writers() -> List[threading.Thread]:
    """The writer threads of this process that are still running."""
    return [t for t in threading.enumerate() if isinstance(t, WriterThread) and t.is_alive()]


def _definer(cls: type, name: str) -> type:
    return next(klass for klass in cls.__mro__ if name in vars(klass))


def batches(cls: type) -> bool:
    """Whether a lane hands ``cls`` several steps in one `Backend.write_many` call: where it overrides it, and no
    lower in its classes than `write` (a subclass that overrides only ``write``, to skip or change steps, gets
    every step through it)."""
    many = _definer(cls, "write_many")
    return many is not Backend and issubclass(many, _definer(cls, "write"))


class Lane:
    """One remote backend's calls, made on a thread of its own in the order `put` was called.

    Args:
        backend: the backend; only this lane calls it once the lane exists.
        writer: the logger's `Writer` (its ledger, its open, its close's time bound).
        bound: most records waiting at once (the logger's ``queue_size``).
    """

    def __init__(self, backend: Backend, writer: Any, bound: int, waited: Callable[[], float]):
        self.backend = backend
        self.name = backend.name
        self._writer = writer
        self.bound = bound
        self._block = writer.on_full == "block"
        self._waited = 0.0  # seconds the writer waited for room since this lane last had nothing waiting
        self._all_waited = waited  # the same, summed over the writer's lanes: PATIENCE bounds the sum
        self._queue: Deque[Tuple[int, str, tuple, Optional[list]]] = collections.deque()
        self._records = 0
        self._cond = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._ended = False  # closed, or left out of the run: nothing more is queued
        self.failed = 0  # calls that raised (this lane's thread only)
        self.dropped = 0  # records dropped because the lane was full (the writer's thread only)
        self.unopened = False  # its open failed and it opens itself at a later record (`Backend.reopens`)
        self.running: Optional[Tuple[str, str]] = None  # the call under way: for a close that gives up on it
        self._many = batches(type(backend))  # it sends the steps waiting in its lane together
        self.in_call = 0  # records in the call under way (several in a `Backend.write_many`)
        self._thread = WriterThread(target=self._run, name=f"instrument-lane-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the writer's side
    def put(self, method: str, *args: Any, answer: Optional[list] = None) -> int:
        """Queue ``backend.method(*args)``; returns its sequence number in this lane. ``answer`` (a flush's,
        ``[count, 0]``): set to this lane's failure count before the flush once it is made (`_drop_oldest`). A
        periodic flush (no ``answer``) right behind another flush, and any call to a lane that has ended,
        queue nothing."""
        dropped = None
        with self._cond:
            if self._ended or (method == "flush" and answer is None and self._queue and self._queue[-1][1] == "flush"):
                return self._submitted
            if method in DROPPABLE and self._records >= self.bound:
                while self._block and self._records >= self.bound and not self._ended:
                    left = PATIENCE - self._all_waited()
                    if left <= 0:
                        break
                    began = time.monotonic()
                    self._cond.wait(left)
                    self._waited += time.monotonic() - began
                if self._ended:
                    return self._submitted
                if self._records >= self.bound:
                    dropped = self._drop_oldest()
            self._submitted += 1
            self._queue.append((self._submitted, method, args, answer))
            if method in DROPPABLE:
                self._records += 1
            self._cond.notify()
            seq = self._submitted
        if dropped is not None:
            self._say_dropped(dropped)
        return seq

    @property
    def submitted(self) -> int:
        return self._submitted

    @property
    def pending(self) -> int:
        """Records waiting in this lane."""
        return self._records

    @property
    def ended(self) -> bool:
        return self._ended

    def owns(self, thread: threading.Thread) -> bool:
        return thread is self._thread

    def wait(self, seq: int, timeout: Optional[float]) -> bool:
        """Wait (at most ``timeout`` seconds) until this lane has made call ``seq``, or has ended. On the lane's
        own thread (its backend flushing or closing the logger) a call not made yet never is while it waits:
        False at once, not a hang."""
        with self._cond:
            if self._done < seq and not self._ended and threading.current_thread() is self._thread:
                return False
            return self._cond.wait_for(lambda: self._done >= seq or self._ended, timeout)

    def join(self) -> None:
        self._thread.join()

    def disown(self) -> None:
        """In a forked child, where this lane's thread does not exist: ended, nothing queued."""
        self._cond = threading.Condition()
        self._queue.clear()
        self._records = 0
        self._ended = True

    def _drop_oldest(self) -> Any:
        """Drop the oldest waiting record. A `Writer.flush` queued before it was handed its steps whole: the drop
        is not counted in that flush's answer (``answer[1]``), only in the ones after it."""
        for index, (_, method, args, answer) in enumerate(self._queue):
            if method in DROPPABLE:
                del self._queue[index]
                self._records -= 1
                self.dropped += 1
                return args[0]
            if answer is not None:
                answer[1] += 1
        return None

    def _say_dropped(self, record: Any) -> None:
        said = (f"step {getattr(record, 'step', '?')} was dropped for it alone: it is {self.bound} records behind (its "
                f"calls wait on its server), and it loses its oldest waiting record for each new one while it is "
                f"this slow; the other backends get every step and training does not wait for it (a larger "
                f"queue_size lets it fall further behind first)")
        self._writer.ledger.record(self.name, "write", quiet=True)  # counted; not a failure of its write to report
        if self.dropped == 1:
            log.warning("instrument: backend %r: %s", self.name, said)

    # ------------------------------------------------------------------ the lane's thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue:
                        self._cond.wait()
                    seq, method, args, answer = self._queue.popleft()
                    records = None
                    if method == "write" and self._many and not self.unopened and self._queue and \
                            self._queue[0][1] == "write":  # steps waiting right behind it: one call for them all
                        records = [args[0]]
                        while self._queue and self._queue[0][1] == "write" and len(records) < MANY:
                            seq, _, more, _ = self._queue.popleft()
                            records.append(more[0])
                        self._records -= len(records) - 1
                    if method in DROPPABLE:
                        self._records -= 1
                        if not self._records and records is None:
                            self._waited = 0.0  # caught up: the writer may wait for room again
                        self._cond.notify_all()  # room: a writer waiting in `put` goes on
                try:
                    end = self._write_many(records) if records is not None else self._make(method, args, answer)
                except BaseException:  # never let the lane die (not even by a backend's sys.exit)
                    log.exception("instrument: the lane of backend %r failed on %s(); it goes on", self.name, method)
                    end = method == "close"
                with self._cond:
                    self._done = seq
                    if records is not None and not self._records:
                        # Caught up once the steps it took are written and none came meanwhile (taking them all
                        # is not catching up: a server slower than they come would renew the wait each time).
                        self._waited = 0.0
                    if end:
                        self._end()
                    self._cond.notify_all()
                if end:
                    return
        finally:
            with self._cond:
                self._end()
                self._cond.notify_all()

    def _end(self) -> None:
        """Ended (under the lock): nothing queued is made; a `Writer.flush` queued behind the end gets this
        lane's failures so far, as if made (a failed open, a failed close)."""
        for *_, answer in self._queue:
            if answer is not None:
                answer[0] = self.failed + self.dropped - answer[1]
        self._ended = True
        self._queue.clear()
        self._records = 0

    def _make(self, method: str, args: tuple, answer: Optional[list]) -> bool:
        """Make one call; True when the lane ends with it (its backend closed, or left out of the run)."""
        writer = self._writer
        if method == "open":
            if open_backend(writer, self.backend, *args, lane=self):
                return False
            self.failed += 1  # the next flush says so, as for a backend the writer opens
            if self.unopened:
                return False
            writer.leave_out(self.backend)
            return True
        if self.unopened and method in _REOPENING:
            if reopening_call(writer, self.name, method, lambda: self._call(method, args)):
                self.unopened = False
            else:
                self.failed += 1
            return False
        if not self._call(method, args):
            self.failed += 1
        if method == "flush" and answer is not None:
            answer[0] = self.failed + self.dropped - answer[1]
        if method == "close":
            let_go(writer, self.backend)
        return method == "close"

    def _write_many(self, records: List[Any]) -> bool:
        """`Backend.write_many`; an exception costs every record of the call, a `PartialWriteError` one per step
        with something that failed (the rest was written)."""
        ledger = self._writer.ledger
        self.in_call = len(records)  # before `running`, which a close that gives up reads first
        self.running = (self.name, "write_many")
        try:
            self.backend.write_many(records)
        except ledger.catch as exc:
            # each step that failed counts, as when each was written apart
            lost = min(len(records), max(1, exc.steps)) if isinstance(exc, PartialWriteError) else len(records)
            ledger.record(self.name, "write_many", exc)
            for _ in range(lost - 1):
                ledger.record(self.name, "write_many", quiet=True)
            self.failed += lost
        finally:
            self.running, self.in_call = None, 0
        return False

    def _call(self, method: str, args: tuple) -> bool:
        ledger = self._writer.ledger
        self.in_call = int(method in DROPPABLE)
        self.running = (self.name, method)
        try:
            getattr(self.backend, method)(*args)
            return True
        except ledger.catch as exc:
            ledger.record(self.name, method, exc)
            return False
        finally:
            self.running, self.in_call = None, 0


class Lanes:
    """A writer's lanes: the current one of each open remote backend, the ones made since the last flush (whose
    failures count in `Writer.flush`; an ended one's are folded into `folded`), and where a lane stood when an
    open or a close was queued on it (`mark`), so that waiting for that call waits for the lane too."""

    _MARKS = 256  # marks kept: a waiter for a close or an open waits right after queueing it

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self.current: Dict[int, Lane] = {}  # id(backend) -> its lane, while it is open
        self.made: List[Lane] = []
        self.folded = 0  # the failures of lanes that ended, no longer in `made`
        self._marks: Dict[int, List[Tuple[Lane, int]]] = {}  # a writer item's seq -> lanes and their call then

    def get(self, backend: Backend) -> Optional[Lane]:
        return self.current.get(id(backend)) if self.current else None

    def start(self, backend: Backend) -> Lane:
        self._prune()
        lane = self.current[id(backend)] = Lane(backend, self._writer, self._writer.queue_size, self.waited)
        self.made.append(lane)
        return lane

    def waited(self) -> float:
        """Seconds the writer has waited for room in lanes that have not caught up since (`Lane.put`)."""
        return sum(lane._waited for lane in self.made)

    def owns(self, thread: threading.Thread) -> bool:
        return any(lane.owns(thread) for lane in self.made)

    def mark(self, seq: int, lanes: List[Lane]) -> None:
        """Waiting for the writer's item ``seq`` (done now) waits for ``lanes``' calls so far too (`wait`)."""
        self._marks[seq] = [(lane, lane.submitted) for lane in lanes]
        if len(self._marks) > self._MARKS:
            del self._marks[next(iter(self._marks))]

    def wait(self, seq: int, deadline: Optional[float]) -> bool:
        for lane, mark in self._marks.get(seq, ()):
            if not lane.wait(mark, None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        return True

    def flush(self, answer: Optional[list]) -> None:
        """Queue a flush on each lane; for `Writer.flush` (``answer``), each lane's flush and its failure count
        go to ``answer[1]``."""
        if answer is None:
            for lane in self.current.values():
                lane.put("flush")
            return
        self._prune()
        slots = [(lane, [lane.failed + lane.dropped, 0]) for lane in self.made]
        answer[1] = [(lane, lane.put("flush", answer=slot), slot) for lane, slot in slots]

    def _prune(self) -> None:
        """Let go of lanes that ended and are nobody's current one, keeping their failure counts."""
        current = set(map(id, self.current.values()))
        for lane in [lane for lane in self.made if lane.ended and id(lane) not in current]:
            self.folded += lane.failed + lane.dropped
            self.made.remove(lane)

    def close(self, status: Optional[str]) -> None:
        for lane in self.current.values():
            if status:
                lane.put("on_exit", status)
            lane.put("close")

    def join(self) -> None:
        for lane in self.made:
            lane.join()

    def running(self) -> Optional[Tuple[str, str, int, int]]:
        """The call one of the lanes is making, if any, the records waiting for it and those in the call (for a
        close that gives up waiting)."""
        for lane in self.made:
            running = lane.running  # read once: the lane's thread may end the call meanwhile
            if running is not None:
                return (*running, lane.pending, lane.in_call)
        return None

    def disown(self) -> None:
        for lane in self.made:
            lane.disown()
