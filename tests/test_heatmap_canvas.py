"""A heatmap's canvas under one tag keeps its size from step to step, and stays bounded where its text is long.

Read back from what a user opens: TensorBoard event files (EventAccumulator) and JSONL lines.
"""

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from instrument import JsonlBackend, Logger, RunInfo, TensorBoardBackend
from instrument.core.colormap import VIRIDIS_LUT
from instrument.logger import render
from tests.conftest import event_accumulator


def _tb_images(log_dir: Path, tag: str) -> dict:
    """step -> the RGB pixels of ``tag``'s image at that step, as TensorBoard shows them."""
    return {event.step: np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
            for event in event_accumulator(log_dir).Images(tag)}


def _jsonl_shapes(path: Path, tag: str) -> dict:
    """step -> the shape JSONL wrote for ``tag``'s image at that step."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["step"]: tuple(line["images"][tag]) for line in lines if tag in line.get("images", {})}


def test_a_heatmaps_canvas_keeps_its_size_across_steps_when_its_labels_need_more_room(tmp_path):
    """A review found the image of one tag changing width from step to step: the canvas was widened for a wide
    colour-bar label (-1.23e+06) at one step and narrow again at the next (9.5), so the image jumped in
    TensorBoard's slider. Each tag's canvas now grows where a step needs more room and then stays that size;
    the cells, the colour bar and its labels are where they would be alone, the rest white."""
    small, wide = np.linspace(0.0, 9.5, 512).reshape(32, 16), np.linspace(-1234567.8, 3.0, 512).reshape(32, 16)
    logger = Logger([TensorBoardBackend(), JsonlBackend()], RunInfo("r", tmp_path))
    for step, matrix in enumerate((small, wide, small, small)):
        logger.log_heatmap("h", matrix, step, x_label="channel", y_label="iteration")
        logger.log_heatmap("other", small, step)  # a tag of its own: never widened by "h"
        logger.commit(step)
    logger.close()
    images = _tb_images(tmp_path / "r", "h")
    alone = [render.render_heatmap(m, title="h", x_label="channel", y_label="iteration") for m in (small, wide)]
    assert alone[1].shape[1] > alone[0].shape[1]  # the wide label needs room: the canvas grows at step 1
    np.testing.assert_array_equal(images[0], alone[0])
    np.testing.assert_array_equal(images[1], alone[1])
    for step in (2, 3):  # and then keeps its size, the room it grew by white
        assert images[step].shape == images[1].shape, step
        height, width = alone[0].shape[:2]
        np.testing.assert_array_equal(images[step][:height, :width], alone[0])
        assert (images[step][:, width:] == 255).all() and (images[step][height:] == 255).all()
    shapes = _jsonl_shapes(tmp_path / "r" / "metrics.jsonl", "h")
    assert shapes == {step: images[step].shape for step in range(4)}
    others = _tb_images(tmp_path / "r", "other")
    assert {image.shape for image in others.values()} == {render.render_heatmap(small, title="other").shape}


def test_a_heatmaps_canvas_grows_with_its_matrix_and_does_not_shrink_back(tmp_path):
    """A matrix of another shape under the same tag (a rollout of another length) is drawn at its own cell size,
    on a canvas no smaller than the tag's largest so far: rows numbered in 5 digits and more take a wider left
    margin, and the canvas keeps that width after."""
    logger = Logger([TensorBoardBackend()], RunInfo("r", tmp_path))
    shapes = ((4, 2), (12000, 2), (4, 2))
    for step, shape in enumerate(shapes):
        logger.log_heatmap("h", np.zeros(shape), step)
        logger.commit(step)
    logger.close()
    images = _tb_images(tmp_path / "r", "h")
    big = render.render_heatmap(np.zeros((12000, 2)), title="h")
    assert images[1].shape == big.shape == images[2].shape
    left, top, cw, ch = render.heatmap_geometry(4, 2)
    assert (images[2][top + ch // 2, left + cw // 2] == VIRIDIS_LUT[0]).all()  # the cells where geometry says


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


def test_a_resumed_run_draws_each_heatmap_on_the_canvas_its_tag_had(tmp_path):
    """The sizes are in `state_dict()`, as the running colour ranges are: a run resumed from a checkpoint drew a
    tag narrower than before it (its size started again), so the slider jumped at the resume. A checkpoint without
    them (an older instrument's) loads, and a bad one is refused before anything changes."""
    import pytest

    import instrument
    from instrument.errors import ConfigurationError

    small, wide = np.linspace(0.0, 9.5, 8).reshape(4, 2), np.linspace(-1234567.8, 3.0, 8).reshape(4, 2)

    def session(resume):
        return instrument.Instrumentation(backends=[TensorBoardBackend()], run_name="s", log_dir=str(tmp_path),
                                          resume=resume)

    inst = session(False)
    for step, matrix in ((0, small), (10, wide)):
        with inst.step(step):
            inst.logger.log_heatmap("h", matrix, step)
    state = json.loads(json.dumps(inst.state_dict()))  # a checkpoint round trip
    inst.close()
    assert state["heatmap_sizes"] == {"h": list(render.render_heatmap(wide, title="h").shape[:2])}
    again = session(True)
    again.load_state_dict(state)
    with again.step(20):
        again.logger.log_heatmap("h", small, 20)
    again.close()
    images = _tb_images(tmp_path / "s", "h")
    assert images[20].shape == images[10].shape != images[0].shape

    old = {key: value for key, value in state.items() if key != "heatmap_sizes"}
    for bad in ({"h": [0, 10]}, {"h": [10.5, 10]}, {"h": [10, True]}, [314, 368], {"h": [10, 2**40]}, {1: [1, 1]},
                {"h": [2**20, 2**13]}):  # each side within bounds, 24 GiB of RGB in all
        late = session(True)
        with pytest.raises(ConfigurationError, match="'heatmap_sizes'"):
            late.load_state_dict({**state, "heatmap_sizes": bad})
        late.load_state_dict(old)  # refused before anything changed; a checkpoint without them loads
        assert late.logger._sizes.snapshot() == {}
        late.close()


def test_a_matrix_of_thousands_of_rows_is_drawn_one_pixel_per_row_every_value_its_own(tmp_path):
    """What the docs promise for a long rollout: no row averaged or left out, so a lone spike shows (the image is
    as tall as the matrix has rows, documented rather than bounded)."""
    matrix = np.zeros((3000, 4))
    matrix[1234, 2] = 1.0  # one exploding value among 12,000
    logger = Logger([TensorBoardBackend()], RunInfo("r", tmp_path))
    logger.log_heatmap("h", matrix, 0)
    logger.commit(0)
    logger.close()
    image = _tb_images(tmp_path / "r", "h")[0]
    left, top, cw, ch = render.heatmap_geometry(3000, 4)
    assert ch == 1
    cells = image[top:top + 3000, left:left + 4 * cw:cw]
    expected = np.where(matrix[..., None] == 1.0, VIRIDIS_LUT[255], VIRIDIS_LUT[0])
    np.testing.assert_array_equal(cells, expected)


def test_a_long_name_of_a_wide_column_is_shortened_to_its_cell_and_laid_flat():
    """A column 256 pixels wide has room for its name flat once shortened: not a vertical one 128 pixels tall."""
    matrix = np.arange(4.0).reshape(4, 1)
    image = render.render_heatmap(matrix, x_ticks=["encoder.blocks." * 20 + "end"])
    assert image.shape == render.render_heatmap(matrix, x_ticks=["end"]).shape


def test_a_fixed_range_of_subnormal_numbers_is_drawn_not_dropped(tmp_path):
    """color_range=(0, 1e-323) is accepted (finite, lo < hi), but the colour bar's round step, a quarter of the
    span, is below float64's normal numbers: log10 of 0 failed on the writer thread and the heatmap was dropped
    with a message blaming its shape. Drawn now, each cell its colour, the bar's ends labelled apart."""
    lo, hi = 0.0, 1e-323
    logger = Logger([TensorBoardBackend()], RunInfo("r", tmp_path))
    logger.log_heatmap("hm", np.array([[lo, hi / 2, hi, 1.0]]), step=0, color_range=(lo, hi))
    logger.commit(0)
    logger.close()
    assert logger.failures == {}
    image = _tb_images(tmp_path / "r", "hm")[0]
    left, top, cw, ch = render.heatmap_geometry(1, 4)
    want = VIRIDIS_LUT[np.round(np.array([0.0, 0.5, 1.0, 1.0]) * 255).astype(int)]  # 1.0: above the range
    np.testing.assert_array_equal(image[top + ch // 2, left + cw // 2::cw][:4], want)
    ticks = render.colorbar_ticks(lo, hi, ch)
    texts = render.colorbar_labels(ticks, one_colour=False)
    assert [v for v, _ in ticks] == [hi, lo] and texts[0] != texts[1] and float(texts[1]) == lo, texts
