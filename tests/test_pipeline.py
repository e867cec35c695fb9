"""The commit pipeline: one writer thread per Logger, backpressure, durability, faults, threads, signals.

Everything is read back from real backends (JSONL lines, TensorBoard event files with EventAccumulator);
nothing is timed: waits poll with a generous bound.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import instrument
from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.errors import InvalidValueError
from instrument.logger import writer as writer_module
from instrument.logger.logger import Logger
from tests.conftest import read_scalars, run_child

WAIT = 60.0  # seconds: only a bound for polling, never a timing assertion


def poll(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def lines(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_of(path: Path):
    return [line["step"] for line in lines(path) if "step" in line]


class Blocking(Backend):
    """Blocks in `write` until released; records the steps it wrote."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.steps = []

    def write(self, record):
        self.entered.set()
        self.release.wait(WAIT)
        self.steps.append(record.step)


class Raising(Backend):
    def write(self, record):
        raise RuntimeError("disk on fire")


class Buffered(Backend):
    """Keeps lines in memory until `flush`: only the logger's periodic flush puts them on disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.buffer = []

    def write(self, record):
        self.buffer.append(json.dumps({"step": record.step}))

    def flush(self):
        if self.buffer:
            with open(self.path, "a") as f:
                f.write("\n".join(self.buffer) + "\n")
            self.buffer.clear()


def test_step_order_and_exactly_once_across_threads_and_the_system_monitor(tmp_path):
    path = tmp_path / "metrics.jsonl"
    monitor = instrument.SystemMonitor(collection_interval=0.05, flush_interval=0.05, gpu=False)
    logger = Logger([JsonlBackend(str(path))], RunInfo("t", tmp_path), queue_size=8)
    monitor.start(logger)
    counter = [0]
    step_lock = threading.Lock()
    per_thread = 2500

    def work(i: int) -> None:
        for n in range(per_thread):
            with step_lock:  # steps are taken in order; staging happens with the step it took
                step = counter[0]
                counter[0] += 1
                logger.log_metrics({f"t{i}/{n}": float(n)}, step=step)
            logger.commit()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.2)  # let the monitor sample at least once more while training idles
    monitor.stop()
    logger.close()
    records = lines(path)
    steps = [r["step"] for r in records if "step" in r]
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # step order, each step once
    seen = [key for r in records if "step" in r for key in r["metrics"]]
    assert len(seen) == 4 * per_thread and set(seen) == {f"t{i}/{n}" for i in range(4) for n in range(per_thread)}
    assert all(r["metrics"][k] == float(k.split("/")[1]) for r in records if "step" in r for k in r["metrics"])
    assert any("system_step" in r for r in records)  # the monitor's side channel was written in between
    assert logger.failures == {} and logger.dropped == 0


def test_flush_makes_every_record_readable_in_tensorboard_and_jsonl(tmp_path):
    run = RunInfo("flush", tmp_path)
    logger = Logger([TensorBoardBackend(flush_every_commit=False), JsonlBackend()], run)
    for step in range(5):
        logger.log_metrics({"loss": torch.tensor(float(step))}, step=step)
        logger.commit(step)
    assert logger.flush(timeout=WAIT) is True
    assert read_scalars(run.dir)["loss"] == {s: float(s) for s in range(5)}
    assert steps_of(run.dir / "metrics.jsonl") == [0, 1, 2, 3, 4]
    logger.close()
    assert logger.flush() is False  # closed: nothing more to flush
    assert not logger._writer.alive  # close joined the writer thread


def test_every_backend_call_runs_on_the_one_writer_thread_one_at_a_time(tmp_path):
    class Where(Backend):
        def __init__(self) -> None:
            self.calls = []
            self.busy = False
            self.overlap = False

        def _note(self, method):
            self.overlap |= self.busy
            self.busy = True
            self.calls.append((method, threading.current_thread().name))
            time.sleep(0.0005)
            self.busy = False

        def open(self, run):
            self._note("open")

        def log_hyperparams(self, params, config_text=None):
            self._note("log_hyperparams")

        def write(self, record):
            self._note("write")

        def write_system(self, record):
            self._note("write_system")

        def flush(self):
            self._note("flush")

        def close(self):
            self._note("close")

    backend = Where()
    logger = Logger([backend], RunInfo("w", tmp_path))
    logger.log_hyperparams({"lr": 0.1})
    monitor = threading.Thread(
        target=lambda: [logger.write_system(StepRecord(i, {"system/x": 1.0})) for i in range(20)]
    )
    monitor.start()
    for step in range(20):
        logger.log_metrics({"x": float(step)}, step=step)
        logger.commit(step)
    monitor.join()
    logger.close()
    assert {thread for _, thread in backend.calls} == {"instrument-writer-w"}
    methods = [m for m, _ in backend.calls]
    assert methods[:2] == ["open", "log_hyperparams"] and methods[-1] == "close"
    assert methods.count("write") == 20 and methods.count("write_system") == 20 and not backend.overlap


def test_a_record_reaches_disk_within_flush_secs_without_flush_or_close(tmp_path):
    path = tmp_path / "buffered.jsonl"
    logger = Logger([Buffered(path)], RunInfo("fs", tmp_path), flush_secs=0.2)
    logger.log_metrics({"a": 1.0}, step=7)
    logger.commit(7)
    poll(lambda: path.exists() and steps_of(path) == [7], "the periodic flush")  # training stalls meanwhile
    logger.close()


def test_an_idle_writer_backs_off_to_half_of_flush_secs_and_still_finds_the_next_commit(tmp_path):
    """An idle writer looks for records less and less often (a commit does not wake it), but never less often
    than every flush_secs / 2: a record committed after a pause is written and flushed without a flush() or a
    read of its handle. The writer's own interval is read, nothing is timed."""
    path = tmp_path / "backoff.jsonl"
    logger = Logger([Buffered(path)], RunInfo("backoff", tmp_path), flush_secs=0.4)
    writer = logger._writer
    logger.log_metrics({"a": 1.0}, step=1)
    logger.commit(1)
    poll(lambda: path.exists() and steps_of(path) == [1], "the first record")
    seen = set()

    def capped() -> bool:
        seen.add(writer.interval)
        return writer.interval == 0.2

    poll(capped, "the poll interval to reach its cap")
    for _ in range(100):  # about five more polls at the cap: an uncapped interval would double to 0.4 next
        seen.add(writer.interval)
        time.sleep(0.01)
    assert max(seen) == 0.2 and not writer._parked  # backed off, capped at 0.4 / 2, and not parked (30 s)
    logger.log_metrics({"a": 2.0}, step=2)
    logger.commit(2)  # not woken: found by the writer's next poll
    poll(lambda: steps_of(path) == [1, 2], "the record committed to a backing-off writer")
    logger.close()


