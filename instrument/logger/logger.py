"""The logger: stages values on the device, commits them to every backend in one batched transfer.

Observers and the training loop call ``log_*`` with Python numbers or device tensors. Nothing leaves the
device until `commit`, which runs once per logging step: every staged tensor is copied to the host in one
batched transfer per device, heatmaps are drawn, and the resulting `StepRecord` is written to each backend.

Values a loop logs on non-logging steps are accumulated on the device (summed, no sync) and committed as their
mean over the interval at the next commit, so logging a loss every step is cheap and still honest.

The logger only routes: a backend that raises is reported once and skipped for that step; the others still
get it. A step lower than one already committed raises `StepOrderError` (``on_step_regression="raise"``, the
default), or is dropped with a warning (``"warn"``).

Under `torch.distributed` (see docs/distributed.md) only rank 0 opens backends and writes; at each commit the
scalars of every rank are reduced with one collective (`instrument.logger.reduce`) before the one transfer,
so `commit` is a collective: every rank commits at the same steps. Images, histograms, text, videos and
samples are rank 0's. Without a process group nothing changes.
"""

import logging
import math
import numbers
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from instrument.backends.base import Backend, RunInfo, SampleTable, StepRecord
from instrument.errors import ConfigurationError, StepOrderError
from instrument.logger.params import flatten_params, redact_config_text, redact_secrets
from instrument.logger.ranks import rank
from instrument.logger.reduce import CrossRankReducer, Entry, local_value, resolve_ops
from instrument.logger.render import render_heatmap, to_hwc_uint8
from instrument.logger.timer import Timer
from instrument.logger.transfer import to_host

__all__ = ["Logger"]

log = logging.getLogger("instrument")

Value = Union[float, int, bool, Tensor, np.ndarray, np.number]
_STEP_POLICIES = ("raise", "warn")


class _Accumulator:
    """Sum and count of one metric over a logging interval; the sum stays on the device for tensors.

    With a weight it keeps sum(weight * value) and sum(weight) instead, so the interval's value is the
    weighted mean over time, and across ranks too.
    """

    __slots__ = ("op", "total", "count", "weight")

    def __init__(self, op: str, value: Union[float, Tensor], weight: Any = None) -> None:
        self.op = op
        self.total = value if weight is None else value * weight
        self.weight = weight
        self.count = 1

    def add(self, name: str, op: str, value: Union[float, Tensor], weight: Any = None) -> None:
        if op != self.op or (weight is None) != (self.weight is None):
            before = " and a weight" if self.weight is not None else ""
            now = " and a weight" if weight is not None else ""
            raise ConfigurationError(
                f"metric {name!r} was logged with reduce={self.op!r}{before} and now with reduce={op!r}{now} "
                f"in one logging interval; log each metric with one reduce op, always with or always without "
                f"a weight."
            )
        self.total = self.total + (value if weight is None else value * weight)
        if weight is not None:
            self.weight = self.weight + weight
        self.count += 1

    def mean(self) -> Union[float, Tensor]:
        return self.total / self.count if self.count > 1 else self.total

    def entry(self, key: str) -> Entry:
        if self.weight is not None:
            return Entry(key, "wmean", self.total, self.weight)
        return Entry(key, self.op, self.mean())


