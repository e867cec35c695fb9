"""JSONL: an append-only local record, one JSON object per committed step, flushed at each commit."""

import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional

from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.terminal.samples import cell

__all__ = ["JsonlBackend"]


def _json_number(value: float) -> Any:
    # JSON has no NaN/Infinity; keep them readable and round-trippable as strings.
    return value if math.isfinite(value) else str(value)


class JsonlBackend(Backend):
    """Appends ``{"step", "time", "metrics", ...}`` lines to ``path`` (default ``runs/<run-name>/metrics.jsonl``).

    Hyperparameters are written as one ``{"hyperparameters": ..., "config": ...}`` line. Images, videos and
    histograms are summarised (shape, or count/min/max), not embedded; validation samples are written in full
    under ``"samples"``. System-monitor samples are ``{"system_step": <whole seconds since the monitor
    started>, "time", "metrics"}`` lines, so a reader tells the two axes apart by the key.
    """

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path
        self._file = None

    def open(self, run: RunInfo) -> None:
        path = Path(self.path) if self.path else run.dir / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self._file = open(path, "a", encoding="utf-8")

    def _write_line(self, obj: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(obj, sort_keys=False) + "\n")
        self._file.flush()

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        self._write_line({"hyperparameters": dict(params), "config": config_text})

    def write(self, record: StepRecord) -> None:
        line: dict = {"step": record.step, "time": record.wall_time,
                      "metrics": {k: _json_number(v) for k, v in record.flat_scalars().items()}}
        if record.histograms:
            line["histograms"] = {
                k: {"count": int(v.size), "min": _json_number(float(v.min())), "max": _json_number(float(v.max()))}
                if v.size else {"count": 0}
                for k, v in record.histograms.items()
            }
        if record.images:
            line["images"] = {k: list(v.shape) for k, v in record.images.items() if v is not None}
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
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __repr__(self) -> str:
        return f"JsonlBackend(path={self.path!r})"