def test_records_found_together_are_flushed_together_when_the_flush_is_overdue(tmp_path):
    """Two steps committed back to back after a pause longer than flush_secs (a train and an eval step at the
    end of an epoch): the writer finds both at one poll and the flush is overdue after the first. Flushing
    between them would restart the flush clock for the second, which would then reach disk up to flush_secs
    late; both must go out in one flush. The writer's lock is held while committing so that it finds both."""
    path = tmp_path / "together.jsonl"
    groups = []

    class Grouped(Buffered):
        def flush(self):
            if self.buffer:
                groups.append([json.loads(line)["step"] for line in self.buffer])
            super().flush()

    logger = Logger([Grouped(path)], RunInfo("together", tmp_path), flush_secs=0.2)
    writer = logger._writer
    logger.log_metrics({"a": 0.0}, step=0)
    logger.commit(0)
    poll(lambda: path.exists() and steps_of(path) == [0], "the first record")
    poll(lambda: time.monotonic() - writer._last_flush > 0.2, "the flush to become overdue")
    with writer._cond:  # the writer cannot take the first step before the second is queued
        for step in (1, 2):
            logger.log_metrics({"a": float(step)}, step=step)
            logger.commit(step)
    poll(lambda: steps_of(path) == [0, 1, 2], "both records")
    logger.close()
    assert groups == [[0], [1, 2]]


def test_a_writer_parked_after_an_idle_spell_wakes_for_the_next_commit(tmp_path, monkeypatch):
    """An idle writer stops polling (it parks) so idle loggers cost nothing; the next commit must wake it,
    or that record would wait forever. Nothing is timed: the writer's own flag says it parked."""
    monkeypatch.setattr(writer_module, "_PARK_AFTER", 0.3)  # 30 s by default
    path = tmp_path / "parked.jsonl"
    logger = Logger([Buffered(path)], RunInfo("park", tmp_path), flush_secs=0.05)
    logger.log_metrics({"a": 1.0}, step=1)
    logger.commit(1)
    poll(lambda: path.exists() and steps_of(path) == [1], "the first record")
    poll(lambda: logger._writer._parked, "the writer to park")
    logger.log_metrics({"a": 2.0}, step=2)
    logger.commit(2)  # no flush, no read of the handle: only the commit's own wake can start the writer
    poll(lambda: steps_of(path) == [1, 2], "the record committed to a parked writer")
    logger.close()


