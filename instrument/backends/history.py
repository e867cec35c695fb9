"""Run history: a backend that keeps the run in memory and answers questions about it in a notebook.

It stores what the logger commits — host values only, like every backend:

- ``metrics``: every scalar, as ``{key: deque([(step, value), ...])}``: a deque (``max_steps`` bounds it), which
  cannot be sliced; `series` gives NumPy arrays.
- ``timelog``: per stage, the durations the logger's timers committed (``record.timings``), as
  ``{stage: deque([(step, mean_seconds, count), ...])}``.
- ``batch_log``: per-item values per batch for the histogram tags registered with `add_log` (log them with
  ``logger.log_histogram(tag, per_item_values, step)``, e.g. each sample's reward), as
  ``{tag: deque([(step, values), ...])}``.
- ``unique_samples``: the set of samples seen: the values of the histogram tag ``sample_key`` (integer ids,
  e.g. pool indices, logged like any per-item value) or hashable items given to `add_samples`.
- ``system``: the `SystemMonitor`'s samples on their own axis (seconds since the monitor started, not the
  training step), as ``{key: [(seconds, value), ...]}``; `system_keys` and `system_series` query them.

`to_dataframe` joins samples and per-item values into a pandas DataFrame, one row per (sample, step);
`plot_metrics` and `plot_timelog` draw with matplotlib (`instrument.backends.history_plot`) and return the
figure, which a notebook shows.
pandas and matplotlib are imported only there (``pip install 'torch-instrument[analysis]'``).

Threads: the writer thread writes each committed step under one lock, and every query (`keys`, `series`,
`last`, `to_dataframe`, the plots) copies what it reads under that lock, so a notebook or the training loop
may query the history while the run goes on and sees whole steps only. The containers themselves
(``metrics``, ``timelog``, ...) are the live ones: iterate them only after the run is closed.

Runs: the history holds one run. Opening a new run starts it empty (new containers: ones taken from the run
before keep that run, so read or copy a run's history before giving the instance to the next run); one still
open for a session is refused to another. A run
resumed in the same process (``Instrumentation(resume=True)`` and ``load_state_dict``, or a `Logger`'s
``resume_after``) keeps it and drops every entry from the checkpoint's next step on (`on_resume`), as JSONL cuts
its file, so the steps written again are not followed by their repeats.

Memory: ``max_steps`` keeps the most recent committed steps of each series and batch log (and the most recent
samples of each system series), ``max_samples``
caps the set of unique samples. Neither bounds the number of series: each key ever logged keeps one (about 1 KB
even with ``max_steps=10``), so keys made up per step (``eval/episode_{i}``) grow it with the run. Reaching a
cap is reported once through the ``instrument`` logger; after that
the oldest steps are dropped (samples beyond the cap are not added).
"""

import collections
import logging
import math
import numbers
import threading
from typing import Any, Deque, Dict, Hashable, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np

from instrument.backends import history_plot
from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.checks import check_int
from instrument.errors import ConfigurationError, require

__all__ = ["RunHistoryBackend"]

log = logging.getLogger("instrument")

