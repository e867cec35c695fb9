"""The logger: stages values on the device; at commit hands one immutable record to its writer thread.

Observers and the training loop call ``log_*`` with Python numbers or device tensors. Nothing leaves the
device until `commit`, which runs once per logging step and does only three things on the calling thread:
validate, start the one batched device->host transfer (non-blocking into pinned memory on CUDA), and hand the
staged values over to the logger's writer thread (`instrument.logger.writer`). Rendering, conversion,
serialisation, file and network I/O and every backend call happen there, in step order.

Values a loop logs on non-logging steps are accumulated on the device (summed, no sync) and committed as their
mean over the interval at the next commit, so logging a loss every step is cheap and still honest; a call of
floats, or of one-element tensors of one dtype on one device, is staged whole (`instrument.logger.blocks`),
any other call key by key (`instrument.logger.table`). ``log_metrics(..., commit=True)`` writes values at
their own step instead (`instrument.logger.steps`); what each kind of number becomes is in
`instrument.logger.values`.

Media kinds (images, heatmaps, histograms, text, videos, samples) are one table (`instrument.logger.media`):
a cheap check on the caller, a conversion on the writer. A value that fails its conversion is dropped with
one message naming it; the rest of the step and every later step are written. A backend that raises is
reported once, counted in `failures`, and gets the next record again.

Thread safety: ``log_*``, `commit`, `flush` and `close` may be called from several threads; every accepted
value is committed exactly once, by the first commit that follows it. A step lower than one already
committed raises `StepOrderError` (``on_step_regression="raise"``, the default), or is dropped with a warning
(``"warn"``).

Under `torch.distributed` (see docs/distributed.md) only rank 0 opens backends and writes; at each commit the
scalars of every rank are reduced with one collective (`instrument.logger.reduce`) on the committing thread,
so `commit` is a collective: every rank commits at the same steps. Images, histograms, text, videos and
samples are rank 0's. Without a process group nothing changes.
"""

import dataclasses
import logging
import sys
import threading
from threading import get_ident
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from torch import Tensor

from instrument.backends.base import Backend, RunInfo, StepRecord, check_apart, check_backends, name_apart
from instrument.checks import check_int, check_number
from instrument.core.failures import BACKEND_CONSEQUENCE, BACKEND_CONSEQUENCES, FailureLedger
from instrument.errors import ConfigurationError
from instrument.logger import shutdown
from instrument.logger.assemble import build_record, describe
from instrument.logger.blocks import MAX_BLOCKS, Block, float_block, fold, tensor_block
from instrument.logger.lifecycle import LoggerEnd, check_timeout, closed_use, open_backends
from instrument.logger.media import CanvasSizes, check_media, heatmap_options, refuse_shared_tag, video_fps
from instrument.logger.params import redact_argv, redact_hyperparams
from instrument.logger.ranks import initialized, rank
from instrument.logger.reduce import CrossRankReducer, resolve_ops
from instrument.logger.steps import LAZY, MAX_STEP, StepRecords, check_commit_step, check_step
from instrument.logger.table import StagedTable
from instrument.logger.timer import Timer, named_timer
from instrument.logger.values import Wide, check_keys, merge_wide, rounded_message
from instrument.logger.writer import ON_FULL, CommittedStep, Writer

__all__ = ["Logger"]

log = logging.getLogger("instrument")

Value = Union[float, int, bool, Tensor, np.ndarray, np.number]
_STEP_POLICIES = ("raise", "warn")
_REENTRY_WAIT = 0.1  # seconds a commit on the writer thread waits for the commit lock (`Logger._gate`)