def test_reading_a_committed_step_waits_for_its_record_not_for_the_backends_writing_it(tmp_path):
    """result() waited until every backend had written the step: a slow backend held whoever read it (the training
    thread, for NonFinite(raise_on_nonfinite=True)) for its whole write."""
    backend = Blocking()
    logger = Logger([backend], RunInfo("r", tmp_path))
    logger.log_metrics({"a": 1.5}, step=0)
    handle = logger.commit(0)
    record = handle.result(timeout=WAIT)
    assert record is not None and record.scalars == {"a": 1.5}
    assert handle.scalars == {"a": 1.5}
    poll(backend.entered.is_set, "the backend's write")  # built first, then handed to the backend
    assert backend.steps == []  # still inside its write
    backend.release.set()
    assert logger.flush(WAIT) and backend.steps == [0]
    logger.close()


def test_full_queue_blocks_by_default_and_loses_nothing(tmp_path):
    backend = Blocking()
    logger = Logger([backend], RunInfo("b", tmp_path), queue_size=2)

    def train():
        for step in range(10):
            logger.log_metrics({"a": float(step)}, step=step)
            logger.commit(step)

    trainer = threading.Thread(target=train)
    trainer.start()
    poll(lambda: backend.entered.is_set() and logger._writer.pending == 2, "a full queue")
    assert trainer.is_alive()  # blocked in commit, waiting for room
    backend.release.set()
    trainer.join(WAIT)
    assert logger.flush(WAIT)
    assert backend.steps == list(range(10)) and logger.dropped == 0
    logger.close()


def test_full_queue_drop_mode_drops_the_oldest_counts_and_warns_once(tmp_path, caplog):
    backend = Blocking()
    logger = Logger([backend], RunInfo("d", tmp_path), queue_size=2, on_full="drop")
    logger.log_metrics({"a": 0.0}, step=0)
    first = logger.commit(0)
    poll(backend.entered.is_set, "the writer to take step 0")
    with caplog.at_level(logging.WARNING, logger="instrument"):
        handles = []
        for step in range(1, 10):
            logger.log_metrics({"a": float(step)}, step=step)
            handles.append(logger.commit(step))  # never waits
    assert logger.dropped == 7
    assert sum("queue is full" in r.getMessage() for r in caplog.records) == 1
    backend.release.set()
    assert logger.flush(WAIT)
    assert backend.steps == [0, 8, 9]
    assert [h.dropped for h in handles] == [True] * 7 + [False, False]
    assert first.scalars == {"a": 0.0} and handles[-1].result().scalars == {"a": 9.0}
    with pytest.raises(LookupError, match="step 1 was dropped"):
        _ = handles[0].scalars
    logger.close()


class Poisoner(instrument.Observer):
    """Stages one poisoned value at step 3; a scalar every step."""

    def __init__(self, name, poison) -> None:
        self.name = name
        self.poison = poison

    def log(self, logger, step):
        logger.log_metrics({f"{self.name}/ok": float(step)}, step=step)
        if step == 3:
            self.poison(logger, step)


POISONS = {
    "meta": lambda lg, s: lg.log_heatmap("meta", torch.empty(4, 4, device="meta"), s),
    "heatmap3d": lambda lg, s: lg.log_heatmap("hm3", torch.rand(2, 3, 4), s),
    "image877": lambda lg, s: lg.log_image("img", np.zeros((8, 8, 7)), s),
}


def test_poisoned_values_at_step_3_cost_that_value_only(tmp_path, caplog):
    good = []

    class Good(instrument.Observer):
        name = "good"

        def log(self, logger, step):
            logger.log_metrics({"good/loss": float(step)}, step=step)
            logger.log_heatmap("good/hm", torch.rand(3, 5), step)
            good.append(step)

    observers = [Poisoner(name, poison) for name, poison in POISONS.items()] + [Good()]
    with caplog.at_level(logging.ERROR, logger="instrument"):
        with instrument.Instrumentation(
            observers, backends=[TensorBoardBackend(), JsonlBackend()], log_interval=1, run_name="p",
            log_dir=str(tmp_path),
        ) as inst:
            for step in range(10):
                with inst.step(step):
                    pass
    run = tmp_path / "p"
    scalars = read_scalars(run)
    for key in ["good/loss"] + [f"{name}/ok" for name in POISONS]:
        assert scalars[key] == {s: float(s) for s in range(10)}, key
    by_step = {r["step"]: r for r in lines(run / "metrics.jsonl") if "step" in r}
    assert sorted(by_step) == list(range(10))
    assert all("good/hm" in by_step[s]["images"] for s in range(10))
    assert set(by_step[3]["images"]) == {"good/hm"}
    assert inst.failures == {name: 1 for name in POISONS}  # each poisoned observer, once; no backend
    text = caplog.text  # each observer's failure is reported once, with the value's own message
    assert "log_heatmap('meta'): got a meta tensor of shape (4, 4)" in text
    assert "log_heatmap('hm3'): expected a 2-D matrix [rows, cols] (1-D: one column), got shape (2, 3, 4)" in text
    assert "log_image('img'): expected an image of shape" in text and "got shape (8, 8, 7)" in text


