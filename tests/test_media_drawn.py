"""Media drawn otherwise than logged are said, and media moved off a taken name keep their own series.

Read back from what a user opens: TensorBoard event files (EventAccumulator, GIFs decoded with Pillow), W&B
offline run files, JSONL. References are computed here with NumPy.
"""

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from instrument import JsonlBackend, Logger, RunInfo, TensorBoardBackend
from instrument.core.colormap import NAN_COLOUR, VIRIDIS_LUT
from instrument.observers.rollout_video import render_frames
from tests.conftest import event_accumulator
from tests.wandb_reader import read_run


def _warnings(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _tb_pixels(log_dir: Path, tag: str) -> np.ndarray:
    acc = event_accumulator(log_dir)
    event = acc.Images(tag)[-1]
    return np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))


def test_nan_and_infinite_pixels_of_images_and_videos_are_said_once_per_tag(tmp_path, caplog):
    logger = Logger([TensorBoardBackend()], RunInfo("r", tmp_path))
    image = np.array([[np.nan, 0.5], [np.inf, -np.inf]])
    video = np.zeros((2, 2, 2, 3))
    video[0, 0, 0, 0] = np.nan
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            logger.log_image("img", image, step)
            logger.log_video("vid", video, step, fps=4)
            logger.commit(step)
        logger.close()
    said = _warnings(caplog, "NaN or infinite pixel")
    assert len(said) == 2, said  # once per tag, not per step
    assert any("log_image('img') got 3 NaN or infinite pixel value(s) of 4" in m for m in said)
    assert any("log_video('vid') got 1 NaN or infinite pixel value(s) of 24" in m for m in said)
    # what was drawn, as the message says: NaN and -inf as 0, +inf as 255
    assert _tb_pixels(tmp_path / "r", "img")[:, :, 0].tolist() == [[0, 128], [255, 0]]


def test_float_video_frames_outside_0_1_are_said_like_images(tmp_path, caplog):
    logger = Logger([JsonlBackend()], RunInfo("r", tmp_path))
    frames = torch.linspace(0.0, 255.0, 2 * 3 * 3 * 3).reshape(2, 3, 3, 3)  # 0..255 floats: drawn almost all white
    with caplog.at_level(logging.WARNING, logger="instrument"):
        logger.log_video("vid", frames, 0, fps=2)
        logger.commit(0)
        logger.close()
    said = _warnings(caplog, "log_video('vid') got floats from 0 to 255")
    assert len(said) == 1 and "clipped" in said[0], [r.getMessage() for r in caplog.records]


def test_a_fractional_frame_rate_is_kept_to_the_gifs_centiseconds(tmp_path):
    logger = Logger([TensorBoardBackend(), JsonlBackend()], RunInfo("r", tmp_path))
    frames = np.zeros((3, 4, 4, 3), dtype=np.uint8)
    frames[1] = 128
    frames[2] = 255  # three different frames: Pillow merges identical ones into one longer delay
    logger.log_video("a", frames, 0, fps=2.5)
    logger.log_video("b", frames, 0, fps=1.9)
    logger.log_video("c", frames, 0, fps=10)
    logger.log_video("d", frames, 0, fps=100)  # written as 10 ms, which browsers play as 100 ms: slower than 60 fps
    logger.log_video("e", frames, 0, fps=60)
    logger.commit(0)
    logger.close()
    acc = event_accumulator(tmp_path / "r")
    # 1/fps to the nearest centisecond (it was 1/int(fps)), at least 2: 50 fps at most
    for tag, delay in (("a", 400), ("b", 530), ("c", 100), ("d", 20), ("e", 20)):
        gif = Image.open(io.BytesIO(acc.Images(tag)[-1].encoded_image_string))
        delays = []
        for index in range(gif.n_frames):
            gif.seek(index)
            delays.append(gif.info["duration"])
        assert delays == [delay] * 3, (tag, delays)
    line = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert {k: v["fps"] for k, v in line["videos"].items()} == {"a": 2.5, "b": 1.9, "c": 10, "d": 100, "e": 60}
    assert isinstance(line["videos"]["c"]["fps"], int)


