"""TensorBoard: the default backend; event files under ``runs/<run-name>``, no account needed."""

from pathlib import Path
from typing import Any, Mapping, Optional

from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.terminal.samples import markdown_table

__all__ = ["TensorBoardBackend"]


class TensorBoardBackend(Backend):
    """Writes scalars, images, histograms, text and video with ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        log_dir: where the event files go; None means the run directory (``runs/<run-name>``).
            Training metrics use the training step as ``global_step``; system-monitor metrics (``system/...``)
            use whole seconds since the monitor started, with the sample's wall time.
        flush_every_commit: flush after each committed step so ``tensorboard`` shows it at once (one small
            file write per logging step).
    """

    def __init__(self, log_dir: Optional[str] = None, flush_every_commit: bool = True) -> None:
        self.log_dir = log_dir
        self.flush_every_commit = flush_every_commit
        self._writer = None

    def open(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        path = Path(self.log_dir) if self.log_dir else run.dir
        self.log_dir = str(path)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        if params:
            rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
            self._writer.add_text("hyperparameters", "| parameter | value |\n|---|---|\n" + rows, 0)
        if config_text:
            # Four leading spaces make TensorBoard's markdown show the config verbatim.
            self._writer.add_text("config/operative", "\n".join("    " + line for line in config_text.splitlines()), 0)
        self._writer.flush()

    def write(self, record: StepRecord) -> None:
        w, step, t = self._writer, record.step, record.wall_time
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
        for key, value in record.scalars.items():
            self._writer.add_scalar(key, value, record.step, walltime=record.wall_time)
        if self.flush_every_commit:
            self._writer.flush()

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __repr__(self) -> str:
        return f"TensorBoardBackend(log_dir={self.log_dir!r})"
