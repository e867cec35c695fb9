"""TensorBoard: the default backend; event files under ``runs/<run-name>``, no account needed."""

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Tuple

import numpy as np

from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.backends.crc32c import use_fast_checksums
from instrument.backends.drops import Drops, finite, load_keys, save_keys, utf8, utf8_keys
from instrument.backends.hparams import hyperparameter_table
from instrument.backends.png import encodable, encode_png
from instrument.backends.tb_tags import TagKinds
from instrument.backends.video import encode_gif, filmstrip, raise_failures, write_each
from instrument.errors import ConfigurationError
from instrument.terminal.samples import markdown_table

__all__ = ["TensorBoardBackend"]

_VIDEO_FORMATS = ("gif", "filmstrip")
SYSTEM_RUN = "system"  # the system samples' run directory, inside the training run's: TensorBoard lists it apart

log = logging.getLogger("instrument")


class TensorBoardBackend(Backend):
    """Writes scalars, images, histograms, text and videos with ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        log_dir: where the event files go; None means the run directory (``runs/<run-name>``) of each run the
            backend is given to.
            Training metrics use the training step as ``global_step``; system-monitor metrics (``system/...``)
            use milliseconds since the run first started (one step above the last for each sample, across the
            processes of a resumed run: TensorBoard's server hides a stored sample at or above a step that
            arrives after it), with the sample's wall time, and go to the sibling run ``<log_dir>/system``: a
            resumed run's purge marker hides the training steps after the checkpoint, in its own directory
            only, and would otherwise hide every sample stepped past it as well.
        flush_every_commit: flush after each committed step so ``tensorboard`` shows it at once (one small
            file write per logging step), and so a failed write is raised by the record that hit it.
        video_format: ``"gif"`` (default): each video is an animated GIF in the Images tab, with a step slider
            (the summary ``add_video`` writes, encoded with Pillow: no extra needed, the frame rate kept);
            ``"filmstrip"``: a PNG of the frames side by side, 8 per row (a still overview of each video).
            A video that cannot be written costs that video only: the rest of the step is written first, then
            the failure is raised (and reported once, counted in ``Logger.failures``). Any other value that
            cannot be converted costs that value only, with one warning per key (`instrument.backends.drops`):
            a histogram is binned from its finite values, one with none is dropped; a text with a lone
            surrogate is written with it escaped.
        writer: a ``SummaryWriter`` you already have: instrument writes into it (its ``log_dir``) and flushes
            it, but never closes or replaces it; you do, after `Instrumentation.close`. A resumed run writes
            its purge marker through it. Not together with ``log_dir``.
            It is written from the logger's writer thread (``SummaryWriter`` queues events under its own lock,
            so your own ``add_scalar`` calls may go on). Its records are checksummed with NumPy from then on,
            yours too: the same bytes, without TensorBoard's per-byte Python loop (`instrument.backends.crc32c`).

    Checksums: every record of an event file carries a CRC-32C, which TensorBoard (without TensorFlow) computes
    in a Python loop over the bytes, holding the GIL for about 11 ms per logging step of the bench's NCA (its
    heatmap PNGs). This backend's writers compute it with NumPy instead (`instrument.backends.crc32c`; same
    bytes, about 40 times faster), so TensorBoard's writer thread no longer holds the GIL for them.

    Faults: TensorBoard's own writer thread stops for good at its first I/O error (a full disk, a directory
    that went away or became unwritable) and re-raises that error on every later call. This backend raises
    it once, drops the dead writer, and on the next record opens a new event file in the same directory; if
    that fails too, the record raises again and the one after tries again. TensorBoard reads every event file
    of a directory, so the steps before and after the fault show as one run; the records that raised are lost.
    """

    def __init__(
        self,
        log_dir: Optional[str] = None,
        flush_every_commit: bool = True,
        video_format: Literal["gif", "filmstrip"] = "gif",
        writer: Any = None,
    ) -> None:
        if video_format not in _VIDEO_FORMATS:
            raise ConfigurationError(
                f"TensorBoardBackend.video_format must be one of {_VIDEO_FORMATS}, got {video_format!r}."
            )
        self.video_format = video_format
        if writer is not None:
            if log_dir is not None:
                raise ConfigurationError(
                    f"TensorBoardBackend got both log_dir={log_dir!r} and a writer; the writer's own log_dir is "
                    f"used, so pass only one of them."
                )
            missing = [m for m in ("add_scalar", "add_text", "flush", "get_logdir") if not hasattr(writer, m)]
            if missing:
                raise ConfigurationError(
                    f"TensorBoardBackend(writer=...) takes a torch.utils.tensorboard.SummaryWriter, got "
                    f"{type(writer).__name__} (it has no {', '.join(missing)})."
                )
            log_dir = str(writer.get_logdir())
        self.log_dir = log_dir
        self._given = log_dir  # None: each run's own folder, also when the backend is given to a later run
        self.flush_every_commit = flush_every_commit
        self._external = writer  # the user's: flushed, never closed
        self._writer = None
        self._system = None  # the system samples' own writer, in `SYSTEM_RUN` (opened at the first sample)
        self.reopened = 0  # new event files opened after a fault
        self._drops = Drops(self.name)
        self._keys_saved = 0  # the version of the escaped keys' names saved (`save_keys`)
        self._bin_edges: Optional[np.ndarray] = None
        self._tags = TagKinds()  # the tag of each value: one kind of value per tag (`instrument.backends.tb_tags`)

    def writes_to(self, run: RunInfo) -> Tuple[str, ...]:
        """The event files' folder: two writers there write every step twice (TensorBoard reads both files). And
        its `SYSTEM_RUN` subfolder, the system samples' run: another backend's steps there were shown as that run's
        (a second TensorBoardBackend), or a file of that name (JSONL) made every system sample fail."""
        folder = Path(self._given) if self._given else run.dir
        return (os.path.realpath(folder), os.path.realpath(folder / SYSTEM_RUN))

    def open(self, run: RunInfo) -> None:
        if self._external is not None:
            self._writer = self._external
            use_fast_checksums(self._external)
        else:
            # The folder given, or this run's: an instance given to run after run wrote every run into the first's
            # folder (TensorBoard showed them as one run). What it learned of a run's tags starts afresh too.
            path = Path(self._given) if self._given else run.dir
            self.log_dir = str(path)
            self._tags, self._drops = TagKinds(), Drops(self.name)
            self._writer = self._new_writer()
        self._keys_saved = self._drops.version
        # a resume: each key's series goes on under its name, each tag holds its kind of value (open(None) with a
        # log_dir of its own, as torch's own tools use it, has no run to resume)
        if run is not None and run.resume is not None:
            load_keys(self._drops, self.log_dir)
            self._tags.load(self.log_dir)

    def _new_writer(self, purge_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=self.log_dir, purge_step=purge_step)
        use_fast_checksums(writer)
        return writer

    def on_resume(self, next_step: int) -> None:
        """A new event file in the same directory that starts with TensorBoard's purge marker: TensorBoard hides
        every event at ``next_step`` or later from the earlier files, so steps written again replace them.

        The marker is a ``SessionLog.START`` at ``next_step``, written twice: TensorBoard's server takes the
        first START of a run for the run's own start and purges only from the second on, and the first run's
        files hold none (a single marker there left every re-run step shown twice)."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        start = Event(step=next_step, session_log=SessionLog(status=SessionLog.START))
        if self._external is not None:  # the user's writer: never closed or replaced, so both markers go into it
            self._writer = self._external
            file_writer = self._external._get_file_writer()
            file_writer.add_event(start)
            file_writer.add_event(start)
            self._external.flush()
            return
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        _sort_after_earlier_files(self.log_dir)
        self._writer = self._new_writer(purge_step=next_step)
        self._writer._get_file_writer().add_event(start)

    def _guarded(self, fn: Callable[[Any], None]) -> None:
        """Run ``fn(writer)``; after a fault, drop a writer that can no longer write and re-raise."""
        if self._writer is None:
            self._writer = self._new_writer()  # raises while the directory is still unusable
            self.reopened += 1
            log.warning("instrument: TensorBoardBackend opened a new event file in %s after a write failed",
                        self.log_dir)
        writer = self._writer
        try:
            fn(writer)
        except Exception:
            if not _alive(writer):
                self._writer = None
                if writer is not self._external:  # the user's dead writer is theirs to close
                    _close_quietly(writer)
            raise

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        """A markdown table (``hyperparameters``), the operative config verbatim (``config/operative``) and
        the HParams plugin's session-start data, so runs can be compared in TensorBoard's HParams tab."""

        def log_params(w) -> None:
            # Names escaped as metric keys are (an os.fsdecode-d file name), so protobuf takes them.
            named = utf8_keys(self._drops, "hyperparameter", dict(params))
            self._keys_saved = save_keys(self._drops, self.log_dir, self._keys_saved)
            table = utf8(self._drops, "text", "hyperparameters", hyperparameter_table(named))
            w.add_text("hyperparameters", table, 0)
            values = {k: utf8(self._drops, "hyperparameter", k, v) if isinstance(v, str) else v
                      for k, v in named.items()}
            w._get_file_writer().add_summary(hparams_summary(values, Path(self.log_dir).name), 0)
            w.flush()

        def log_config(w) -> None:
            # Four leading spaces make TensorBoard's markdown show the config verbatim.
            text = "\n".join("    " + line for line in config_text.splitlines())
            w.add_text("config/operative", utf8(self._drops, "text", "config/operative", text), 0)
            w.flush()

        # Each part on its own: one that fails costs neither the other nor the rest of the run.
        failed: Optional[BaseException] = None
        for part, wanted in ((log_params, bool(params)), (log_config, bool(config_text))):
            if not wanted:
                continue
            try:
                self._guarded(part)
            except Exception as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def write(self, record: StepRecord) -> None:
        try:
            self._guarded(lambda w: self._write(w, record))
        finally:  # the names escaped keys took and each tag's kind, for a resumed run (`save_keys`, `TagKinds.save`)
            self._keys_saved = save_keys(self._drops, self.log_dir, self._keys_saved)
            self._tags.save(self.log_dir, self._drops)

    def _write(self, w, record: StepRecord) -> None:
        """Each image, histogram, text and samples table is converted to its summary on its own, so one that
        cannot be converted is dropped (`instrument.backends.drops`) and the rest of the step is written."""
        from torch.utils.tensorboard import summary as tb

        step, t, drops = record.step, record.wall_time, self._drops
        scalars = self._tags.scalars(utf8_keys(drops, "scalar", record.flat_scalars()))  # os.fsdecode names escaped
        _add_scalars(w, scalars, step, t, drops)
        images = ((self._tags.media("image", k, scalars), v)
                  for k, v in utf8_keys(drops, "image", record.images).items() if v is not None)
        histograms = ((self._tags.media("histogram", k, scalars), v)
                      for k, v in utf8_keys(drops, "histogram", record.histograms).items() if v.size)
        texts = ((self._tags.text("text", k, scalars), v) for k, v in utf8_keys(drops, "text", record.texts).items())
        bins = self._bins(w)
        summaries = [
            *drops.each("image", images, _image, "an HWC image").values(),
            *drops.each("histogram", histograms, lambda k, v: _histogram(drops, k, v, bins),
                        "real numbers, at least one finite").values(),
            *drops.each("text", texts, lambda k, v: tb.text(k, utf8(drops, "text", k, v)), "a str").values(),
        ]
        file_writer = w._get_file_writer()
        for summary in summaries:
            file_writer.add_summary(summary, step, t)
        videos = {self._tags.media("video", k, scalars): v for k, v in utf8_keys(drops, "video", record.videos).items()}
        failed = write_each(videos,
                            lambda key, frames, fps: self._write_video(w, key, frames, fps, step, t))
        tables = ((self._tags.text("table", k, scalars), v)
                  for k, v in utf8_keys(drops, "samples table", record.samples).items())
        tables = drops.each("samples table", tables,
                            lambda k, v: tb.text(k, utf8(drops, "samples table", k, markdown_table(v.rows))),
                            "rows of strings and numbers")
        for summary in tables.values():
            file_writer.add_summary(summary, step, t)
        if self.flush_every_commit:
            w.flush()
        raise_failures(self.name, step, failed)

    def _bins(self, w) -> Any:
        """TensorBoard's own bucket limits (``SummaryWriter.default_bins``, +-1e-12 to +-1e20, 10% apart) with
        one more bucket on each side reaching the largest float: TensorBoard leaves values beyond +-1e20 out
        of every bucket, and a histogram of only such values is "empty" to it. An array, made once: handed a list,
        ``np.histogram`` converts and checks its 1,551 edges at every call (about 330 instead of 130 us for the
        bench's 32 values on a 2-core CPU machine, holding the GIL)."""
        if self._bin_edges is None:
            big = float(np.finfo(np.float64).max)
            edges = np.array([-big, *getattr(w, "default_bins", []), big], dtype=np.float64)
            edges.flags.writeable = False
            self._bin_edges = edges
        return self._bin_edges

    def _write_video(self, w, key: str, frames, fps: int, step: int, t: float) -> None:
        if self.video_format == "filmstrip":
            w.add_image(key, filmstrip(frames), step, walltime=t, dataformats="HWC")
            return
        # What add_video writes (an image summary holding a GIF), encoded with Pillow: add_video needs moviepy,
        # whose GIFs lose the frame rate (instrument.backends.video).
        from tensorboard.compat.proto.summary_pb2 import Summary

        _, h, w_, c = frames.shape
        image = Summary.Image(height=h, width=w_, colorspace=c, encoded_image_string=encode_gif(frames, fps))
        w._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=key, image=image)]), step, t)

    def write_system(self, record: StepRecord) -> None:
        """Into the sibling run `SYSTEM_RUN`, through a writer of its own (opened again after a fault, like the
        training writer): never into the training run, whose purge marker on resume covers every tag."""
        from torch.utils.tensorboard import SummaryWriter

        if self._system is None:
            self._system = SummaryWriter(log_dir=str(Path(self.log_dir or ".") / SYSTEM_RUN))
            use_fast_checksums(self._system)
        writer = self._system
        try:
            scalars = utf8_keys(self._drops, "system scalar", record.scalars)
            self._keys_saved = save_keys(self._drops, self.log_dir, self._keys_saved)
            _add_scalars(writer, scalars, record.step, record.wall_time, self._drops)
            if self.flush_every_commit:
                writer.flush()
        except Exception:
            if not _alive(writer):
                self._system = None
                _close_quietly(writer)
            raise

    def flush(self) -> None:
        """Write what is queued to the event files; raises (and drops the writer) if that fails."""
        if self._writer is not None:
            self._guarded(lambda w: w.flush())
        if self._system is not None:
            writer = self._system
            try:
                writer.flush()
            except Exception:
                self._system = None
                _close_quietly(writer)
                raise

    def close(self) -> None:
        """Flush and close the event files; a writer passed in as ``writer=`` is flushed and left open."""
        writer, self._writer = self._writer, None
        system, self._system = self._system, None
        try:
            if writer is not None and writer is self._external:
                writer.flush()
            elif writer is not None:
                _flush_and_close(writer)
        finally:
            if system is not None:
                _flush_and_close(system)

    def __repr__(self) -> str:
        return f"TensorBoardBackend(log_dir={self.log_dir!r})"


