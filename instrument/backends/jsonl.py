"""JSONL: an append-only local record, one JSON object per committed step, flushed at each commit."""

import contextlib
import json
import logging
import math
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.terminal.samples import cell

__all__ = ["JsonlBackend"]

log = logging.getLogger("instrument")


def _json_number(value: float) -> Any:
    # JSON has no NaN/Infinity; keep them readable and round-trippable as strings. (Ints are exact in JSON.)
    return value if isinstance(value, int) or math.isfinite(value) else str(value)


def _json_value(value: Any) -> Any:
    """A hyperparameter as JSON holds it: NaN and inf (also inside lists and dicts) as strings, like metrics."""
    if isinstance(value, float):
        return _json_number(value)
    if isinstance(value, Mapping):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


class JsonlBackend(Backend):
    """Appends ``{"step", "time", "metrics", ...}`` lines to ``path`` (default ``runs/<run-name>/metrics.jsonl``).

    Hyperparameters are written as one ``{"hyperparameters": ..., "config": ...}`` line. Images, videos and
    histograms are summarised (shape, or count/min/max), not embedded; validation samples are written in full
    under ``"samples"``. System-monitor samples are ``{"system_step": <milliseconds since the run first
    started>, "time", "metrics"}`` lines, so a reader tells the two axes apart by the key.

    Every line parses. Each line goes to an ``O_APPEND`` descriptor in one ``os.write``, so a killed process
    leaves whole lines (the kernel has the bytes once the call returns). A write cut short (a full disk, a
    file-size limit) is cut back to the last whole line before the error is raised, and the next record is
    tried again on a fresh descriptor; so is a file deleted while the run writes it. A file that already
    ends in a partial line when it is opened (a process died mid-write on a filesystem without that
    guarantee) has that partial line removed, with a warning naming how many bytes.

    ``path`` may also name something that is not a regular file (``/dev/stdout`` piped into another
    program, a FIFO): lines are written to it the same way, without what only a file has (the size checks,
    cutting a torn line, ``fsync``). A FIFO whose reader is gone blocks the writer once the pipe is full.
    """

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path
        self._given = path  # None: each run's own folder, also when the backend is given to a later run
        self._fd: Optional[int] = None
        self._end = 0  # where the file ended after our own last write: another size means someone else changed it
        self._regular = True  # a regular file (not a pipe or a device): sizes, truncation and fsync apply

    def writes_to(self, run: RunInfo) -> Tuple[str, ...]:
        """The file, resolved (symlinks too); none for a pipe or a device, which several writers may share. While
        the backend is open no other session in this process may open a backend on it (`instrument.backends.held`):
        two sessions' lines would interleave with nothing to tell the runs apart, and one's resume would cut the
        other's."""
        path = Path(self._given) if self._given else run.dir / "metrics.jsonl"
        if path.exists() and not path.is_file():
            return ()
        return (os.path.realpath(path),)

    def open(self, run: RunInfo) -> None:
        path = Path(self._given) if self._given else run.dir / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self._open()

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except FileNotFoundError:  # the run folder was removed under us (a cleanup script): make it again
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, flags, 0o644)
        try:
            self._regular = stat.S_ISREG(os.fstat(fd).st_mode)
            if self._regular:
                _drop_partial_line(fd, self.path)
            self._end = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return fd

    def _write_line(self, obj: Mapping[str, Any]) -> None:
        # allow_nan=False: a NaN that slipped past the conversions above is an error, never a non-JSON line.
        data = (json.dumps(obj, sort_keys=False, allow_nan=False) + "\n").encode("utf-8")
        fd = self._fd if self._fd is not None else self._open()  # a failed write dropped the old descriptor
        if not self._regular:  # a pipe or a device: no size to check, nothing to cut back
            self._write_all(fd, data)
            return
        info = os.fstat(fd)
        if info.st_nlink == 0:  # the file was deleted under us: lines written to it would be lost unseen
            self._fd = None
            os.close(fd)
            fd = self._open()
            info = os.fstat(fd)
        start = info.st_size
        if start != self._end:  # changed by someone else (cut mid-line, say): a line appended now could be torn
            _drop_partial_line(fd, self.path)
            start = os.fstat(fd).st_size
        try:
            self._write_all(fd, data)
            self._end = start + len(data)
        except OSError:
            self._fd = None
            try:
                os.ftruncate(fd, start)  # never leave a torn line behind
            finally:
                os.close(fd)
            raise

    @staticmethod
    def _write_all(fd: int, data: bytes) -> None:
        written = os.write(fd, data)
        while written < len(data):  # a short write: the rest raises (EFBIG, ENOSPC) or completes the line
            written += os.write(fd, data[written:])

    def on_resume(self, next_step: int) -> None:
        """Remove the training-step lines at ``next_step`` or later, so the steps the resumed run writes again
        replace those of the interrupted run instead of repeating them. Every other line after them (system
        samples the interrupted process took after the checkpoint, hyperparameters) is kept.

        With nothing to keep the file is cut (one ``ftruncate``). Otherwise the new file is written beside it
        and renamed over it (``os.replace``, after ``fsync``): a crash during the rewrite leaves the old file
        whole, never a torn or half-removed tail (the next resume does it again)."""
        fd = self._fd if self._fd is not None else self._open()
        if not self._regular:  # a pipe or a device holds no earlier steps to cut (and reading it would block)
            return
        tmp = self.path + ".resume.tmp"
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # left by a resume that crashed while rewriting: the file itself is whole
        cut: Optional[int] = None
        kept, removed, offset = [], 0, 0
        with open(self.path, "rb") as f:
            for line in f:
                step = _step_of(line)
                if isinstance(step, int) and step >= next_step:
                    cut = offset if cut is None else cut
                    removed += 1
                elif cut is not None:
                    kept.append(line)
                offset += len(line)
        if cut is None:
            return
        if not kept:
            os.ftruncate(fd, cut)
        else:
            try:
                _rewrite(self.path, tmp, cut, kept)
            except OSError as exc:  # a full disk, a folder that takes no new file: cut in place instead
                with contextlib.suppress(OSError):
                    os.unlink(tmp)  # a partial copy would only take the space the lines need
                self._cut_in_place(fd, cut, kept, exc)
                return
            self._fd = None
            os.close(fd)
            self._open()
        log.info("instrument: %s: removed %d step line(s) from step %d on for the resumed run (kept %d other "
                 "line(s) written after them)", self.path, removed, next_step, len(kept))

    def _cut_in_place(self, fd: int, cut: int, kept: list, why: OSError) -> None:
        """`on_resume` when the file cannot be rewritten beside itself: the interrupted run's steps from the
        checkpoint on are cut all the same (the resumed run must not follow them with its own), then the other
        lines after them are written back, whole lines only; any that do not fit are said, never torn."""
        os.ftruncate(fd, cut)
        written = 0
        try:
            for line in kept:
                self._write_all(fd, line)
                written += 1
        except OSError:
            os.ftruncate(fd, cut + sum(len(line) for line in kept[:written]))  # no torn line
        self._end = os.fstat(fd).st_size
        log.warning("instrument: %s: could not rewrite the file for the resumed run (%s); cut it in place at the "
                    "checkpoint instead and wrote back %d of the %d other line(s) (system samples, hyperparameters) "
                    "written after it", self.path, why, written, len(kept))

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        self._write_line({"hyperparameters": {k: _json_value(v) for k, v in params.items()}, "config": config_text})

    def write(self, record: StepRecord) -> None:
        line: dict = {"step": record.step, "time": record.wall_time,
                      "metrics": {k: _json_number(v) for k, v in record.flat_scalars().items()}}
        if record.histograms:
            line["histograms"] = {
                k: {"count": int(v.size), "min": _json_number(v.min().item()), "max": _json_number(v.max().item())}
                if v.size else {"count": 0}
                for k, v in record.histograms.items()
            }
        if record.images:
            line["images"] = {k: list(v.shape) for k, v in record.images.items() if v is not None}
        if record.videos:
            line["videos"] = {k: {"shape": list(v.shape), "fps": fps} for k, (v, fps) in record.videos.items()}
        if record.texts:
            line["texts"] = dict(record.texts)
        if record.samples:
            line["samples"] = {
                tag: [{k: cell(v) for k, v in row.items()} for row in table.rows]
                for tag, table in record.samples.items()
            }
        self._write_line(line)

    def write_system(self, record: StepRecord) -> None:
        self._write_line({"system_step": record.step, "time": record.wall_time,
                          "metrics": {k: _json_number(v) for k, v in record.scalars.items()}})

    def flush(self) -> None:
        """Every line is in the kernel once written; this also asks the disk to keep it (``fsync``)."""
        if self._fd is not None and self._regular:  # a pipe or a device has nothing to sync (EINVAL)
            os.fsync(self._fd)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                if self._regular:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def __repr__(self) -> str:
        return f"JsonlBackend(path={self.path!r})"


def _step_of(line: bytes) -> Any:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj.get("step") if isinstance(obj, dict) else None


def _rewrite(path: str, tmp: str, cut: int, kept: list) -> None:
    """``path`` becomes its first ``cut`` bytes followed by the ``kept`` lines, atomically (`on_resume`)."""
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        left = cut
        while left:
            block = src.read(min(left, 1 << 20))
            if not block:
                break
            dst.write(block)
            left -= len(block)
        dst.writelines(kept)
        dst.flush()
        os.fsync(dst.fileno())
    shutil.copymode(path, tmp)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # the rename itself durable, where the directory can be synced
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _drop_partial_line(fd: int, path: str) -> None:
    """Cut a trailing partial line (no final newline) so that every line of the file parses."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    end = size
    while end > 0:  # find the last newline, reading backwards in blocks
        begin = max(0, end - 65536)
        block = os.pread(fd, end - begin, begin)
        newline = block.rfind(b"\n")
        if newline >= 0:
            end = begin + newline + 1
            break
        end = begin
    os.ftruncate(fd, end)
    log.warning("instrument: %s ended in a partial line (%d bytes, left by an interrupted write); removed it "
                "so that every line parses", path, size - end)
