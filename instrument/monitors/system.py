"""`SystemMonitor`: process, host and GPU resources sampled by a background thread on a wall-clock axis.

Training steps and wall time are different axes: a monitor that logged at the training step would either wait
for the loop or push the step ahead (W&B then drops the loop's next step). So the monitor writes through the
logger's side channel (`Logger.write_system`), which never touches the training step's order check.

A sample's step (TensorBoard's ``global_step``, MLflow's ``step``, JSONL's ``system_step``) is the milliseconds
since the run first started (`RunInfo.started`, kept in the run folder's ``run.json``, so a resumed process goes
on from where the wall clock is, not from 0), and each sample's is above the one before: TensorBoard's server
hides a stored sample whose step is at or above a newly arriving one, so steps that went back at a resume hid
the earlier process's samples, and whole seconds kept one sample per second. ``system/seconds`` is the exact
seconds since this monitor started. Across processes the steps follow the wall clock (a resume on a host whose
clock is behind the first one's could go back); within one, a monotonic clock.

Lifecycle (the `Instrumentation` drives it when given ``system_monitor=``)::

    monitor.start(logger)      # starts a daemon thread on rank 0; samples every collection_interval seconds,
                               # the first one interval after the start (CPU use is measured over a window)
    ...                        # every flush_interval seconds the buffered samples go to the backends
    monitor.stop(timeout)      # wakes the thread, samples the time since the last sample (when it is at least
                               # half an interval), flushes what is buffered, joins it for at most timeout s

A `Logger` stops its monitor before it closes, however it closes (``logger.close()`` first, SIGTERM, the process
exit after a crash or without ``inst.close()``: `Logger.before_close`), so the buffered samples are written
before the backends close, not lost; that stop takes at most half of a close's ``timeout``. A sample that hangs
(an NVML call on a wedged GPU, a read of a stuck ``/proc``) does not hold the close: the stop hands the buffered
samples over itself, says which call hung, and leaves the thread behind (a daemon: it never holds the process at
exit), which drops the sample it was taking and shuts NVML down once that call returns.

The training thread never waits on sampling (psutil, NVML): that happens in the monitor's thread, outside any
lock; the only shared step is the backend write, which the logger serialises with its commits. At most
``max_buffered`` samples wait in the monitor: a buffer that fills before the next flush is flushed at once, so
no sample is dropped for want of room. A sample that cannot be written (the logger was closed before the
monitor could hand it over, or the write raised) is counted in `SystemMonitor.dropped` and reported in a warning
with the count.

Metric keys (GiB = 2**30 bytes; ``<i>`` is the CUDA device index as the process sees it):

| key | meaning |
|---|---|
| ``system/seconds`` | seconds since this monitor started (W&B's and `RunHistoryBackend`'s x axis) |
| ``system/process_cpu_percent`` | this process's CPU use; 100 = one core |
| ``system/cpu_window_seconds`` | the seconds the CPU percentages are measured over: since the previous reading |
| ``system/process_rss_gib`` | this process's resident memory |
| ``system/host_cpu_percent`` | the whole host's CPU use, 0-100 |
| ``system/host_memory_percent`` | host memory in use, 0-100 |
| ``system/host_memory_available_gib`` | host memory available |
| ``system/gpu<i>/torch_allocated_gib`` | ``torch.cuda.memory_allocated`` (only once CUDA is initialised) |
| ``system/gpu<i>/torch_reserved_gib`` | ``torch.cuda.memory_reserved`` |
| ``system/gpu<i>/torch_peak_allocated_gib`` | ``torch.cuda.max_memory_allocated`` |
| ``system/gpu<i>/utilization_percent`` | NVML GPU utilisation (with ``nvidia-ml-py``) |
| ``system/gpu<i>/memory_used_gib`` | NVML memory used, all processes |
| ``system/gpu<i>/memory_used_percent`` | NVML memory used / total (left out when NVML reports no total) |

The kernel counts CPU time in ticks of 10 ms (``USER_HZ`` = 100), so a CPU percentage measured over a few
milliseconds is noise (a busy process read 9773 % over 1 us): the three CPU keys are measured over at least
``MIN_CPU_WINDOW`` (0.1 s, ten ticks: one tick is at most 10 points of a core). A sample taken sooner after the
last CPU reading (a ``collection_interval`` under 0.1 s) leaves them out, and the window goes on to the next.

NVML numbers devices physically; its keys use the process's numbering, read from ``CUDA_VISIBLE_DEVICES`` as the
CUDA runtime reads it (indices, or UUIDs and their prefixes as Slurm and Kubernetes set them: `visible_nvml_handles`).
"""