@pytest.mark.parametrize("name", sorted(POISONS))
def test_poisoned_values_raise_on_the_caller_and_the_rest_is_committed(name, tmp_path):
    path = tmp_path / "m.jsonl"
    logger = Logger([JsonlBackend(str(path))], RunInfo("c", tmp_path))
    logger.log_metrics({"a": 1.0}, step=3)
    with pytest.raises(InvalidValueError) as caught:
        POISONS[name](logger, 3)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, TypeError)
    logger.log_metrics({"b": 2.0}, step=3)
    logger.commit(3)
    for step in range(4, 10):
        logger.log_metrics({"a": float(step)}, step=step)
        logger.commit(step)
    logger.close()  # does not raise
    records = lines(path)
    assert records[0]["metrics"] == {"a": 1.0, "b": 2.0} and [r["step"] for r in records] == list(range(3, 10))


def test_a_value_failing_on_the_writer_is_dropped_alone_and_said_once(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    logger = Logger([JsonlBackend(str(path))], RunInfo("w", tmp_path))
    with caplog.at_level(logging.ERROR, logger="instrument"):
        for step in range(3):
            logger.log_metrics({"a": float(step)}, step=step)
            logger.log_histogram("h", [1.0, 2.0], step)
            with logger._lock:  # a value the caller's cheap checks let through; it fails to render on the writer
                logger._media[("heatmap", "hm3")] = (torch.rand(2, 3, 4), ("", ""))
            logger.commit(step)
        logger.close()
    records = lines(path)
    assert [r["metrics"]["a"] for r in records] == [0.0, 1.0, 2.0]
    assert all("images" not in r and r["histograms"]["h"]["count"] == 2 for r in records)
    dropped = [r.getMessage() for r in caplog.records if "dropped heatmap 'hm3'" in r.getMessage()]
    assert len(dropped) == 1 and "received a cpu tensor of shape (2, 3, 4)" in dropped[0]
    assert "expected a 2-D matrix" in dropped[0]
    assert logger.failures == {"heatmap hm3": 3}


def test_nested_and_meta_values_are_refused_on_the_caller():
    logger = Logger([])
    nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)
    with pytest.raises(InvalidValueError, match="log_heatmap\\('s'\\): got a nested tensor"):
        logger.log_heatmap("s", nested, 0)  # a sparse one is drawn dense (tests/test_media_values.py)
    with pytest.raises(InvalidValueError, match="field 'score' of sample 0: got a meta tensor"):
        logger.log_samples("v", [{"score": torch.empty((), device="meta")}], 0)
    with pytest.raises(ValueError, match="metric 'm' is a meta tensor"):
        logger.log_metrics({"m": torch.empty((), device="meta")}, 0)
    assert not logger.has_pending
    logger.close()


def test_a_backend_raising_on_every_write_costs_the_others_nothing(tmp_path, caplog):
    run = RunInfo("r", tmp_path)
    with caplog.at_level(logging.ERROR, logger="instrument"):
        logger = Logger([Raising(), TensorBoardBackend(), JsonlBackend()], run)
        for step in range(10):
            logger.log_metrics({"x": float(step)}, step=step)
            logger.commit(step)
        logger.close()
    assert read_scalars(run.dir)["x"] == {s: float(s) for s in range(10)}
    assert steps_of(run.dir / "metrics.jsonl") == list(range(10))
    reports = [r for r in caplog.records if "Raising" in r.getMessage()]
    assert len(reports) == 1 and "backend 'Raising' failed in write()" in reports[0].getMessage()
    assert logger.failures == {"Raising": 10}


def test_staged_values_are_cleared_when_a_commit_raises():
    logger = Logger([])
    logger.log_metrics({"a": 1.0}, step=5)
    logger.commit(5)
    logger.log_metrics({"b": 1.0}, step=5)
    with pytest.raises(instrument.StepOrderError):
        logger.commit(4)
    assert not logger.has_pending
    logger.close()


