"""Run logs: terse lines on the terminal, everything with timestamps in a file next to the run's outputs.

One call sets both up for the ``instrument`` logger (and any loggers you name)::

    from instrument.terminal.runlog import setup_run_logging
    run_log = setup_run_logging("runs/nca-01", "nca-01")    # or Instrumentation(run_log=True)
    ...
    run_log.close()                                         # or use it as a context manager

- Terminal: ``W instrument: backend X failed ...`` -- one level mark (D, I, W, E, C) and the message; an
  exception adds only its last line. Written through ``tqdm.write`` when a progress bar is active.
- File: ``runs/nca-01/20250101-120000-nca-01.log`` at DEBUG, with timestamps, levels, logger names and full
  tracebacks. `ConsoleBackend`'s table rows (logger ``instrument.console``) go there too, and at DEBUG every
  scalar of every step, so the file keeps what the terminal leaves out.

Your own logging configuration is left alone: no ``basicConfig``, no change to the root logger. The handlers
are added to the named loggers only and removed by `RunLog.close`, which also restores every level and
``propagate`` flag it changed. While run logging is on, ``instrument`` does not propagate to the root logger
(``propagate=False``), so its messages do not print twice when you have root handlers of your own.
"""

import contextlib
import logging
import re
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence, TextIO, Tuple, Union

from instrument.errors import ConfigurationError
from instrument.terminal.output import write_line

__all__ = ["setup_run_logging", "RunLog", "TerseFormatter", "TerminalHandler", "FILE_FORMAT"]

FILE_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-8s %(name)s: %(message)s"
FILE_DATEFMT = "%Y-%m-%d %H:%M:%S"
_MARKS = {
    logging.DEBUG: "D",
    logging.INFO: "I",
    logging.WARNING: "W",
    logging.ERROR: "E",
    logging.CRITICAL: "C",
}

# Open run logs, oldest first. One takes instrument's messages at a time (the last): the handlers never pile up, and
# when it is closed the one before it takes them again. Messages carry no session, so two files cannot split them.
_open: List["RunLog"] = []


class TerseFormatter(logging.Formatter):
    """``<mark> <message>``: one character for the level; of an exception, only its last line."""

    def format(self, record: logging.LogRecord) -> str:
        mark = _MARKS.get(record.levelno) or (record.levelname[:1] or "?")
        text = f"{mark} {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            text += f" [{type(exc).__name__}: {exc}; traceback in the run log]"
        return text


