"""Console: one aligned table row per committed step, a legend at start and a summary at the end.

The layout is decided once and never changes during the run, so a column is always in the same place::

    columns:
      step   step        training step
      loss↓  train/loss  training loss, mean over the interval
      ...
       step     loss↓  alive↑
          0    0.1234   0.012
         10    0.0871   0.153

Every line (legend, header, rows, summary) is written to the terminal through `write_line` (it goes through
``tqdm.write`` when a progress bar is active, so rows stay intact) and to the ``instrument.console`` logger
at INFO, which `setup_run_logging` sends to the run's log file. That logger does not propagate, so a user's
root handlers never print the table a second time; attach a handler to it to get rows elsewhere. At DEBUG
the same logger records every scalar of every step, so the log file keeps what the table leaves out.

Rendering (formats, ``nan``, ``?``, overflow into scientific notation) is `StepTable`'s job; see
`instrument.logging.table`.
"""

import dataclasses
import logging
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, TextIO

from instrument.logging.backends.base import Backend, RunInfo, StepRecord
from instrument.logging.table import Column, ColumnSpec, StepTable, resolve_columns, unique_headers
from instrument.logging.terminal import write_line

__all__ = ["ConsoleBackend"]

table_log = logging.getLogger("instrument.console")
table_log.propagate = False  # rows are printed by the backend itself; handlers here are files (run logs)


@dataclasses.dataclass
class _Summary:
    last: float = math.nan
    total: float = 0.0
    count: int = 0
    low: float = math.inf
    high: float = -math.inf

    def add(self, value: float) -> None:
        self.last = value
        if not math.isnan(value):
            self.total += value
            self.count += 1
            self.low = min(self.low, value)
            self.high = max(self.high, value)

    def row(self, key: str) -> Dict[str, Any]:
        if not self.count:
            return {"metric": key, "last": self.last, "steps": 0}
        return {
            "metric": key,
            "last": self.last,
            "mean": self.total / self.count,
            "min": self.low,
            "max": self.high,
            "steps": self.count,
        }


