"""SystemMonitor: a real background thread, real psutil readings, real backends read back."""

import json
import threading
import time

import pytest

from instrument import (
    ConfigurationError,
    Instrumentation,
    JsonlBackend,
    Logger,
    RunInfo,
    SystemMonitor,
    TensorBoardBackend,
)

pytest.importorskip("psutil")


def _monitor_threads():
    return [t for t in threading.enumerate() if t.name == "instrument-system-monitor"]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]



def _sampled(monitor, seconds):
    """The records ``monitor`` writes while it runs for ``seconds``."""
    sink = _Sink()
    monitor.start(sink)
    time.sleep(seconds)
    monitor.stop()
    return sink


class _Sink:
    """Keeps the monitor's records, as a backend's write_system would get them."""

    def __init__(self):
        self.records = []

    def write_system(self, record):
        self.records.append(record)

def test_starts_and_stops_with_the_instrumentation(tmp_path):
    monitor = SystemMonitor(collection_interval=0.05, flush_interval=0.1)
    inst = Instrumentation(
        backends=[JsonlBackend()], log_interval=1, log_dir=str(tmp_path), run_name="r", system_monitor=monitor
    )
    assert monitor.running and len(_monitor_threads()) == 1
    for step in range(3):
        with inst.step(step):
            inst.logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        time.sleep(0.1)
    inst.close()
    assert not monitor.running and _monitor_threads() == []
    monitor.stop()  # idempotent
    lines = _lines(tmp_path / "r" / "metrics.jsonl")
    system = [line for line in lines if "system_step" in line]
    steps = [line["step"] for line in lines if "step" in line]
    assert steps == [0, 1, 2]  # the training axis is untouched by the monitor
    assert len(system) >= 3
    seconds = [line["metrics"]["system/seconds"] for line in system]
    assert seconds == sorted(seconds) and all(s >= 0 for s in seconds)
    ms = [line["system_step"] for line in system]  # milliseconds since the run started: one step per sample
    assert ms == sorted(set(ms)) and all(step >= int(s * 1000) for step, s in zip(ms, seconds, strict=True))
    first = system[0]["metrics"]
    assert first["system/process_rss_gib"] > 0.001
    assert 0 < first["system/host_memory_percent"] < 100
    assert first["system/host_memory_available_gib"] > 0
    # at a 0.05 s interval every other sample reads the CPU, over at least MIN_CPU_WINDOW (0.1 s)
    cpu = [line["metrics"] for line in system if "system/process_cpu_percent" in line["metrics"]]
    assert cpu and all("system/host_cpu_percent" in m and m["system/cpu_window_seconds"] >= 0.1 for m in cpu)


def test_slow_sampling_never_blocks_the_training_thread(tmp_path):
    class SlowMonitor(SystemMonitor):
        def sample(self):
            time.sleep(0.5)  # e.g. a stuck NVML call
            return {"system/slow": 1.0}

    monitor = SlowMonitor(collection_interval=0.01, flush_interval=0.01)
    logger = Logger([JsonlBackend()], RunInfo("r", tmp_path))
    monitor.start(logger)
    time.sleep(0.05)  # the thread is now inside sample()
    worst = 0.0
    for step in range(20):
        start = time.perf_counter()
        logger.log_metrics({"loss": float(step)}, step=step)
        logger.commit(step)
        worst = max(worst, time.perf_counter() - start)
    assert worst < 0.25
    monitor.stop()
    logger.close()
    system = [line for line in _lines(tmp_path / "r" / "metrics.jsonl") if "system_step" in line]
    assert system and system[0]["metrics"]["system/slow"] == 1.0


def test_tensorboard_system_axis_is_seconds(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = SystemMonitor(collection_interval=0.02, flush_interval=0.02)
    logger = Logger([TensorBoardBackend()], RunInfo("r", tmp_path))
    logger.log_metrics({"loss": 1.0}, step=1000)
    logger.commit(1000)
    monitor.start(logger)
    time.sleep(0.1)
    monitor.stop()
    logger.log_metrics({"loss": 2.0}, step=1001)  # the training step continues after system steps near 0
    logger.commit(1001)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "r"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1000, 1001]
    assert not [tag for tag in acc.Tags()["scalars"] if tag.startswith("system/")]
    acc = EventAccumulator(str(tmp_path / "r" / "system"))  # a run of its own: a resume's purge never hides it
    acc.Reload()
    rss = acc.Scalars("system/process_rss_gib")
    assert rss and all(e.value > 0 for e in rss)
    # a step of its own per sample: the milliseconds since the monitor started (a Logger's run has no start)
    steps = [e.step for e in rss]
    assert steps == sorted(set(steps))
    assert all(abs(e.step - 1000 * e.value) <= 1 for e in acc.Scalars("system/seconds"))  # float32 seconds