def _histograms(log_dir: Path):
    acc = event_accumulator(log_dir)
    return {tag: {e.step: (e.histogram_value.num, e.histogram_value.min, e.histogram_value.max)
                  for e in acc.Histograms(tag)} for tag in acc.Tags()["histograms"]}


def test_tensorboard_a_users_own_tag_named_like_a_moved_one_gets_a_tag_of_its_own(tmp_path, caplog):
    logger = Logger([TensorBoardBackend()], RunInfo("r", tmp_path))
    with caplog.at_level(logging.WARNING, logger="instrument"):
        logger.log_metrics({"reward": 1.0}, step=1)
        logger.log_histogram("reward", torch.tensor([1.0, 2.0, 3.0]), 1)  # moved: 'reward' holds a scalar
        logger.commit(1)
        logger.log_histogram("reward/histogram", torch.tensor([100.0, 200.0]), 2)  # the user's own tag
        logger.commit(2)
        logger.close()
    got = _histograms(tmp_path / "r")
    assert got["reward/histogram"] == {1: (3.0, 1.0, 3.0)}  # the moved one alone: the user's did not replace it
    assert got["reward/histogram/histogram"] == {2: (2.0, 100.0, 200.0)}
    assert any("'reward/histogram' under the tag 'reward/histogram/histogram'" in m
               for m in _warnings(caplog, "TensorBoardBackend writes"))


def test_wandb_a_users_own_key_named_like_a_moved_one_gets_a_key_of_its_own(tmp_path):
    from instrument import WandbBackend

    logger = Logger([WandbBackend(dir=str(tmp_path), mode="offline")], RunInfo("r", tmp_path))
    logger.log_metrics({"reward": 1.0}, step=1)
    logger.log_histogram("reward", torch.tensor([1.0, 2.0, 3.0]), 1)
    logger.commit(1)
    logger.log_histogram("reward/histogram", torch.tensor([100.0, 200.0]), 2)
    logger.log_metrics({"reward/histogram": 5.0}, step=2)  # a scalar of that name moves off it too
    logger.commit(2)
    logger.close()
    rows, _ = read_run(tmp_path)
    keys = {row["_step"]: {k for k in row if not k.startswith("_")} for row in rows}
    assert keys[1] == {"reward", "reward/histogram"}
    assert keys[2] == {"reward/histogram/histogram", "reward/histogram/scalar"}  # never into 'reward/histogram'
    second = next(row for row in rows if row["_step"] == 2)["reward/histogram/histogram"]
    assert min(second["bins"]) == pytest.approx(100.0) and max(second["bins"]) == pytest.approx(200.0)


def test_rollout_video_draws_float64_states_in_float64():
    def colours(values):
        stack = torch.tensor(values, dtype=torch.float64).reshape(1, 1, 1, -1)  # [T, k, H, W]
        return render_frames(stack)[0, 0].tolist()

    grey = NAN_COLOUR.tolist()
    # finite beyond float32's range: the channel's own ends, not the grey of NaN (inf in float32)
    drawn = colours([1e39, -1e39, 0.0, 1.0])
    assert grey not in drawn and drawn[0] == VIRIDIS_LUT[255].tolist() and drawn[1] == VIRIDIS_LUT[0].tolist()
    # values float32 cannot tell apart (1e9 + 10 is 1e9 in float32): four colours, evenly over the map
    values = 1e9 + np.array([0.0, 10.0, 20.0, 30.0])
    want = [VIRIDIS_LUT[int(np.round((v - values[0]) / (values[-1] - values[0]) * 255.0))].tolist() for v in values]
    assert colours(values.tolist()) == want