class ConsoleBackend(Backend):
    """Prints committed steps as a fixed-width table.

    Args:
        columns: the table's columns in order: `Column` objects, or dicts / ``(key, header, width, fmt,
            description)`` tuples (gin literals). A ``step`` column is put first unless one is declared.
            None builds the table from the first committed step and prints that choice once.
        header_every: reprint the header every this many rows (0: once).
        summary: key prefixes (or exact keys) kept out of the streaming table; their last/mean/min/max over
            the run print as a final table at `close`. Default: timings.
        keys: with ``columns=None``, only metrics equal to or under these keys/prefixes are candidates.
        max_keys: with ``columns=None``, at most this many metric columns (besides ``step``).
        legend: print the legend once at start.
        stream: where the table goes; None means ``sys.stdout`` at write time.
    """

    def __init__(
        self,
        columns: Optional[Sequence[ColumnSpec]] = None,
        header_every: int = 20,
        summary: Sequence[str] = ("timing/",),
        keys: Optional[Sequence[str]] = None,
        max_keys: int = 8,
        legend: bool = True,
        stream: Optional[TextIO] = None,
    ) -> None:
        self.declared: Optional[List[Column]] = None if columns is None else resolve_columns(columns)
        self.header_every = header_every
        self.summary = tuple(summary)
        self.keys = list(keys) if keys is not None else None
        self.max_keys = max_keys
        self.legend = legend
        self.stream = stream
        self.table: Optional[StepTable] = None
        self._summaries: Dict[str, _Summary] = {}
        if self.declared is not None:
            self.table = self._make_table(self.declared)  # validate now: a bad column fails before training

    # ------------------------------------------------------------------ Backend
    def open(self, run: RunInfo) -> None:
        if self.table is not None and self.legend:
            self._emit_all(self.table.legend())

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        if table_log.isEnabledFor(logging.DEBUG):
            table_log.debug("hyperparameters: %s", dict(params))
            if config_text:
                table_log.debug("operative config:\n%s", config_text)

    def write(self, record: StepRecord) -> None:
        if table_log.isEnabledFor(logging.DEBUG):
            table_log.debug(
                "step %d scalars: %s%s",
                record.step,
                ", ".join(f"{k}={v!r}" for k, v in record.scalars.items()),
                _media(record),
            )
        for key, value in record.scalars.items():
            if self._is_summary(key):
                self._summaries.setdefault(key, _Summary()).add(value)
        if self.table is None:
            if not record.scalars:
                return
            self.table = self._infer(record)
        values = self._values(record)
        if not any(values.get(c.key) is not None for c in self.table.columns if c.key != "step"):
            return  # nothing of this table in the record (e.g. a commit of images only)
        self._emit_all(self.table.render(values))

    def close(self) -> None:
        if not self._summaries:
            return
        width = max(max(len(k) for k in self._summaries), len("metric"))
        stats = [Column(name, name, 10, ".4g") for name in ("last", "mean", "min", "max")]
        table = StepTable(
            [Column("metric", "metric", width, "str"), *stats, Column("steps", "steps", 5, "d")]
        )
        self._emit(f"summary of metrics kept out of the table ({', '.join(self.summary)}):")
        self._emit(table.header())
        for key in sorted(self._summaries):
            self._emit(table.row(self._summaries[key].row(key)))

    # ------------------------------------------------------------------ internals
    def _make_table(self, columns: List[Column]) -> StepTable:
        if not any(c.key == "step" for c in columns):
            columns = [Column("step", "step", 7, "d", "training step"), *columns]
        return StepTable(columns, header_every=self.header_every)

    def _infer(self, record: StepRecord) -> StepTable:
        """Columns from the first committed step: its scalars in logged order (or ``keys`` order), '.4g'."""
        shown = [k for k in record.scalars if not self._is_summary(k)]
        if self.keys is not None:  # in the order of ``keys``, then logged order under each prefix
            shown = [k for want in self.keys for k in shown if _under(k, want)]
            shown = list(dict.fromkeys(shown))
        chosen = shown[: self.max_keys]
        headers = unique_headers(chosen)
        # '.4g' whatever the first value looks like: a metric that starts at 0 or 1 is rarely a whole number
        # later. Nine characters hold most '.4g' values; a wider first value widens its column, and a wider
        # later one goes to compact scientific notation like every overflow.
        columns = [
            Column(key, headers[key], max(len(headers[key]), len(format(record.scalars[key], ".4g")), 9), ".4g")
            for key in chosen
        ]
        table = self._make_table(columns)
        left_out = len(shown) - len(chosen)
        self._emit(
            f"console: no columns declared; showing {len(chosen)} metrics from step {record.step}"
            + (f" ({left_out} more are in the run log)" if left_out else "")
            + ". Bind ConsoleBackend.columns to choose them."
        )
        if self.legend:
            self._emit_all(table.legend())
        return table

    def _values(self, record: StepRecord) -> Dict[str, Any]:
        assert self.table is not None
        values: Dict[str, Any] = {"step": record.step}
        for col in self.table.columns:
            if col.key == "step":
                continue
            value = record.scalars.get(col.key, record.texts.get(col.key))
            if col.fmt == "frac" and col.denominator is not None and value is not None:
                den = col.denominator
                value = (value, record.scalars.get(den) if isinstance(den, str) else den)
            values[col.key] = value
        return values

    def _is_summary(self, key: str) -> bool:
        return any(_under(key, prefix) for prefix in self.summary)

    def _emit(self, line: str) -> None:
        write_line(line, self.stream)
        table_log.info(line)

    def _emit_all(self, lines: Sequence[str]) -> None:
        for line in lines:
            self._emit(line)

    def __repr__(self) -> str:
        shown = None if self.declared is None else [c.key for c in self.declared]
        return (
            f"ConsoleBackend(columns={shown!r}, header_every={self.header_every}, summary={self.summary!r})"
        )


def _under(key: str, want: str) -> bool:
    return key == want or key.startswith(want if want.endswith("/") else want + "/")


def _media(record: StepRecord) -> str:
    names = [*record.images, *record.histograms, *record.texts, *record.videos]
    return f"; media: {', '.join(names)}" if names else ""