def test_memory_is_bounded_when_nothing_flushes():
    monitor = SystemMonitor(collection_interval=0.01, flush_interval=1000.0, max_buffered=3)

    class Sink:
        records = []

        def write_system(self, record):
            self.records.append(record)

    sink = Sink()
    monitor.start(sink)
    time.sleep(0.15)
    assert monitor.buffered <= 3
    monitor.stop()
    assert len(sink.records) > 3 and monitor.dropped == 0  # a full buffer is flushed early: nothing dropped


def test_only_started_once():
    monitor = SystemMonitor(collection_interval=1.0, flush_interval=1.0)
    monitor.start(Logger([]))
    try:
        with pytest.raises(ConfigurationError, match="already started; create a new one per run"):
            monitor.start(Logger([]))
    finally:
        monitor.stop()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"collection_interval": 0},
         r"collection_interval must be a number of seconds from 0.001 \(1 ms\) to 604800 \(a week\).*got 0"),
        (
            {"collection_interval": 5.0, "flush_interval": 1.0},
            r"flush_interval \(1.0\) must be >= collection_interval",
        ),
        ({"max_buffered": 0}, r"max_buffered must be a positive int"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        SystemMonitor(**kwargs)


def test_bound_in_gin_with_the_mlflow_backend(tmp_path):
    from instrument import MlflowBackend
    from instrument.config import backend_set, parse

    config = tmp_path / "exp.gin"
    config.write_text(
        "include 'system_monitor.gin'\ninclude 'backends/mlflow.gin'\n"
        "SystemMonitor.collection_interval = 0.05\nSystemMonitor.flush_interval = 0.05\n"
        "MlflowBackend.experiment_name = 'nca'\n"
    )
    parse([str(config)])
    (mlflow_backend,) = backend_set()
    assert isinstance(mlflow_backend, MlflowBackend) and mlflow_backend.experiment_name == "nca"
    inst = Instrumentation(backends=[JsonlBackend()], log_dir=str(tmp_path), run_name="r")
    assert isinstance(inst.system_monitor, SystemMonitor) and inst.system_monitor.running
    assert inst.system_monitor.collection_interval == 0.05
    inst.close()
    assert not inst.system_monitor.running


def test_a_stalled_sample_is_not_made_up_by_a_burst_of_samples():
    """One sample takes 1 s at a 0.05 s interval (an NVML call that blocks, SIGSTOP, a suspended laptop): the
    missed slots are skipped, so no two samples are closer than the interval (a burst measured CPU percentages
    over ~0 s, all 0)."""

    class OneSlowSample(SystemMonitor):
        calls = 0

        def sample(self):
            OneSlowSample.calls += 1
            if OneSlowSample.calls == 2:
                time.sleep(1.0)
            return super().sample()

    sink = _sampled(OneSlowSample(collection_interval=0.05, flush_interval=0.05, gpu=False), 1.6)
    seconds = [r.scalars["system/seconds"] for r in sink.records]
    gaps = [b - a for a, b in zip(seconds, seconds[1:], strict=False)]
    # At least half an interval: on a loaded machine one sample starts late and the next on its slot (a gap of
    # 0.035 s was seen while another process unpacked wheels); the burst this guards against had gaps of ~0.
    assert len(seconds) >= 5 and min(gaps) >= 0.025, gaps


def test_every_cpu_reading_is_measured_over_a_whole_interval_the_first_too():
    """The first sample was taken right after the counters were primed, so its CPU percentages covered a few
    milliseconds (the host's read 0.0, a busy process's 150). Each sample now says the window its CPU use is
    measured over: a whole interval for all but the one taken when stopping (at least half of one)."""
    sink = _sampled(SystemMonitor(collection_interval=0.2, flush_interval=0.2, gpu=False), 1.0)
    windows = [r.scalars["system/cpu_window_seconds"] for r in sink.records]
    assert windows, "no sample"
    # about a whole interval each (a wait may end a little early: half of one tells them from the bug's ~10 ms)
    assert all(w >= 0.1 for w in windows), windows
    first = sink.records[0].scalars
    assert first["system/seconds"] >= first["system/cpu_window_seconds"]  # measured from the start, not before
    assert 0 <= first["system/host_cpu_percent"] <= 100 and first["system/process_cpu_percent"] >= 0


class _NvmlWithoutUtilization:
    """NVML as a MIG or vGPU device answers it: memory is read, utilisation is not supported."""

    class _Memory:
        used, total = 2 * 2**30, 8 * 2**30

    def nvmlDeviceGetUtilizationRates(self, handle):
        raise RuntimeError("NVMLError_NotSupported(3)")

    def nvmlDeviceGetMemoryInfo(self, handle):
        return self._Memory()

    def nvmlShutdown(self):
        pass


def test_a_gpu_query_the_device_does_not_support_costs_its_own_keys_only(caplog):
    """One NVML query failing lost every sample of the run, host and process metrics included (a review)."""
    import logging

    monitor = SystemMonitor(collection_interval=0.1, flush_interval=0.1, gpu=True)
    monitor._nvml, monitor._nvml_handles = _NvmlWithoutUtilization(), [(0, object())]
    monitor._init_nvml = lambda: None  # the device above, not the machine's (which has none)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        sink = _sampled(monitor, 0.8)
    assert len(sink.records) >= 3
    assert sum("system/host_cpu_percent" in record.scalars for record in sink.records) >= 2
    for record in sink.records:
        assert "system/process_rss_gib" in record.scalars
        assert record.scalars["system/gpu0/memory_used_percent"] == 25.0
        assert "system/gpu0/utilization_percent" not in record.scalars
    said = [r.getMessage() for r in caplog.records if "could not read NVML utilization of GPU 0" in r.getMessage()]
    assert len(said) == 1


class _FlakyProcess:
    """A psutil.Process whose first CPU reading raises (a transient error as the monitor starts)."""

    def __init__(self, process):
        self._process, self._calls = process, 0

    def cpu_percent(self, interval=None):
        self._calls += 1
        if self._calls == 1:
            raise OSError("transient")
        return self._process.cpu_percent(interval)

    def memory_info(self):
        return self._process.memory_info()


def test_a_psutil_error_as_the_monitor_starts_does_not_end_its_thread(caplog):
    """The counters were primed outside any try: one transient error ended the thread for the run, unsaid."""
    import logging

    import psutil

    class FlakyPsutil:
        def __getattr__(self, name):
            return getattr(psutil, name)

        def Process(self):
            return _FlakyProcess(psutil.Process())

    monitor = SystemMonitor(collection_interval=0.15, flush_interval=0.15, gpu=False)
    monitor._psutil = FlakyPsutil()
    with caplog.at_level(logging.WARNING, logger="instrument"):
        sink = _sampled(monitor, 0.8)
    assert len(sink.records) >= 3 and all("system/host_cpu_percent" in r.scalars for r in sink.records)
    assert any("could not read host" in r.getMessage() for r in caplog.records)


class _ThreeDevices:
    """NVML's answers on a machine with three GPUs (PCI order) and one MIG instance on the last."""

    UUIDS = ("GPU-a1b2-0000", "GPU-a1c3-1111", "GPU-ffee-2222")
    MIG = "MIG-9f9f-3333"

    def nvmlDeviceGetCount(self):
        return len(self.UUIDS)

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.UUIDS):
            raise RuntimeError("NVMLError_InvalidArgument")
        return f"physical {index}"

    def nvmlDeviceGetUUID(self, handle):
        return self.UUIDS[int(handle.split()[1])].encode()  # older nvidia-ml-py answers bytes

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != self.MIG:
            raise RuntimeError("NVMLError_NotFound")
        return "mig 2/0"