def _image(key: str, image: Any) -> Any:
    """The image summary of ``image``: a uint8 RGB or RGBA image (what the logger hands over) encoded by
    `instrument.backends.png`, anything else by ``torch.utils.tensorboard``'s ``summary.image``."""
    if encodable(image):
        from tensorboard.compat.proto.summary_pb2 import Summary

        height, width, channels = image.shape
        encoded = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=encode_png(image))
        return Summary(value=[Summary.Value(tag=key, image=encoded)])
    from torch.utils.tensorboard import summary as tb

    return tb.image(key, image, dataformats="HWC")


def _histogram(drops: Drops, key: str, values: Any, bins: np.ndarray) -> Any:
    """The histogram summary of the finite values (NaN and inf left out, with one warning per key: they
    cannot be binned); none finite raises `DroppedValue`. Sums past the float range are written as inf."""
    from torch.utils.tensorboard.summary import histogram

    values = finite(drops, "histogram", key, values)
    with np.errstate(over="ignore", invalid="ignore"):
        return histogram(key, values, bins)


def _alive(writer) -> bool:
    """Whether a SummaryWriter still writes: a dead one re-raises its writer thread's error from ``flush``."""
    try:
        writer.flush()
        return True
    except Exception:
        return False


def _flush_and_close(writer) -> None:
    try:
        writer.flush()  # SummaryWriter.close drops a write error of its thread; flush raises it
    except Exception:
        _close_quietly(writer)
        raise
    writer.close()