@pytest.mark.parametrize("shape, target", [((16, 32), 256), ((3, 5), 256), ((40, 7), 300), ((1, 1), 64)])
def test_a_heatmap_read_back_has_every_cell_pixel_and_pillows_labels(tmp_path, shape, target):
    """The heatmap is drawn in NumPy onto a cached frame, its colour-bar labels laid from cached text: every pixel
    of every cell block is the cell's colour, and the label column is what Pillow draws for those ticks."""
    from PIL import ImageDraw

    from instrument.logger import render

    rng = np.random.default_rng(sum(shape))
    matrix = rng.normal(size=shape) * 7.0
    if matrix.size > 4:  # NaN and infinite cells are grey; the scale is that of the finite ones
        matrix.flat[:3] = [np.nan, np.inf, -np.inf]
    image = render.render_heatmap(matrix, title="m", target_size=target)
    left, top, cw, ch = render.heatmap_geometry(*shape, target_size=target)
    lo, hi = matrix[np.isfinite(matrix)].min(), matrix[np.isfinite(matrix)].max()
    span = hi - lo if hi > lo else 1.0  # one cell: drawn as a constant image
    finite = np.isfinite(matrix)
    index = np.clip(np.round((np.where(finite, matrix, lo) - lo) / span * 255.0), 0, 255).astype(np.uint8)
    colours = np.where(finite[..., None], VIRIDIS_LUT[index], NAN_COLOUR)
    cells = image[top:top + ch * shape[0], left:left + cw * shape[1]]
    np.testing.assert_array_equal(cells, np.repeat(np.repeat(colours, ch, axis=0), cw, axis=1))

    bar_x = left + cw * shape[1] + 8
    tick_x = bar_x + 10
    reference = Image.new("RGB", (image.shape[1], image.shape[0]), (255, 255, 255))
    draw = ImageDraw.Draw(reference)
    font = render._font(11)
    ticks = render.colorbar_ticks(lo, hi, ch * shape[0])
    for (_, y), text in zip(ticks, render.colorbar_labels(ticks), strict=True):
        draw.line([(tick_x, y + top), (tick_x + 3, y + top)], fill=(0, 0, 0))
        draw.text((tick_x + 5, y + top - 6), text, fill=(0, 0, 0), font=font)
    reference = np.asarray(reference)
    np.testing.assert_array_equal(image[:, tick_x:], reference[:, tick_x:])

    if target != 256:  # the logger draws at the default size
        return
    logger = Logger([TensorBoardBackend()], RunInfo("r", tmp_path))  # and so it reads back from TensorBoard
    logger.log_heatmap("m", matrix, step=0)
    logger.commit(0)
    logger.close()
    np.testing.assert_array_equal(_tb_pixels(tmp_path / "r", "m"), image)


def _pillow_label(text: str, font) -> tuple:
    """What Pillow draws for ``text``: black on white, on its own bounding box from the origin (reference)."""
    from PIL import ImageDraw

    left, top, right, bottom = font.getbbox(text)
    dx, dy = min(left, 0), min(top, 0)
    image = Image.new("RGB", (max(1, right - dx), max(1, bottom - dy)), (255, 255, 255))
    ImageDraw.Draw(image).text((-dx, -dy), text, fill=(0, 0, 0), font=font)
    return np.asarray(image), dx, dy


def test_colorbar_labels_laid_from_cached_characters_are_what_pillow_draws():
    """A label not seen before (a heatmap's own minimum and maximum, new at every step) is laid from cached
    characters: for every string of up to three label characters and for labels of values across magnitudes, signs
    and NaN, it is Pillow's drawing pixel for pixel, with the same offsets."""
    import itertools

    from instrument.logger import colorbar, render

    font = render._font(11)
    assert render._glyphs(font) is not None, (
        "this Pillow's default font no longer passes the check in render._glyphs: labels fall back to Pillow's "
        "drawing (slower on the writer thread, never different); see whether the check or the font changed")
    rng = np.random.default_rng(3)
    values = rng.normal(size=1500) * 10.0 ** rng.integers(-15, 16, size=1500)
    ends = [*values, 0.0, -0.0, np.nan, 5e-324, -1.7976931348623157e308, 4.44, -44.4]
    texts = [""] + [colorbar._fmt(v) for v in ends]
    texts += ["".join(t) for n in (1, 2, 3) for t in itertools.product(render._LABEL_CHARACTERS, repeat=n)]
    for text in texts:
        pixels, dx, dy = render._label(text, font)
        want, want_dx, want_dy = _pillow_label(text, font)
        assert (dx, dy) == (want_dx, want_dy), text
        np.testing.assert_array_equal(pixels, want, err_msg=text)
        assert not pixels.flags.writeable  # shared through the cache


