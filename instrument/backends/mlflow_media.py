"""One step's media in MLflow, as `instrument.backends.mlflow.MlflowBackend` writes them: images (one image card
per key, with a step slider), texts, videos (animated GIF artifacts: MLflow has no video type) and samples tables
(JSON artifacts). Each value is written on its own, so one that fails costs that value only."""

import json
import os
import tempfile
from typing import Any, Callable, Dict, List, Tuple

from instrument.backends.base import StepRecord
from instrument.backends.drops import Drops, utf8
from instrument.backends.video import encode_gif, write_each
from instrument.terminal.samples import cell, columns

__all__ = ["media_count", "write_media"]

_THUMBNAIL = 256  # MLflow's thumbnail side (mlflow.tracking.multimedia.COMPRESSED_IMAGE_SIZE)


def media_count(record: StepRecord) -> int:
    """How many media values of the step `write_media` writes."""
    images = sum(value is not None for value in record.images.values())
    return images + len(record.texts) + len(record.videos) + len(record.samples)


def write_media(client: Any, run_id: str, record: StepRecord, name: Callable[[str, str], str], drops: Drops,
                named: bool) -> List[Tuple[str, Exception]]:
    """One step's images, texts, videos and samples tables, each under ``name(kind, key)`` (unique within its
    kind); the values that failed (``named``: with their step in the name)."""
    step = record.step
    failed: List[Tuple[str, Exception]] = []  # a media value that fails costs that value only

    def each(kind: str, items, write) -> None:
        for key, value in items:
            try:
                write(key, value)
            except Exception as exc:  # raised after the rest is written: counted in `failures`, as always
                failed.append((f"step {step} {kind} {key}" if named else f"{kind} {key}", exc))

    stamp = int(record.wall_time * 1000)

    def image(key: str, value) -> None:  # key + step: the UI shows one image card per key, with a step slider
        image_name = name("image", key)
        height, width = value.shape[:2]
        if int(min(height, width) * (_THUMBNAIL / max(height, width))) == 0:  # MLflow's thumbnail: a side of 0
            client.log_image(run_id, value, artifact_file=f"images/{image_name}/step_{step:08d}.png")
            return
        client.log_image(run_id, value, key=image_name, step=step, timestamp=stamp)

    def text(key: str, value) -> None:  # MLflow writes text as UTF-8: lone surrogates escaped
        client.log_text(run_id, utf8(drops, "text", key, value), f"text/{name('text', key)}/step_{step:08d}.txt")

    def table(tag: str, data) -> None:
        client.log_dict(run_id, data, f"samples/{name('samples table', tag)}/step_{step:08d}.json")

    def video(key: str, frames, fps: int) -> None:  # an animated GIF artifact ``videos/<key>/step_<step:08d>.gif``
        with tempfile.TemporaryDirectory(prefix="instrument-video-") as tmp:
            path = os.path.join(tmp, f"step_{step:08d}.gif")
            with open(path, "wb") as f:
                f.write(encode_gif(frames, fps))
            client.log_artifact(run_id, path, artifact_path=f"videos/{name('video', key)}")

    each("image", ((k, v) for k, v in record.images.items() if v is not None), image)
    each("text", record.texts.items(), text)
    failed += [(f"step {step} {key}" if named else key, exc) for key, exc in write_each(record.videos, video)]
    tables = drops.each("samples table", record.samples.items(), lambda tag, rows: _table(rows.rows),
                        "rows of JSON values")
    each("samples table", tables.items(), table)
    return failed


def _table(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """``{"columns", "data"}`` of a samples table, every cell a JSON value (checked here, so a value JSON
    cannot hold costs that table only)."""
    names = columns(rows)
    data = {"columns": names, "data": [[cell(row.get(c)) for c in names] for row in rows]}
    json.dumps(data, allow_nan=False)
    return data
