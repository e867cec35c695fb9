"""``close(timeout=...)`` and ``flush(timeout=...)``: a bounded close that gives up says what it left unwritten,
and a bad timeout is refused before anything closes.

A backend that blocks in ``write`` until released stands in for a hung remote (an SDK call that never returns);
it is released at the end of each test so that no writer thread outlives it. Nothing is timed.
"""

import json
import logging
import threading
import time

import pytest

import instrument
from instrument.backends.base import RunInfo
from instrument.backends.jsonl import JsonlBackend
from instrument.errors import ConfigurationError
from instrument.logger.logger import Logger
from tests.test_pipeline import Blocking  # blocks in write until released

WAIT = 60.0  # a bound for waiting, never a timing assertion


def gave_up(caplog):
    return [r.getMessage() for r in caplog.records if "gave up" in r.getMessage()]


def test_a_close_that_times_out_says_which_backend_held_it_and_how_many_steps_are_unwritten(tmp_path, caplog):
    hung = Blocking()
    logger = Logger([hung, JsonlBackend()], RunInfo("r", tmp_path))
    for step in range(3):
        logger.log_metrics({"x": float(step)}, step=step)
        logger.commit()
    assert hung.entered.wait(WAIT)
    try:
        with caplog.at_level(logging.WARNING, logger="instrument"):
            logger.close(timeout=0.2)
            logger.close(timeout=0.2)  # a second close waits for the same one: said once
    finally:
        hung.release.set()
    messages = gave_up(caplog)
    assert len(messages) == 1, messages
    # step 0 is in the hung write; steps 1 and 2 wait behind it
    assert "backend 'Blocking' was still in write()" in messages[0] and "2 committed step(s)" in messages[0]
    assert "timeout" in messages[0]


def test_a_close_that_spent_its_bound_waiting_for_a_blocked_commit_names_the_whole_bound(tmp_path, caplog):
    # A commit waiting for room in a full queue holds the commit lock: the close spends its whole bound there and
    # gives up with nothing left for the writer. The message said "gave up after 0s".
    hung = Blocking()
    logger = Logger([hung], RunInfo("r", tmp_path), queue_size=1)
    for step in range(2):  # step 0 in the hung write, step 1 fills the queue
        logger.log_metrics({"x": float(step)}, step=step)
        logger.commit()
    assert hung.entered.wait(WAIT)
    blocked = threading.Event()

    def third():
        logger.log_metrics({"x": 2.0}, step=2)
        blocked.set()
        logger.commit()  # waits for room, holding the commit lock

    thread = threading.Thread(target=third, daemon=True)
    thread.start()
    try:
        assert blocked.wait(WAIT)
        while logger._commit_lock.acquire(blocking=False):  # until the third commit holds it
            logger._commit_lock.release()
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="instrument"):
            logger.close(timeout=0.25)
    finally:
        hung.release.set()
        thread.join(WAIT)
    messages = gave_up(caplog)
    assert len(messages) == 1 and "gave up after 0.25s" in messages[0], messages


def test_a_close_that_finishes_in_time_says_nothing(tmp_path, caplog):
    logger = Logger([JsonlBackend()], RunInfo("r", tmp_path))
    logger.log_metrics({"x": 1.0}, step=0)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        logger.close(timeout=WAIT)
    assert gave_up(caplog) == []
    assert [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()] == [0]


def test_instrumentation_close_takes_a_timeout(tmp_path, caplog):
    hung = Blocking()
    inst = instrument.Instrumentation(observers=[], backends=[hung, JsonlBackend()], log_dir=str(tmp_path),
                                      log_interval=1)
    try:
        for step in range(2):
            with inst.step(step):
                inst.logger.log_metrics({"loss": float(step)}, step=step)
        assert hung.entered.wait(WAIT)
        with caplog.at_level(logging.WARNING, logger="instrument"):
            inst.close(timeout=0.2)
    finally:
        hung.release.set()
    messages = gave_up(caplog)
    assert len(messages) == 1 and "backend 'Blocking' was still in write()" in messages[0], messages


@pytest.mark.parametrize("timeout", [-1, float("nan"), "10", True, [1.0]])
def test_bad_timeouts_are_refused_before_anything_closes(tmp_path, timeout):
    logger = Logger([JsonlBackend()], RunInfo("r", tmp_path))
    logger.log_metrics({"x": 1.0}, step=0)
    for call in (logger.flush, logger.close):
        with pytest.raises(ConfigurationError, match=r"timeout must be a number of seconds >= 0 or None.*got"):
            call(timeout=timeout)
    logger.log_metrics({"x": 2.0}, step=1)  # still open: nothing was closed by the refused call
    logger.close(timeout=float("inf"))  # inf waits as None does
    steps = [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]  # one interval: steps 0 and 1 averaged into the commit at 1

    inst = instrument.Instrumentation(observers=[], backends=[JsonlBackend()], log_dir=str(tmp_path / "i"))
    with pytest.raises(ConfigurationError, match="close: timeout"):
        inst.close(timeout=timeout)
    with inst.step(0):
        inst.logger.log_metrics({"loss": 1.0}, step=0)  # the session is still open
    inst.close()