import collections
import logging
import os
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch

from instrument.backends.base import StepRecord
from instrument.checks import check_int, check_number
from instrument.core.real import is_one_real
from instrument.errors import ConfigurationError, require
from instrument.monitors.nvml import visible_nvml_handles

__all__ = ["SystemMonitor"]

log = logging.getLogger("instrument")
_GIB = float(2**30)
# How long a close from a signal handler or at exit gives the monitor's thread to stop before handing the
# buffered samples over itself (`SystemMonitor._before_close`): a stop takes a sample at most, milliseconds.
_PROMPT_WAIT = 0.2
# How long `SystemMonitor.stop` waits for the thread when no timeout is given (a close with timeout=None).
STOP_WAIT = 10.0
# The shortest window a CPU percentage is measured over: ten of the kernel's 10 ms accounting ticks.
MIN_CPU_WINDOW = 0.1
# The longest interval: a week. Far below what a thread's wait accepts (threading.TIMEOUT_MAX, ~292 years);
# a longer one (inf) ended the thread with an OverflowError.
MAX_INTERVAL = 7 * 24 * 3600.0
# The shortest collection interval: a sample's step is in milliseconds, one step above the last at least, so
# samples taken faster than one a millisecond would run their steps ahead of the clock (and of a resumed run's).
MIN_INTERVAL = 0.001