class Logger:
    """Routes staged values to backends; one batched host transfer per commit.

    Args:
        backends: destinations; each is opened here with ``run``.
        run: where local outputs of the run go (``runs/<name>``).
        on_step_regression: ``"raise"`` (default) or ``"warn"`` when a step goes backwards.
        reducer: how scalars are reduced across ranks; None means a `CrossRankReducer` on the default group
            (a no-op without a process group). Backends are opened only on rank 0 of its group.
    """

    def __init__(
        self,
        backends: Sequence[Backend] = (),
        run: Optional[RunInfo] = None,
        on_step_regression: str = "raise",
        reducer: Optional[CrossRankReducer] = None,
    ) -> None:
        if on_step_regression not in _STEP_POLICIES:
            raise ConfigurationError(
                f"on_step_regression must be one of {_STEP_POLICIES}, got {on_step_regression!r}."
            )
        for b in backends:
            if not isinstance(b, Backend):
                raise ConfigurationError(
                    f"Logger backends must be instrument Backend instances, got {type(b).__name__}; "
                    f"subclass instrument.Backend or use one of the built-in backends."
                )
        self.run = run or RunInfo(name="run")
        self.on_step_regression = on_step_regression
        self.reducer = reducer if reducer is not None else CrossRankReducer()
        self.is_writer = rank(self.reducer.group) == 0  # only rank 0 opens backends and writes
        self._write_lock = threading.Lock()  # commits and side-channel writes (system monitor) take turns
        self.backends: List[Backend] = []
        self._failed: Dict[str, int] = {}
        self._last_step: Optional[int] = None
        self._scalars: Dict[str, _Accumulator] = {}
        self._images: Dict[str, Any] = {}
        self._heatmaps: Dict[str, Tuple[Any, str, str]] = {}
        self._histograms: Dict[str, Any] = {}
        self._texts: Dict[str, str] = {}
        self._videos: Dict[str, Tuple[Any, int]] = {}
        self._samples: Dict[str, Tuple[List[Dict[str, Any]], str]] = {}
        self._timers: Dict[str, Timer] = {}
        self._pending_step: Optional[int] = None
        self._closed = False
        for backend in backends if self.is_writer else ():
            if self._guard(backend, "open", self.run):
                self.backends.append(backend)

    def add_backend(self, backend: Backend) -> bool:
        """Open ``backend`` with this run and route later commits to it too; False (reported) if opening failed."""
        if not isinstance(backend, Backend):
            raise ConfigurationError(f"add_backend takes an instrument Backend, got {type(backend).__name__}.")
        if backend in self.backends:
            return True
        if self._guard(backend, "open", self.run):
            self.backends.append(backend)
            return True
        return False

    # ------------------------------------------------------------------ staging
    def log_metrics(
        self,
        metrics: Mapping[str, Value],
        step: int,
        prefix: str = "",
        reduce: Union[str, Mapping[str, str]] = "mean",
        weights: Any = None,
    ) -> None:
        """Stage scalar metrics (numbers or one-element tensors) under ``prefix/key``.

        A metric logged several times before a commit is committed as its mean over the interval. ``reduce``
        says how ranks combine it at commit: ``"mean"``, ``"sum"``, ``"min"``, ``"max"`` or ``"l2"`` (root of
        the sum of squares), for all keys or as a dict key -> op (unnamed keys: mean). ``weights`` (a number,
        a one-element tensor, or a dict key -> weight) makes a mean weighted, e.g. by batch size: the result
        is sum(weight * value) / sum(weight) over the interval and over ranks.
        """
        ops = resolve_ops(list(metrics), reduce, weights)
        if not self._accept(step):
            return
        for key, value in metrics.items():
            name = _join(prefix, key)
            scalar = _as_scalar(name, value)
            op, weight = ops[key]
            if weight is not None:
                weight = _as_scalar(f"weight of {name}", weight)
            acc = self._scalars.get(name)
            if acc is None:
                self._scalars[name] = _Accumulator(op, scalar, weight)
            else:
                acc.add(name, op, scalar, weight)

    def log_image(self, tag: str, image: Union[Tensor, np.ndarray], step: int) -> None:
        """Stage an image: [H,W], [C,H,W] or [H,W,C] (C in 1,3,4), floats in [0,1] or uint8."""
        if not self._accept_media(step):
            return
        self._images[tag] = _detach(image)

    def log_heatmap(
        self, tag: str, matrix: Union[Tensor, np.ndarray], step: int, x_label: str = "", y_label: str = ""
    ) -> None:
        """Stage a 2-D matrix; at commit it is drawn colour-mapped with axes and logged as an image."""
        if not self._accept_media(step):
            return
        self._heatmaps[tag] = (_detach(matrix), x_label, y_label)

    def log_histogram(self, tag: str, values: Union[Tensor, np.ndarray, Sequence[float]], step: int) -> None:
        """Stage raw values for a histogram (any shape; flattened)."""
        if not self._accept_media(step):
            return
        self._histograms[tag] = _detach(values) if isinstance(values, (Tensor, np.ndarray)) else np.asarray(values)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Stage text (markdown where the backend renders it)."""
        if not self._accept_media(step):
            return
        self._texts[tag] = str(text)

    def log_video(self, tag: str, frames: Union[Tensor, np.ndarray], step: int, fps: int = 30) -> None:
        """Stage a video: uint8 or [0,1] float frames shaped [T, H, W, C] (C in 1, 3, 4)."""
        if not self._accept_media(step):
            return
        self._videos[tag] = (_detach(frames), int(fps))

    def log_samples(
        self, tag: str, samples: Sequence[Mapping[str, Any]], step: int, score_key: str = "score"
    ) -> None:
        """Stage validation samples: dicts such as ``{"input": ..., "output": ..., "score": ..., **extra}``.

        The console prints a few as panels, best and worst by ``score_key`` mixed (``ConsoleBackend(
        num_val_samples_to_print=N)``); W&B gets them all as a table, TensorBoard as a markdown table, JSONL
        as a list. Tensor values (e.g. a score on the device) join the commit's one batched transfer.
        """
        rows = _check_samples(tag, samples)
        if not self._accept_media(step):
            return
        self._samples[tag] = (rows, score_key)

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        """Flatten nested params, redact secret-looking keys, and send them to every backend now."""
        flat = redact_secrets(flatten_params(params))
        text = redact_config_text(config_text) if config_text else config_text
        for backend in self.backends:
            self._guard(backend, "log_hyperparams", flat, text)

    def timer(self, name: str, reduce: Optional[str] = None) -> Timer:
        """A named timer owned by this logger: ``with logger.timer("rollout"): ...`` or as a decorator.

        Its durations are committed as ``timing/<name>/{mean,min,max,count}`` (seconds); across ranks each is
        reduced with ``reduce`` (default ``"max"``: the slowest rank sets the pace).
        """
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = Timer(name, reduce=reduce or "max")
        elif reduce is not None and reduce != timer.reduce:
            raise ConfigurationError(
                f"timer {name!r} already exists with reduce={timer.reduce!r}, asked for {reduce!r}."
            )
        return timer

    def write_system(self, record: StepRecord) -> None:
        """Side channel for the system monitor: its own step axis, never the training step's order check.

        ``record.step`` is whole seconds since the monitor started. Safe to call from another thread.
        """
        with self._write_lock:
            for backend in self.backends:
                self._guard(backend, "write_system", record)

    # ------------------------------------------------------------------ commit
    @property
    def has_pending(self) -> bool:
        return bool(
            self._scalars or self._images or self._heatmaps or self._histograms or self._texts or self._videos
            or self._samples or any(t.count for t in self._timers.values())
        )

    def commit(self, step: Optional[int] = None) -> Optional[StepRecord]:
        """Transfer everything staged to the host once and write it to every backend.

        Returns the committed record, or None when nothing was staged. With a process group this is a
        collective: every rank calls it at the same steps, also ranks with nothing staged.
        """
        if step is None:
            step = self._pending_step
        collective = self.reducer.active()
        if not collective and (step is None or not self.has_pending):
            self._pending_step = None
            return None
        if step is None:
            step = self._last_step if self._last_step is not None else 0
        if not self._accept(step):
            self._discard()
            return None
        record = self._build_record(int(step))
        self._pending_step = None
        self._last_step = record.step
        if record.is_empty():
            return None
        with self._write_lock:
            for backend in self.backends:
                self._guard(backend, "write", record)
        return record

    def close(self) -> None:
        """Commit what is still staged, then close every backend (each failure reported, none fatal)."""
        if self._closed:
            return
        try:
            if self.has_pending or self.reducer.active():
                self.commit()
        finally:
            self._closed = True
            with self._write_lock:  # a side-channel write (system monitor) never meets a closing backend
                for backend in self.backends:
                    self._guard(backend, "close")

    @property
    def failures(self) -> Dict[str, int]:
        """Backend name -> number of calls that raised."""
        return dict(self._failed)

    # ------------------------------------------------------------------ internals
    def _accept(self, step: int) -> bool:
        """Validate ``step``; False when it goes backwards under the "warn" policy (values are dropped)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an int, got {type(step).__name__} ({step!r}).")
        step = int(step)
        last = self._last_step
        if last is not None and step < last:
            self._step_regressed(step, last)
            return False
        if self._pending_step is None or step > self._pending_step:
            self._pending_step = step
        return True

    def _accept_media(self, step: int) -> bool:
        # Other ranks validate the step but stage nothing: only rank 0 writes media.
        return self._accept(step) and self.is_writer

    def _step_regressed(self, step: int, last: int) -> None:
        message = (
            f"step {step} is lower than step {last}, which was already committed; steps must not go backwards "
            f"(W&B silently drops such data). Log with monotonically increasing steps, or pass "
            f"on_step_regression='warn' to drop these values instead."
        )
        if self.on_step_regression == "raise":
            raise StepOrderError(message)
        log.warning("instrument: %s", message)

    def _build_record(self, step: int) -> StepRecord:
        entries = [acc.entry(k) for k, acc in self._scalars.items()]
        for name, timer in self._timers.items():
            seconds = timer.drain()
            if seconds:
                entries += [Entry(k, timer.reduce, v) for k, v in _timing(name, seconds).items()]
        pending = self.reducer.start(entries) if self.reducer.active() else None
        scalar_items = [] if pending is not None else [(e.key, local_value(e)) for e in entries]
        tensors: List[Tensor] = []
        slots: List[Tuple[str, str]] = []

        def stage(kind: str, key: str, value: Any) -> None:
            if isinstance(value, Tensor):
                slots.append((kind, key))
                tensors.append(value)

        for key, value in scalar_items:
            stage("scalar", key, value)
        for key, value in self._images.items():
            stage("image", key, value)
        for key, (value, _, _) in self._heatmaps.items():
            stage("heatmap", key, value)
        for key, value in self._histograms.items():
            stage("histogram", key, value)
        for key, (value, _) in self._videos.items():
            stage("video", key, value)
        for tag, (rows, _) in self._samples.items():
            for i, row in enumerate(rows):
                for field, value in row.items():
                    stage("sample", f"{tag}\0{i}\0{field}", value)
        if pending is not None:
            stage("reduced", "", pending.result)
        host = dict(zip(slots, to_host(tensors), strict=True))

        def value_of(kind: str, key: str, value: Any) -> Any:
            return host[(kind, key)] if isinstance(value, Tensor) else value

        record = StepRecord(step=step)
        for key, value in scalar_items:
            record.scalars[key] = float(value_of("scalar", key, value))
        if pending is not None:
            reduced = self.reducer.finish(pending, host[("reduced", "")])
            record.scalars.update(reduced if reduced is not None else self.reducer.resolve(entries))
        for key, value in self._images.items():
            record.images[key] = self._host_image(key, value_of("image", key, value), to_hwc_uint8)
        for key, (value, x_label, y_label) in self._heatmaps.items():
            matrix = value_of("heatmap", key, value)
            record.images[key] = self._host_image(
                key, matrix, lambda m, k, xl=x_label, yl=y_label: render_heatmap(m, title=k, x_label=xl, y_label=yl)
            )
        for key, value in self._histograms.items():
            record.histograms[key] = np.asarray(value_of("histogram", key, value), dtype=np.float64).reshape(-1)
        for key, (value, fps) in self._videos.items():
            frames = np.asarray(value_of("video", key, value))
            record.videos[key] = (np.stack([to_hwc_uint8(f, key) for f in frames]), fps)
        record.texts.update(self._texts)
        for tag, (rows, score_key) in self._samples.items():
            host_rows = [
                {f: _host_field(value_of("sample", f"{tag}\0{i}\0{f}", v)) for f, v in row.items()}
                for i, row in enumerate(rows)
            ]
            record.samples[tag] = SampleTable(host_rows, score_key)
        self._discard()
        return record

    def _discard(self) -> None:
        media = (self._images, self._heatmaps, self._histograms, self._texts, self._videos, self._samples)
        for staged in (self._scalars,) + media:
            staged.clear()

    def _host_image(self, key: str, value: Any, convert) -> Optional[np.ndarray]:
        try:
            return convert(value, key)
        except ValueError:
            raise
        except Exception as exc:  # a drawing failure must not cost the other metrics of the step
            log.warning("instrument: could not render image %r: %s", key, exc)
            return None

    def _guard(self, backend: Backend, method: str, *args: Any) -> bool:
        try:
            getattr(backend, method)(*args)
            return True
        except Exception:
            name = backend.name
            count = self._failed.get(name, 0) + 1
            self._failed[name] = count
            if count == 1:
                log.exception("instrument: backend %s failed in %s(); other backends are unaffected", name, method)
            else:
                log.debug("instrument: backend %s failed again in %s() (%d failures)", name, method, count)
            return False