def _close_quietly(writer) -> None:
    try:
        writer.close()
    except Exception:  # it already failed, and that failure was raised; closing it only releases its thread
        # A dead writer's close re-raises before it joins TensorBoard's writer thread, which may still be
        # reporting its error; wait for it so the fault is over (and reported) before the next record.
        thread = _event_thread(writer)
        if thread is not None:
            thread.join(timeout=5.0)


def _event_thread(writer) -> Any:
    """TensorBoard's own writer thread behind a SummaryWriter (private attributes: None if they moved)."""
    file_writer = getattr(writer, "file_writer", None)
    async_writer = getattr(getattr(file_writer, "event_writer", None), "_async_writer", None)
    return getattr(async_writer, "_worker", None)


def _sort_after_earlier_files(log_dir: str) -> None:
    """TensorBoard reads a run's event files in name order, ``events.out.tfevents.<seconds>.<host>.<pid>.<n>``: a
    resumed file named within the same second as the crashed process's, with a pid that sorts lower ("123" before
    "99"), was read first, so its purge marker hid nothing and every re-run step showed twice. Wait (on the writer
    thread, up to three seconds) until a file made now sorts after every other process's file."""
    own = f".{socket.gethostname()}.{os.getpid()}."
    others = [p.name for p in Path(log_dir).glob("events.out.tfevents.*") if own not in p.name]
    if not others:
        return
    for _ in range(3):
        now = time.time()
        if f"events.out.tfevents.{int(now):010d}{own}" > max(others):
            return
        time.sleep(int(now) + 1 - now + 0.01)


