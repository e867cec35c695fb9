"""SystemMonitor samples from a subclass (values that are no plain float, a sample that fails) and in a forked
child: real threads, real psutil readings, a real Logger and JSONL read back, a real fork."""

import json
import logging
import os
import time

import numpy as np
import pytest
import torch

from instrument import JsonlBackend, Logger, SystemMonitor

pytest.importorskip("psutil")


def test_a_subclass_s_numpy_scalars_and_tensors_are_written_and_a_value_that_is_no_number_costs_its_own_key(
        tmp_path, caplog):
    """The class docstring invites subclasses to add quantities to `sample`. A NumPy float32 there made JSONL fail
    on every sample (none written, `dropped` 0), a 0-d tensor too, and a None (a sensor not read) failed every
    sample in every backend. Numbers are now written as floats; anything else is left out, said once per key."""

    class Mine(SystemMonitor):
        def sample(self):
            out = super().sample()
            out.update({"system/fan_rpm": np.float32(1200.5), "system/disks": np.int64(3),
                        "system/temp_c": torch.tensor(41.25, dtype=torch.float64), "system/ok": True,
                        "system/unread": None, "system/phase": 2 + 1j, 7: 1.0, "system/flag": np.bool_(True),
                        "system/array": np.array(2.5), "system/meta": torch.empty((), device="meta")})
            return out

    path = tmp_path / "m.jsonl"
    logger = Logger(backends=[JsonlBackend(str(path))])
    monitor = Mine(collection_interval=0.1, flush_interval=0.1, gpu=False)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        monitor.start(logger)
        time.sleep(0.6)
        logger.close()
    samples = [json.loads(line) for line in path.read_text().splitlines() if "system_step" in line]
    assert len(samples) >= 3 and monitor.dropped == 0 and logger.failures == {}
    for sample in samples:
        metrics = sample["metrics"]
        assert metrics["system/fan_rpm"] == 1200.5 and metrics["system/disks"] == 3.0
        assert metrics["system/temp_c"] == 41.25 and metrics["system/ok"] == 1.0
        assert metrics["system/flag"] == 1.0 and metrics["system/array"] == 2.5
        assert not {"system/unread", "system/phase", "7", "system/meta"} & set(metrics)
        assert "system/process_rss_gib" in metrics
    said = [r.getMessage() for r in caplog.records if "sample() gave" in r.getMessage()]
    assert len(said) == 4  # once per key, not once per sample
    assert any("gave None for key 'system/unread'" in m and "expected a real number" in m for m in said)


def test_a_lost_sample_that_read_the_cpu_counters_starts_the_next_sample_s_window():
    """A subclass's sample that raised after `super().sample()` had read (and so reset) the CPU counters left the
    window's start where it was: the next sample said it measured twice the time its CPU percentages covered.
    Its window now starts at the lost sample, exactly."""
    starts = []

    class Flaky(SystemMonitor):
        def sample(self):
            out = super().sample()
            starts.append(self._sampled_at)  # when this sample began: where the CPU counters were read
            if len(starts) == 2:
                raise OSError("a sensor read failed once")
            return out

    records = []

    class Sink:
        def write_system(self, record):
            records.append(record)

    monitor = Flaky(collection_interval=0.2, flush_interval=0.2, gpu=False)
    monitor.start(Sink())
    while len(starts) < 4:
        time.sleep(0.05)
    monitor.stop()
    windows = [r.scalars["system/cpu_window_seconds"] for r in records]
    assert windows[1] == starts[2] - starts[1]  # the sample after the lost one: from the lost one
    assert windows[2] == starts[3] - starts[2]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_that_stops_the_monitor_neither_writes_the_parent_s_samples_nor_warns(tmp_path):
    """A child forked while samples were buffered inherited them: its stop (or an inst.close() there) wrote them a
    second time into anything with write_system, or warned that a thread which was never its own did not stop
    and that the samples were lost. The parent writes them; the child now leaves them alone."""
    path = tmp_path / "steps.txt"

    class Lines:
        def write_system(self, record):
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {record.step}\n")

    monitor = SystemMonitor(collection_interval=0.05, flush_interval=3600.0, gpu=False)
    monitor.start(Lines())
    while monitor.buffered < 3:
        time.sleep(0.02)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: stop the monitor, say what happened, leave at once
        code = 1
        try:
            handler = _Said()
            logging.getLogger("instrument").addHandler(handler)
            monitor.stop()
            os.write(write, json.dumps({"said": handler.said, "dropped": monitor.dropped}).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = json.loads(pipe.read())
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    monitor.stop()
    assert child["said"] == [] and child["dropped"] == 0
    lines = [line.split() for line in path.read_text().splitlines()]
    assert {who for who, _ in lines} == {str(os.getpid())}  # every sample written by the parent ...
    steps = [int(step) for _, step in lines]
    assert len(steps) >= 3 and len(steps) == len(set(steps))  # ... once


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.said = []

    def emit(self, record):
        self.said.append(record.getMessage())