class CountingJsonl(JsonlBackend):
    """A real JSONL backend that counts its closes."""

    def __init__(self) -> None:
        super().__init__()
        self.closes = 0

    def close(self) -> None:
        self.closes += 1
        super().close()


def test_close_backend_closes_one_backend_after_what_was_handed_over_and_writes_nothing_more_to_it(tmp_path):
    first, other = CountingJsonl(), JsonlBackend(path=str(tmp_path / "r" / "other.jsonl"))
    logger = Logger([first, other], RunInfo("r", tmp_path))
    for step in range(3):
        logger.log_metrics({"x": float(step)}, step=step)
        logger.commit()
    assert logger.close_backend(first, timeout=WAIT)
    assert logger.close_backend(first, timeout=WAIT)  # a second time: nothing more to do
    for step in range(3, 5):
        logger.log_metrics({"x": float(step)}, step=step)
        logger.commit()
    logger.close()

    def read(name):
        return [json.loads(line)["step"] for line in (tmp_path / "r" / name).read_text().splitlines()]

    assert read("metrics.jsonl") == [0, 1, 2]
    assert read("other.jsonl") == [0, 1, 2, 3, 4]
    assert first.closes == 1  # not closed again by the logger's close
    assert not logger.close_backend(JsonlBackend())  # not one of this logger's
    with pytest.raises(ConfigurationError, match="close_backend: timeout"):
        logger.close_backend(other, timeout=-1.0)


def test_a_bounded_close_is_bounded_while_another_thread_waits_for_room_behind_a_stuck_backend(tmp_path, caplog):
    """Another thread's commit waits for room in a full queue, holding the commit lock, behind a backend that does
    not return: close(timeout=...) (and the exit's close, which uses the same path) waited for that lock for
    ever. Now it gives up on its last commit within the bound, says so, and every step that was handed over is
    still written once the backend returns."""
    backend = Blocking()
    logger = Logger([backend], RunInfo("c", tmp_path), queue_size=2)
    handed = []

    def trainer():
        for step in range(10):
            try:
                logger.log_metrics({"x": float(step)}, step=step)
                if logger.commit(step) is not None:
                    handed.append(step)
            except Exception:  # the logger closed under it: explicit close, later calls raise
                return

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not (backend.entered.is_set() and logger._writer.pending == 2):
        assert time.monotonic() < deadline, "the queue never filled"
        time.sleep(0.01)
    closer = threading.Thread(target=logger.close, kwargs={"timeout": 0.5}, daemon=True)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        closer.start()
        closer.join(WAIT)
        assert not closer.is_alive(), "close(timeout=0.5) waited for the commit lock"
    assert any("waited 0.5 s for another thread's commit" in r.getMessage() for r in caplog.records)
    stopped = threading.Event()
    logger.when_stopped(stopped.set)
    backend.release.set()
    assert stopped.wait(WAIT)
    thread.join(WAIT)
    assert backend.steps == handed and handed[:3] == [0, 1, 2]  # every step handed over, once, in order


@pytest.mark.parametrize("timeout", [1e10, 1e300])
def test_a_timeout_longer_than_a_thread_can_wait_waits_as_none_does(tmp_path, timeout):
    # threading.TIMEOUT_MAX is about 292 years: beyond it Lock.acquire and Condition.wait raise OverflowError,
    # which left close() raising and the logger open (its staged step never committed)
    logger = Logger([JsonlBackend()], RunInfo("r", tmp_path), open_timeout=timeout)
    logger.log_metrics({"x": 1.0}, step=0)
    logger.commit()
    assert logger.flush(timeout=timeout) is True
    logger.log_metrics({"x": 2.0}, step=1)
    logger.close(timeout=timeout)
    with pytest.raises(ConfigurationError, match="closed"):  # closed: what it staged was committed
        logger.log_metrics({"x": 3.0}, step=2)
    steps = [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]

    inst = instrument.Instrumentation(observers=[], backends=[JsonlBackend()], log_dir=str(tmp_path / "i"),
                                      open_timeout=timeout)
    with inst.step(0):
        inst.logger.log_metrics({"loss": 1.0}, step=0)
        inst.state_dict(flush_timeout=timeout)
    inst.close(timeout=timeout)