@pytest.mark.parametrize("size", [8, None])
def test_a_font_whose_characters_cannot_be_laid_side_by_side_gets_pillows_labels(size):
    """At size 8 the default font's glyphs reach past their neighbour, and the bitmap font is another kind of font:
    either way the labels are exactly what Pillow draws (the check refuses to lay what it cannot lay exactly)."""
    from PIL import ImageFont

    from instrument.logger import render

    font = ImageFont.load_default(size=8) if size else ImageFont.load_default_imagefont()
    if size == 8:
        assert render._glyphs(font) is None
    for text in ("0.5", "-4.44e+04", "nan", "1.23e-07", "444"):
        pixels, dx, dy = render._label(text, font)
        want, want_dx, want_dy = _pillow_label(text, font)
        assert (dx, dy) == (want_dx, want_dy)
        np.testing.assert_array_equal(pixels, want, err_msg=text)


def _logged_heatmap(tmp_path: Path, matrix, **options) -> np.ndarray:
    """``matrix`` logged as heatmap "h" and read back from TensorBoard's PNG."""
    logger = Logger([TensorBoardBackend()], RunInfo("r", tmp_path))
    logger.log_heatmap("h", matrix, step=0, **options)
    logger.commit(0)
    logger.close()
    return _tb_pixels(tmp_path / "r", "h")


@pytest.mark.parametrize("lo, hi", [(-12345.6, -12001.0), (-0.000123456, 0.000987), (-1.2345e-300, 3.0)])
def test_colorbar_labels_are_never_cut_at_the_canvas_edge(tmp_path, lo, hi):
    """The right margin is widened to the widest colour-bar label: every label's text box lies inside the PNG."""
    from instrument.logger import render

    matrix = np.linspace(lo, hi, 8).reshape(4, 2)
    image = _logged_heatmap(tmp_path, matrix)
    assert (image[:, -2:] == 255).all(), "a label reaches the canvas's edge: it is cut"
    left, top, cw, ch = render.heatmap_geometry(4, 2)
    tick_x = left + 2 * cw + 8 + 10
    font = render._font(11)
    texts = render.colorbar_labels(render.colorbar_ticks(lo, hi, ch * 4))
    assert image.shape[1] >= tick_x + 5 + max(font.getbbox(text)[2] for text in texts)
    # where every label fits, the canvas keeps its width
    assert render.render_heatmap(np.array([[0.0, 1.0]])).shape[1] == left + 2 * 128 + render.RIGHT


@pytest.mark.parametrize("lo, hi", [(100.1, 100.9), (1000.0, 1000.5), (0.99901, 0.99999), (12345.0, 12349.0),
                                    (-12345.6, -12001.0), (1.0, 1.0 + 1e-12), (1e16, 1e16 + 64.0), (-1.0, 1.0),
                                    (0.013, 0.97), (999999.4, 1000001.0)])
def test_neighbouring_colorbar_labels_differ_and_are_the_values_rounded(lo, hi):
    from instrument.logger import render

    ticks = sorted(render.colorbar_ticks(lo, hi, 256), key=lambda tick: tick[1])
    texts = render.colorbar_labels(ticks)
    assert all(a != b for a, b in zip(texts[:-1], texts[1:], strict=True)), texts
    for (value, _), text in zip(ticks, texts, strict=True):
        assert abs(float(text) - value) <= 5e-3 * abs(value), (value, text)  # 3 significant digits or more
        assert len(text) <= 18
    # short where the range allows
    assert render.colorbar_labels(sorted(render.colorbar_ticks(-1.0, 1.0, 256), key=lambda t: t[1])) == [
        "1", "0.5", "0", "-0.5", "-1"]
    assert render.colorbar_labels([(1000.0, 0), (2000.0, 100)]) == ["1000", "2000"]


