"""Weights & Biases: offline by default, so no account or network is needed until a user binds ``mode``."""

import contextlib
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.errors import ConfigurationError, require
from instrument.terminal.samples import cell, columns

__all__ = ["WandbBackend"]

_MODES = ("offline", "online", "disabled", "shared")
_EXIT_STATUSES = ("killed", "failed")


class WandbBackend(Backend):
    """Logs each committed step with ``run.log(..., step=step, commit=True)``.

    Images are logged as ``wandb.Image`` under the same key every step, so the W&B UI shows a step slider.
    Needs ``pip install 'torch-instrument[wandb]'``; the SDK is imported only when the run opens.

    Args:
        project: W&B project.
        mode: ``"offline"`` (default: written under the run directory, sync later with ``wandb sync``),
            ``"online"``, ``"disabled"`` or ``"shared"``.
        entity, group, tags, notes: passed to ``wandb.init``.
        dir: where W&B writes its files; None means the run directory.
        flush_secs: how often W&B's service writes its buffered data to the run's ``.wandb`` file (W&B's
            ``x_transaction_log_flush_interval`` setting; W&B's default is 15). 0 writes only when a 32 KiB
            block fills or the run finishes.

    Durability: W&B's service keeps the last partial block of the ``.wandb`` file in memory and writes it
    every ``flush_secs``; W&B has no call that forces it sooner, so a process killed without `close` loses
    at most the last ``flush_secs`` of steps. `close` calls ``run.finish``, which writes everything; after
    `on_exit` ("killed"/"failed") it finishes with exit code 1, so W&B marks the run failed, not finished.

    Step axes: training metrics use ``step=`` (the training step). System-monitor metrics (``system/...``)
    are plotted against ``system/seconds`` (``define_metric``); W&B keeps one history row per step, so they
    ride on the next training row (the newest sample wins) instead of advancing W&B's step, which would make
    W&B drop the next training step. Validation samples are logged as a ``wandb.Table`` under their tag.
    """

    def __init__(
        self,
        project: str = "instrument",
        mode: str = "offline",
        entity: Optional[str] = None,
        group: Optional[str] = None,
        tags: Optional[Sequence[str]] = None,
        notes: Optional[str] = None,
        dir: Optional[str] = None,
        flush_secs: float = 2.0,
    ) -> None:
        if mode not in _MODES:
            raise ConfigurationError(
                f"WandbBackend.mode must be one of {_MODES}, got {mode!r}; 'offline' needs no account."
            )
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or not flush_secs >= 0:
            raise ConfigurationError(
                f"WandbBackend.flush_secs must be a number of seconds >= 0, got {flush_secs!r}."
            )
        self.flush_secs = float(flush_secs)
        self._exit_code = 0
        self.project, self.mode, self.entity, self.group = project, mode, entity, group
        self.tags, self.notes, self.dir = list(tags or []), notes, dir
        self.run = None
        self._wandb = None
        self._system: dict = {}

    def open(self, run: RunInfo) -> None:
        wandb = self._wandb = require("wandb", "wandb", "WandbBackend")
        path = (Path(self.dir) if self.dir else run.dir).resolve()  # absolute: W&B's service has its own cwd
        path.mkdir(parents=True, exist_ok=True)
        self.dir = str(path)
        # Older W&B (before the setting existed) writes on its own fixed schedule.
        flush_field = "x_transaction_log_flush_interval"
        flush = {flush_field: self.flush_secs} if flush_field in getattr(wandb.Settings, "model_fields", {}) else {}
        with _argv(run.argv):  # W&B records sys.argv in the run's metadata: let it see the redacted one
            self.run = wandb.init(
                project=self.project, entity=self.entity, name=run.name, group=self.group, tags=self.tags,
                notes=self.notes, dir=self.dir, mode=self.mode, reinit="create_new",
                settings=wandb.Settings(console="off", silent=True, **flush), **_resume(run, self.name),
            )
        self.run.define_metric("system/seconds")
        self.run.define_metric("system/*", step_metric="system/seconds")

    @property
    def resume_id(self) -> Optional[str]:
        return self.run.id if self.run is not None else None

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        values = dict(params)
        if config_text:
            values["operative_config"] = config_text
        self.run.config.update(values, allow_val_change=True)

    def write(self, record: StepRecord) -> None:
        if record.step < self.run.step:  # a resumed online run already holds it; W&B would drop it anyway
            return
        wandb = self._wandb
        data: dict = record.flat_scalars()
        for key, image in record.images.items():
            if image is not None:
                data[key] = wandb.Image(image)
        for key, values in record.histograms.items():
            if values.size:
                data[key] = wandb.Histogram(values)
        for key, text in record.texts.items():
            data[key] = wandb.Html(f"<pre>{_escape(text)}</pre>")
        for key, (frames, fps) in record.videos.items():
            data[key] = wandb.Video(frames.transpose(0, 3, 1, 2), fps=fps, format="gif")
        for tag, table in record.samples.items():
            cols = columns(table.rows)
            data[tag] = wandb.Table(columns=cols, data=[[cell(r.get(c)) for c in cols] for r in table.rows])
        if self._system:
            data = {**self._system, **data}
            self._system = {}
        self.run.log(data, step=record.step, commit=True)

    def write_system(self, record: StepRecord) -> None:
        self._system = {**self._system, **record.scalars}

    def flush(self) -> None:
        """W&B has no call that writes its buffer sooner; its service does so every ``flush_secs``."""

    def on_exit(self, status: str) -> None:
        """Make `close` finish the run with exit code 1: W&B then marks it failed instead of finished."""
        if status not in _EXIT_STATUSES:
            raise ConfigurationError(
                f"WandbBackend.on_exit got status {status!r}; expected one of {_EXIT_STATUSES}."
            )
        self._exit_code = 1

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            try:
                if self._system:  # the last samples after the last training step
                    run.log(self._system, commit=True)
                    self._system = {}
            finally:
                run.finish(exit_code=self._exit_code)  # writes the buffered block and the exit record

    def __repr__(self) -> str:
        return f"WandbBackend(project={self.project!r}, mode={self.mode!r})"


def _resume(run: RunInfo, name: str) -> dict:
    """``wandb.init`` arguments that continue the run whose id the run folder kept (offline too)."""
    run_id = (run.resume or {}).get(name)
    return {"id": run_id, "resume": "allow"} if run_id else {}


_ARGV_LOCK = threading.Lock()


@contextlib.contextmanager
def _argv(argv: Optional[Sequence[str]]) -> Iterator[None]:
    """``sys.argv`` replaced by ``argv`` (the redacted command line) while W&B reads it, when they differ.

    W&B (``Settings._args``) takes the command line from ``sys.argv`` and has no setting to pass another;
    the swap lasts only for ``wandb.init`` on the writer thread."""
    if argv is None or list(argv) == sys.argv:
        yield
        return
    with _ARGV_LOCK:
        saved = sys.argv[:]
        sys.argv[:] = list(argv)
        try:
            yield
        finally:
            sys.argv[:] = saved


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