def hparams_summary(params: Mapping[str, Any], trial: str) -> Any:
    """The HParams plugin's session-start summary: every (flat, redacted) hyperparameter as an hparam.

    Only the session-start info is written, no experiment summary: TensorBoard expects at most one of those
    in a whole log directory, and without one its HParams tab builds the experiment from every run's
    session-start info and takes each run's scalar tags as its metrics, which is what lets runs be compared.
    """
    from tensorboard.plugins.hparams import summary_v2

    values = {k: _hparam(v) for k, v in params.items()}
    return summary_v2.hparams_pb(values, trial_id=trial, start_time_secs=time.time())


def _hparam(value: Any) -> Any:
    """An hparam value as the plugin keeps it: numbers as doubles, so an int beyond 2**53 (a seed, a hash)
    is kept as its digits instead of rounded (2**64 + 1 read 1.8446744073709552e+19), as the other backends
    keep it."""
    if isinstance(value, bool) or isinstance(value, (float, str)):
        return value
    if isinstance(value, int):
        return value if -(2**53) <= value <= 2**53 else str(value)
    return str(value)


def _add_scalars(w, scalars: Mapping[str, float], step: int, t: float, drops: Drops) -> None:
    """All of a step's scalars as one event (one ``Summary`` with a value per key), as TensorBoard's own
    summary writers can: ``add_scalar`` builds and queues one event per key (about 27 us each, on the writer
    thread, under the GIL), while one event with 100 values costs about a tenth of that. TensorBoard reads
    each value as its own scalar series, exactly as if logged one by one.

    The values are added in place to the event's own summary rather than built as messages of their own:
    protobuf's C implementation (upb) gives every top-level message an arena and calls glibc's
    ``malloc_trim(0)`` after every 10,000 arena frees, which hands all the process's free heap memory back to
    the kernel, so the training thread's next steps fault their working memory in again (about 18,700 page
    faults, +40 ms, on the bench's compiled NCA step with a probe). One message per step instead of one per
    value makes that about 15 times rarer (3 trims in 4,000 steps of 100 scalars instead of 22 in 2,000), and
    the step costs this thread about 330 us instead of 470 us."""
    if not scalars:
        return
    from tensorboard.compat.proto.event_pb2 import Event

    event = Event()
    add = event.summary.value.add
    for key, value in scalars.items():
        add(tag=key, simple_value=float(value))
    w._get_file_writer().add_event(event, step, t)
    _say_beyond_float32(drops, scalars)