class RunHistoryBackend(Backend):
    """Keeps metrics, per-item batch values, stage timings and unique samples of the run in memory.

    Args:
        batch_keys: histogram tags whose per-item values are kept per batch (more with `add_log`).
        sample_key: the histogram tag that holds the ids of a batch's items, aligned with the per-item values.
        max_steps: keep at most this many most recent steps per series / batch log; None keeps everything.
        max_samples: keep at most this many unique samples; None keeps every one.
    """

    def __init__(
        self,
        batch_keys: Sequence[str] = (),
        sample_key: Optional[str] = None,
        max_steps: Optional[int] = None,
        max_samples: Optional[int] = None,
    ) -> None:
        for name, cap in (("max_steps", max_steps), ("max_samples", max_samples)):
            check_int(f"RunHistoryBackend.{name}", cap, least=1, none=True, expected="None or a positive int",
                      why="None keeps everything", fix=f"bind e.g. RunHistoryBackend.{name} = 1000")
        if isinstance(batch_keys, (str, bytes)):  # a lone tag would be taken apart into its characters
            raise ConfigurationError(
                f"RunHistoryBackend batch_keys must be a list of histogram tags, got the {type(batch_keys).__name__} "
                f"{batch_keys!r}: its characters would be the tags. Put it in a list: batch_keys=[{batch_keys!r}].")
        self.sample_key = sample_key
        self.max_steps = max_steps
        self.max_samples = max_samples
        self.batch_log: Dict[str, Deque[Tuple[int, np.ndarray]]] = {}
        self.run: Optional[RunInfo] = None
        self._pending_samples: Dict[int, List[Hashable]] = {}
        # The writer thread writes a step under it; queries copy under it (a deque iterated while it is
        # appended to raises "deque mutated during iteration"); add_samples comes from the training thread.
        self._lock = threading.RLock()
        self._start_empty()
        self._stash: Optional[Tuple[RunInfo, Dict[str, Any]]] = None  # `open`: the run a bare Logger may resume
        self._open_for: Optional[RunInfo] = None  # the run it is open for, from open to close
        for key in batch_keys:
            self.add_log(key)

    _HELD = ("metrics", "timelog", "batch_log", "batch_samples", "system", "unique_samples", "_first_seen", "_said")

    def _start_empty(self) -> None:
        """New containers for a new run (the registered batch-log tags stay registered); containers taken from
        the run before keep that run."""
        self.metrics: Dict[str, Deque[Tuple[int, float]]] = {}
        self.timelog: Dict[str, Deque[Tuple[int, float, int]]] = {}
        self.batch_log = {key: collections.deque(maxlen=self.max_steps) for key in self.batch_log}
        self.batch_samples: Deque[Tuple[int, Tuple[Hashable, ...]]] = collections.deque(maxlen=self.max_steps)
        self.system: Dict[str, Deque[Tuple[float, float]]] = {}  # the system monitor's axis: seconds
        self.unique_samples: Set[Hashable] = set()
        self._first_seen: Dict[Hashable, int] = {}  # sample -> the step it was first seen at (`on_resume`)
        self._said: Set[str] = set()

    # ------------------------------------------------------------------ registration
    def add_log(self, key: str) -> None:
        """Keep the per-item values of histogram tag ``key`` for every batch (not only a histogram of
        them)."""
        if not key or not isinstance(key, str):
            raise ConfigurationError(f"add_log takes a histogram tag (a non-empty string), got {key!r}.")
        with self._lock:
            self.batch_log.setdefault(key, collections.deque(maxlen=self.max_steps))

    def add_samples(self, step: int, samples: Iterable[Hashable]) -> None:
        """Name the items of the batch logged at ``step`` (any hashable items: ints, strings, tuples).

        Call it before that step is committed; the per-item values committed at ``step`` are aligned with
        them. ``step`` is the int step the batch is committed at. A tensor or NumPy array of ids (and tensor or
        NumPy scalars among the items) is read as Python values (``.tolist()``), so equal ids are one sample:
        a tensor element hashes by identity, so each batch's ``tensor(0)`` would be a new sample.
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ConfigurationError(
                f"RunHistoryBackend.add_samples: step must be a non-negative int, the step the batch is committed "
                f"at, got {step!r} ({type(step).__name__}). Pass the int step given to the logger (a tensor's: "
                f"int(t.item()))."
            )
        if isinstance(samples, (str, bytes)) or not hasattr(samples, "__iter__") and not hasattr(samples, "tolist"):
            raise ConfigurationError(
                f"RunHistoryBackend.add_samples takes the batch's items, one per item (a list, tuple, 1-D tensor "
                f"or array of ids), got {type(samples).__name__} {samples!r:.80}."
            )
        if callable(getattr(samples, "tolist", None)):  # a tensor, an array: Python ints and floats
            samples = samples.tolist()
            if not isinstance(samples, list):
                raise ConfigurationError(
                    f"RunHistoryBackend.add_samples takes one id per item of the batch, got a 0-d tensor or array "
                    f"({samples!r}); pass a 1-D one, e.g. ids.reshape(-1)."
                )
        items = [item.tolist() if callable(getattr(item, "tolist", None)) else item for item in samples]
        for item in items:
            hash(item)  # an unhashable item fails here, with Python's own message
        with self._lock:
            self._pending_samples[int(step)] = items

    # ------------------------------------------------------------------ backend
    def open(self, run: RunInfo) -> None:
        """A new run starts an empty history: one instance given to run after run would otherwise append each
        run's steps to the series of the runs before it. Only ``Instrumentation(resume=True)`` of the run this
        history holds keeps it (`on_resume` then drops the steps the resumed run writes again)."""
        with self._lock:
            if self._open_for is not None:
                raise ConfigurationError(
                    f"RunHistoryBackend is already open for the run in {str(self._open_for.dir)!r}, and was given to "
                    f"the run in {str(run.dir)!r} too: one instance holds one run at a time (a second would wipe "
                    f"the first's history and mix their steps). Give each session its own RunHistoryBackend(), or "
                    f"close the first session before giving the instance to the next (one you no longer hold, such "
                    f"as a notebook cell's that raised before close(), keeps it: make a new instance)."
                )
            self._open_for = run
            same = self.run is not None and self.run.dir.resolve() == run.dir.resolve()  # 'runs' is ./runs
            self._stash = None
            if not (same and run.resume is not None):
                if same:  # a bare Logger resumes with resume_after only: on_resume may yet ask for this run
                    self._stash = (self.run, {name: getattr(self, name) for name in self._HELD})
                self._start_empty()
            self.run = run

    def on_resume(self, next_step: int) -> None:
        """Drop every entry at ``next_step`` or later (metrics, timelog, batch log and samples; samples first
        seen there leave ``unique_samples``), as JSONL cuts its file: the resumed run writes those steps again,
        and kept they would be followed by their repeats. The system samples (their own axis) stay."""
        with self._lock:
            if self._stash is not None:  # `Logger.resume_after` of the run opened before: that run goes on
                for name, value in self._stash[1].items():
                    setattr(self, name, value)
                self._stash = None
            removed = 0
            for table in (self.metrics, self.timelog, self.batch_log):
                for key in list(table):
                    removed += _cut(table[key], next_step)
                    if not table[key] and table is not self.batch_log:  # registered batch-log tags stay
                        del table[key]
            removed += _cut(self.batch_samples, next_step)
            for item in [item for item, step in self._first_seen.items() if step >= next_step]:
                del self._first_seen[item]
                self.unique_samples.discard(item)
        if removed:
            log.info("instrument: RunHistoryBackend: removed %d entries from step %d on for the resumed run",
                     removed, next_step)

    def close(self) -> None:
        """Samples named for steps that were never committed would be paired with a later run's steps."""
        with self._lock:
            self._pending_samples.clear()
            self._open_for = None

    def write(self, record: StepRecord) -> None:
        with self._lock:  # a query sees this step whole or not at all
            self._stash = None  # the new run has begun: the one before is not resumed
            self._write(record)

    def _write(self, record: StepRecord) -> None:
        """Every value is converted first and stored after: a value that fails its conversion (a sample id that
        is not a number) raises before anything of the step is kept, so the history never holds part of a step."""
        step = record.step
        scalars = [(key, (step, float(value))) for key, value in record.flat_scalars().items()]  # timings too
        times = [(stage, (step, float(stats["mean"]), int(stats.get("count", 1))))
                 for stage, stats in record.timings.items() if "mean" in stats]
        samples = self._pending_samples.get(step)
        named = "add_samples"
        if samples is None and self.sample_key is not None and self.sample_key in record.histograms:
            samples, named = [_as_id(v) for v in record.histograms[self.sample_key]], repr(self.sample_key)
        batches = [(key, np.asarray(values).copy()) for key, values in record.histograms.items()
                   if key in self.batch_log]
        # stored: nothing below converts a value
        for key, item in scalars:
            series = self.metrics.get(key)
            if series is None:
                series = self.metrics[key] = collections.deque(maxlen=self.max_steps)
            self._append(series, item, "max_steps", f"metric {key!r}")
        for stage, item in times:
            series_t = self.timelog.setdefault(stage, collections.deque(maxlen=self.max_steps))
            self._append(series_t, item, "max_steps", f"timelog {stage!r}")
        self._pending_samples.pop(step, None)
        for stale in [s for s in self._pending_samples if s < step]:
            del self._pending_samples[stale]
        for key, values in batches:
            if samples is not None and len(values) != len(samples):  # kept as logged, never paired
                self._say_once(f"misaligned {key}", _misaligned(key, step, len(values), len(samples), named)
                               + "; kept in batch_log as logged, left unpaired (NaN) by to_dataframe, which "
                               "says so each time")
            self._append(self.batch_log[key], (step, values), "max_steps", f"batch log {key!r}")
        if samples is not None:
            self._append(self.batch_samples, (step, tuple(samples)), "max_steps", "batch samples")
            self._add_unique(samples, step)

    def write_system(self, record: StepRecord) -> None:
        """The system monitor's samples, kept on their own axis: the exact ``system/seconds`` since the monitor
        started (the record's step counts milliseconds since the run first started), never mixed with the
        training steps in ``metrics``."""
        seconds = float(record.scalars.get("system/seconds", record.step / 1000))  # the step counts milliseconds
        with self._lock:
            for key, value in record.scalars.items():
                series = self.system.get(key)
                if series is None:
                    series = self.system[key] = collections.deque(maxlen=self.max_steps)
                self._append(series, (seconds, float(value)), "max_steps", f"system metric {key!r}")

    def _append(self, series: Deque, item: Any, cap: str, what: str) -> None:
        if series.maxlen is not None and len(series) == series.maxlen:
            self._say_once(
                cap, f"{what} reached max_steps={series.maxlen}; older steps are dropped from now on"
            )
        series.append(item)

    def _add_unique(self, samples: Iterable[Hashable], step: int) -> None:
        cap = self.max_samples
        for item in samples:
            if item in self.unique_samples:
                continue
            if cap is not None and len(self.unique_samples) >= cap:
                self._say_once(
                    "max_samples", f"unique samples reached max_samples={cap}; new samples are not added, and "
                    f"to_dataframe leaves out their rows"
                )
                return
            self.unique_samples.add(item)
            self._first_seen[item] = step

    def _say_once(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            log.warning("instrument: RunHistoryBackend: %s.", message)

    # ------------------------------------------------------------------ queries
    def keys(self) -> List[str]:
        with self._lock:
            return sorted(self.metrics)

    def series(self, key: str) -> Tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of one metric as NumPy arrays (a copy, safe to take while the run goes on)."""
        with self._lock:
            pairs = list(self.metrics.get(key, ()))
            if key not in self.metrics:
                raise KeyError(f"no metric {key!r} in the run history; known keys: {sorted(self.metrics)[:20]}")
        return (
            np.array([s for s, _ in pairs], dtype=np.int64 if all(abs(s) < 2**63 for s, _ in pairs) else object),
            np.fromiter((v for _, v in pairs), dtype=np.float64, count=len(pairs)),
        )

    def last(self, key: str) -> float:
        return self.series(key)[1][-1]

    def system_keys(self) -> List[str]:
        """The system monitor's metric keys (``system/...``), kept apart from the training metrics' `keys`."""
        with self._lock:
            return sorted(self.system)

    def system_series(self, key: str) -> Tuple[np.ndarray, np.ndarray]:
        """``(seconds, values)`` of one system-monitor metric as float64 NumPy arrays: seconds since the monitor
        started (``system/seconds``), the system axis, not training steps. A copy, safe while the run goes on."""
        with self._lock:
            if key not in self.system:
                raise KeyError(f"no system metric {key!r} in the run history (the SystemMonitor's samples); known "
                               f"system keys: {sorted(self.system)[:20]}")
            pairs = list(self.system[key])
        return (
            np.fromiter((t for t, _ in pairs), dtype=np.float64, count=len(pairs)),
            np.fromiter((v for _, v in pairs), dtype=np.float64, count=len(pairs)),
        )

    def to_dataframe(self):
        """A pandas DataFrame with one row per (sample, step): columns ``sample``, ``step`` and each batch-log
        key's per-item value. NaN where a key was not logged that step, or where its values were not one per
        sample of the batch: those are never paired by position (which would give samples another's values);
        each such batch is named in a warning, with its tag, step and both lengths, and its values stay in
        ``batch_log`` as logged.

        Every value is kept exact (`_exact_dtype`): a column of integers is int64 (uint64 past int64's range),
        and a column that float64 would round (ids or counts beyond 2**53 beside a float or a NaN) is of
        dtype object, holding the Python values, so two ids never become one."""
        pd = require("pandas", "analysis", "RunHistoryBackend.to_dataframe")
        with self._lock:  # one consistent copy: the writer may be appending meanwhile
            batch_log = {key: list(entries) for key, entries in self.batch_log.items()}
            batch_samples, unique = list(self.batch_samples), set(self.unique_samples)
        # A step committed twice has two entries of each: the k-th samples of a step go with its k-th values.
        by_step: Dict[int, Dict[str, List[np.ndarray]]] = {}
        for key, entries in batch_log.items():
            for step, values in entries:
                by_step.setdefault(step, {}).setdefault(key, []).append(values)
        keys = list(batch_log)
        columns: Dict[str, List[Any]] = {name: [] for name in ("sample", "step", *keys)}
        seen: Dict[int, int] = {}
        unpaired: List[str] = []
        for step, samples in batch_samples:
            k = seen[step] = seen.get(step, -1) + 1
            values = {key: lists[k] for key, lists in by_step.get(step, {}).items() if k < len(lists)}
            for key in [key for key, v in values.items() if len(v) != len(samples)]:
                unpaired.append(_misaligned(key, step, len(values.pop(key)), len(samples)))
            items = {key: v.tolist() for key, v in values.items()}  # Python ints and floats: exact
            for i, sample in enumerate(samples):
                if sample not in unique:
                    continue
                columns["sample"].append(sample)
                columns["step"].append(step)
                for key in keys:
                    v = items.get(key)
                    columns[key].append(v[i] if v is not None else math.nan)
        if unpaired:
            log.warning("instrument: RunHistoryBackend.to_dataframe: %d batch(es) left unpaired (NaN): %s%s",
                        len(unpaired), "; ".join(unpaired[:5]), "; ..." if len(unpaired) > 5 else "")
        return pd.DataFrame({name: pd.Series(column, dtype=_exact_dtype(column)) for name, column in columns.items()},
                            columns=list(columns))

    def plot_metrics(self, keys: Sequence[str], title: Optional[str] = None, max_panels: int = 24):
        """One panel per key, value against step; returns the matplotlib Figure (`history_plot`: a marker on
        each point a line cannot show, values not drawn (NaN, inf) counted in the panel's title, keys drawn as
        literal text).

        ``max_panels`` bounds the figure: each panel is 2.2 inches tall, so all of a run's keys (hundreds) would
        make a figure metres tall that takes minutes to draw. More keys than that are refused, with the way to
        select them; pass a larger ``max_panels`` to draw them all anyway."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        max_panels = check_int("RunHistoryBackend.plot_metrics max_panels", max_panels, least=1,
                               fix="pass e.g. max_panels=48", why="the most panels one figure holds")
        if not keys:
            raise ConfigurationError("plot_metrics needs at least one metric key.")
        if len(keys) > max_panels:
            raise ConfigurationError(
                f"plot_metrics got {len(keys)} keys, more than max_panels={max_panels} (one panel of "
                f"{history_plot.PANEL_INCHES} inches per key: a figure {history_plot.PANEL_INCHES * len(keys):.0f} "
                f"inches tall, slow to draw and to read). Select the keys to plot, e.g. "
                f"[k for k in history.keys() if k.startswith('train/')], split them over several figures, or pass "
                f"max_panels={len(keys)} to draw them all in one."
            )
        with self._lock:  # every panel from one state: a step committed meanwhile is in all of them or in none
            series = [(key, *self.series(key)) for key in keys]
        return history_plot.plot_metrics(series, title)

    def plot_timelog(self, title: Optional[str] = None):
        """Mean seconds per stage against step, one line per stage; returns the matplotlib Figure (drawn as
        `plot_metrics` draws a panel)."""
        with self._lock:
            timelog = {stage: list(entries) for stage, entries in self.timelog.items()}
        return history_plot.plot_timelog(timelog, title)

    def __repr__(self) -> str:
        return (
            f"RunHistoryBackend(metrics={len(self.metrics)}, steps_cap={self.max_steps}, "
            f"samples={len(self.unique_samples)}, samples_cap={self.max_samples})"
        )


def _cut(entries: Deque, next_step: int) -> int:
    """Drop the entries of ``entries`` (``(step, ...)`` tuples, in place) at ``next_step`` or later; how many."""
    kept = [entry for entry in entries if entry[0] < next_step]
    removed = len(entries) - len(kept)
    if removed:
        entries.clear()
        entries.extend(kept)
    return removed


def _misaligned(key: str, step: int, values: int, samples: int, named: Optional[str] = None) -> str:
    by = f" (named by {named})" if named else ""
    return (f"batch log {key!r} at step {step} has {values} value(s) for {samples} sample(s){by}: "
            f"they cannot be paired with the samples (log one value per sample, in the order of the ids)")


def _exact_dtype(values: List[Any]) -> str:
    """The dtype that holds each value as it is. Left to pandas, ints beside a float or a NaN become float64,
    which rounds those beyond 2**53 (two ids become one, a count changes): those columns stay ``object``."""
    lo = hi = 0
    floats = False
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return "object"  # strings, tuples, ...: as pandas would
        if isinstance(v, int):
            lo, hi = min(lo, v), max(hi, v)
        else:
            floats = True
    if not values:
        return "object"
    if floats:
        return "float64" if -(2**53) <= lo and hi <= 2**53 else "object"
    if -(2**63) <= lo and hi < 2**63:
        return "int64"
    return "uint64" if hi < 2**64 and lo >= 0 else "object"


def _as_id(value: float) -> Hashable:
    """Ids travel through the logger's float64 transfer; integral ones come back as ints."""
    return int(value) if float(value).is_integer() else float(value)
