"""A failed step's timer spans are dropped exactly, with no work at a step's start: `Logger.mark` only bumps a
number, and each timer notes where it stood at its first span after it (`Timer.rewind`). A mark used to fold
every pending timer (a lock, a query per CUDA pair and an fsum each), which made a non-logging step with 20
timers cost about three times a bare one."""

import math
import threading

import pytest

import instrument
from instrument.logger import timer as timer_module
from instrument.logger.timer import FOLD_AT, timing_stats


class FakeTime:
    """``time.perf_counter`` for the timer module, moved by hand."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class RunPair:
    """A CUDA event pair that has run (``done``), lasting ``ms`` milliseconds (stands in for a span on a GPU)."""

    def __init__(self, ms, done=True):
        self.ms, self.done = ms, done

    def query(self):
        return self.done

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return self.ms


def spans(timer, clock, durations):
    for seconds in durations:
        with timer:
            clock.now += seconds


def stats(durations):
    return {"mean": math.fsum(durations) / len(durations), "min": min(durations), "max": max(durations),
            "count": float(len(durations))}


@pytest.fixture
def clock(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(timer_module, "time", fake)
    return fake


def test_a_failed_steps_spans_are_dropped_exactly_across_folds_and_marks(clock):
    """Spans held unfolded before a mark, folded together with the step's own ones (CPU spans and CUDA pairs):
    the discard keeps exactly those measured before the mark, whatever was folded in between."""
    log = instrument.Logger([])
    timer = log.timer("stage")
    kept = [2.0**-10 * (i % 7 + 1) for i in range(FOLD_AT - 300)]  # exact in binary: so are the clock's
    spans(timer, clock, kept)
    late = RunPair(7.0, done=False)  # still queued on the GPU: it stops the folds' walk until it has run
    timer._events += [(RunPair(5.0), RunPair(5.0)), (late, late), (RunPair(6.0), RunPair(6.0))]  # held at the mark
    kept += [5.0 / 1000.0, 7.0 / 1000.0, 6.0 / 1000.0]
    mark = log.mark()
    spans(timer, clock, [10.0] * (FOLD_AT + 50))  # the failed step: folds the spans held at the mark with its own
    assert len(timer._seconds) < FOLD_AT and len(timer._events) == 2  # the first pair folded, the others wait
    late.done = True
    spans(timer, clock, [10.0] * FOLD_AT)  # ...and folds the rest of the pairs held at the mark
    assert timer._events == []
    assert log.discard_staged(mark) == ["timer stage"]
    assert log.discard_staged(mark) == []  # once
    assert timer.count == len(kept)
    for step in range(3 * FOLD_AT // 100):  # steps that succeed, 100 spans each, folded across their marks
        log.mark()
        durations = [2.0**-9 * (1 + (step + i) % 5) for i in range(100)]
        spans(timer, clock, durations)
        kept += durations
    mark = log.mark()
    spans(timer, clock, [20.0] * 3)
    assert log.discard_staged(mark) == ["timer stage"]
    got = log.commit(0).timings["stage"]
    want = stats(kept)
    assert got["count"] == want["count"] and got["min"] == want["min"] and got["max"] == want["max"]
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-12)
    log.close()


def test_a_commit_inside_the_failed_step_leaves_only_what_came_after_it_to_drop(clock):
    log = instrument.Logger([])
    timer, late = log.timer("stage"), log.timer("late")
    spans(timer, clock, [1.0] * 4)
    mark = log.mark()
    spans(timer, clock, [2.0] * 2)
    assert log.commit(0).timings["stage"]["count"] == 6.0  # committed inside the step: written, not dropped
    spans(timer, clock, [3.0] * 5)
    spans(late, clock, [4.0])  # a timer first measured after the mark
    assert sorted(log.discard_staged(mark)) == ["timer late", "timer stage"]
    assert timer.count == 0 and late.count == 0 and timing_stats(timer.take()) is None
    log.close()


def test_a_steps_start_touches_no_timer():
    """`mark` visits no timer: it does not wait for one whose lock another thread holds (a span ending, a fold),
    and a span ending on another thread while steps start and fail is dropped or kept whole."""
    log = instrument.Logger([])
    timer = log.timer("busy", cuda=False)
    with timer:
        pass
    started = []
    with timer._lock:  # another thread mid-fold
        marker = threading.Thread(target=lambda: started.append(log.mark()))
        marker.start()
        marker.join(5)
        assert started, "mark waited for a timer's lock"
    assert log.discard_staged(started[0]) == [] and timer.count == 1
    log.close()


@pytest.mark.cuda
def test_on_a_gpu_a_failed_steps_event_pairs_are_dropped_exactly_across_folds():
    """Real CUDA event pairs held at a mark, folded (a query each) with the failed step's own: the discard keeps
    the pairs measured before the mark, and the commit counts them and the later steps' pairs."""
    import torch

    log = instrument.Logger([])
    timer = log.timer("gpu", cuda=True)
    x = torch.ones(64, device="cuda")
    for _ in range(FOLD_AT - 100):
        with timer:
            x = x * 1.0
    mark = log.mark()
    for _ in range(99):  # the failed step's spans
        with timer:
            x = x * 1.0
    torch.cuda.synchronize()  # every pair has run: the next span's fold reads those held at the mark too
    for _ in range(FOLD_AT + 10):
        with timer:
            x = x * 1.0
    assert log.discard_staged(mark) == ["timer gpu"]
    assert timer.count == FOLD_AT - 100
    log.mark()
    for _ in range(10):  # a step that succeeds
        with timer:
            x = x * 1.0
    stats = log.commit(0).timings["gpu"]
    assert stats["count"] == FOLD_AT - 90 and 0 <= stats["min"] <= stats["mean"] <= stats["max"]
    log.close()
