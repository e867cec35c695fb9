"""A heatmap's canvas stays bounded where its text is long.

Read back from what a user opens: TensorBoard event files (EventAccumulator) and JSONL lines.
"""

import io
from pathlib import Path

import numpy as np
from PIL import Image

from instrument import Logger, RunInfo, TensorBoardBackend
from instrument.logger import render
from tests.conftest import event_accumulator


def _tb_images(log_dir: Path, tag: str) -> dict:
    """step -> the RGB pixels of ``tag``'s image at that step, as TensorBoard shows them."""
    return {event.step: np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
            for event in event_accumulator(log_dir).Images(tag)}


def test_long_vertical_column_names_are_shortened_so_the_canvas_height_stays_bounded(tmp_path):
    """Column names wider than their cells are written vertically; a review found a canvas as tall as its longest
    name (2,100 pixels for names of 300 characters). They are now shortened from the middle like the other
    texts, start and end kept, so names differing at their end stay apart and the height is bounded."""
    matrix = np.arange(512.0).reshape(32, 16)
    short = [f"layer{i}" for i in range(16)]
    names = ["encoder.blocks." * 20 + f"layer{i}" for i in range(16)]
    logger = Logger([TensorBoardBackend()], RunInfo("r", tmp_path))
    for step, ticks in enumerate((names, names[:15] + ["encoder.blocks." * 20 + "layerX"])):
        logger.log_heatmap(f"h{step}", matrix, step, x_ticks=ticks)
        logger.commit(step)
    logger.close()
    image, other = (_tb_images(tmp_path / "r", f"h{step}")[step] for step in (0, 1))
    usual = render.render_heatmap(matrix, x_ticks=short)
    left, top, cw, ch = render.heatmap_geometry(32, 16)
    assert image.shape[1] == usual.shape[1]
    assert image.shape[0] <= top + 32 * ch + 160, image.shape  # the names below the cells: 2,100 pixels before
    # the names' distinguishing ends are drawn: the last column's differs
    below = slice(top + 32 * ch + 5, image.shape[0] - 16)
    last = slice(left + 15 * cw, left + 16 * cw)
    assert not np.array_equal(image[below, last], other[below, last])
    assert np.array_equal(image[below, :left + 15 * cw], other[below, :left + 15 * cw])
