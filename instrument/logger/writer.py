"""The logger's writer thread: the one place where backends are called.

The training thread hands each committed step over as an immutable record of staged values (plus the
started device->host transfer); this thread waits for the transfer, converts and renders, and calls every
backend, one call at a time and in the order things were handed over. Backend calls are isolated by the
shared `FailureLedger`: a backend that raises is reported once, counted, and still gets the next record. A
remote backend (`Backend.remote`) is called on a thread of its own instead (`instrument.logger.lane`), so
that a server that does not answer holds that backend alone.

Backpressure: at most ``queue_size`` step records wait here. When the queue is full, ``on_full="block"``
makes the committing thread wait for room (nothing is lost); ``"drop"`` drops the oldest waiting record,
counts it in ``dropped`` and warns once. Control calls (open, hyperparameters, system samples, flush, close)
are never dropped and do not count toward the bound.

Durability: whatever was written is flushed (`Backend.flush`) at the latest ``flush_secs`` later, also when
nothing else arrives; `flush` returns once everything handed over before it is written and flushed, and
says whether every backend call since the previous `flush` succeeded.
"""

import collections
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from instrument.backends.base import Backend, StepRecord
from instrument.backends.held import let_go
from instrument.core.failures import FailureLedger
from instrument.logger.committed import CommittedStep
from instrument.logger.lane import Lanes, WriterThread, running_writers
from instrument.logger.lifecycle import say_gave_up
from instrument.logger.opening import open_backend, reopening_call

__all__ = ["Writer", "CommittedStep", "ON_FULL", "WriterThread", "running_writers"]

log = logging.getLogger("instrument")

ON_FULL = ("block", "drop")
# How an idle writer looks for records that were handed over without waking it (`submit`): first after _POLL
# seconds, then at twice the previous interval, at most every _MAX_POLL seconds (and at most every
# flush_secs / 2, but not below 5 ms, so that a record is still on disk within flush_secs). A loop's logging
# steps, however far apart, then never pay a wake on the committing thread (a futex wake, often a context
# switch: about 30 us of a 100-float commit on a 2-core machine), and an idle logger wakes about twice a second.
_POLL = 0.05
_MAX_POLL = 0.5
# Seconds with nothing to do before the writer parks: a parked writer sleeps until woken, so a process with
# many idle loggers (or one that logs less than twice a minute) spends no CPU and no GIL on them; the first
# commit after such a pause pays one wake instead.
_PARK_AFTER = 30.0
_RECORD, _CALL, _FLUSH, _CLOSE = "record", "call", "flush", "close"


