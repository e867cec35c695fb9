"""TensorBoard: the default backend; event files under ``runs/<run-name>``, no account needed."""

import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.terminal.samples import markdown_table

__all__ = ["TensorBoardBackend"]

log = logging.getLogger("instrument")


class TensorBoardBackend(Backend):
    """Writes scalars, images, histograms, text and video with ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        log_dir: where the event files go; None means the run directory (``runs/<run-name>``).
            Training metrics use the training step as ``global_step``; system-monitor metrics (``system/...``)
            use whole seconds since the monitor started, with the sample's wall time.
        flush_every_commit: flush after each committed step so ``tensorboard`` shows it at once (one small
            file write per logging step), and so a failed write is raised by the record that hit it.

    Faults: TensorBoard's own writer thread stops for good at its first I/O error (a full disk, a directory
    that went away or became unwritable) and re-raises that error on every later call. This backend raises
    it once, drops the dead writer, and on the next record opens a new event file in the same directory; if
    that fails too, the record raises again and the one after tries again. TensorBoard reads every event file
    of a directory, so the steps before and after the fault show as one run; the records that raised are lost.
    """

    def __init__(self, log_dir: Optional[str] = None, flush_every_commit: bool = True) -> None:
        self.log_dir = log_dir
        self.flush_every_commit = flush_every_commit
        self._writer = None
        self.reopened = 0  # new event files opened after a fault

    def open(self, run: RunInfo) -> None:
        path = Path(self.log_dir) if self.log_dir else run.dir
        self.log_dir = str(path)
        self._writer = self._new_writer()

    def _new_writer(self, purge_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=self.log_dir, purge_step=purge_step)

    def on_resume(self, next_step: int) -> None:
        """A new event file in the same directory that starts with TensorBoard's purge marker: TensorBoard hides
        every event at ``next_step`` or later from the earlier files, so steps written again replace them."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        self._writer = self._new_writer(purge_step=next_step)

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
                _close_quietly(writer)
            raise

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        def log(w) -> None:
            if params:
                rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
                w.add_text("hyperparameters", "| parameter | value |\n|---|---|\n" + rows, 0)
            if config_text:
                # Four leading spaces make TensorBoard's markdown show the config verbatim.
                w.add_text("config/operative", "\n".join("    " + line for line in config_text.splitlines()), 0)
            w.flush()

        self._guarded(log)

    def write(self, record: StepRecord) -> None:
        self._guarded(lambda w: self._write(w, record))

    def _write(self, w, record: StepRecord) -> None:
        step, t = record.step, record.wall_time
        for key, value in record.flat_scalars().items():
            w.add_scalar(key, value, step, walltime=t)
        for key, image in record.images.items():
            if image is not None:
                w.add_image(key, image, step, walltime=t, dataformats="HWC")
        for key, values in record.histograms.items():
            if values.size:
                w.add_histogram(key, values, step, walltime=t)
        for key, text in record.texts.items():
            w.add_text(key, text, step, walltime=t)
        for key, (frames, fps) in record.videos.items():
            # add_video wants [N, T, C, H, W]; moviepy is needed for the GIF encoding.
            w.add_video(key, frames.transpose(0, 3, 1, 2)[None], step, fps=fps, walltime=t)
        for tag, table in record.samples.items():
            w.add_text(tag, markdown_table(table.rows), step, walltime=t)
        if self.flush_every_commit:
            w.flush()

    def write_system(self, record: StepRecord) -> None:
        def log(w) -> None:
            for key, value in record.scalars.items():
                w.add_scalar(key, value, record.step, walltime=record.wall_time)
            if self.flush_every_commit:
                w.flush()

        self._guarded(log)

    def flush(self) -> None:
        """Write what is queued to the event file; raises (and drops the writer) if that fails."""
        if self._writer is not None:
            self._guarded(lambda w: w.flush())

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.flush()  # SummaryWriter.close drops a write error of its thread; flush raises it
            except Exception:
                _close_quietly(writer)
                raise
            writer.close()

    def __repr__(self) -> str:
        return f"TensorBoardBackend(log_dir={self.log_dir!r})"


def _alive(writer) -> bool:
    """Whether a SummaryWriter still writes: a dead one re-raises its writer thread's error from ``flush``."""
    try:
        writer.flush()
        return True
    except Exception:
        return False


def _close_quietly(writer) -> None:
    try:
        writer.close()
    except Exception:  # it already failed, and that failure was raised; closing it only releases its thread
        pass
