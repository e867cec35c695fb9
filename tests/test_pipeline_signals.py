"""A signal handler that closes a logger interrupts the training thread anywhere, also inside the logger: it
must never wait for a lock the interrupted code holds, and a step handed over before the close is written."""

import collections
import inspect
import os
import signal
import sys
import textwrap
import threading

import pytest

from instrument.logger import writer as writer_module
from instrument.logger.logger import Logger
from tests.conftest import run_child
from tests.test_pipeline import WAIT, Blocking, poll, steps_of

# The handler closes the logger while the main thread holds one of its locks; the writer thread then needs
# that lock to record a failure (a value it cannot convert, a backend that raises). TIMEOUT is cut to 3 s so
# that a deadlock shows as a lost step quickly, not as a 30 s wait.
SIGTERM_WHILE_LOCKED = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from instrument.backends.base import Backend, RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.logger import shutdown
    from instrument.logger.logger import Logger

    class Raising(Backend):
        def write(self, record):
            raise RuntimeError("disk on fire")

    shutdown.TIMEOUT = 3.0
    logger = Logger([Raising(), JsonlBackend()], RunInfo("r", sys.argv[1]))
    logger.log_metrics({"a": 1.0}, step=1)
    with logger._lock:  # a value the caller's cheap checks let through: it fails to render on the writer
        logger._media[("heatmap", "hm3")] = (torch.rand(2, 3, 4), ("", ""))
    logger.commit()
    lock = logger._lock if sys.argv[2] == "staging" else logger.ledger._lock
    with lock:  # where the training thread is, e.g. inside log_metrics, when the signal arrives
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between two of these bytecodes
            pass
    print("survived", flush=True)
    """
)


@pytest.mark.parametrize("lock", ["staging", "ledger"])
def test_sigterm_while_the_training_thread_holds_a_lock_the_writer_needs_keeps_the_step(tmp_path, lock):
    done = run_child(tmp_path, SIGTERM_WHILE_LOCKED, str(tmp_path), lock, timeout=WAIT)
    assert done.returncode == -signal.SIGTERM, done.stdout + done.stderr
    assert "survived" not in done.stdout
    assert steps_of(tmp_path / "r" / "metrics.jsonl") == [1], done.stderr
    assert "dropped heatmap 'hm3' at step 1" in done.stderr


@pytest.fixture
def sigusr1():
    previous = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, previous)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_close_from_a_signal_handler_writes_the_step_whose_commit_waited_for_room(sigusr1):
    backend = Blocking()
    logger = Logger([backend], queue_size=1)
    signal.signal(signal.SIGUSR1, lambda *_: logger.close())
    logger.log_metrics({"a": 0.0}, step=0)
    logger.commit()
    poll(backend.entered.is_set, "the writer to take step 0")  # it now waits in write()
    logger.log_metrics({"a": 1.0}, step=1)
    logger.commit()  # queued: the queue is full now

    def interrupt():
        poll(lambda: logger._writer._waiting, "the commit of step 2 to wait for room")
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs on the main thread, inside that wait
        poll(lambda: logger._writer._closing, "the handler's close")
        backend.release.set()

    thread = threading.Thread(target=interrupt)
    thread.start()
    logger.log_metrics({"a": 2.0}, step=2)
    handle = logger.commit()  # waits for room; the signal's close runs meanwhile
    thread.join(WAIT)
    assert handle is not None and handle.scalars == {"a": 2.0}
    assert backend.steps == [0, 1, 2]  # written before the close, in order


def _line_of(text: str) -> int:
    lines, start = inspect.getsourcelines(writer_module.Writer.submit)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("where", ["self._submitted += 1", "self._queue.append(entry)"])
def test_a_close_by_a_signal_handler_inside_submit_never_leaves_a_step_silently_unwritten(tmp_path, where, caplog):
    """The few bytecodes between a step's sequence number and its place in the queue: a close there (only a
    signal handler on the same thread can, since submit holds the lock) puts the close first. The step can
    then not be written, and the commit says so (None and a warning), never a handle that looks pending."""
    backend = Blocking()
    backend.release.set()
    logger = Logger([backend])
    logger.log_metrics({"a": 0.0}, step=0)
    logger.commit()
    assert logger.flush()
    line = _line_of(where)
    fired = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line and not fired:
            fired.append(True)
            logger.close()  # what a SIGTERM handler does, at this exact point
        return local

    def trace(frame, event, arg):
        return local if frame.f_code is writer_module.Writer.submit.__code__ else None

    logger.log_metrics({"a": 1.0}, step=1)
    sys.settrace(trace)
    try:
        handle = logger.commit()
    finally:
        sys.settrace(None)
    assert fired
    assert handle is None
    assert "step 1 was committed after the logger closed; it is not written" in caplog.text
    assert backend.steps == [0]
    assert all(item[0] != writer_module._RECORD for item in logger._writer._queue)  # taken back out


def test_a_close_by_a_signal_handler_right_after_the_append_writes_the_step_and_says_so():
    """A close just after the record was queued is queued behind it: the record is written before the close,
    so the commit returns its handle (not None and "not written")."""
    backend = Blocking()
    backend.release.set()
    logger = Logger([backend])
    writer = logger._writer

    class CloseAfterAppend(collections.deque):  # a signal handler that runs right after the append
        armed = True

        def append(self, item):
            super().append(item)
            if item[0] == writer_module._RECORD and CloseAfterAppend.armed:
                CloseAfterAppend.armed = False
                logger.close()

    writer._queue = CloseAfterAppend(writer._queue)
    logger.log_metrics({"a": 7.0}, step=7)
    handle = logger.commit()
    assert handle is not None and handle.step == 7 and handle.scalars == {"a": 7.0}
    assert backend.steps == [7]


class FailsToOpen(Blocking):
    def open(self, run):
        raise OSError("server not answering")


def test_flush_says_false_once_after_a_backend_failed_to_open():
    """A backend whose open failed gets none of the steps: the first flush after it says so."""
    backend = Blocking()
    backend.release.set()
    logger = Logger([backend, FailsToOpen()], on_backend_error="warn")
    logger.log_metrics({"a": 1.0}, step=0)
    logger.commit()
    assert logger.flush() is False
    assert logger.flush() is True
    assert logger.failures == {"FailsToOpen": 1} and backend.steps == [0]
    logger.close()