def test_instrumentation_passes_queue_settings_and_an_exception_marks_the_run_failed(tmp_path):
    seen = []

    class Status(Backend):
        def write(self, record):
            pass

        def on_exit(self, status):
            seen.append(status)

    with pytest.raises(RuntimeError, match="diverged"):
        with instrument.Instrumentation(
            backends=[Status()], log_dir=str(tmp_path), queue_size=3, on_full="drop", flush_secs=0.5
        ) as inst:
            assert inst.logger._writer.queue_size == 3 and inst.logger._writer.on_full == "drop"
            raise RuntimeError("diverged")
    assert seen == ["failed"]
    with pytest.raises(instrument.ConfigurationError, match="on_full must be one of"):
        Logger([], on_full="never")


CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from instrument.backends.base import RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.backends.tensorboard import TensorBoardBackend
    from instrument.logger.logger import Logger

    run = RunInfo("child", sys.argv[1])
    logger = Logger([TensorBoardBackend(flush_every_commit=False), JsonlBackend()], run, flush_secs=3600)
    step = 0
    while True:
        logger.log_metrics({"loss": torch.tensor(float(step))}, step=step)
        logger.commit(step)
        print(step, flush=True)
        step += 1
        time.sleep(0.01)
    """
)


def test_sigterm_keeps_every_committed_step_and_the_child_dies_by_the_signal(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    wanted = 20
    committed = -1
    try:
        for line in child.stdout:
            committed = int(line)
            if committed + 1 >= wanted:
                break
        os.kill(child.pid, signal.SIGTERM)
        child.communicate(timeout=WAIT)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGTERM
    run = tmp_path / "child"
    jsonl = steps_of(run / "metrics.jsonl")
    tb = sorted(read_scalars(run)["loss"])
    # Every step printed (committed) before the signal is on disk; a step committed after the last print
    # and before the signal arrived may be there too.
    assert jsonl[: committed + 1] == list(range(committed + 1)) and jsonl == list(range(len(jsonl)))
    assert tb == jsonl


INTERRUPTED_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    # Python's own Ctrl-C handler, as in a terminal: a parent started in the background (e.g. `make test &`
    # from a script) hands its children SIGINT ignored, and Python then installs none.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import instrument
    from instrument.backends.base import Backend
    from instrument.backends.jsonl import JsonlBackend

    class Status(Backend):
        def write(self, record):
            pass

        def on_exit(self, status):
            print("on_exit", status, flush=True)

    try:
        with instrument.Instrumentation(
            backends=[JsonlBackend(), Status()], log_interval=1, run_name="child", log_dir=sys.argv[1]
        ) as inst:
            for step in range(5):
                with inst.step(step):
                    inst.logger.log_metrics({"a": float(step)}, step=step)
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
    """
)