@pytest.mark.parametrize("visible, expected", [
    (None, ["physical 0", "physical 1", "physical 2"]),
    ("", []),
    ("2,0", ["physical 2", "physical 0"]),
    # UUIDs, whole or as unique prefixes (as Slurm and Kubernetes set them): the process's cuda:0 is physical 2
    ("GPU-ffee-2222,GPU-a1b2", ["physical 2", "physical 0"]),
    (" GPU-a1c , 0", ["physical 1", "physical 0"]),
    ("MIG-9f9f-3333", ["mig 2/0"]),
    # the CUDA runtime ends the list at an entry naming no device: an index out of range, an ambiguous prefix
    ("0,7,1", ["physical 0"]),
    ("1,GPU-a1,2", ["physical 1"]),
    ("GPU-0bad,0", []),
    ("MIG-unknown,0", []),
    ("1,1,2", ["physical 1"]),
])
def test_gpu_keys_follow_the_process_s_device_numbering(visible, expected):
    """NVML numbers devices physically; ``system/gpu<i>/*`` must be torch's cuda:<i>. With UUIDs in
    CUDA_VISIBLE_DEVICES every physical device was read, so gpu0 held another job's GPU (found by a review)."""
    from instrument.monitors.system import visible_nvml_handles

    assert visible_nvml_handles(_ThreeDevices(), visible) == expected