class SystemMonitor:
    """Samples resources every ``collection_interval`` seconds and flushes them every ``flush_interval``.

    Args:
        collection_interval: seconds between samples, from 1 ms to a week (after a stall, the missed ones are
            skipped, not made up in a burst). Under ``MIN_CPU_WINDOW`` (0.1 s) the CPU keys come in every few
            samples only: each is measured over at least 0.1 s.
        flush_interval: seconds between writes to the backends (>= collection_interval, at most a week).
        gpu: include GPU memory (torch.cuda stats, once CUDA is initialised) and NVML utilisation/memory
            (when ``nvidia-ml-py`` is installed); False skips both.
        max_buffered: most samples kept between flushes; when that many are buffered they are flushed at
            once, before ``flush_interval`` is up (nothing is dropped).

    Needs ``psutil`` (``pip install 'torch-instrument[monitor]'``). Subclass and extend `sample` to add
    quantities; keep keys under ``system/``, values real numbers (NumPy scalars and one-element tensors are
    converted; anything else costs its key, said once).
    """

    def __init__(
        self,
        collection_interval: float = 10.0,
        flush_interval: float = 60.0,
        gpu: bool = True,
        max_buffered: int = 1024,
    ) -> None:
        check_number("SystemMonitor.collection_interval", collection_interval, least=MIN_INTERVAL,
                     most=MAX_INTERVAL, expected=f"a number of seconds from {MIN_INTERVAL} (1 ms) to "
                     f"{MAX_INTERVAL:.0f} (a week)", why="a sample's step is the milliseconds since the run started",
                     fix="bind e.g. SystemMonitor.collection_interval = 10.0")
        check_number("SystemMonitor.flush_interval", flush_interval, above=0, most=MAX_INTERVAL,
                     expected=f"a positive number of seconds, at most {MAX_INTERVAL:.0f} (a week)",
                     fix="bind e.g. SystemMonitor.flush_interval = 60.0")
        if flush_interval < collection_interval:
            raise ConfigurationError(
                f"SystemMonitor.flush_interval ({flush_interval}) must be >= collection_interval "
                f"({collection_interval}): a flush writes the samples collected since the last one."
            )
        check_int("SystemMonitor.max_buffered", max_buffered, least=1, expected="a positive int",
                  why="the most samples kept between flushes", fix="bind e.g. SystemMonitor.max_buffered = 1024")
        self._psutil = require("psutil", "monitor", "SystemMonitor")
        self.collection_interval = float(collection_interval)
        self.flush_interval = float(flush_interval)
        self.gpu = gpu
        self.max_buffered = max_buffered
        self._buffer: Deque[Tuple[int, float, float, Dict[str, float]]] = collections.deque()
        self._dropped = 0  # samples that could not be written (`dropped`)
        self._reported = 0  # of those, how many a warning already reported
        self._last_sample = True  # a stop takes one more sample (not a hand-over at a signal or the exit)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._logger: Any = None
        self._t0 = 0.0
        self._t0_ms = 0.0  # the milliseconds from the run's first start to _t0: the first sample's step
        self._last_step = -1  # the step of the last sample: each one's is above it
        self._read_at = 0.0  # when the CPU counters were last read: a sample measures the time since
        self._cpu_due = True  # the sample being taken reads the CPU counters (MIN_CPU_WINDOW has passed)
        self._cpu_read = False  # the sample being taken did read (and so reset) them
        self._pid = os.getpid()  # the process that started the monitor (`_forked`)
        self._said_values: set = set()  # keys of a subclass's sample whose value was not a number (`_numbers`)
        self._sampled_at = 0.0  # when the last sample was taken
        self._doing: Optional[str] = None  # what the thread is inside of, for a stop that gives up on it
        self._left = False  # a stop gave up on the thread: it drops what it takes and shuts NVML down itself
        self._ended = False  # the thread has ended (`_leave`)
        self._end_lock = threading.Lock()
        self._process: Any = None
        self._nvml: Any = None
        self._nvml_handles: List[Tuple[int, Any]] = []
        self._failed_parts: set = set()  # sources whose failure was said (`_part_failed`)

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def buffered(self) -> int:
        """Samples collected and not yet flushed (at most ``max_buffered``)."""
        return len(self._buffer)

    @property
    def dropped(self) -> int:
        """Samples taken that could not be written: the logger was closed before they were handed over (it
        was not a `Logger`, or it was closed already when the monitor started), or its ``write_system`` raised.
        Reported in a warning with the count."""
        return self._dropped

    def start(self, logger: Any) -> None:
        """Start sampling into ``logger`` (anything with ``write_system(record)``; one that returns False did
        not take the record). Once per monitor. A logger with ``before_close`` (a `Logger`) stops this monitor
        before it closes, so the samples still buffered are written before its backends close. The steps count
        milliseconds from its ``run.started`` (`RunInfo.started`), else from now."""
        if self._thread is not None:
            raise ConfigurationError("this SystemMonitor was already started; create a new one per run.")
        self._logger = logger
        self._pid = os.getpid()
        before_close = getattr(logger, "before_close", None)
        if callable(before_close):
            before_close(self._before_close)
        self._process = self._psutil.Process()
        if self.gpu:
            self._init_nvml()
        self._t0 = time.monotonic()  # the counters are primed, and _read_at set, in the monitor's thread
        started = getattr(getattr(logger, "run", None), "started", None)
        self._t0_ms = max(0.0, (time.time() - started) * 1000.0) if started is not None else 0.0
        self._thread = threading.Thread(target=self._run, name="instrument-system-monitor", daemon=True)
        self._thread.start()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Wake the thread, take a last sample when at least half an interval passed since the previous one,
        flush what is buffered and join, waiting at most ``timeout`` seconds (None: ``STOP_WAIT``, 10 s). A
        thread still busy then (a hung sample) is left behind, said in a warning naming the call it is in: what
        it buffered is handed over from this thread, and the sample it is taking is dropped. Idempotent."""
        if self._thread is None or self._stop.is_set() or self._forked():
            return
        self._stop.set()
        wait = STOP_WAIT if timeout is None else max(0.0, float(timeout))
        self._thread.join(wait)
        doing = self._doing
        if not self._leave():
            self._stopped()
            return
        log.warning("instrument: the system monitor's thread did not stop within %.1f s: %s. Its buffered samples "
                    "are written now; the sample it holds is dropped when that call returns, and the thread "
                    "(a daemon) does not hold the process at exit", wait,
                    f"it is still inside {doing}" if doing else "it is still running")
        self._flush()  # the deque's pops are atomic: each sample is handed over by one thread only
        self._stopped(nvml=False)  # NVML stays up while the thread may still be inside an NVML call

    def _before_close(self, prompt: bool, timeout: Optional[float] = None) -> None:
        """Its logger is about to close within ``timeout`` seconds (None: no bound): the stop takes half of them
        at most, so a hung sample leaves the other half to the logger's writer. ``prompt`` (a signal handler or
        the exit closes it): the monitor's thread may be waiting for a lock the interrupted code holds (a
        commit's, to hand over a sample), so it is given a moment only, and what is still buffered is handed
        over from this thread."""
        if not prompt:
            self.stop(None if timeout is None else timeout / 2)
            return
        if self._thread is None or self._stop.is_set() or self._forked():
            return
        self._last_sample = False  # no sample after this hand-over: the logger closes right after it
        self._stop.set()
        self._thread.join(_PROMPT_WAIT)
        alive = self._leave()
        if alive:
            self._flush()  # the deque's pops are atomic: each sample is handed over by one thread only
        self._stopped(nvml=not alive)  # NVML stays up while the thread may still read it

    def _forked(self) -> bool:
        """True in a child forked from the process that started the monitor: the thread did not follow, and the
        samples it buffered are the parent's, which writes them itself; the child neither writes them again nor
        waits for a thread it does not have (nor shuts down the parent's NVML session)."""
        if self._pid == os.getpid():
            return False
        self._stop.set()
        self._buffer.clear()
        return True

    def _leave(self) -> bool:
        """After a join that timed out or not: True when the thread still runs, which then drops the sample it
        is taking and shuts NVML down as it ends (never under its own NVML call)."""
        with self._end_lock:
            self._left = not self._ended
        if self._left:
            self._last_sample = False  # nor a last sample once the hung one returns
        return self._left

    def _stopped(self, nvml: bool = True) -> None:
        if self._dropped > self._reported:  # more than the first warning said
            log.warning("instrument: the system monitor could not write %d of its samples in all (see the warning "
                        "above)", self._dropped)
        if nvml:
            self._shutdown_nvml()

    def _shutdown_nvml(self) -> None:
        with self._end_lock:
            nvml, self._nvml = self._nvml, None
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass

    # ------------------------------------------------------------------ sampling
    def sample(self) -> Dict[str, float]:
        """One sample of every quantity (runs in the monitor's thread). Each source is read on its own: one that
        fails (an NVML query a MIG or vGPU device does not support, a psutil error) costs its own keys, said
        once per source, and the others are sampled."""
        out: Dict[str, float] = {}
        parts = [("host", self._host)] + ([("torch.cuda", self._torch_cuda), ("NVML", self._nvml_sample)]
                                          if self.gpu else [])
        doing = self._doing
        for name, part in parts:
            self._doing = f"the {name} reading" + (" (psutil)" if name == "host" else "")
            try:
                out.update(part())
            except Exception as exc:
                self._part_failed(name, exc)
        self._doing = doing
        return out

    def _part_failed(self, part: str, exc: BaseException) -> None:
        if part not in self._failed_parts:  # reported once per source; the monitor keeps trying
            self._failed_parts.add(part)
            log.warning("instrument: the system monitor could not read %s (%r); its metrics are left out of the "
                        "samples while that lasts, the others are written. (Said once.)", part, exc)

    def _host(self) -> Dict[str, float]:
        ps, proc = self._psutil, self._process
        vm = ps.virtual_memory()
        out = {
            "system/process_rss_gib": proc.memory_info().rss / _GIB,
            "system/host_memory_percent": float(vm.percent),
            "system/host_memory_available_gib": vm.available / _GIB,
        }
        if self._cpu_due:  # else too soon after the last reading to mean much: the window goes on (MIN_CPU_WINDOW)
            process = float(proc.cpu_percent(None))
            self._cpu_read = True  # the counters are reset: the next window starts at this sample, kept or not
            out["system/process_cpu_percent"] = process
            out["system/host_cpu_percent"] = float(ps.cpu_percent(None))
        return out

    def _torch_cuda(self) -> Dict[str, float]:
        # Never initialise CUDA from this thread: that would create a context the training never asked for.
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return {}
        out = {}
        for i in range(torch.cuda.device_count()):
            out[f"system/gpu{i}/torch_allocated_gib"] = torch.cuda.memory_allocated(i) / _GIB
            out[f"system/gpu{i}/torch_reserved_gib"] = torch.cuda.memory_reserved(i) / _GIB
            out[f"system/gpu{i}/torch_peak_allocated_gib"] = torch.cuda.max_memory_allocated(i) / _GIB
        return out

    def _init_nvml(self) -> None:
        try:
            import pynvml  # from nvidia-ml-py
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            # Key by the index the process sees (torch's), so NVML and torch metrics line up.
            handles = visible_nvml_handles(pynvml, os.environ.get("CUDA_VISIBLE_DEVICES"))
            self._nvml_handles = list(enumerate(handles))
            self._nvml = pynvml
        except Exception as exc:  # no driver, no permission: GPU metrics are simply absent
            log.info("instrument: NVML unavailable (%s); GPU utilisation is not monitored", exc)

    def _nvml_sample(self) -> Dict[str, float]:
        if self._nvml is None:
            return {}
        out = {}
        for i, handle in self._nvml_handles:  # each query on its own: one a device does not support costs its keys
            self._doing = f"nvmlDeviceGetUtilizationRates (GPU {i})"
            try:
                out[f"system/gpu{i}/utilization_percent"] = float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception as exc:
                self._part_failed(f"NVML utilization of GPU {i}", exc)
            self._doing = f"nvmlDeviceGetMemoryInfo (GPU {i})"
            try:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                out[f"system/gpu{i}/memory_used_gib"] = mem.used / _GIB
                if mem.total > 0:  # a device reporting no total has no percentage, not 0 %
                    out[f"system/gpu{i}/memory_used_percent"] = 100.0 * mem.used / mem.total
            except Exception as exc:
                self._part_failed(f"NVML memory of GPU {i}", exc)
        return out

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            self._sample_until_stopped()
        finally:
            with self._end_lock:
                self._ended, left = True, self._left
            if left:  # the stop gave up on this thread and left NVML up for it
                self._shutdown_nvml()

    def _sample_until_stopped(self) -> None:
        # The first sample comes one interval after the counters were primed: taken at once, its CPU
        # percentages were measured over the few milliseconds since (the host's read 0, a busy process's 150).
        # The first reading is always 0: prime both counters, here, since psutil keeps the host's per thread.
        try:
            self._process.cpu_percent(None)
            self._psutil.cpu_percent(None)
        except Exception as exc:  # a transient psutil error must not end the thread: the samples say what they can
            self._part_failed("host", exc)
        self._read_at = self._sampled_at = time.monotonic()
        next_sample = self._t0 + self.collection_interval
        next_flush = self._t0 + self.flush_interval
        while not self._stop.wait(max(0.0, next_sample - time.monotonic())):
            self._collect()
            # After a stall (a slow sample, SIGSTOP, a suspended laptop) the missed slots are skipped, not made
            # up in a burst of samples microseconds apart whose CPU percentages would read 0 over ~0 s.
            now = time.monotonic()
            next_sample += self.collection_interval
            if next_sample <= now:  # behind: a whole interval from now, so the next sample measures one
                next_sample = now + self.collection_interval
            if time.monotonic() >= next_flush:
                self._flush()
                next_flush = max(next_flush + self.flush_interval, time.monotonic())
        if self._last_sample and time.monotonic() - self._sampled_at >= self.collection_interval / 2:  # stopping: the
            self._collect()  # time since the last sample is measured too, unless too short a window to mean much
        self._flush()

    def _collect(self) -> None:
        started = self._sampled_at = time.monotonic()
        self._cpu_due = started - self._read_at >= MIN_CPU_WINDOW
        self._cpu_read = False
        self._doing = f"{type(self).__name__}.sample()"
        try:
            values = self._numbers(self.sample())
        except Exception as exc:  # a subclass's sample: the whole sample is lost
            self._part_failed("a sample", exc)
            return
        finally:
            self._doing = None
            # The window the CPU percentages are measured over: from the last reading of the counters, which a
            # lost sample made too (the next sample's percentages cover only the time since that reading).
            window = started - self._read_at
            if self._cpu_read:
                self._read_at = started
        if self._left:  # a stop gave up waiting for this sample (and said so): too late to write it
            self._dropped += 1
            return
        if self._cpu_read and "system/host_cpu_percent" in values:  # else the window goes on
            values["system/cpu_window_seconds"] = window
        if not values:
            return
        seconds = time.monotonic() - self._t0
        step = self._last_step = max(int(self._t0_ms + seconds * 1000.0), self._last_step + 1)
        self._buffer.append((step, seconds, time.time(), values))
        if len(self._buffer) >= self.max_buffered:  # full before the flush is due: flush now, drop nothing
            self._flush()

    def _numbers(self, values: Any) -> Dict[str, float]:
        """A sample as plain floats: a subclass's NumPy scalar or one-element tensor is converted (JSONL could not
        write one, and every sample was lost there); a value that is no real number (None for a sensor that could
        not be read) costs its own key, said once per key."""
        if not isinstance(values, dict):
            raise TypeError(f"sample() must return a dict of str keys to numbers, got {type(values).__name__}")
        out: Dict[str, float] = {}
        for key, value in values.items():
            number: Optional[float] = None
            if isinstance(key, str) and is_one_real(value):  # a NumPy scalar too, or one element of a real dtype
                try:
                    if isinstance(value, (torch.Tensor, np.ndarray)):
                        value = value.reshape(()).item()  # host sync: the monitor's thread
                    number = float(value)
                except (RuntimeError, TypeError, ValueError, OverflowError, NotImplementedError):
                    pass  # a meta or sparse tensor: its own key only
            if number is not None:
                out[key] = number
            elif key not in self._said_values:
                self._said_values.add(key)
                log.warning("instrument: %s.sample() gave %r for key %r; expected a real number (a float, an int, a "
                            "NumPy scalar or a one-element tensor) under a str key. That key is left out of the "
                            "samples while that lasts, the others are written. (Said once per key.)",
                            type(self).__name__, value, key)
        return out

    def _flush(self) -> None:
        dropped, error = 0, None
        mine = threading.current_thread() is self._thread
        while self._buffer:
            step, seconds, wall, values = self._buffer.popleft()
            record = StepRecord(step=step, scalars={**values, "system/seconds": seconds}, wall_time=wall)
            if mine:
                self._doing = "the logger's write_system"
            try:
                if self._logger.write_system(record) is False:  # the logger is closed: not written
                    dropped += 1
            except Exception as exc:
                dropped, error = dropped + 1, exc
            finally:
                if mine:
                    self._doing = None
        if not dropped:
            return
        self._dropped += dropped
        if self._reported:  # said once; stop() gives the total
            return
        self._reported = self._dropped
        why = (f"its write_system raised {error!r}" if error is not None else
               "a stop gave up waiting for the monitor's thread (see the warning above)" if self._left else
               "the process was ending (a signal or the exit closed the logger) while the monitor's thread was "
               "handing them over" if not self._last_sample else
               "the logger was closed before the monitor handed them over (stop the monitor, or close the "
               "Instrumentation, before closing its logger; a Logger does that itself)")
        log.warning("instrument: the system monitor could not write %d buffered sample(s): %s. They are lost; "
                    "SystemMonitor.dropped counts every sample not written", dropped, why)

    def __repr__(self) -> str:
        return (
            f"SystemMonitor(collection_interval={self.collection_interval}, "
            f"flush_interval={self.flush_interval}, "
            f"gpu={self.gpu})"
        )