def test_sigint_still_raises_keyboard_interrupt_and_marks_the_run_killed(tmp_path):
    done = run_child(tmp_path, INTERRUPTED_CHILD, str(tmp_path), timeout=WAIT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["on_exit killed", "KeyboardInterrupt"]
    assert steps_of(tmp_path / "child" / "metrics.jsonl") == [0, 1, 2, 3, 4]


def test_bad_input_errors_are_instrument_errors_and_keep_their_old_types():
    from instrument.errors import InstrumentError
    from instrument.logger.timer import Timer

    logger = Logger([])
    for bad, old in ((lambda: logger.log_metrics({"a": "x"}, 0), TypeError),
                     (lambda: logger.log_metrics({"a": torch.ones(2)}, 0), ValueError),
                     (lambda: Timer(""), ValueError),
                     (lambda: Timer("t", reduce="median"), ValueError)):
        with pytest.raises(old) as caught:
            bad()
        assert isinstance(caught.value, InstrumentError)
    logger.close()


FAILING_CHILD = textwrap.dedent(
    """
    import sys
    from instrument.backends.base import Backend, RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.logger.logger import Logger

    class Status(Backend):
        def write(self, record):
            pass

        def on_exit(self, status):
            print("on_exit", status, flush=True)

        def close(self):
            print("close", flush=True)

    logger = Logger([JsonlBackend(), Status()], RunInfo("child", sys.argv[1]))  # never closed by the script
    for step in range(3):
        logger.log_metrics({"a": float(step)}, step=step)
        logger.commit(step)
    raise RuntimeError("diverged")
    """
)


def test_an_uncaught_exception_marks_the_run_failed_and_exit_closes_the_logger(tmp_path):
    done = run_child(tmp_path, FAILING_CHILD, str(tmp_path), timeout=WAIT)
    assert done.returncode == 1 and "RuntimeError: diverged" in done.stderr
    assert done.stdout.splitlines() == ["on_exit failed", "close"]
    assert steps_of(tmp_path / "child" / "metrics.jsonl") == [0, 1, 2]


def test_a_value_logged_while_close_hands_over_its_last_commit_is_written_or_refused(tmp_path):
    backend = Blocking()
    logger = Logger([backend, JsonlBackend()], RunInfo("c", tmp_path), queue_size=1)
    logger.log_metrics({"a": 0.0}, step=0)
    logger.commit(0)
    poll(lambda: backend.entered.is_set() and logger._writer.pending == 0, "the writer inside write(step 0)")
    logger.log_metrics({"a": 1.0}, step=1)
    logger.commit(1)  # the queue (size 1) is full now
    logger.log_metrics({"a": 2.0}, step=2)  # staged: close() commits it and waits for room
    closer = threading.Thread(target=logger.close)
    closer.start()
    poll(lambda: not logger.has_pending, "close() to take the staged values")
    assert closer.is_alive()  # blocked handing its final commit over
    try:
        logger.log_metrics({"late": 7.0}, step=3)  # another thread (an evaluation thread) logs now
        accepted = True
    except instrument.ConfigurationError:
        accepted = False  # refused loudly: that is fine as well
    backend.release.set()
    closer.join(WAIT)
    written = {key for line in lines(tmp_path / "c" / "metrics.jsonl") if "step" in line for key in line["metrics"]}
    assert not accepted or "late" in written  # an accepted value is written, never silently lost


def test_a_numpy_buffer_reused_after_commit_is_written_as_it_was_at_commit(tmp_path):
    from instrument.logger.render import render_heatmap, to_hwc_uint8

    class Records(Backend):
        def __init__(self):
            self.records = []

        def write(self, record):
            self.records.append(record)

    blocking, records = Blocking(), Records()
    logger = Logger([blocking, JsonlBackend(), records], RunInfo("n", tmp_path))
    logger.log_metrics({"a": 0.0}, step=0)
    logger.commit(0)
    poll(blocking.entered.is_set, "the writer inside write(step 0)")  # step 1 is built only after the release
    buffer = np.arange(10, dtype=np.float64)  # e.g. per-episode returns, refilled every logging step
    frame = np.linspace(0.0, 1.0, 48).reshape(4, 4, 3)  # a render buffer, reused for the next frame
    matrix = np.arange(6, dtype=np.float64).reshape(3, 2)
    expected = (to_hwc_uint8(frame.copy()), render_heatmap(matrix.copy(), title="m"))
    logger.log_histogram("returns", buffer, step=1)
    tokens = [3, 1, 4]  # a Python list refilled in place the same way
    logger.log_samples("val", [{"input": "x", "score": 1.0, "returns": buffer, "tokens": tokens}], step=1)
    logger.log_image("frame", frame, step=1)
    logger.log_video("clip", frame[None], step=1)
    logger.log_heatmap("m", matrix, step=1)
    logger.commit(1)
    buffer[:] = -1.0  # the next interval starts filling the buffers again
    tokens[:] = [9]
    frame[:] = 0.0
    matrix[:] = 7.0
    blocking.release.set()
    logger.close()
    line = next(x for x in lines(tmp_path / "n" / "metrics.jsonl") if x.get("step") == 1)
    assert line["histograms"]["returns"] == {"count": 10, "min": 0.0, "max": 9.0}
    record = next(r for r in records.records if r.step == 1)
    assert record.samples["val"].rows[0]["returns"] == list(range(10))
    assert record.samples["val"].rows[0]["tokens"] == [3, 1, 4]
    np.testing.assert_array_equal(record.images["frame"], expected[0])
    np.testing.assert_array_equal(record.videos["clip"][0][0], expected[0])
    np.testing.assert_array_equal(record.images["m"], expected[1])


NEAR_CONSTANT_HEATMAP = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from instrument.backends.base import RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.logger.logger import Logger

    logger = Logger([JsonlBackend()], RunInfo("h", sys.argv[1]))
    # e.g. alive fractions that are all 1.0 but for float64 rounding in one cell
    logger.log_heatmap("alive", np.array([[1.0, 0.9999999999999999], [1.0, 1.0]]), step=0)
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.commit(0)
    logger.log_metrics({"loss": 0.4}, step=1)
    logger.commit(1)
    print("flushed", logger.flush(10.0), flush=True)  # a bound, not a timing check
    logger.close(timeout=2.0)
    os._exit(0)  # a writer thread still spinning must not hold this process
    """
)


def test_a_heatmap_spanning_a_few_ulps_does_not_stop_the_writer(tmp_path):
    child = run_child(tmp_path, NEAR_CONSTANT_HEATMAP, str(tmp_path))
    assert "flushed True" in child.stdout, child.stdout + child.stderr
    assert steps_of(tmp_path / "h" / "metrics.jsonl") == [0, 1]
    from instrument.logger.render import _LUT, colorbar_ticks, heatmap_geometry, render_heatmap

    # ranges the tick loop could not step through: a few ulps, subnormal, overflowing, at 2**53
    for lo, hi in [(0.9999999999999999, 1.0), (0.0, 5e-324), (0.0, 1e-320), (-1.7e308, 1.7e308),
                   (1e16, 1e16 + 64.0), (-1.0, np.nextafter(-1.0, 0.0))]:
        ticks = colorbar_ticks(lo, hi, 256)
        assert ticks[:2] == [(hi, 0), (lo, 255)] and all(lo <= v <= hi for v, _ in ticks)
    # rounding noise is drawn as the constant image it is (one colour), not as full contrast
    image = render_heatmap(np.array([[1.0, 0.9999999999999999], [1.0, 1.0]]))
    left, top, cw, ch = heatmap_geometry(2, 2)
    cells = {tuple(image[top + r * ch + ch // 2, left + c * cw + cw // 2]) for r in range(2) for c in range(2)}
    assert cells == {tuple(_LUT[0])}
    # a range wider than float64 holds is drawn too (lowest, highest and middle colours), not refused
    image = render_heatmap(np.array([[-1e308, 1e308], [0.0, 0.0]]))
    centre = [tuple(image[top + r * ch + ch // 2, left + c * cw + cw // 2]) for r, c in ((0, 0), (0, 1), (1, 0))]
    assert centre == [tuple(_LUT[0]), tuple(_LUT[255]), tuple(_LUT[128])]


CLOSE_INTERRUPTED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from instrument.backends.base import Backend, RunInfo
    from instrument.logger.logger import Logger

    out = Path(sys.argv[1])

    class SlowClose(Backend):  # e.g. W&B's run.finish, which writes the run's last block
        def write(self, record):
            pass

        def close(self):
            (out / "closing").write_text("")
            deadline = time.monotonic() + 60.0
            while not (out / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            (out / "closed").write_text("")

    logger = Logger([SlowClose()], RunInfo("c", out))
    logger.log_metrics({"a": 1.0}, step=0)
    logger.close()
    """
)


