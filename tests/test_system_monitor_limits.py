"""SystemMonitor at its limits: a sample that hangs while the run closes, intervals too long for a thread's wait or
too short for the kernel's CPU accounting, an NVML device that reports no memory total. Real threads, real psutil,
a real session's JSONL read back; NVML is a stand-in set on the monitor, as in test_system_monitor.py."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from instrument import ConfigurationError, Instrumentation, JsonlBackend, Logger, RunInfo, SystemMonitor
from instrument.monitors.system import MIN_CPU_WINDOW
from tests.test_system_monitor import _Sink  # keeps the monitor's records

pytest.importorskip("psutil")


def _system_lines(path):
    return [line for line in map(json.loads, path.read_text().splitlines()) if "system_step" in line]


@pytest.mark.parametrize("closes", ["session", "logger"])
def test_a_close_whose_monitor_hangs_in_a_sample_returns_within_its_timeout_with_the_buffered_samples(tmp_path,
                                                                                                       caplog, closes):
    """The stop waited a fixed 10 s whatever the close's timeout, then left the buffered samples to a thread that
    could only drop them once the logger had closed, and blamed the user for closing the logger first. Closing
    the Instrumentation stops the monitor itself; closing a Logger stops it through its before_close hook."""
    entered, release = threading.Event(), threading.Event()

    class Hangs(SystemMonitor):
        calls = 0

        def sample(self):
            Hangs.calls += 1
            if Hangs.calls == 4:  # three samples are buffered (the flush interval is an hour), the fourth hangs
                entered.set()
                release.wait(120)
            return super().sample()

    monitor = Hangs(collection_interval=0.05, flush_interval=3600.0, gpu=False)
    if closes == "session":
        closing = Instrumentation(backends=[JsonlBackend()], log_interval=1, log_dir=str(tmp_path), run_name="r",
                                  system_monitor=monitor, overhead_budget=None)
    else:
        closing = Logger([JsonlBackend()], RunInfo("r", tmp_path))
        monitor.start(closing)
    try:
        assert entered.wait(60)
        with caplog.at_level(logging.WARNING, logger="instrument"):
            closing.close(timeout=1.0)
        returned_while_hung = monitor.running and not release.is_set()
    finally:
        release.set()
    monitor._thread.join(60)
    assert returned_while_hung
    assert len(_system_lines(tmp_path / "r" / "metrics.jsonl")) == 3  # handed over by the close itself
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "did not stop within 0.5 s: it is still inside Hangs.sample()" in said  # half the close's timeout
    assert "before closing its logger" not in said
    assert monitor.dropped == 1  # the hung sample, dropped by the thread when it returned


class _HangingNvml:
    """NVML whose second memory query hangs (a wedged GPU) until released; it records every nvmlShutdown and
    whether an NVML call was still running then."""

    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()
        self.calls, self.busy, self.shutdowns = 0, False, []

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=50)

    def nvmlDeviceGetMemoryInfo(self, handle):
        self.calls += 1
        if self.calls == 2:
            self.busy = True
            self.inside.set()
            self.release.wait(120)
            self.busy = False
        return SimpleNamespace(used=2**30, total=2**32)

    def nvmlShutdown(self):
        self.shutdowns.append(self.busy)


def test_a_stop_that_gives_up_on_an_nvml_call_names_it_and_leaves_nvml_up_until_it_returns(caplog):
    nvml = _HangingNvml()
    monitor = SystemMonitor(collection_interval=0.05, flush_interval=3600.0, gpu=True)
    monitor._nvml, monitor._nvml_handles = nvml, [(0, "handle 0")]
    monitor._init_nvml = lambda: None  # the stand-in above, not the machine's NVML
    sink = _Sink()
    monitor.start(sink)
    try:
        assert nvml.inside.wait(60)
        with caplog.at_level(logging.WARNING, logger="instrument"):
            monitor.stop(timeout=0.2)
        at_stop = list(nvml.shutdowns)
        records_at_stop = len(sink.records)
    finally:
        nvml.release.set()
    monitor._thread.join(60)
    assert at_stop == []  # not shut down under the running call
    assert nvml.shutdowns == [False]  # by the thread, once the call returned
    assert records_at_stop == 1  # the sample buffered before the hung one
    assert any("still inside nvmlDeviceGetMemoryInfo (GPU 0)" in r.getMessage() for r in caplog.records)


CHILD = textwrap.dedent(
    """
    import logging, sys, threading, instrument

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    entered, never = threading.Event(), threading.Event()

    class Hangs(instrument.SystemMonitor):
        def sample(self):
            entered.set()
            never.wait()  # for good
            return super().sample()

    mon = Hangs(collection_interval=0.05, flush_interval=3600.0, gpu=False)
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_dir=sys.argv[1], run_name="r",
                                      system_monitor=mon, overhead_budget=None)
    entered.wait()
    inst.close(timeout=1.0)
    print("closed; monitor running:", mon.running, flush=True)
    """
)


def test_a_monitor_thread_hung_for_good_does_not_hold_the_process_at_exit(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "closed; monitor running: True" in done.stdout
    assert "it is still inside Hangs.sample()" in done.stderr


@pytest.mark.parametrize("kwargs", [
    {"collection_interval": float("inf"), "flush_interval": float("inf")},
    {"collection_interval": 1e10, "flush_interval": 1e10},
    {"collection_interval": 1.0, "flush_interval": 1e10},
])
def test_an_interval_longer_than_a_week_is_refused_not_a_thread_that_dies(kwargs):
    """inf or 1e10 was accepted; the thread then died of an OverflowError in its wait: no sample at all."""
    with pytest.raises(ConfigurationError, match=r"interval must be a .*number of seconds.* 604800 \(a week\)"):
        SystemMonitor(**kwargs)


def test_cpu_percentages_are_never_measured_over_less_than_the_kernel_s_accounting_resolution():
    """At collection_interval=1e-6 a process's CPU use read 9773 % on a 2-CPU host, the host's 0.0 in most samples:
    psutil's counters tick every 10 ms. Memory is still sampled at the short interval."""
    monitor = SystemMonitor(collection_interval=1e-3, flush_interval=1e-3, gpu=False)
    sink = _Sink()
    monitor.start(sink)
    deadline = time.monotonic() + 60
    while sum("system/host_cpu_percent" in r.scalars for r in sink.records) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    monitor.stop()
    cpu = [r.scalars for r in sink.records if "system/host_cpu_percent" in r.scalars]
    assert len(cpu) >= 3
    assert all(s["system/cpu_window_seconds"] >= MIN_CPU_WINDOW for s in cpu)
    # one 10 ms tick of user and of system time each, over at least 0.1 s: 20 points of a core at most
    assert all(s["system/process_cpu_percent"] <= 100 * os.cpu_count() + 20 for s in cpu), cpu
    assert len(sink.records) > len(cpu)  # the samples in between hold the rest
    assert all("system/process_rss_gib" in r.scalars for r in sink.records)


class _NoTotal:
    """NVML answering a memory total of 0 (a broken or virtual device) with 5 GiB used."""

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=10)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=5 * 2**30, total=0)

    def nvmlShutdown(self):
        pass


def test_an_nvml_memory_total_of_0_leaves_the_percentage_out_not_0_percent():
    monitor = SystemMonitor(collection_interval=0.05, flush_interval=0.05, gpu=True)
    monitor._nvml, monitor._nvml_handles = _NoTotal(), [(0, "handle 0")]
    monitor._init_nvml = lambda: None
    sink = _Sink()
    monitor.start(sink)
    deadline = time.monotonic() + 60
    while len(sink.records) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    monitor.stop()
    assert len(sink.records) >= 2
    for record in sink.records:
        assert record.scalars["system/gpu0/memory_used_gib"] == 5.0
        assert "system/gpu0/memory_used_percent" not in record.scalars