def _join(prefix: str, key: str) -> str:
    return f"{prefix.rstrip('/')}/{key}" if prefix else str(key)


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else np.asarray(value)


def _as_scalar(name: str, value: Any) -> Union[float, Tensor]:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {name!r} is a tensor of shape {tuple(value.shape)}; log_metrics takes scalars "
                f"(one-element tensors or numbers). Reduce it first, e.g. value.mean(), or log_histogram it."
            )
        value = value.detach().reshape(())
        return value if value.is_floating_point() else value.to(torch.float32)
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise ValueError(f"metric {name!r} is an array of shape {value.shape}; log a scalar instead.")
        return float(value.reshape(()))
    if isinstance(value, (numbers.Real, np.number)):
        return float(value)
    raise TypeError(
        f"metric {name!r} has type {type(value).__name__}; expected a Python number or a one-element tensor."
    )


def _check_samples(tag: str, samples: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    if isinstance(samples, Mapping) or not isinstance(samples, Sequence):
        raise TypeError(f"log_samples({tag!r}) takes a list of dicts, got {type(samples).__name__}.")
    rows = []
    for i, row in enumerate(samples):
        if not isinstance(row, Mapping):
            raise TypeError(
                f"log_samples({tag!r}): sample {i} is a {type(row).__name__}; each sample must be a dict "
                f"such as {{'input': ..., 'output': ..., 'score': ...}}."
            )
        rows.append({str(k): (v.detach() if isinstance(v, Tensor) else v) for k, v in row.items()})
    return rows


def _host_field(value: Any) -> Any:
    """A sample field as the backends want it: numbers as floats, small arrays as lists, the rest as is."""
    if isinstance(value, np.ndarray):
        return float(value) if value.size == 1 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _timing(name: str, seconds: List[float]) -> Dict[str, float]:
    return {
        f"timing/{name}/mean": math.fsum(seconds) / len(seconds),
        f"timing/{name}/min": min(seconds),
        f"timing/{name}/max": max(seconds),
        f"timing/{name}/count": float(len(seconds)),
    }