def test_sigterm_during_close_still_lets_the_backends_finish_closing(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CLOSE_INTERRUPTED)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    try:
        poll(lambda: (tmp_path / "closing").exists() or child.poll() is not None, "the backend's close to start")
        os.kill(child.pid, signal.SIGTERM)  # the main thread is inside Logger.close, waiting for the writer
        (tmp_path / "release").write_text("")
        child.wait(WAIT)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGTERM
    assert (tmp_path / "closed").exists()  # the close in progress was waited for (at most 30 s), not cut off


class FailingFlush(Backend):
    """Writes, but cannot make what it wrote durable (an fsync that fails with EIO, a full disk)."""

    def write(self, record):
        pass

    def flush(self):
        raise OSError(5, "Input/output error")


def test_flush_does_not_report_success_when_a_backend_could_not_flush(tmp_path):
    logger = Logger([FailingFlush(), JsonlBackend()], RunInfo("f", tmp_path))
    logger.log_metrics({"a": 1.0}, step=0)
    logger.commit(0)
    flushed = logger.flush(WAIT)
    logger.close()
    assert logger.failures.get("FailingFlush", 0) >= 1
    assert flushed is False


class FailsAtStepOne(Backend):
    """Cannot write one record (a dropped connection), writes the others."""

    def write(self, record):
        if record.step == 1:
            raise ConnectionError("connection reset")


def test_flush_says_whether_every_step_since_the_previous_flush_was_written(tmp_path):
    logger = Logger([FailsAtStepOne(), JsonlBackend()], RunInfo("w", tmp_path))
    answers = []
    for step in range(3):
        logger.log_metrics({"a": float(step)}, step=step)
        logger.commit(step)
        answers.append(logger.flush(WAIT))
    logger.close()
    assert answers == [True, False, True]  # step 1 was not written by every backend; steps 0 and 2 were
    assert logger.failures["FailsAtStepOne"] == 1
    assert steps_of(tmp_path / "w" / "metrics.jsonl") == [0, 1, 2]  # the other backend lost nothing



class SlowWrite(Backend):
    """Each write takes a while, so that a flush with a short timeout gives up before the writer reaches it."""

    def write(self, record):
        time.sleep(0.05)


