"""The system samples' step: milliseconds since the run first started, one step per sample, never going back
across the processes of a resumed run. TensorBoard's server (the Rust data server `tensorboard --logdir` runs)
hides a stored sample whose step is at or above one that arrives after it: steps that started at 0 again in a
resumed process hid all of the earlier process's samples, and whole-second steps kept one sample a second.
Real sessions, real threads and psutil; TensorBoard's event files and the JSONL file read back."""

import json
import time

import pytest

from instrument import ConfigurationError, Instrumentation, JsonlBackend, SystemMonitor, TensorBoardBackend

pytest.importorskip("psutil")


def _session(tmp_path, resume):
    monitor = SystemMonitor(collection_interval=0.05, flush_interval=0.05, gpu=False)
    inst = Instrumentation(backends=[TensorBoardBackend(), JsonlBackend()], log_interval=1, log_dir=str(tmp_path),
                           run_name="r", resume=resume, system_monitor=monitor, overhead_budget=None)
    before, deadline = len(_jsonl_steps(tmp_path)), time.monotonic() + 60
    while len(_jsonl_steps(tmp_path)) - before < 4 and time.monotonic() < deadline:  # a few samples written
        time.sleep(0.05)
    inst.close()


def _jsonl_steps(tmp_path):
    path = tmp_path / "r" / "metrics.jsonl"
    if not path.exists():
        return []
    return [line["system_step"] for line in map(json.loads, path.read_text().splitlines()) if "system_step" in line]


def _started(tmp_path):
    path = tmp_path / "r" / "run.json"
    return json.loads(path.read_text()).get("started") if path.exists() else None


def _tensorboard_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "r" / "system"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars("system/seconds")]


def _served(steps):
    """What TensorBoard's server keeps of the steps in the order they arrive: each arriving record drops the
    stored ones at or above its step."""
    kept = []
    for step in steps:
        kept = [s for s in kept if s < step] + [step]
    return kept


def test_a_resumed_run_s_system_samples_step_on_from_the_earlier_process_s(tmp_path):
    _session(tmp_path, resume=False)
    first = _jsonl_steps(tmp_path)
    started = _started(tmp_path)
    _session(tmp_path, resume=True)
    steps = _jsonl_steps(tmp_path)
    assert len(first) >= 4 and len(steps) >= len(first) + 4
    assert min(steps[len(first):]) > max(first)  # the resumed process's steps are above the earlier ones
    assert steps == sorted(set(steps))
    assert _tensorboard_steps(tmp_path) == steps
    assert _served(steps) == steps  # all of them, the earlier process's too
    assert started is not None and _started(tmp_path) == started  # the run's first start, kept in run.json


def test_samples_under_a_second_apart_each_have_a_step_of_their_own(tmp_path):
    _session(tmp_path, resume=False)
    steps = _jsonl_steps(tmp_path)
    assert len(steps) >= 4 and steps == sorted(set(steps))
    assert _served(_tensorboard_steps(tmp_path)) == steps  # every sample shown, not one a second


def test_a_collection_interval_under_a_millisecond_is_refused():
    """Its samples' millisecond steps would run ahead of the clock, and of a resumed process's."""
    with pytest.raises(ConfigurationError, match=r"collection_interval must be a number of seconds from 0.001 "
                                                 r"\(1 ms\) to 604800 \(a week\).*got 0.0001"):
        SystemMonitor(collection_interval=1e-4, flush_interval=1.0)


def test_a_resumed_run_without_its_first_start_steps_on_from_what_its_files_hold(tmp_path):
    """A review found the steps going back where run.json has no "started" (a run made before it was kept, or
    its run file lost): counted from the resumed process's start, they fell below the earlier process's, and
    TensorBoard's server hid every earlier sample. The origin is then the earliest time the run's files record."""
    _session(tmp_path, resume=False)
    first = _jsonl_steps(tmp_path)
    run_file = tmp_path / "r" / "run.json"
    data = json.loads(run_file.read_text())
    data.pop("started")
    run_file.write_text(json.dumps(data))
    _session(tmp_path, resume=True)
    steps = _jsonl_steps(tmp_path)
    assert len(steps) >= len(first) + 4
    assert min(steps[len(first):]) > max(first), (first, steps[len(first):])
    assert _served(_tensorboard_steps(tmp_path)) == steps  # every sample shown
    assert _started(tmp_path) is not None  # the origin found is kept for the next resume