_F32_INF = 3.4028235677973366e38  # 2**128 * (1 - 2**-25): float32 rounds this and beyond to inf
_F32_ZERO = 2.0**-150  # half the smallest float32 subnormal: this and below round to 0


def _say_beyond_float32(drops: Drops, scalars: Mapping[str, float]) -> None:
    """TensorBoard keeps a scalar as float32: a finite value beyond its range reads inf there, a nonzero one
    below its smallest subnormal reads 0. Said once per key (JSONL, W&B and MLflow keep such values); the
    usual step costs one pass over the values and two C-level ones (about 5 us for 100, on the writer thread)."""
    magnitudes = [abs(float(v)) for v in scalars.values()]
    if max(magnitudes) < _F32_INF and min(filter(None, magnitudes), default=1.0) > _F32_ZERO:
        return  # (inf and NaN go on to the loop, which says nothing of them: they are stored as they are)
    for (key, value), size in zip(scalars.items(), magnitudes, strict=True):
        if _F32_INF <= size < float("inf") or 0 < size <= _F32_ZERO:
            drops.say(key, "float32", logging.WARNING,
                      "instrument: TensorBoard stores scalars as float32: %r = %r reads %s there (JSONL, W&B and "
                      "MLflow keep it); said once per key", key, float(value),
                      ("inf" if value > 0 else "-inf") if size > 1 else "0")