def test_a_flush_that_timed_out_leaves_the_failures_it_saw_to_the_next_flush(tmp_path):
    """The writer answered a flush whose caller had given up, which took the failure of step 1 as told: the
    next flush said True although step 1 was never written by FailsAtStepOne."""
    logger = Logger([SlowWrite(), FailsAtStepOne(), JsonlBackend()], RunInfo("t", tmp_path))
    for step in range(6):
        logger.log_metrics({"a": float(step)}, step=step)
        logger.commit(step)
    assert logger.flush(timeout=0.01) is False  # gave up: six slow writes are ahead of it
    assert logger.flush(WAIT) is False  # step 1 failed since the last flush that answered its caller
    assert logger.failures["FailsAtStepOne"] == 1
    assert logger.flush(WAIT) is True
    logger.close()


SIGNAL_WHILE_REGISTERING = textwrap.dedent(
    """
    import os, signal, sys
    from instrument.backends.base import RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.logger import shutdown
    from instrument.logger.logger import Logger

    logger = Logger([JsonlBackend()], RunInfo("r", sys.argv[1]))
    logger.log_metrics({"a": 1.0}, step=0)
    logger.commit(0)
    # The main thread holds the registry's lock for a moment whenever a logger is created or closed
    # (register / unregister); a SIGTERM that arrives then runs its handler on this thread, inside it.
    with shutdown._lock:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between two of these bytecodes
            pass
    print("survived", flush=True)
    """
)


def test_sigterm_while_the_main_thread_holds_the_logger_registry_lock_does_not_deadlock(tmp_path):
    done = run_child(tmp_path, SIGNAL_WHILE_REGISTERING, str(tmp_path), timeout=WAIT)  # a deadlock: TimeoutExpired
    assert done.returncode == -signal.SIGTERM, done.stdout + done.stderr
    assert steps_of(tmp_path / "r" / "metrics.jsonl") == [0]


FORKED_CHILD = textwrap.dedent(
    """
    import os, sys
    import instrument

    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=1, run_name="r",
                                      log_dir=sys.argv[1], queue_size=4)
    with inst.step(0):
        inst.logger.log_metrics({"parent": 0.0}, step=0)
    pid = os.fork()
    if pid == 0:  # the child inherits the logger, not its writer thread
        for step in range(1, 20):  # more commits than the queue holds: this used to wait forever
            try:
                inst.logger.log_metrics({"child": 1.0}, step=step)
                inst.logger.commit(step)
            except instrument.ConfigurationError as exc:
                print("child:", exc, flush=True)
        inst.close()
        own = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("own", sys.argv[1]))
        own.log_metrics({"child": 1.0}, step=0)  # what the error says to do: a logger of the child's own
        own.commit()
        sys.exit(0)  # a normal exit runs atexit (closing `own`): it used to wait 30 s for the inherited writer
    _, status = os.waitpid(pid, 0)
    print("child status", os.waitstatus_to_exitcode(status), flush=True)
    for step in (1, 2):
        with inst.step(step):
            inst.logger.log_metrics({"parent": float(step)}, step=step)
    inst.close()
    """
)


def test_a_forked_child_is_told_to_make_its_own_logger_and_the_parent_loses_nothing(tmp_path):
    done = run_child(tmp_path, FORKED_CHILD, str(tmp_path), timeout=WAIT)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("child:")]
    assert len(said) == 19 and all("forked child process" in line and "Create the Logger" in line for line in said)
    assert done.stdout.splitlines()[-1] == "child status 0"
    records = lines(tmp_path / "r" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["parent"]) for r in records if "step" in r] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert not any("child" in r.get("metrics", {}) for r in records)
    assert [(r["step"], r["metrics"]) for r in lines(tmp_path / "own" / "metrics.jsonl")] == [(0, {"child": 1.0})]


class ReadsItsOwnCommit(Backend):
    """A backend that commits a step from inside ``write`` and reads it back (on the writer thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.logger = None
        self.steps = []
        self.errors = []

    def write(self, record: StepRecord) -> None:
        self.steps.append(record.step)
        if record.step == 0:
            self.logger.log_metrics({"x": 1.0}, step=1)
            handle = self.logger.commit()
            try:
                self.errors.append(handle.scalars)  # not built yet, nor while this thread waits: it used to hang
            except LookupError as exc:
                self.errors.append(str(exc))


def test_a_backend_reading_a_step_not_built_yet_gets_an_error_not_a_hang(tmp_path):
    backend = ReadsItsOwnCommit()
    logger = Logger([backend], RunInfo("r", tmp_path))
    backend.logger = logger
    logger.log_metrics({"x": 0.0}, step=0)
    logger.commit()
    assert logger.flush(timeout=WAIT)  # the writer went on: step 1 is written too
    logger.close(timeout=WAIT)
    assert backend.steps == [0, 1]
    assert len(backend.errors) == 1 and "writer thread" in backend.errors[0]