class _FileFormatter(logging.Formatter):
    """`FILE_FORMAT`, without printing the logger name twice for messages that already start with it."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        return text.replace(f" {record.name}: {record.name}: ", f" {record.name}: ", 1)


class TerminalHandler(logging.Handler):
    """Writes formatted records with `write_line` (so above any tqdm bar) to ``stream`` or ``sys.stderr``."""

    def __init__(self, stream: Optional[TextIO] = None, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.stream = stream
        self.setFormatter(TerseFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_line(self.format(record), self.stream if self.stream is not None else sys.stderr)
        except Exception:
            self.handleError(record)


class _RunLogFile(logging.FileHandler):
    """The run log's file. A write that fails (a full disk, a quota) is said once on the terminal and
    turns the file off, instead of logging's own traceback for every later record; a failing close is
    swallowed: losing the run log must never end the run or its close."""

    broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.broken:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):  # not the file's fault (a record that cannot be formatted)
            super().handleError(record)
            return
        if self.broken:
            return
        self.broken = True
        with contextlib.suppress(Exception):
            write_line(f"W instrument: the run log {self.baseFilename} cannot be written ({error!r}); it is "
                       f"turned off for the rest of the run, and the terminal and the backends go on", sys.stderr)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the flush of what was buffered failed: nothing more can be done for that file
            self.broken = True


class RunLog:
    """What `setup_run_logging` returns: the file ``path`` and ``close()`` (idempotent, also on exit)."""

    def __init__(self, path: Path, terminal: Optional[TerminalHandler], file: logging.FileHandler) -> None:
        self.path = path
        self.terminal = terminal
        self.file = file
        self._restore: List[Tuple[logging.Logger, int, bool, List[logging.Handler]]] = []
        self._attached: List[Tuple[logging.Logger, List[logging.Handler], Optional[bool]]] = []
        self.closed = False

    def _attach(
        self, logger: logging.Logger, handlers: List[logging.Handler], propagate: Optional[bool]
    ) -> None:
        self._attached.append((logger, handlers, propagate))
        self._restore.append((logger, logger.level, logger.propagate, handlers))
        for handler in handlers:
            logger.addHandler(handler)
        if logger.level == logging.NOTSET or logger.level > logging.DEBUG:
            logger.setLevel(
                logging.DEBUG
            )  # the file wants DEBUG; the terminal handler filters by its own level
        if propagate is not None:
            logger.propagate = propagate

    def _detach(self) -> None:
        """Remove the handlers, restore levels and ``propagate``."""
        restore, self._restore = self._restore, []
        for logger, level, propagate, handlers in reversed(restore):
            for handler in handlers:
                logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate

    def close(self) -> None:
        """Remove the handlers, restore levels and ``propagate``, close the file; the run log opened before this
        one, if still open, takes the messages again."""
        if self.closed:
            return
        self.closed = True
        taking = bool(_open) and _open[-1] is self
        with contextlib.suppress(ValueError):
            _open.remove(self)
        try:
            self._detach()
            self.file.close()
        finally:
            if taking and _open:
                _open[-1]._resume(self.path)

    def _resume(self, closed: Path) -> None:
        attached, self._attached = self._attached, []
        for logger, handlers, propagate in attached:
            self._attach(logger, handlers, propagate)
        logging.getLogger("instrument").info(
            "instrument: run log %s was closed; this run log takes instrument's messages again", closed)

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RunLog(path={str(self.path)!r}, closed={self.closed})"


def setup_run_logging(
    run_dir: Union[str, Path],
    run_name: str,
    level: Union[int, str] = "INFO",
    loggers: Sequence[str] = (),
    terminal: bool = True,
    stream: Optional[TextIO] = None,
    propagate: bool = False,
) -> RunLog:
    """Log ``instrument`` (and ``loggers``) tersely to the terminal and verbosely to a file in ``run_dir``.

    Args:
        run_dir: the run's output folder (created if needed); the file is ``<start time>-<run_name>.log``
            (just ``<start time>.log`` when the run is named by its start time, the default).
        run_name: the run's name, part of the file name.
        level: the terminal's level (the file always gets DEBUG).
        loggers: more logger names (yours, e.g. ``"myproject"``) to send to the same two places. Their
            ``propagate`` is left as you set it.
        terminal: False writes the file only (e.g. when something else already prints to the terminal).
        stream: the terminal stream; None means ``sys.stderr`` at each write.
        propagate: whether ``instrument`` keeps propagating to the root logger meanwhile (default False, so
            nothing prints twice).

    One run log takes the messages at a time: calling it again while a run log is open (a second session with
    ``run_log=True``) hands them to the new one until it is closed, then to the earlier one again, and both files
    say so (instrument's messages name no session, so they cannot be split between two files). Handlers never
    pile up: the earlier one's are taken off meanwhile. Close each run log (or use it as a context manager).
    """
    if isinstance(level, str):
        resolved = logging.getLevelName(level.upper())
        if not isinstance(resolved, int):
            raise ConfigurationError(
                f"setup_run_logging level must be a logging level such as 'INFO' or logging.DEBUG, "
                f"got {level!r}."
            )
        level = resolved
    if not run_name or not isinstance(run_name, str):
        raise ConfigurationError(f"setup_run_logging needs a non-empty run_name string, got {run_name!r}.")
    loggers = list(loggers)  # read twice below: an iterator would be empty the second time
    for name in loggers:  # before anything is made or the open run log is taken off: a refusal changes nothing
        if name == "instrument" or name.startswith("instrument."):
            raise ConfigurationError(f"loggers names your own loggers; {name!r} is covered already.")
    folder = Path(run_dir)
    started = time.strftime("%Y%m%d-%H%M%S")
    # A run named by its start time (the default, `YYYYmmdd-HHMMSS-xxxxxx`) would otherwise get it twice.
    stem = _safe(run_name) if re.match(r"\d{8}-\d{6}(-|$)", run_name) else f"{started}-{_safe(run_name)}"
    stem = stem[:200]  # room for "-N.log" within a file name's 255 bytes (the run's folder has the whole name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = _unique(folder, stem)
        file_handler = _RunLogFile(path, encoding="utf-8", errors="backslashreplace", delay=False)  # lone surrogates
    except OSError as exc:
        raise ConfigurationError(
            f"the run log cannot be written in {str(folder)!r} ({type(exc).__name__}: {exc}); check that log_dir "
            f"is a folder you can write to, or pass run_log=False."
        ) from exc
    file_handler.setLevel(logging.DEBUG)
    file_handler.setFormatter(_FileFormatter(FILE_FORMAT, FILE_DATEFMT))
    term = TerminalHandler(stream, level) if terminal else None
    run_log = RunLog(path, term, file_handler)
    earlier = _open[-1] if _open else None
    if earlier is not None:
        logging.getLogger("instrument").info(
            "instrument: run log %s was started while this one is open; it takes instrument's messages until it "
            "is closed, then this run log takes them again", path)
        earlier._detach()
    both: List[logging.Handler] = [h for h in (term, file_handler) if h is not None]
    run_log._attach(logging.getLogger("instrument"), both, propagate)
    run_log._attach(logging.getLogger("instrument.console"), [file_handler], None)  # it prints rows itself
    for name in loggers:
        run_log._attach(logging.getLogger(name), both, None)
    _open.append(run_log)
    logging.getLogger("instrument").debug(
        "instrument: run log %s started (terminal level %s)", path, logging.getLevelName(level)
    )
    if earlier is not None:
        logging.getLogger("instrument").warning(
            "instrument: this run log takes instrument's messages while the run log %s stays open, from every "
            "session in this process, until it is closed; then that one takes them again", earlier.path)
    return run_log


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"


def _unique(folder: Path, stem: str) -> Path:
    path = folder / f"{stem}.log"
    n = 2
    while path.exists():
        path = folder / f"{stem}-{n}.log"
        n += 1
    return path