class Logger(StagedTable, StepRecords, LoggerEnd):
    """Stages values, commits them with one batched host transfer, writes them on one background thread.

    Args:
        backends: destinations; each is opened with ``run`` on the writer thread.
        run: where local outputs of the run go (``runs/<name>``).
        on_step_regression: ``"raise"`` (default) or ``"warn"`` when a step goes backwards.
        reducer: how scalars are reduced across ranks; None means a `CrossRankReducer` on the default group
            (a no-op without a process group). Backends are opened only on rank 0 of its group.
        queue_size: how many committed steps may wait for the writer at once.
        on_full: when that many wait: ``"block"`` (default: the committing thread waits, nothing is lost) or
            ``"drop"`` (the oldest waiting step is dropped, counted in `dropped`, warned about once).
        flush_secs: a written step is flushed to disk (`Backend.flush`) at most this many seconds later, also
            when training stalls.
        on_backend_error, open_timeout, secret_keys: as for `Instrumentation`.
    """

    def __init__(
        self,
        backends: Sequence[Backend] = (),
        run: Optional[RunInfo] = None,
        on_step_regression: str = "raise",
        reducer: Optional[CrossRankReducer] = None,
        queue_size: int = 64,
        on_full: str = "block",
        flush_secs: float = 2.0,
        on_backend_error: str = "raise",
        open_timeout: float = 60.0,
        secret_keys: Sequence[str] = (),
    ) -> None:
        if on_step_regression not in _STEP_POLICIES:
            raise ConfigurationError(
                f"on_step_regression must be one of {_STEP_POLICIES}, got {on_step_regression!r}."
            )
        if on_full not in ON_FULL:
            raise ConfigurationError(f"on_full must be one of {ON_FULL}, got {on_full!r}.")
        check_int("queue_size", queue_size, least=1, why="committed steps waiting for the writer",
                  fix="bind e.g. Instrumentation.queue_size = 64")
        check_number("flush_secs", flush_secs, above=0, noun="a number of seconds",
                     fix="bind e.g. Instrumentation.flush_secs = 2.0")
        backends = check_backends(backends)
        for index, backend in enumerate(backends):
            name_apart(backend, backends[:index])  # unique names: they key failures and run ids
        self.secret_keys = tuple(str(k) for k in secret_keys)
        self.run = run or RunInfo(name="run")
        if self.run.argv is None:  # the command line, redacted, for backends that record it (W&B)
            self.run = dataclasses.replace(self.run, argv=tuple(redact_argv(sys.argv, self.secret_keys)))
        self.on_step_regression = on_step_regression
        self.reducer = reducer if reducer is not None else CrossRankReducer()
        self.is_writer = rank(self.reducer.group) == 0  # only rank 0 opens backends and writes
        if self.is_writer:  # before any opens: two that share a file would write every record twice
            check_apart(backends, self.run)
        self.ledger = FailureLedger(
            "backend", BACKEND_CONSEQUENCE, consequences=BACKEND_CONSEQUENCES,
            catch=BaseException,  # on the writer thread: a backend's sys.exit or CancelledError costs it alone
        )
        self._lock = threading.RLock()  # staging and the swap of the staged table
        self._commit_lock = threading.RLock()  # commits hand over one at a time, in step order
        self._totals: Dict[str, Any] = {}  # scalar name -> sum over the interval (float or device tensor)
        self._blocks: List[Block] = []  # whole calls of floats or tensors (`instrument.logger.blocks`)
        self._names: Dict[str, Dict[Any, str]] = {}  # prefix -> key -> "prefix/key"
        self._counts: Dict[str, int] = {}  # only names logged more than once in the interval
        self._on_device: Dict[str, None] = {}  # names whose value is a device tensor (ordered set)
        self._ops: Dict[str, str] = {}  # only names whose reduce op is not "mean"
        self._weights: Dict[str, Any] = {}  # only weighted names: sum of weights
        self._media: Dict[Tuple[str, str], Tuple[Any, Any]] = {}  # (kind, tag) -> (staged value, extra)
        self._tags: Dict[Tuple[str, str], None] = {}  # (kind, tag) logged since the last commit, on every rank
        self._wide: Wide = {}  # flags of int64 values beyond 2**53, read on the writer (`values.note_beyond`)
        self._ranges: Dict[str, Tuple[float, float]] = {}  # heatmap tag -> running (lo, hi); writer thread only
        self._sizes = CanvasSizes()  # heatmap tag -> its largest canvas so far: its images keep one size
        self._noted: set = set()  # (image tag, note) said once by the writer (`media._convert_image`)
        self._timers: Dict[str, Timer] = {}
        self._timed: Dict[str, Timer] = {}  # the timers measured since their last take (`Timer._pending`)
        self._last_step: Optional[int] = None
        self._pending_step: Optional[int] = None
        self._checkpointed: Optional[int] = None  # a step a checkpoint counted before it committed (`keep_on_shutdown`)
        self._closed = False
        self._final = False  # close() is committing: its commit closes the logger under the staging lock
        self._closed_by = ""  # "close" (explicit: later calls raise) or "shutdown" (a signal or exit: warn once)
        self._warned_closed = False
        self._before_close: List[Any] = []  # callables run once before it closes (`LoggerEnd.before_close`)
        self._exit_status: Optional[str] = None
        self._value_failures: Dict[str, int] = {}
        self._warned: Dict[str, None] = {}  # keys (or "step <n>") already warned about once
        self._mark = 0  # the live `mark` (0: none)
        self._marks: List[int] = [0]  # the last mark's number, read by this logger's timers (`Timer.rewind`)
        self._snapshot: Any = None  # the staged table as it was at the mark; LAZY: not taken yet
        self.backends: List[Backend] = list(backends) if self.is_writer else []
        self._writer = Writer(
            self.backends, self._build, self.ledger, queue_size, on_full, float(flush_secs),
            name=f"instrument-writer-{self.run.name}",
        )
        self.open_timeout = open_timeout  # also bounds the close of a session whose start failed
        with shutdown.starting():  # SIGTERM while they open ends them "killed" (`shutdown.starting`)
            open_backends(self, on_backend_error, open_timeout)  # raises if one failed ("raise")
        shutdown.register(self)

    def add_backend(self, backend: Backend) -> bool:
        """Route later commits to ``backend`` too; it is opened with this run on the writer thread first.

        Returns True once queued; a failure to open is reported, counted, and removes it from `backends`
        (unless it `Backend.reopens`: then it stays and opens itself on a later record).
        """
        if not isinstance(backend, Backend):
            raise ConfigurationError(f"add_backend takes an instrument Backend, got {type(backend).__name__}.")
        if backend in self.backends:
            return True
        if not self.is_writer:
            return False
        name_apart(backend, self.backends)
        check_apart([*self.backends, backend], self.run)  # a ConfigurationError: it would share a file
        self.backends.append(backend)
        return self._writer.call("open", self.run, backend=backend) > 0

    # ------------------------------------------------------------------ staging
    def log_metrics(
        self,
        metrics: Mapping[str, Value],
        step: int,
        prefix: str = "",
        reduce: Union[str, Mapping[str, str]] = "mean",
        weights: Any = None,
        commit: bool = False,
    ) -> Optional[CommittedStep]:
        """Stage scalar metrics (numbers or one-element tensors) under ``prefix/key``.

        A metric logged several times before a commit is committed as its mean over the interval, at the step
        of that commit. ``commit=True`` writes these values now as a record of their own at ``step`` and leaves
        the rest staged (returns the `CommittedStep`; with a process group a collective, like `commit`). ``reduce``
        says how ranks combine it at commit: ``"mean"``, ``"sum"``, ``"min"``, ``"max"`` or ``"l2"`` (root of
        the sum of squares), for all keys or as a dict key -> op (unnamed keys: mean). ``weights`` (>= 0: a
        number, a one-element tensor, whose sign is not checked since reading it would sync, or a dict key ->
        weight) makes a mean weighted: sum(weight * value) / sum(weight) over the interval and over ranks."""
        if type(metrics) is not dict or "" in metrics:
            check_keys(metrics)
        plain = weights is None and type(reduce) is str and reduce == "mean"
        ops = None if plain else resolve_ops(list(metrics), reduce, weights)
        head = prefix.rstrip("/") + "/" if prefix else ""
        if commit:
            return self._commit_own(metrics, step, head, ops)
        block = wide = None
        if plain and metrics:  # the hottest path: the whole call as one block, no per-key work here
            metrics = dict(metrics)  # a copy: this is what is checked and staged, whatever the caller does next
            block = float_block(head, metrics)
            if block is None:
                wide = {}
                block = tensor_block(head, metrics, wide)
        with self._lock:
            if self._snapshot is LAZY:  # before the step moves: a discarded step takes its step number back too
                self._take_snapshot()
            last, pending = self._last_step, self._pending_step
            if type(step) is int and 0 <= step <= MAX_STEP and not self._closed and (last is None or step >= last):
                if pending is None or step > pending:  # the common case, as `_accept` would decide it
                    self._pending_step = step
            elif not self._accept(step):
                return None
            if not metrics:  # an empty call counts its step and folds no blocks
                return None
            blocks = self._blocks
            if block is not None and not self._totals and len(blocks) < MAX_BLOCKS:
                blocks.append(block)
                if wide:
                    merge_wide(self._wide, wide)
                return None
            if blocks:  # the per-key path from here on, so that it sees (and checks) what the blocks hold
                fold(blocks, self._totals, self._counts, self._on_device)
                self._blocks = []
            try:
                self._stage_keys(metrics, head, ops, plain)
            except BaseException:  # a refused call stages nothing, not even the step of the next commit()
                self._pending_step = pending
                raise
        return None

    def log_image(self, tag: str, image: Union[Tensor, np.ndarray], step: int) -> None:
        """Stage an image: [H,W], [C,H,W] or [H,W,C] (C in 1,3,4), floats in [0,1], uint8 or bool; other integer
        dtypes are refused (0..255 read as floats would be drawn white): convert them to uint8."""
        self._stage("image", tag, image, step, self._noted)  # what the writer notes once per tag

    def log_heatmap(self, tag: str, matrix: Union[Tensor, np.ndarray], step: int, x_label: str = "",
                    y_label: str = "", x_ticks: Optional[Sequence[str]] = None, color_range: Any = None) -> None:
        """Stage a 2-D matrix; on the writer thread it is drawn colour-mapped with axes and logged as an image.

        ``x_ticks`` names the columns. ``color_range`` fixes what colours mean across steps: ``(lo, hi)``, or
        ``"running"`` (the range of every matrix of this tag so far, tracked on the writer thread: no host
        sync); None scales each image to its own values. The colour bar has round intermediate ticks.
        """
        extra = (*heatmap_options(tag, x_label, y_label, x_ticks, color_range), self._ranges, self._sizes)
        self._stage("heatmap", tag, matrix, step, extra)

    def log_histogram(self, tag: str, values: Union[Tensor, np.ndarray, Sequence[float]], step: int) -> None:
        """Stage raw values for a histogram (any shape; flattened)."""
        self._stage("histogram", tag, values, step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Stage text (markdown where the backend renders it)."""
        self._stage("text", tag, text, step)

    def log_video(self, tag: str, frames: Union[Tensor, np.ndarray], step: int, fps: int = 30) -> None:
        """Stage a video: uint8, bool or [0,1] float frames shaped [T, H, W, C] (C in 1, 3, 4)."""
        self._stage("video", tag, frames, step, (video_fps(tag, fps), self._noted))

    def log_samples(
        self, tag: str, samples: Sequence[Mapping[str, Any]], step: int, score_key: str = "score"
    ) -> None:
        """Stage validation samples: dicts such as ``{"input": ..., "output": ..., "score": ..., **extra}``.

        The console prints a few as panels, best and worst by ``score_key`` mixed (``ConsoleBackend(
        num_val_samples_to_print=N)``); W&B gets them all as a table, TensorBoard as a markdown table, JSONL
        as a list. Tensor values (e.g. a score on the device) join the commit's one batched transfer.
        """
        self._stage("samples", tag, samples, step, score_key)

    def _stage(self, kind: str, tag: str, value: Any, step: int, extra: Any = None) -> None:
        """Check a media value on the caller (cheap: metadata only) and stage it; rank 0 only."""
        staged = check_media(kind, tag, value, extra)
        with self._lock:
            refuse_shared_tag(kind, tag, self._tags)  # before the step moves: a refused call stages nothing
            if self._snapshot is LAZY:  # before the step moves (see log_metrics)
                self._take_snapshot()
            if self._accept(step):
                self._tags[(kind, tag)] = None  # on every rank: a refusal must happen on all ranks alike
                if (kind, tag) in self._media:  # one value per tag and commit: the last wins
                    self._warn_once(f"{kind} {tag}", f"log_{kind}({tag!r}) was called again before the commit; "
                                    f"only the last value of a tag is written. Commit in between, or use one tag each.")
                if self.is_writer:  # other ranks validate the step but stage no media
                    self._media[(kind, tag)] = (staged, extra)

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        """Redact secret-looking keys (at any depth), flatten nested params, queue them for every backend."""
        if self._closed:
            closed_use(self, "log_hyperparams")
            return
        flat, text = redact_hyperparams(params, config_text, self.secret_keys)
        self._writer.call("log_hyperparams", flat, text)

    def timer(self, name: str, reduce: Optional[str] = None, cuda: Optional[bool] = None) -> Timer:
        """A named timer owned by this logger: ``with logger.timer("rollout"): ...`` or as a decorator.
        ``cuda``: CUDA events (True) or wall time (False); None decides at each span (`Timer`).

        Its durations are committed as ``record.timings[name]`` = ``{mean, min, max, count}`` (seconds;
        scalar-only backends write them as ``timing/<name>/<stat>``); across ranks each is reduced with
        ``reduce`` (default ``"max"``: the slowest rank sets the pace).
        """
        with self._lock:
            return named_timer(self._timers, name, reduce, self._timed, cuda, self._marks)

    def write_system(self, record: StepRecord) -> bool:
        """Side channel for the system monitor: its own step axis, never the training step's order check.

        ``record.step`` is milliseconds since the run first started. Safe to call from any thread; written on
        the writer thread between training records. False when the logger's writer is closed (not written).
        """
        return self._writer.call("write_system", record) > 0

    # ------------------------------------------------------------------ commit
    @property
    def has_pending(self) -> bool:
        return bool(self._totals or self._blocks or self._media
                    or (self._timed and any(t.count for t in self._timed.copy().values())))

    def commit(self, step: Optional[int] = None, paired: bool = True) -> Optional[CommittedStep]:
        """Hand everything staged over to the writer thread, with one batched host transfer started.

        Returns a `CommittedStep` (its ``step`` at once; reading ``scalars``, ``images``... waits for the writer to
        build the `StepRecord`), or None when nothing was staged. With a process group this is a collective: every
        rank calls it at the same steps, also ranks with nothing staged. Staged values are cleared whatever happens
        (a ``step`` refused as no int in range takes none). Without ``step`` the record goes to the highest step
        staged since the last commit, or to the last committed step where that is higher (values staged before a
        ``log_metrics(..., commit=True)`` record at a later step), so an implicit commit never goes backwards.
        Timer measurements carry no step: they go with the next record, and with ``step`` given they make one.
        Under a process group a ``step`` given is checked to be every rank's (one more value in the collective):
        ranks out of step raise `InstrumentError` on every rank instead of mixing their steps' values;
        ``paired=False`` leaves it unchecked, for loops whose ranks count their own steps (frames).
        """
        collective = initialized() and self.reducer.active()  # one attribute read without a group
        if get_ident() != self._writer.ident:  # the common case, decided inline (`_gate`)
            self._commit_lock.acquire()
        elif not self._gate(f"commit({step})"):
            return None  # what is staged stays staged, for the next commit
        try:
            with self._lock:
                if self._closed:
                    closed_use(self, f"commit({step})")
                    return None
                if self._final:  # close()'s commit: closed in the same hold of the lock as the swap, so a value
                    self._closed = True  # logged from now on is refused (`closed_use`), never staged and lost
                    self._closed_by = self._closed_by or "close"
                implicit = step is None
                if implicit:
                    step = self._pending_step
                elif not (type(step) is int and 0 <= step <= MAX_STEP):
                    check_commit_step(step)  # a bad argument commits nothing and keeps what is staged
                # Timer measurements alone carry no step: they wait for the next record that has one (and
                # those taken after the last logging step are not written at close, see docs/backends.md).
                if not collective and (step is None or not (self._blocks or self.has_pending)):
                    self._pending_step = None
                    return None
                last = self._last_step
                snapshot = self._snapshot  # the table as a session's step found it (`mark`), if one was taken
                if step is None:
                    step = last if last is not None else 0
                elif implicit and last is not None and step < last:
                    # Values staged before a later step was committed on its own (log_metrics(commit=True)): an
                    # implicit commit (close() included) writes them at that step rather than lose them.
                    step = last
                staged = self._swap()
                self._pending_step = None
                if not (type(step) is int and 0 <= step <= MAX_STEP and (last is None or step >= last)):
                    if not self._accept(step, pending=False):
                        return None
                    step = int(step)
                if step == last:
                    # timer names too: timings measured after the last commit, written by close() at that step
                    self._check_repeat(step, [*staged[0], *(b[0] + key for b in staged[7] for key in b[1]),
                                              *("timing/" + name for name in staged[6])])
                self._last_step = step
            return self._submit(step, staged, collective, last, snapshot, paired and not implicit)
        finally:
            self._commit_lock.release()

    def _gate(self, what: str, then: str = "nothing is committed by this call; what it staged goes with the next "
              "commit", timeout: Optional[float] = None) -> bool:
        """Take the commit lock. On the writer thread (a backend or a logging handler calling back into this
        logger) only for a bounded wait, since the thread holding it may be waiting for this one (for room
        in a full queue): False then, said once, and the caller commits nothing. Elsewhere within ``timeout`` (a
        bounded close: the holder may wait for room behind a backend that never returns), else False, said once."""
        if get_ident() != self._writer.ident:
            if timeout is None:
                self._commit_lock.acquire()
                return True
            if self._commit_lock.acquire(timeout=timeout):
                return True
            self._warn_once("gate timeout", f"{what} waited {timeout:g} s for another thread's commit (waiting for "
                            f"room in a full queue behind a backend that does not return), so {then}")
            return False
        if self._commit_lock.acquire(timeout=_REENTRY_WAIT):
            return True
        self._warn_once("reentrant commit", (
            f"{what} was called on the logger's own writer thread (from a backend or a logging handler) while "
            f"another thread was committing and waiting for that writer: waiting here would deadlock, so {then}. "
            f"Call it from the training thread instead"))
        return False

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every step handed over so far is written and flushed by every backend.

        Returns True, or False when ``timeout`` (seconds) passed first, the logger is closed, or a backend
        failed to write or flush something handed over since the previous flush that answered (one that timed
        out leaves them to the next; reported once and counted in `failures`, as always). Steps dropped under
        ``on_full="drop"`` are counted in `dropped` instead.
        """
        return self._writer.flush(check_timeout("flush", timeout))

    @property
    def failures(self) -> Dict[str, int]:
        """Backend name -> number of calls that raised; ``"<kind> <tag>"`` -> values dropped on the writer."""
        return {**self.ledger.counts(), **dict(self._value_failures)}  # a dict's copy is atomic: no lock needed

    @property
    def dropped(self) -> int:
        """Committed steps dropped because the queue was full (``on_full="drop"``)."""
        return self._writer.dropped

    # ------------------------------------------------------------------ internals
    def _accept(self, step: int, pending: bool = True) -> bool:
        """Validate ``step`` (under the lock); False when it goes backwards under the "warn" policy.

        `log_metrics` and `commit` decide the common case inline (an ``int`` >= 0, not below the last committed
        step, on an open logger) and call this for everything else: a change to these rules belongs there too.
        """
        if type(step) is not int:  # a wrong type is refused first, on a closed logger too
            check_step(step)
        if self._closed and not closed_use(self, f"a value at step {step}"):
            return False
        check_step(step)
        last = self._last_step
        if last is not None and step < last:
            self._step_regressed(int(step), last)
            return False
        if pending and (self._pending_step is None or step > self._pending_step):
            self._pending_step = int(step)
        return True

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned[key] = None
            log.warning("instrument: %s (Said once per key.)", message)

    def _swap(self) -> tuple:
        """Take the staged table and leave an empty one (under the lock)."""
        timers = {}
        for name in self._timed.copy():  # taken off before its take: a span ending now enters it again
            t = self._timed.pop(name)
            if t.count:
                timers[name] = (t.reduce, t.take())
        staged = (self._totals, self._counts, self._ops, self._weights, self._on_device, self._media, timers,
                  self._blocks, self._wide)
        self._totals, self._counts, self._ops, self._weights, self._on_device, self._media = {}, {}, {}, {}, {}, {}
        self._blocks, self._wide, self._tags = [], {}, {}
        if self._snapshot is not None:  # a live mark: all that is staged from now on is newer than it
            self._snapshot = LAZY
        return staged

    def _build(self, payload: tuple) -> StepRecord:
        """On the writer thread: the `StepRecord` of a handed-over step (`instrument.logger.assemble`)."""
        return build_record(payload, self._value_failed, self._rounded)

    def _rounded(self, name: str, value: Any) -> None:
        """On the writer thread: metric ``name`` was logged from an integer tensor beyond 2**53 (said once).

        No lock: a signal handler's close may hold the staging lock while it waits for this thread. Two threads
        warning about one key at once could both say it; a dict's operations themselves are atomic.
        """
        if name not in self._warned:
            self._warned[name] = None
            log.warning("instrument: %s (Said once per key.)", rounded_message(name, value))

    def _value_failed(self, kind: str, tag: str, step: int, value: Any, expected: str, exc: Exception) -> None:
        # No lock: on the writer, its only writer (a signal handler's close may wait for it; see `_rounded`).
        key = f"{kind} {tag}"
        count = self._value_failures.get(key, 0) + 1
        self._value_failures[key] = count
        if count == 1:
            log.error(
                "instrument: dropped %s %r at step %d: received %s, expected %s (%s: %s). The rest of the step "
                "and later steps are written; later failures of this value are counted in Logger.failures.",
                kind, tag, step, describe(value), expected, type(exc).__name__, exc,
            )
        else:
            log.debug("instrument: dropped %s %r again at step %d (%d times)", kind, tag, step, count)