def test_a_users_range_narrower_than_rounding_noise_is_drawn_in_contrast_and_its_ends_labelled_apart():
    """color_range=(1.0, 1.0 + 4 ulp) is the user's scale: drawn in full contrast, so its two labels differ (both
    read '1' when the labels took it for a data range of rounding noise, drawn in one colour)."""
    from instrument.logger import render

    lo, hi = 1.0, 1.0 + 4 * np.spacing(1.0)
    image = render.render_heatmap(np.array([[lo, hi]]), color_range=(lo, hi))
    left, top, cw, ch = render.heatmap_geometry(1, 2)
    np.testing.assert_array_equal(image[top + ch // 2, [left + cw // 2, left + cw + cw // 2]], VIRIDIS_LUT[[0, 255]])
    tick_x = left + 2 * cw + 8 + 10
    top_label, bottom_label = (image[y - 6:y + 8, tick_x + 5:] for y in (top, top + ch - 1))
    assert not np.array_equal(top_label, bottom_label), "both ends of the colour bar read the same"
    texts = render.colorbar_labels(render.colorbar_ticks(lo, hi, ch), one_colour=False)
    assert texts[0] != texts[1] and float(texts[0]) == hi and float(texts[1]) == lo, texts
    # the same range taken from the data is drawn in one colour, labelled to 3 digits
    assert render.colorbar_labels(render.colorbar_ticks(lo, hi, ch)) == ["1", "1"]
    data = render.render_heatmap(np.array([[lo, hi]]))
    assert (data[top + ch // 2, left + cw // 2] == data[top + ch // 2, left + cw + cw // 2]).all()


def test_row_labels_of_many_digits_end_before_the_cells():
    """Row numbers of 5 digits and more are drawn whole, left of the cells: the band of the last labelled row is
    what Pillow draws for its number, not cut by the cells drawn over it."""
    from PIL import ImageDraw

    from instrument.logger import render

    rows = 12000
    image = render.render_heatmap(np.zeros((rows, 2)), target_size=64)
    left, top, cw, ch = render.heatmap_geometry(rows, 2, target_size=64)
    row = 10500  # the last row labelled: every 1500th (at most ~8 labels)
    y = top + row * ch + ch // 2
    band = image[y - 6:y + 8, :left - 3]
    font = render._font(11)

    def drawn_at(x0):
        reference = Image.new("RGB", (left + 64, 14), (255, 255, 255))
        ImageDraw.Draw(reference).text((x0, 0), str(row), fill=(0, 0, 0), font=font)
        return np.asarray(reference)[:, :left - 3]

    found = [x0 for x0 in range(left - 3) if np.array_equal(band, drawn_at(x0))]
    assert found, f"the row label {row} is not drawn whole left of the cells"
    x0 = found[0]
    assert x0 + font.getbbox(str(row))[2] < left - 3


def test_the_y_label_is_drawn_whole_and_rotated_beside_the_row_labels():
    from instrument.logger import render

    matrix = np.arange(32.0).reshape(16, 2)
    long, cut = (render.render_heatmap(matrix, y_label=label) for label in ("iteration", "iterati"))
    assert not np.array_equal(long, cut)  # not cut to 7 characters
    left, top, cw, ch = render.heatmap_geometry(16, 2, y_label="iteration")
    column = (long[:, :left - render._ROW_GAP] < 128).any(axis=2)  # left of the row labels
    ys, xs = np.nonzero(column)
    font = render._font(11)
    assert ys.max() - ys.min() + 1 >= font.getbbox("iteration")[2] - 3  # written bottom to top
    assert xs.max() - xs.min() + 1 <= font.getbbox("Agjy|")[3]
    # the row labels' column holds the row numbers only
    rows_column = long[:, left - render._ROW_GAP:left - 3]
    no_y = render.render_heatmap(matrix)
    np.testing.assert_array_equal(rows_column, no_y[:, left - render._ROW_GAP:left - 3])


def _dark_columns(band: np.ndarray) -> np.ndarray:
    return np.nonzero((band < 128).any(axis=(0, 2)))[0]


def test_texts_too_long_for_their_room_are_shortened_from_the_middle_keeping_their_ends():
    """A Cyrillic tag escapes to ~500 px on a 368 px canvas: its end (``1`` / ``2``) was cut off, so two tags had
    the same title row. A long y label made the image as tall as the label (2406 px for 400 characters), and a long
    x label was cut on both sides. Each is now shortened from the middle to its room, start and end kept."""
    from instrument.logger import render

    matrix = np.arange(512.0).reshape(32, 16)
    usual = render.render_heatmap(matrix, title="grad/norm", x_label="module", y_label="iteration")
    height, width = usual.shape[:2]
    left, top, cw, ch = render.heatmap_geometry(32, 16, y_label="iteration")
    first, second = (render.render_heatmap(matrix, title=f"градиенты/слой{i}") for i in (1, 2))
    assert first.shape[:2] == (height, width)
    assert not np.array_equal(first[:top - 2], second[:top - 2]), "the titles' distinguishing ends are cut off"
    assert _dark_columns(first[:top - 2]).max() < width - 2
    # the start is kept too: titles differing in their first character differ
    assert not np.array_equal(*(render.render_heatmap(matrix, title=f"{c}радиенты/слой1")[:top - 2] for c in "аб"))

    for label in ("y" * 400, "шаг обучения", "é" * 60, "layer." * 30 + "end"):  # the canvas never grows for it
        image = render.render_heatmap(matrix, y_label=label)
        assert image.shape[:2] == (height, width), label
        ys = np.nonzero((image[:, :left - render._ROW_GAP] < 128).any(axis=(1, 2)))[0]
        assert top <= ys.min() and ys.max() < top + ch * 32, label  # beside the cells
    ends = [render.render_heatmap(matrix, y_label="layer." * 30 + e)[:, :left - render._ROW_GAP] for e in "ab"]
    assert not np.array_equal(*ends)

    band = slice(top + ch * 32 + 6 + 14, height)  # the x label's row
    for label in ("x" * 200, "module/" * 40 + "end"):
        image = render.render_heatmap(matrix, x_label=label)
        assert image.shape[:2] == (height, width)
        columns = _dark_columns(image[band])
        assert columns.min() >= 2 and columns.max() < width - 2, label  # not cut on either side
    ends = [render.render_heatmap(matrix, x_label="module/" * 40 + e)[band] for e in "ab"]
    assert not np.array_equal(*ends)


def test_a_label_without_room_draws_nothing_and_a_huge_one_is_shortened_not_refused():
    """A review found an empty y label on a 1x1 heatmap drawn as a stray rotated '..' (no room, so the cut mark
    alone was drawn), and a title of a million escaped characters raising Pillow's 'too many characters in
    string' (the whole text was measured before it was shortened)."""
    from instrument.logger import render

    font = render._font(11)
    assert render._fitted("", font, -1) == "" and render._fitted("abc", font, 1) == ""
    plain = render.render_heatmap(np.zeros((1, 1)), target_size=1)
    assert np.array_equal(render.render_heatmap(np.zeros((1, 1)), y_label="", target_size=1), plain)
    huge = render.render_heatmap(np.arange(4.0).reshape(2, 2), title="\u03b8" * 10**6, x_label="x" * 10**6)
    assert huge.shape == render.render_heatmap(np.arange(4.0).reshape(2, 2)).shape
    shortened = render._fitted("θ" * 10**6 + "end", font, 200)
    assert shortened.startswith("\\u03b8") and shortened.endswith("end") and ".." in shortened


def test_usual_labels_are_drawn_whole_as_before():
    """Short ASCII labels are drawn as given, where they were drawn (the x label as before: 3 px per character
    left of the cells' centre)."""
    from PIL import ImageDraw

    from instrument.logger import render

    matrix = np.arange(512.0).reshape(32, 16)
    image = render.render_heatmap(matrix, title="grad/norm", x_label="module", y_label="iteration")
    left, top, cw, ch = render.heatmap_geometry(32, 16, y_label="iteration")
    font = render._font(11)
    reference = Image.new("RGB", (image.shape[1], image.shape[0]), (255, 255, 255))
    draw = ImageDraw.Draw(reference)
    draw.text((left, 4), "grad/norm", fill=(0, 0, 0), font=font)
    y = top + ch * 32 + 6 + 14
    draw.text((left + cw * 16 // 2 - 3 * len("module"), y), "module", fill=(0, 0, 0), font=font)
    reference = np.asarray(reference)
    bar_x = left + cw * 16 + 8  # the colour bar's top label reaches up into the title's rows
    np.testing.assert_array_equal(image[:top - 2, :bar_x], reference[:top - 2, :bar_x])
    np.testing.assert_array_equal(image[y:], reference[y:])


def test_characters_the_font_lacks_are_drawn_as_escapes_so_names_stay_apart(tmp_path):
    """Pillow's default font has ASCII only: "θ" and "ω" would both be the missing-glyph box. They are drawn as
    ``\\u03b8`` and ``\\u03c9``; the metric key keeps the name."""
    from instrument.logger import render

    matrix = np.arange(4.0).reshape(2, 2)
    assert render.drawable_text("θ-ω é\n") == "\\u03b8-\\u03c9 \\u00e9\\u000a"
    assert render.drawable_text("conv1.weight") == "conv1.weight"
    theta, omega = (render.render_heatmap(matrix, title=name) for name in ("θ", "ω"))
    assert not np.array_equal(theta, omega)
    theta, omega = (render.render_heatmap(matrix, x_ticks=[name, "a"]) for name in ("θ", "ω"))
    assert not np.array_equal(theta, omega)
    # a backslash typed before "u" is drawn doubled: not the escape of "θ"
    assert not np.array_equal(theta, render.render_heatmap(matrix, x_ticks=["\\u03b8", "a"]))
    logger = Logger([TensorBoardBackend()], RunInfo("r", tmp_path))
    logger.log_heatmap("act/θ", matrix, step=0, y_label="θ")
    logger.commit(0)
    logger.close()
    drawn = _tb_pixels(tmp_path / "r", "act/θ")
    np.testing.assert_array_equal(drawn, render.render_heatmap(matrix, title="act/θ", y_label="θ"))
    assert not np.array_equal(drawn, render.render_heatmap(matrix, title="act/\\u03b8", y_label="\\u03b8"))


def test_a_typed_backslash_is_drawn_doubled_where_escapes_could_be_read_into_it():
    """``act/caf\\u00e9`` typed with a real backslash and ``act/café`` are drawn differently; a backslash in a
    text with nothing escaped and no backslash before "u" is drawn as it is."""
    from instrument.logger import render

    typed, accented = "act/caf\\u00e9", "act/caf\u00e9"
    assert render.drawable_text(accented) == "act/caf\\u00e9"
    assert render.drawable_text(typed) == "act/caf\\\\u00e9"
    assert render.drawable_text("a\\θ") == "a\\\\\\u03b8"
    assert render.drawable_text("C:\\dir\\x") == "C:\\dir\\x"
    matrix = np.arange(4.0).reshape(2, 2)
    assert not np.array_equal(render.render_heatmap(matrix, title=typed), render.render_heatmap(matrix, title=accented))


def test_video_frames_that_read_as_tchw_and_as_thwc_are_drawn_as_thwc_and_said_once_per_tag(tmp_path, caplog):
    """A [T, C, H, W] video whose width is 1, 3 or 4 was read as [T, H, W, C] without a word (log_image says so for
    the same ambiguity). It is drawn as [T, H, W, C], as documented, and said once per tag."""
    logger = Logger([TensorBoardBackend()], RunInfo("r", tmp_path))
    frames = np.zeros((2, 3, 16, 4), dtype=np.uint8)
    frames[1] = 255
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            logger.log_video("v", frames, step, fps=2)
            logger.commit(step)
    logger.close()
    said = _warnings(caplog, "reads as [T,C,H,W] and as [T,H,W,C]")
    assert len(said) == 1 and "log_video('v')" in said[0] and "permute(0, 2, 3, 1)" in said[0]
    gif = Image.open(io.BytesIO(event_accumulator(tmp_path / "r").Images("v")[-1].encoded_image_string))
    assert gif.size == (16, 3)  # width 16, height 3: [T, H=3, W=16, C=4]