class Writer:
    """One background thread per `Logger` that builds records and calls the backends in order.

    Args:
        backends: the logger's list of backends; each is driven once its ``open`` (queued with
            ``call("open", run, backend=b)``) succeeded, and one whose ``open`` fails is removed from it.
        build: ``payload -> StepRecord``; the logger's conversion of a handed-over step, run here.
        ledger: where backend failures are counted and reported.
        queue_size: most step records waiting at once.
        on_full: ``"block"`` or ``"drop"`` (the oldest waiting record).
        flush_secs: the longest a written record waits before the backends are flushed.
        name: the thread's name.
    """

    def __init__(
        self,
        backends: List[Backend],
        build: Callable[[Any], Optional[StepRecord]],
        ledger: FailureLedger,
        queue_size: int,
        on_full: str,
        flush_secs: float,
        name: str = "instrument-writer",
    ) -> None:
        self.backends = backends
        self._active: List[Backend] = []  # opened, in order; touched only on the writer thread
        self._unopened: List[Backend] = []  # active ones whose open failed, opening themselves again (reopens)
        self._lanes = Lanes(self)  # each remote backend's own thread (`Backend.remote`, `instrument.logger.lane`)
        self._build = build
        self.ledger = ledger
        self.queue_size = queue_size
        self.on_full = on_full
        self.flush_secs = flush_secs
        self.dropped = 0
        self.open_errors: List[Tuple[Backend, Exception]] = []  # backends whose open raised, in order
        self.report_open = True  # False while the logger waits to raise open failures itself
        self._queue: Deque[Tuple[str, int, Any]] = collections.deque()
        self._records = 0
        self._waiting: Dict[int, Tuple[CommittedStep, Any]] = {}  # submits waiting for room (under the lock)
        self._mutex = threading.RLock()  # `submit` enters it directly: Condition's own __enter__ is Python
        self._cond = threading.Condition(self._mutex)
        self._submitted = 0
        self._done = 0
        self._closing = False
        self._close_seq = 0  # the queued close's sequence number, once there is one
        self._gave_up = False  # a close timed out (and said so)
        self._on_stop: List[Callable[[], None]] = []  # `when_stopped` callbacks waiting for the thread to stop
        self._close_bound: Optional[float] = None  # the close's timeout (a signal's, a failed start's), if any
        self._stopped = False
        self._dirty = False
        self._failed = 0  # backend calls (write, control calls, flush) that raised; writer thread only
        # The highest `_failed` a flush's caller was told (under the lock): a flush whose caller gave up waiting
        # tells nobody, so the failures it saw are still the next flush's to report.
        self._failed_told = 0
        self._parked = False  # idle past _PARK_AFTER: waits for a wake, not for a poll (read under _cond)
        self._max_poll = max(0.005, min(_MAX_POLL, flush_secs / 2))
        self.interval = 0.0  # the idle writer's current poll interval (seconds); 0 while it works or parks
        self._last_flush = time.monotonic()
        self._thread = WriterThread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.ident = self._thread.ident  # compared with threading.get_ident() on every commit (`Logger.commit`)

    # ------------------------------------------------------------------ producer side
    def submit(self, handle: CommittedStep, payload: Any, wait: bool = True) -> bool:
        """Hand a step over; False when the writer is closed (the step is not written).

        A step waiting for room (``on_full="block"``) when the writer is closed, by another thread or by a
        signal handler that interrupted this wait, was handed over before the close: `_put` queues it ahead
        of the close, and this returns True. A wait interrupted by an exception (Ctrl-C) hands nothing over:
        the step is not written, rather than written at close behind later steps. ``wait=False`` (the close's
        own last commit, whose close follows at once) queues past the bound instead of waiting for room.
        """
        with self._mutex:
            if self._closing:
                return False
            if self._records >= self.queue_size and not self._on_own_thread():
                if self.on_full == "drop":
                    self._drop_oldest()
                elif wait:
                    key = id(handle)
                    self._waiting[key] = (handle, payload)
                    try:
                        while self._records >= self.queue_size and not self._closing:
                            self._cond.wait()
                    except BaseException:
                        self._waiting.pop(key, None)  # still waiting: never handed over; queued by a close: kept
                        raise
                    if self._waiting.pop(key, None) is None:
                        return True  # queued by the close, ahead of it
                    if self._closing:
                        return False
            self._submitted += 1
            seq = self._submitted
            handle.seq = seq
            entry = (_RECORD, seq, (handle, payload))
            self._queue.append(entry)
            self._records += 1
            if self._closing and self._behind_close(entry):
                # Only a signal handler on this very thread can have closed the writer since the check above
                # (other threads wait for the lock this thread holds), before the append: the record is behind
                # the close and would never be written. Say so instead of returning a handle. (A close after
                # the append is behind the record, which is then written first.)
                self._queue.remove(entry)
                self._records -= 1
                handle.seq = 0
                return False
            # Waking a sleeping thread costs the committing thread a futex wake and often a context switch
            # (about 30 us, as much as the rest of a 100-float commit): records are picked up by the writer's
            # next poll (at most _MAX_POLL seconds later) unless the queue is filling up or the writer parked
            # after a long idle spell. flush(), close() and readers of a CommittedStep wake it at once.
            if self._parked or self._records * 2 >= self.queue_size:
                self._cond.notify_all()
            return True

    def call(self, method: str, *args: Any, backend: Optional[Backend] = None) -> int:
        """Queue ``backend.method(*args)`` (every backend when None); returns its sequence number (0: closed)."""
        return self._put(_CALL, (method, args, backend))

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until everything handed over so far is written and flushed; False on timeout, when closed, or
        when a backend failed to write or flush something handed over since the previous `flush`."""
        if self._on_own_thread():
            return False
        # The writer's failure count, and each lane's flush with its failure count, once this flush is done.
        answer: list = [0, ()]
        deadline = None if timeout is None else time.monotonic() + timeout
        seq = self._put(_FLUSH, answer)
        if seq <= 0 or not self.wait(seq, timeout):
            return False
        failed = answer[0]
        for lane, lane_seq, slot in answer[1]:  # remote backends flush on their own threads (`Lanes.flush`)
            if not lane.wait(lane_seq, None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
            failed += slot[0]
        with self._mutex:
            clean = failed <= self._failed_told
            self._failed_told = max(self._failed_told, failed)
        return clean

    def close(self, status: Optional[str] = None, timeout: Optional[float] = None,
              asked: Optional[float] = None) -> bool:
        """Write what is queued, flush, call ``on_exit(status)`` when given, close the backends, stop. A close
        when one is already queued (another thread's, a signal handler's) waits for that one the same way.
        ``asked``: the caller's whole bound, of which ``timeout`` is what is left (the message names it)."""
        if timeout is not None:  # before the close is queued: the writer reads it once it sees `_closing`
            self._close_bound = timeout
        seq = self._put(_CLOSE, status, closing=True) or self._close_seq
        if self._on_own_thread():
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        done = seq > 0 and self.wait(seq, timeout)
        # One deadline for both waits: a writer stuck in a backend call is given up on after ``timeout``.
        self._thread.join(5.0 if done or deadline is None else max(0.0, deadline - time.monotonic()))
        if seq > 0 and not done and not self._gave_up:
            self._gave_up = True  # said once: a second close (a signal's after the user's) waits for the same
            say_gave_up(timeout if asked is None else asked, self.ledger.running, self.pending, self._lanes.running())
        return done

    def wait(self, seq: int, timeout: Optional[float] = None, ready: Optional[Callable[[], bool]] = None) -> bool:
        """Wait until item ``seq`` is done, or ``ready()`` (a record built, before the backends write it); False on
        timeout. On the writer thread itself (a backend reading a `CommittedStep`) an item not yet done can never
        be done while it waits: False at once, not a hang."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._done < seq and self._on_own_thread():
                return False
            if self._done < seq:
                self._cond.notify_all()  # a reader waits: the writer need not wait for its next poll
            while self._done < seq and not self._stopped and not (ready is not None and ready()):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            if ready is not None and ready():
                return True
            done = self._done >= seq
        return done and self._lanes.wait(seq, deadline)  # an open or a close is made on a remote backend's lane

    def disown(self) -> None:
        """In a forked child, where this writer's thread does not exist: new locks, nothing queued, closed (so
        `submit`, `flush` and `close` return at once instead of waiting for a thread that never comes)."""
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        self._queue.clear()
        self._waiting.clear()
        self._records = 0
        self._closing = self._stopped = True
        self._lanes.disown()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._records

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _put(self, kind: str, payload: Any, closing: bool = False) -> int:
        with self._cond:
            if self._closing:
                return 0
            if closing:
                # Steps whose commit waits for room were handed over before this close: queue them ahead of
                # it (past queue_size), so that they are written; their `submit` then returns True.
                for handle, data in self._waiting.values():
                    self._submitted += 1
                    handle.seq = self._submitted
                    self._queue.append((_RECORD, self._submitted, (handle, data)))
                    self._records += 1
                self._waiting.clear()
            self._closing = closing
            self._submitted += 1
            if closing:
                self._close_seq = self._submitted
            self._queue.append((kind, self._submitted, payload))
            self._cond.notify_all()
            return self._submitted

    def _behind_close(self, entry: Tuple[str, int, Any]) -> bool:
        """Whether ``entry`` is queued after a close (under the lock; a close stays queued once taken)."""
        closed = False
        for item in self._queue:
            if item is entry:
                return closed
            closed = closed or item[0] == _CLOSE
        return False

    def _drop_oldest(self) -> None:
        for index, (kind, _, payload) in enumerate(self._queue):
            if kind == _RECORD:
                del self._queue[index]
                self._records -= 1
                handle = payload[0]
                handle.dropped = True
                self.dropped += 1
                if self.dropped == 1:
                    log.warning(
                        "instrument: the logger's queue is full (queue_size=%d): dropped the oldest waiting step "
                        "(%d) and will drop more while the backends are this slow (counted in "
                        "Logger.dropped); use on_full='block' to lose nothing, or a larger queue_size",
                        self.queue_size, handle.step,
                    )
                return

    # ------------------------------------------------------------------ writer thread
    def when_stopped(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once this writer has stopped (its close done, or its thread ended): now, if it has;
        else on its thread as it stops (a close that gave up on a hung backend: the run folder stays the
        writer's until then)."""
        with self._cond:
            if not self._stopped and self._thread.is_alive():
                self._on_stop.append(callback)
                return
        callback()

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # however the thread ends, nobody waits for it forever
            with self._cond:
                self._stopped = self._closing = True
                self._cond.notify_all()
                callbacks, self._on_stop = self._on_stop, []
            for callback in callbacks:
                try:
                    callback()
                except Exception:
                    log.exception("instrument: a call made when the logger's writer stopped failed")

    def _loop(self) -> None:
        busy_since = time.monotonic()  # when the writer last found work after waiting for it
        while True:
            with self._cond:
                interval = _POLL
                idle_since = None
                if not self._queue:
                    busy_since = None
                while not self._queue:
                    now = time.monotonic()
                    timeout = min(interval, self._max_poll)
                    if self._dirty:  # written, not flushed yet: the flush is due flush_secs after the last one
                        remaining = self.flush_secs - (now - self._last_flush)
                        if remaining <= 0:
                            break
                        timeout = min(timeout, remaining)
                    elif idle_since is None:
                        idle_since = now
                    elif now - idle_since >= _PARK_AFTER:
                        self.interval = 0.0
                        self._parked = True  # set under the lock submit takes: no wake can be missed
                        self._cond.wait()
                        self._parked = False
                        continue
                    self.interval = timeout
                    self._cond.wait(timeout)
                    interval *= 2
                self.interval = 0.0
                if busy_since is None:
                    busy_since = time.monotonic()
                item = self._queue.popleft() if self._queue else None
                if item is not None and item[0] == _RECORD:
                    self._records -= 1
                    self._cond.notify_all()
                elif item is not None and item[0] == _CLOSE:
                    self._queue.appendleft(item)  # stays: what is queued after it is never written (`_behind_close`)
            if item is None:
                self._flush_backends()
                continue
            kind, seq, payload = item
            try:
                self._process(kind, seq, payload)
            except BaseException:  # never let the writer die (not even by a backend's sys.exit)
                log.exception("instrument: the logger's writer failed on a %s item; it goes on", kind)
            finally:
                with self._cond:
                    self._done = seq
                    if kind == _CLOSE:
                        let_go(self)  # before anyone sees it stopped: its backends' files are free once it is
                        self._stopped = True
                    self._cond.notify_all()
            # The item goes now: bound while the loop waits for the next one, a step's staged tensors (device
            # memory on a GPU) and their host copy stayed alive through every step until the next commit, and for
            # good behind a session dropped without close().
            del item, payload
            if kind == _CLOSE:
                return
            # An overdue flush waits for the items found queued with this one (records handed over during one
            # poll, e.g. a train and an eval step): flushing between them would restart the clock for the rest,
            # which would then reach disk up to flush_secs late. A queue that never empties is still flushed
            # once the writer has been busy for _max_poll.
            now = time.monotonic()
            if self._dirty and now - self._last_flush >= self.flush_secs and (
                not self._queue or now - busy_since >= self._max_poll
            ):
                self._flush_backends()

    def _process(self, kind: str, seq: int, payload: Any) -> None:
        if kind == _RECORD:
            handle, data = payload
            record = self._build(data)
            if record is not None:
                record.freeze()  # shared by every backend below and the caller's handle: no backend changes it
            handle.record = record
            with self._cond:  # a reader of this step (`CommittedStep.result`) need not wait for the writes below
                self._cond.notify_all()
            if record is not None and not record.is_empty():
                unopened, lanes = self._unopened, self._lanes
                for backend in self._active:
                    lane = lanes.get(backend)
                    if lane is not None:  # a remote backend: its own thread writes it (`instrument.logger.lane`)
                        lane.put("write", record)
                        continue
                    if unopened and backend in unopened:
                        continue  # after the others: a slow try to open never holds up their copy
                    if not self.ledger.call(backend.name, "write", backend.write, record):
                        self._failed += 1
                    time.sleep(0)  # let a training thread waiting for the GIL in now, not after 5 ms
                for backend in list(unopened):
                    self._reopening_call(backend, "write", record)
                self._dirty = True
        elif kind == _CALL:
            method, args, only = payload
            later = []  # reopening backends not open yet: after the others, as for records
            marked = list(self._lanes.current.values()) if method == "open" else []  # a start waits for them all
            for backend in [only] if only is not None else list(self._active):
                if method == "close" and backend not in self._active:
                    continue  # closed already (`Logger.close_backend` twice), or never opened
                lane = self._lanes.get(backend)
                if lane is not None and lane.ended and method == "open":  # left out before, added again
                    del self._lanes.current[id(backend)]
                    self._active.remove(backend)
                    lane = None
                if lane is None and method == "open" and getattr(backend, "remote", False):
                    lane = self._lanes.start(backend)  # it opens the backend and makes every call to it from now
                    self._active.append(backend)
                if lane is not None:
                    lane.put(method, *args)
                    if method == "close" or method == "open":  # waiting for it waits for this lane (`Writer.wait`)
                        marked.append(lane)
                    continue
                if method == "open":
                    ok = open_backend(self, backend, *args)
                elif backend in self._unopened and method in ("log_hyperparams", "write_system"):
                    later.append(backend)
                    continue
                else:
                    ok = self.ledger.call(backend.name, method, getattr(backend, method), *args)
                if not ok:  # an open that failed too: that backend gets none of the steps, which flush() says
                    self._failed += 1
                if method == "open" and backend not in self._active and backend in self.backends:
                    self.backends.remove(backend)
            for backend in later:
                self._reopening_call(backend, method, *args)
            if method == "close" and only is not None and only in self._active:  # `Logger.close_backend`
                self._active.remove(only)  # closed: no more records, and not closed again at the end
                if self._lanes.current.pop(id(only), None) is None:  # a lane lets go once it closed its backend
                    let_go(self, only)
                if only in self._unopened:
                    self._unopened.remove(only)
            if marked:
                self._lanes.mark(seq, marked)
            self._dirty = True
        elif kind == _FLUSH:
            self._flush_backends(payload)
            payload[0] = self._failed + self._lanes.folded
        elif kind == _CLOSE:
            self._flush_backends()
            self._lanes.close(payload)  # first: remote backends close on their own threads meanwhile
            for backend in self._active:
                if self._lanes.get(backend) is not None:
                    continue
                if payload:
                    self.ledger.call(backend.name, "on_exit", backend.on_exit, payload)
                self.ledger.call(backend.name, "close", backend.close)
            self._lanes.join()  # closed once every backend is: the caller's close bounds this wait

    def _on_own_thread(self) -> bool:  # what this thread would wait for could only be done by itself
        thread = threading.current_thread()
        return thread is self._thread or (bool(self._lanes.made) and self._lanes.owns(thread))

    def leave_out(self, backend: Backend) -> None:
        """A remote backend whose open failed for good: it gets nothing more (its lane has ended)."""
        if backend in self.backends:
            self.backends.remove(backend)

    def closing_bounded(self) -> bool:
        """A close with a time bound (SIGTERM's, a failed start's) is queued: no try to open a backend now."""
        return self._closing and self._close_bound is not None

    def _reopening_call(self, backend: Backend, method: str, *args: Any) -> None:
        """A call to a backend whose open failed and which opens itself on its next call (`reopening_call`)."""
        if reopening_call(self, backend.name, method,
                          lambda: self.ledger.call(backend.name, method, getattr(backend, method), *args)):
            self._unopened.remove(backend)  # it opened: called in its place from now on
        else:
            self._failed += 1

    def _flush_backends(self, answer: Optional[list] = None) -> None:
        """Flush every backend; a remote one's lane flushes it on its thread (for `flush`, whose ``answer[1]``
        gets each lane's flush and its failure count then)."""
        lanes = self._lanes
        for backend in self._active:
            if lanes.get(backend) is None and not self.ledger.call(backend.name, "flush", backend.flush):
                self._failed += 1
        lanes.flush(answer)
        self._dirty = False
        self._last_flush = time.monotonic()
