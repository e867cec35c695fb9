"""SystemMonitor at the end of a run and when its buffer fills: every sample taken is written, or counted and
reported. Real child processes (a crash, an exit without ``close``, SIGTERM), real loggers, JSONL read back."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from instrument import Instrumentation, JsonlBackend, Logger, RunInfo, SystemMonitor

pytest.importorskip("psutil")

# Three logging steps of a session with a SystemMonitor whose hour-long flush interval keeps its samples buffered.
SESSION = textwrap.dedent(
    """
    mon = instrument.SystemMonitor(collection_interval=0.05, flush_interval=3600.0, gpu=False)
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=1, log_dir=root,
                                      run_name="r", system_monitor=mon, overhead_budget=None)
    for s in range(3):
        with inst.step(s):
            inst.logger.log_metrics({"loss": float(s)}, step=s)
    """
)

CHILD = textwrap.dedent(
    """
    import sys, time, instrument

    root, how = sys.argv[1], sys.argv[2]
    """
) + SESSION + textwrap.dedent(
    """
    while mon.buffered < 3:  # samples the hour-long flush interval has not written yet
        time.sleep(0.01)
    print(mon.buffered, flush=True)
    if how == "crash":
        raise RuntimeError("training crashed")
    if how == "sigterm":
        time.sleep(600)
    # "exit": the script ends without inst.close()
    """
)


def _system_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if "system_step" in json.loads(line)]


@pytest.mark.parametrize("how", ["crash", "exit", "sigterm"])
def test_a_run_ended_without_close_still_writes_the_samples_the_monitor_buffered(tmp_path, how):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path), how], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        buffered = int(child.stdout.readline())
        if how == "sigterm":
            os.kill(child.pid, signal.SIGTERM)
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert {"crash": 1, "exit": 0, "sigterm": -signal.SIGTERM}[how] == child.returncode, err
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if '"step"' in line] == [0, 1, 2]
    system = _system_lines(tmp_path / "r" / "metrics.jsonl")
    assert len(system) >= buffered >= 3, err  # the monitor stopped, and flushed, before the logger closed
    seconds = [line["metrics"]["system/seconds"] for line in system]
    assert seconds == sorted(seconds)


def test_a_logger_closed_before_its_monitor_stops_writes_the_samples_first(tmp_path):
    logger = Logger([JsonlBackend()], RunInfo("r", tmp_path))
    monitor = SystemMonitor(collection_interval=0.02, flush_interval=3600.0, gpu=False)
    monitor.start(logger)
    while monitor.buffered < 3:
        time.sleep(0.01)
    buffered = monitor.buffered
    logger.close()  # before monitor.stop(): the logger stops the monitor first
    assert not monitor.running and monitor.dropped == 0
    monitor.stop()
    assert len(_system_lines(tmp_path / "r" / "metrics.jsonl")) >= buffered


def test_samples_a_closed_logger_cannot_take_are_counted_and_reported_once(tmp_path, caplog):
    logger = Logger([JsonlBackend()], RunInfo("r", tmp_path))
    logger.close()

    class Counting(SystemMonitor):
        taken = 0

        def sample(self):
            Counting.taken += 1
            return super().sample()

    monitor = Counting(collection_interval=0.02, flush_interval=3600.0, gpu=False)
    monitor.start(logger)  # a closed logger: nothing the monitor hands over is written
    while monitor.buffered < 3:
        time.sleep(0.01)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        monitor.stop()
    assert monitor.dropped == Counting.taken >= 3
    warnings = [r.getMessage() for r in caplog.records if "system monitor could not write" in r.getMessage()]
    assert warnings == [f"instrument: the system monitor could not write {Counting.taken} buffered sample(s): the "
                        f"logger was closed before the monitor handed them over (stop the monitor, or close the "
                        f"Instrumentation, before closing its logger; a Logger does that itself). They are lost; "
                        f"SystemMonitor.dropped counts every sample not written"]
    assert not [line for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if "system" in line]


def test_a_buffer_that_fills_before_the_flush_is_flushed_early_and_drops_nothing(tmp_path):
    class Counting(SystemMonitor):
        taken = 0
        most = 0

        def sample(self):
            Counting.taken += 1
            Counting.most = max(Counting.most, self.buffered)
            return super().sample()

    monitor = Counting(collection_interval=0.01, flush_interval=3600.0, gpu=False, max_buffered=3)
    inst = Instrumentation(backends=[JsonlBackend()], log_interval=1, log_dir=str(tmp_path), run_name="r",
                           system_monitor=monitor, overhead_budget=None)
    while Counting.taken < 20:  # many more samples than max_buffered within one flush interval
        time.sleep(0.01)
    inst.close()
    assert Counting.most <= 3 and monitor.dropped == 0  # memory stays bounded
    system = _system_lines(tmp_path / "r" / "metrics.jsonl")
    assert len(system) == Counting.taken  # every sample taken is written
    seconds = [line["metrics"]["system/seconds"] for line in system]
    assert seconds == sorted(seconds) and len(set(seconds)) == len(seconds)


SIGNAL_IN_COMMIT = textwrap.dedent(
    """
    import os, signal, sys, time, instrument

    root = sys.argv[1]
    """
) + SESSION + textwrap.dedent(
    """
    while mon.buffered < 5:
        time.sleep(0.01)
    print(mon.buffered, flush=True)
    # SIGTERM arriving while a commit holds the writer's lock (as it does for a moment in every commit); the
    # monitor's thread needs that lock to hand a sample over, so waiting for it stalled the close 10 s.
    with inst.logger._writer._mutex:
        mon.collection_interval = 0.001  # the monitor's thread soon waits for the lock to flush a full buffer
        mon.max_buffered = 1
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(600)
    """
)


def test_sigterm_during_a_commit_hands_the_buffered_samples_over_without_waiting_for_the_monitor(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(SIGNAL_IN_COMMIT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        buffered = int(child.stdout.readline())
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGTERM, err
    assert "did not stop within" not in err, err
    system = _system_lines(tmp_path / "r" / "metrics.jsonl")
    # All but the one sample the blocked thread held (said in a warning naming the ending process) are written.
    assert len(system) >= buffered - 1, err
    if len(system) < buffered:
        assert "the process was ending" in err, err



def test_a_before_close_hook_without_arguments_still_runs(tmp_path):
    """Logger.before_close hooks take ``prompt`` only if they have a parameter: a hook written without one was
    called with an argument, raised TypeError and never ran."""
    logger = Logger([JsonlBackend()], RunInfo("h", tmp_path))
    ran = []
    logger.before_close(lambda: ran.append("plain"))
    logger.before_close(lambda prompt: ran.append(("prompt", prompt)))
    logger.close()
    assert ran == ["plain", ("prompt", False)]
