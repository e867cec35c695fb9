"""Console: one aligned table row per committed step, a legend at start and a summary at the end; validation
samples as readable panels (rich).

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
`instrument.terminal.table`. Validation samples (``logger.log_samples``) print after their step's row as rich
panels, rendered to text first so they take the same route (tqdm-safe, into the run log).
"""

import dataclasses
import difflib
import io
import logging
import math
import re
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, TextIO

from instrument.backends.base import Backend, RunInfo, SampleTable, StepRecord
from instrument.checks import check_int
from instrument.core.exact import overflowed
from instrument.errors import ConfigurationError, require
from instrument.terminal.output import write_line
from instrument.terminal.samples import finite_number, select_samples
from instrument.terminal.table import Column, ColumnSpec, StepTable, resolve_columns, unique_headers
from instrument.terminal.text import display_width, printable

__all__ = ["ConsoleBackend"]

log = logging.getLogger("instrument")
table_log = logging.getLogger("instrument.console")
table_log.propagate = False  # rows are printed by the backend itself; handlers here are files (run logs)

_LEAST_WIDTH = 20  # columns a sample panel is drawn in at least: its border, a field name and some text


@dataclasses.dataclass
class _Summary:
    last: float = math.nan
    total: Any = 0.0  # an ExactSum once a sum of finite values left float64's range
    count: int = 0
    low: float = math.inf
    high: float = -math.inf

    def add(self, value: float) -> None:
        self.last = value
        if not math.isnan(value):
            total = self.total + value
            if type(total) is float and math.isinf(total):  # 1e308 + 1e308: exact from there, the mean stays finite
                total = overflowed(self.total, value, total)
            self.total = total
            self.count += 1
            self.low = min(self.low, value)
            self.high = max(self.high, value)

    def row(self, key: str) -> Dict[str, Any]:
        if not self.count:
            return {"metric": key, "last": self.last, "steps": 0}
        return {
            "metric": key,
            "last": self.last,
            "mean": float(self.total / self.count),
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
        num_val_samples_to_print: how many validation samples (``logger.log_samples``) to print per tag and
            commit, as panels: the best and the worst by score, interleaved. 0 prints none. Needs ``rich``
            (``pip install 'torch-instrument[rich]'``).
        show_system: also print a line per system-monitor sample (``system <whole seconds since the monitor
            started>s | ...``).
        width: panel width in characters; None uses the stream's width as rich detects it.
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
        num_val_samples_to_print: int = 4,
        show_system: bool = False,
        width: Optional[int] = None,
    ) -> None:
        # Every argument is checked here, also those only used once a step has come (an inferred table's
        # header_every, the stream): a bad one must fail before training, not on the writer thread.
        if isinstance(columns, (str, Mapping)):
            raise ConfigurationError(
                f"ConsoleBackend columns must be a list of columns, got {columns!r} ({type(columns).__name__}); "
                f"put the column in a list: columns=[{columns!r}]."
            )
        try:
            self.declared: Optional[List[Column]] = None if columns is None else resolve_columns(columns)
        except ConfigurationError as exc:  # named as the argument, so that the CLI can say where it was bound
            raise ConfigurationError(f"ConsoleBackend columns: {exc}") from None
        self.header_every = check_int("ConsoleBackend header_every", header_every, least=0, why="0: the header once",
                                      fix="bind e.g. ConsoleBackend.header_every = 20")
        self.summary = tuple(_check_strings("summary", summary, "('timing/',)"))
        self.keys = None if keys is None else _check_strings("keys", keys, "['train/loss', 'eval/']")
        self.max_keys = check_int("ConsoleBackend max_keys", max_keys, least=1,
                                  fix="bind e.g. ConsoleBackend.max_keys = 8")
        for name, flag in (("legend", legend), ("show_system", show_system)):
            if not isinstance(flag, bool):
                raise ConfigurationError(f"ConsoleBackend {name} must be True or False, got {flag!r}.")
        self.legend = legend
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise ConfigurationError(
                f"ConsoleBackend stream must be None (sys.stdout when a line is written) or a text stream with a "
                f"write method such as sys.stderr or an open file, got {stream!r} ({type(stream).__name__}). "
                f"Leave it unbound for stdout; pass ConsoleBackend(stream=sys.stderr) from Python for stderr."
            )
        self.stream = stream
        check_int("ConsoleBackend num_val_samples_to_print", num_val_samples_to_print, least=0, why="0: none",
                  fix="bind e.g. ConsoleBackend.num_val_samples_to_print = 4")
        check_int("ConsoleBackend width", width, least=_LEAST_WIDTH, none=True, why="the stream's width",
                  fix="bind e.g. ConsoleBackend.width = 100")
        self.num_val_samples_to_print = num_val_samples_to_print
        self.show_system = show_system
        self.width = width
        self.table: Optional[StepTable] = None
        self._summaries: Dict[str, _Summary] = {}
        self._matched: Dict[str, str] = {}  # a match=True column's pattern -> the metric key it shows
        self._pipe_closed = False  # the stream's reader went away (`| head`): rows go to the run log only
        self._pipe_error: Optional[BaseException] = None  # a broken pipe met while opening, said at the first write
        # Declared columns no step has shown yet, and the keys seen meanwhile: one that never shows is said at
        # close, with the near keys (a misspelt key printed an empty column, or no row at all, unsaid)
        self._unshown = {c.key for c in self.declared or () if c.key != "step"}
        self._seen: set = set()
        if self.declared is not None:
            self.table = self._make_table(self.declared)  # validate now: a bad column fails before training

    # ------------------------------------------------------------------ Backend
    def open(self, run: RunInfo) -> None:
        if self.table is not None and self.legend:
            try:
                self._emit_all(self.table.legend())
            except BrokenPipeError as exc:  # the reader left before the run began: rows go to the run log only,
                self._pipe_error = exc  # and the first write reports it (a console is no reason not to train)

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
        scalars = record.flat_scalars()  # timings as timing/<name>/<stat>; a user's timer-form key renamed always
        for key, value in scalars.items():
            if self._is_summary(key):
                self._summaries.setdefault(key, _Summary()).add(value)
        # Inferred from the first step with a metric for the table: one with only timings (a timed warm-up) fixed
        # a table of no columns for the whole run.
        if self.table is None and any(not self._is_summary(k) for k in scalars):
            self.table = self._infer(record, scalars)
        if self.table is not None:
            values = self._values(record, scalars)
            if self._unshown:
                self._unshown.difference_update(k for k, v in values.items() if v is not None)
                self._seen.update(scalars, record.texts)
            # A commit with nothing for this table (e.g. images only) prints no row.
            if any(values.get(c.key) is not None for c in self.table.columns if c.key != "step"):
                self._emit_all(self.table.render(values))
        for tag, samples in record.samples.items():
            self._print_samples(tag, samples, record.step)

    def write_system(self, record: StepRecord) -> None:
        if not self.show_system:
            return
        items = sorted((k, v) for k, v in record.scalars.items() if k != "system/seconds")
        seconds = int(record.scalars.get("system/seconds", record.step / 1000))  # the step is in milliseconds
        self._emit(" | ".join([f"system {seconds:>6}s"] + [f"{printable(k)} {_fmt(v)}" for k, v in items]))

    def close(self) -> None:
        if self._unshown and self._seen:  # a run that logged nothing (refused before its first step) says nothing
            self._say_unmatched("declared column(s)", sorted(self._unshown), "ConsoleBackend.columns")
        if not self._summaries:
            return
        names = {key: printable(key) for key in self._summaries}  # display only: a newline would split the row
        width = max(max(display_width(name) for name in names.values()), len("metric"))
        stats = [Column(name, name, 10, ".4g") for name in ("last", "mean", "min", "max")]
        table = StepTable(
            [Column("metric", "metric", width, "str"), *stats, Column("steps", "steps", 5, "d")]
        )
        self._emit(f"summary of metrics kept out of the table ({', '.join(self.summary)}):")
        self._emit(table.header())
        for key in sorted(self._summaries):
            self._emit(table.row(self._summaries[key].row(names[key])))

    # ------------------------------------------------------------------ internals
    def _print_samples(self, tag: str, table: SampleTable, step: int) -> None:
        chosen = select_samples(table.rows, self.num_val_samples_to_print, table.score_key)
        if not chosen:
            return
        require("rich", "rich", "printing validation samples on the console")
        from rich.console import Console
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        # a terminal that reports a width of 0 or a few columns (a pipe under COLUMNS=0) would draw empty boxes
        width = self.width or max(_LEAST_WIDTH, Console(file=self.stream or sys.stdout).width)
        buffer = io.StringIO()
        console = Console(file=buffer, width=width, highlight=False, soft_wrap=False)
        for label, row in chosen:
            grid = Table.grid(padding=(0, 1))
            grid.add_column(style="bold", no_wrap=True)
            grid.add_column()
            for field, value in row.items():
                shown = _fmt(value) if isinstance(value, float) else printable(str(value), keep="\n\t")  # lines kept
                grid.add_row(Text(printable(str(field))), Text(shown))
            score = row.get(table.score_key)
            title = f"{printable(tag)} | step {step} | {label}"
            if isinstance(score, (int, float)):
                shown = _fmt(float(score)) if finite_number(score) or isinstance(score, float) else str(score)
                title += f" | {table.score_key} {shown}"
            console.print(Panel(grid, title=Text(title), title_align="left"))
        self._emit_all(buffer.getvalue().rstrip("\n").split("\n"))

    def _say_unmatched(self, what: str, keys: Sequence[str], option: str) -> None:
        """One warning naming the keys that matched no metric, each with the nearest keys the run logged."""
        seen = sorted(self._seen)
        hints = []
        for key in keys:
            near = difflib.get_close_matches(key, seen, n=3, cutoff=0.8)
            hints.append(f"{key!r}" + (f" (did you mean {', '.join(map(repr, near))}?)" if near else ""))
        log.warning("instrument: the console table's %s %s matched no metric this run logged, so they showed "
                    "nothing. Check the key(s) in %s (a metric's key is its prefix and name, e.g. 'train/loss').",
                    what, ", ".join(hints), option)

    def _make_table(self, columns: List[Column]) -> StepTable:
        if not any(c.key == "step" for c in columns):
            columns = [Column("step", "step", 7, "d", "training step"), *columns]
        return StepTable(columns, header_every=self.header_every)

    def _infer(self, record: StepRecord, scalars: Mapping[str, float]) -> StepTable:
        """Columns from the first committed step: its scalars in logged order (or ``keys`` order), '.4g'."""
        shown = [k for k in scalars if not self._is_summary(k)]
        if self.keys is not None:  # in the order of ``keys``, then logged order under each prefix
            unmatched = [want for want in self.keys if not any(_under(k, want) for k in shown)]
            if unmatched:  # the columns are fixed now: a metric first logged later (evaluation) never shows
                self._seen.update(shown)
                self._say_unmatched(
                    "keys", unmatched, "ConsoleBackend.keys: they are matched against the first logged step's "
                    "metrics only, those under a summary prefix left out (for a metric logged later, e.g. an "
                    f"evaluation, declare ConsoleBackend.columns; summary={self.summary!r} keeps its metrics for "
                    "the end-of-run summary)")
            shown = [k for want in self.keys for k in shown if _under(k, want)]
            shown = list(dict.fromkeys(shown))
        chosen = shown[: self.max_keys]
        headers = {key: printable(header) for key, header in unique_headers(chosen).items()}  # display only
        # '.4g' whatever the first value looks like: a metric that starts at 0 or 1 is rarely a whole number
        # later. Nine characters hold most '.4g' values; a wider first value widens its column, and a wider
        # later one goes to compact scientific notation like every overflow.
        columns = []
        for key in chosen:
            width = max(display_width(headers[key]), len(format(scalars[key], ".4g")), 9)  # timings are among them too
            columns.append(Column(key, headers[key], width, ".4g"))
        table = self._make_table(columns)
        left_out = len(shown) - len(chosen)
        # Where the others are: the DEBUG lines of `write` (a run log, or a handler of the user's) keep them.
        where = "are in the run log" if table_log.isEnabledFor(logging.DEBUG) else (
            "are left out here; Instrumentation.run_log = True keeps every scalar in the run log")
        self._emit(
            f"console: no columns declared; showing {len(chosen)} metric{'s' if len(chosen) != 1 else ''} "
            f"from step {record.step}"
            + (f" ({left_out} more {where})" if left_out else "")
            + ". Bind ConsoleBackend.columns to choose them."
        )
        if self.legend:
            self._emit_all(table.legend())
        return table

    def _values(self, record: StepRecord, scalars: Mapping[str, float]) -> Dict[str, Any]:
        assert self.table is not None
        values: Dict[str, Any] = {"step": record.step}
        for col in self.table.columns:
            if col.key == "step":
                continue
            key = self._matched_key(col, scalars, record.texts) if col.match else col.key
            value = scalars.get(key, record.texts.get(key))
            if col.fmt == "frac" and col.denominator is not None and value is not None:
                den = col.denominator
                value = (value, scalars.get(den) if isinstance(den, str) else den)
            values[col.key] = value
        return values

    def _matched_key(self, col: Column, scalars: Mapping[str, Any], texts: Mapping[str, Any]) -> str:
        """The metric key a ``match=True`` column shows: the first of the first step that logs one, then fixed."""
        if col.key not in self._matched:
            pattern = re.compile(col.key)
            found = next((k for k in [*scalars, *texts] if pattern.fullmatch(k)), None)
            if found is None:
                return col.key
            self._matched[col.key] = found
            table_log.info("console: column %r shows %s (it matches %r)", col.header, printable(found), col.key)
        return self._matched[col.key]

    def _is_summary(self, key: str) -> bool:
        return any(_under(key, prefix) for prefix in self.summary)

    def _emit(self, line: str) -> None:
        self._emit_all((line,))

    def _emit_all(self, lines: Sequence[str]) -> None:
        # The run log first: a terminal that breaks (`| head`, a closed window) must not cost it any line.
        for line in lines:
            table_log.info(line)
        if self._pipe_error is not None:  # the pipe closed while the backend opened: said at the first write
            error, self._pipe_error = self._pipe_error, None
            raise error
        if self._pipe_closed:
            return
        try:
            for line in lines:
                try:
                    write_line(line, self.stream)
                except UnicodeEncodeError:  # a lone surrogate (os.fsdecode), or a character the encoding lacks
                    encoding = getattr(self.stream or sys.stdout, "encoding", None) or "utf-8"
                    write_line(line.encode(encoding, "backslashreplace").decode(encoding), self.stream)
        except BrokenPipeError:  # reported once (it raises); nothing more is written to that pipe
            self._pipe_closed = True
            raise

    def __repr__(self) -> str:
        shown = None if self.declared is None else [c.key for c in self.declared]
        return (
            f"ConsoleBackend(columns={shown!r}, header_every={self.header_every}, summary={self.summary!r})"
        )


def _check_strings(name: str, value: Any, example: str) -> List[str]:
    """A list of metric keys or prefixes; a lone string would be taken apart into its characters."""
    if isinstance(value, str):
        raise ConfigurationError(
            f"ConsoleBackend {name} must be a list of metric keys or prefixes, got the string {value!r}: its "
            f"characters would be the keys. Put it in a list: {name}=[{value!r}]."
        )
    try:
        items = list(value)
    except TypeError:
        items = None
    if items is None or not all(isinstance(k, str) and k for k in items):
        raise ConfigurationError(
            f"ConsoleBackend {name} must be a list of non-empty metric keys or prefixes (strings), got {value!r}; "
            f"e.g. {name}={example}."
        )
    return items


def _fmt(value: float) -> str:
    """A loose number format for panels and system lines (the table has its own, per column)."""
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


def _under(key: str, want: str) -> bool:
    return key == want or key.startswith(want if want.endswith("/") else want + "/")


def _media(record: StepRecord) -> str:
    names = [*record.images, *record.histograms, *record.texts, *record.videos, *record.samples]
    return f"; media: {', '.join(names)}" if names else ""
