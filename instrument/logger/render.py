"""Host-side image work: normalising user images and drawing heatmaps with readable axes.

Runs on the logger's writer thread, on values already on the host, holding the GIL for most of it: on a GPU,
where the training thread is mostly Python launching kernels, that time is taken from training. A heatmap's frame
(title, axes, tick labels, colour bar) is drawn once per layout with Pillow and kept as an array; each heatmap is
then a copy of it with the cells written in NumPy and the colour-bar labels laid from cached text (a label not
seen before from cached characters). On a 2-core CPU machine the bench's 16 x 32 heatmap takes about 0.14 ms
with warm caches and about 0.45 ms on the writer thread between training steps, where caches are cold (0.76 ms
there while new labels were drawn by Pillow; 0.8 ms warm when the whole heatmap was drawn with Pillow, tens of
milliseconds with matplotlib), pixel for pixel the same image.
"""

import functools
import math
from typing import Dict, Optional, Tuple

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from instrument.core.colormap import NAN_COLOUR as _NAN_COLOUR
from instrument.core.colormap import VIRIDIS_LUT as _LUT
from instrument.logger.colorbar import colorbar_labels, colorbar_ticks, is_degenerate, ticks_and_step

__all__ = ["to_hwc_uint8", "render_heatmap", "heatmap_geometry", "colorbar_ticks", "colorbar_labels", "drawable_text",
           "is_degenerate", "TICK_ROOM"]


def to_hwc_uint8(image: np.ndarray, tag: str = "image") -> np.ndarray:
    """Accept [H,W], [C,H,W] or [H,W,C] with C in (1,3,4), floats in [0,1] or uint8; return [H,W,3|4] uint8."""
    img = np.asarray(image)
    if img.ndim == 2:
        img = img[:, :, None]
    elif img.ndim == 3 and img.shape[0] in (1, 3, 4) and img.shape[-1] not in (1, 3, 4):
        img = np.transpose(img, (1, 2, 0))
    if img.ndim != 3 or img.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"log_image({tag!r}): expected an image of shape [H,W], [C,H,W] or [H,W,C] with C in 1, 3 or 4, "
            f"got shape {tuple(np.asarray(image).shape)}."
        )
    if img.dtype != np.uint8:
        img = (np.clip(np.nan_to_num(img.astype(np.float64)), 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    if img.shape[-1] == 1:
        img = np.repeat(img, 3, axis=-1)
    return np.ascontiguousarray(img)


@functools.cache
def _font(size: int) -> ImageFont.ImageFont:
    """One font object per size, shared by every layout: the label caches (`_label`, `_glyphs`) are per font."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has only the bitmap font
        return ImageFont.load_default()


_MISSING = "\uffff"  # a noncharacter: no font has it, so it is drawn as the font's missing-glyph box


@functools.lru_cache(maxsize=4096)
def _drawable(char: str, font) -> bool:
    """Whether ``font`` draws ``char`` as itself, not as its missing-glyph box (a control character: never)."""
    if not char.isprintable():
        return False
    if char.isascii():
        return True
    mask, missing = font.getmask(char), font.getmask(_MISSING)
    return mask.size != missing.size or bytes(mask) != bytes(missing)


def drawable_text(text: str, font=None) -> str:
    """``text`` as a heatmap draws it: each character the font cannot draw (Pillow's default font has ASCII only:
    "θ", "ü", a newline) written as its escape (``\\u03b8``), so that names differing in such characters stay
    distinguishable on the image instead of all showing the same missing-glyph boxes. Only the drawn text: the
    metric's key is unchanged."""
    return "".join(_drawn_units(text, _font(11) if font is None else font))


def _drawn_units(text: str, font) -> tuple:
    """`drawable_text` per character of ``text``: what each is drawn as. Where anything is escaped, or the text
    holds a backslash before "u" or "U" itself, a backslash is drawn as ``\\\\``: a typed ``caf\\u00e9`` and
    ``café`` are drawn differently (a text left as it is never shows a backslash before "u" or "U")."""
    if text.isascii() and text.isprintable() and "\\u" not in text and "\\U" not in text:
        return tuple(text)
    units = tuple(
        c if _drawable(c, font) else (f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}") for c in text
    )
    return tuple("\\\\" if c == "\\" else c for c in units)


_CUT = ".."  # where a text too long for its room is shortened (the default font has no ellipsis glyph)


def _fitted(text: str, font, room: int) -> str:
    """``text`` as drawn (`drawable_text`), shortened from the middle where it is wider than ``room`` pixels: its
    start and its end kept (a tag's distinguishing part is usually at its end: ``grad/.../layer2``) around
    ``..``, whole characters (escapes) only, measured with the font's own text width."""
    units = _drawn_units(text, font) if text else ()
    if not units or font.getbbox(_CUT)[2] > room:  # nothing to draw, or no room even for the cut mark
        return "" if not units or len(units) > room or font.getbbox("".join(units))[2] > room else "".join(units)
    if len(units) <= room:  # every character is a pixel wide at least: a longer text cannot fit
        whole = "".join(units)
        if font.getbbox(whole)[2] <= room:
            return whole
    if len(units) > 2 * room:  # only the first and last `room` characters can be kept: measure no more
        units = units[:room] + units[-room:]

    def cut(keep: int) -> str:  # the end gets the odd character
        head = keep // 2
        return "".join(units[:head]) + _CUT + "".join(units[len(units) - (keep - head):])

    fits, wider = 0, len(units)  # keep `fits` characters: fits; `wider`: does not (the whole text)
    while wider - fits > 1:
        keep = (fits + wider) // 2
        if font.getbbox(cut(keep))[2] <= room:
            fits = keep
        else:
            wider = keep
    return cut(fits)


# Layout of a heatmap canvas, in pixels: the least margins around the cells (wider where labels need it).
LEFT, TOP, RIGHT = 48, 22, 64
_BAR_WIDTH = 10
_ROW_GAP = 26  # row labels start this far left of the cells, or further where they are wider
TICK_ROOM = 128  # the most pixels a column name written vertically takes: longer ones are shortened


def _row_labels(rows: int) -> range:
    """The row indices labelled: at most ~8."""
    return range(0, rows, max(1, int(np.ceil(rows / 8))))


@functools.lru_cache(maxsize=256)
def heatmap_geometry(rows: int, cols: int, target_size: int = 256, y_label: str = ""):
    """Where the cells of a ``rows`` x ``cols`` heatmap are drawn: ``(left, top, cell_width, cell_height)``.

    Cell ``(r, c)`` covers ``x`` in ``[left + c * cell_width, left + (c + 1) * cell_width)`` and the same for
    rows; its centre is the pixel to read back when checking colours. ``left`` is `LEFT` unless the row labels
    (5 digits and more) and the y label (drawn rotated, in a column of its own) need more room.
    """
    font = _font(11)
    widest = max(font.getbbox(str(r))[2] for r in _row_labels(rows))
    label_column = font.getbbox("Agjy|")[3] + 6 if y_label else 2
    left = max(LEFT, label_column + max(_ROW_GAP, widest + 6))
    return left, TOP, max(1, target_size // cols), max(1, target_size // rows)


def _vertical_text(text: str, font, fill=(0, 0, 0)) -> Image.Image:
    """``text`` drawn bottom to top (rotated 90 degrees), on white, for x tick labels too wide to lie flat."""
    box = font.getbbox(text)
    img = Image.new("RGB", (max(1, box[2]) + 2, max(1, box[3]) + 2), (255, 255, 255))
    ImageDraw.Draw(img).text((1, 0), text, fill=fill, font=font)
    return img.rotate(90, expand=True)


@functools.lru_cache(maxsize=64)
def _heatmap_frame(rows: int, cols: int, title: str, x_label: str, y_label: str, target_size: int, x_ticks):
    """Everything of a heatmap that does not depend on its values: drawn once per layout, then copied.

    Text drawing is most of a heatmap's cost, and the axes, tick labels and colour bar repeat every logging step.
    """
    left, top, cw, ch = heatmap_geometry(rows, cols, target_size, y_label)
    pw, ph = cw * cols, ch * rows
    font = _font(11)
    width = left + pw + RIGHT
    # Each text shortened from the middle to its room (`_fitted`): the title right of `left`, the x label the
    # canvas's width, the y label (rotated) the cells' height. The canvas never grows for them.
    shown_x = _fitted(x_label, font, width - 4)
    title, y_label = _fitted(title, font, width - left - 2), _fitted(y_label, font, ph - 2)
    labels = [drawable_text(t, font) for t in x_ticks] if x_ticks is not None else [str(c) for c in range(cols)]
    widths = [font.getbbox(label)[2] for label in labels]
    # Names (channel or module names) wider than their cell are written vertically, every one that fits, each
    # shortened from the middle to `TICK_ROOM` pixels: the canvas is never taller than that for them. Cells wider
    # than that (one or two columns) have their names shortened to the cell and laid flat.
    room = max(cw - 2, TICK_ROOM)
    if x_ticks is not None and max(widths) > room:
        labels = [_fitted(t, font, room) for t in x_ticks]
        widths = [font.getbbox(label)[2] for label in labels]
    vertical = x_ticks is not None and max(widths) > cw - 2
    stride = max(1, int(np.ceil(12 / cw))) if vertical else max(1, int(np.ceil(cols / 8)))
    label_height = max(widths) + 4 if vertical else 14
    bottom = 6 + label_height + 16
    y_text = _vertical_text(y_label, font) if y_label else None  # bottom to top, left of the row labels
    height = top + ph + bottom
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    draw.text((left, 4), title, fill=(0, 0, 0), font=font)
    for c in range(0, cols, stride):  # at most ~8 index labels per axis; names as many as fit
        x = left + c * cw + cw // 2
        draw.line([(x, top + ph), (x, top + ph + 3)], fill=(0, 0, 0))
        if vertical:
            text = _vertical_text(labels[c], font)
            canvas.paste(text, (x - text.width // 2, top + ph + 5))
        else:
            draw.text((x - widths[c] // 2, top + ph + 4), labels[c], fill=(0, 0, 0), font=font)
    if shown_x:  # centred under the cells, within the canvas; a label shown as given placed as it always was
        shown_width = font.getbbox(shown_x)[2]
        x = left + pw // 2 - (3 * len(shown_x) if shown_x == x_label else shown_width // 2)
        x = max(2, min(x, width - 2 - shown_width))
        draw.text((x, top + ph + 6 + label_height), shown_x, fill=(0, 0, 0), font=font)
    row_x = left - max(_ROW_GAP, max(font.getbbox(str(r))[2] for r in _row_labels(rows)) + 6)
    for r in _row_labels(rows):
        y = top + r * ch + ch // 2
        draw.line([(left - 3, y), (left, y)], fill=(0, 0, 0))
        draw.text((row_x, y - 6), str(r), fill=(0, 0, 0), font=font)
    if y_text is not None:  # centred on the cells, within the canvas
        canvas.paste(y_text, (2, min(max(2, top + ph // 2 - y_text.height // 2), height - y_text.height - 2)))
    bar_x = left + pw + 8
    # Rounded, as the cells' indices are: truncated, a tick's colour was one entry off its value's cell.
    bar = _LUT[np.rint(np.linspace(255, 0, ph)).astype(np.uint8)][:, None, :].repeat(_BAR_WIDTH, axis=1)
    canvas.paste(Image.fromarray(np.ascontiguousarray(bar)), (bar_x, top))
    frame = np.array(canvas, dtype=np.uint8)
    frame.flags.writeable = False  # shared by every heatmap of this layout: each draws on a copy
    return frame, (left, top), (cw, ch), bar_x, font


@functools.lru_cache(maxsize=1024)
def _label(text: str, font) -> tuple:
    """``text`` drawn in black on white, as Pillow draws it onto the canvas: ``(pixels, dx, dy)``, the pixels to
    lay at ``(x + dx, y + dy)`` for text drawn at ``(x, y)``. Colour-bar labels are round values and repeat from
    step to step, so each is drawn once. The ends of the bar (the matrix's own minimum and maximum) change at
    every logging step: those are laid from cached characters where that gives Pillow's pixels (`_glyphs`)."""
    glyphs = _glyphs(font)
    if glyphs is not None and text and all(c in glyphs for c in text):
        return _laid(text, glyphs)
    return _drawn(text, font)


def _drawn(text: str, font) -> tuple:
    """``text`` drawn by Pillow, as `_label` returns it."""
    left, top, right, bottom = font.getbbox(text)
    dx, dy = min(left, 0), min(top, 0)
    image = Image.new("RGB", (max(1, right - dx), max(1, bottom - dy)), (255, 255, 255))
    ImageDraw.Draw(image).text((-dx, -dy), text, fill=(0, 0, 0), font=font)
    pixels = np.array(image, dtype=np.uint8)
    pixels.flags.writeable = False
    return pixels, dx, dy


# What `colorbar._fmt` writes: digits, sign, point and exponent of a finite value, and "nan".
_LABEL_CHARACTERS = "0123456789.-+ena"


@functools.lru_cache(maxsize=8)
def _glyphs(font) -> Optional[Dict[str, tuple]]:
    """Each label character drawn once, if laying them side by side (`_laid`) gives what Pillow draws for any
    label; else None, and every label is drawn by Pillow. Per character ``(pixels, coverage, spill, advance)``:
    its ``advance`` columns in black on white and as coverage (255 - pixel), and the coverage of the columns it
    reaches into the next character (None if none).

    Drawing a label with Pillow costs about 150 us (more on the writer thread between training steps, with cold
    caches), and a heatmap's two end labels, its own minimum and maximum, miss the cache at every logging step;
    laying cached characters costs about 15 us. It is exact when the font advances by whole pixels and kerns no
    pair of these characters: every glyph is then drawn at a whole-pixel pen position, the same bitmap whatever
    stands beside it, and where neighbours overlap (a "4" reaches one pixel into the next character) Pillow
    composes their coverage as `_laid` does. Checked here, once per font: every glyph starts at its pen position
    on one baseline box, reaches no further than into its neighbour, and every pair of characters laid is
    compared with Pillow's drawing, pixel for pixel. A Pillow or font that draws otherwise falls back: a label
    is never drawn differently."""
    glyphs, height = {}, None
    for char in _LABEL_CHARACTERS:
        advance = font.getlength(char)
        pixels, dx, dy = _drawn(char, font)
        if advance != int(advance) or (dx, dy) != (0, 0) or height not in (None, pixels.shape[0]):
            return None
        height, advance = pixels.shape[0], int(advance)
        if not (pixels == pixels[..., :1]).all():  # grey only: black text on white
            return None
        if pixels.shape[1] < advance:  # narrower than its advance: white up to the next pen position
            pixels = np.pad(pixels, ((0, 0), (0, advance - pixels.shape[1]), (0, 0)), constant_values=255)
        coverage = 255 - pixels[..., 0].astype(np.int32)
        spill = coverage[:, advance:] if pixels.shape[1] > advance else None
        glyphs[char] = (np.ascontiguousarray(pixels[:, :advance]), coverage[:, :advance], spill, advance)
    reach = max(0 if spill is None else spill.shape[1] for _, _, spill, _ in glyphs.values())
    if reach > min(advance for *_, advance in glyphs.values()):  # a pair would not show every overlap
        return None
    for first in _LABEL_CHARACTERS:
        for second in _LABEL_CHARACTERS:
            laid, drawn = _laid(first + second, glyphs), _drawn(first + second, font)
            if laid[1:] != drawn[1:] or not np.array_equal(laid[0], drawn[0]):
                return None
    return glyphs


def _laid(text: str, glyphs: Dict[str, tuple]) -> tuple:
    """``text`` laid from cached characters (`_glyphs`), as `_label` returns it: the characters' columns side by
    side, then each overlap composed as Pillow composes a glyph over the text drawn before it (``new + old *
    (255 - new) / 255``, rounded as Pillow rounds) and drawn in black on white (a pixel is 255 minus coverage)."""
    parts = [glyphs[char] for char in text]
    spill = parts[-1][2]
    columns = [part[0] for part in parts]
    if spill is not None:  # the last character reaches past its advance: over white, as drawn alone
        columns.append(np.repeat((255 - spill).astype(np.uint8)[..., None], 3, axis=2))
    pixels = np.concatenate(columns, axis=1)
    pen = 0
    for part, following in zip(parts[:-1], parts[1:], strict=True):
        pen += part[3]
        if part[2] is not None:
            width = part[2].shape[1]
            new = following[1][:, :width]
            kept = part[2] * (255 - new) + 128
            pixels[:, pen:pen + width] = (255 - new - (((kept >> 8) + kept) >> 8)).astype(np.uint8)[..., None]
    pixels.flags.writeable = False
    return pixels, 0, 0


def _darken(canvas: np.ndarray, pixels: np.ndarray, x: int, y: int) -> None:
    """Lay black-on-white ``pixels`` onto ``canvas`` at ``(x, y)`` (clipped to the canvas): over white, what
    Pillow draws; where two labels' boxes meet, the darker of the two."""
    h, w = pixels.shape[:2]
    x0, y0 = max(x, 0), max(y, 0)
    x1, y1 = min(x + w, canvas.shape[1]), min(y + h, canvas.shape[0])
    if x1 > x0 and y1 > y0:
        region = canvas[y0:y1, x0:x1]
        np.minimum(region, pixels[y0 - y:y1 - y, x0 - x:x1 - x], out=region)


def render_heatmap(
    matrix: np.ndarray,
    title: str = "",
    x_label: str = "",
    y_label: str = "",
    target_size: int = 256,
    color_range=None,
    x_ticks=None,
    at_least: Optional[Tuple[int, int]] = None,
) -> np.ndarray:
    """Draw ``matrix`` [rows, cols] as a colour-mapped image with tick labels, axis names and a colour bar.

    Rows run top to bottom (row 0 at the top), which reads naturally for "iteration" axes. ``color_range``
    ``(lo, hi)`` fixes the scale (values outside it get the end colours), so the same value has the same colour
    in every image drawn with that range; None scales each matrix to its own finite min and max. ``x_ticks``
    names the columns (one string per column) instead of numbering them. NaN and infinite cells are grey.

    Each row and column of cells is ``target_size // rows`` (``// cols``) pixels, and one pixel at least: a matrix
    of more than ``target_size`` rows is drawn one pixel per row, every value its own pixel (never averaged).
    ``at_least`` ``(height, width)``: the canvas is made at least that large, white below and right of what is
    drawn, which stays where it would be (the logger passes a tag's largest canvas so far: `media.CanvasSizes`).
    """
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim == 1:
        m = m[:, None]
    if m.ndim != 2 or m.size == 0:
        raise ValueError(f"log_heatmap({title!r}): expected a non-empty 2-D matrix, got shape {m.shape}.")
    rows, cols = m.shape
    if x_ticks is not None and len(x_ticks) != cols:
        raise ValueError(f"log_heatmap({title!r}): {len(x_ticks)} x_ticks for {cols} columns; give one per column.")
    known = np.isfinite(m)  # NaN and infinite cells are drawn grey
    if color_range is None:
        finite = m[known]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    else:
        lo, hi = float(color_range[0]), float(color_range[1])
    # A constant image, or one whose range is float rounding noise (`is_degenerate`), is drawn in one colour.
    one_colour = not hi > lo or (color_range is None and is_degenerate(lo, hi))
    span = 1.0 if one_colour else hi - lo
    # NaN and -inf as lo, +inf as hi: np.nan_to_num's replacement, without its Python (a tenth of a heatmap's
    # time on the writer thread, with cold caches).
    filled = np.where(known, m, np.where(m > 0, hi, lo))
    with np.errstate(invalid="ignore", over="ignore"):
        if math.isfinite(span):
            scaled = (filled - lo) / span * 255.0
        else:  # a range wider than float64 holds (-1e308 .. 1e308): scaled in halves, exact as halving is
            scaled = (filled / 2 - lo / 2) / (hi / 2 - lo / 2) * 255.0
    idx = np.clip(scaled.round(), 0, 255).astype(np.uint8)
    cells = _LUT[idx]
    cells[~known] = _NAN_COLOUR
    ticks = tuple(x_ticks) if x_ticks is not None else None
    frame, (left, top), (cw, ch), bar_x, font = _heatmap_frame(rows, cols, title, x_label, y_label, target_size, ticks)
    tick_x = bar_x + _BAR_WIDTH
    bar_ticks, step = ticks_and_step(lo, hi, ch * rows)
    labels = [_label(text, font) for text in colorbar_labels(bar_ticks, one_colour, step)]
    # the canvas is widened where a label would not fit the right margin: a label is never cut
    width = max(frame.shape[1], max(tick_x + 5 + dx + pixels.shape[1] for pixels, dx, _ in labels) + 2)
    height = frame.shape[0] if at_least is None else max(frame.shape[0], at_least[0])
    width = width if at_least is None else max(width, at_least[1])
    if (height, width) != frame.shape[:2]:  # the frame copied once, white written only where it is not
        canvas = np.empty((height, width, 3), dtype=np.uint8)
        canvas[:frame.shape[0], :frame.shape[1]] = frame
        canvas[:frame.shape[0], frame.shape[1]:] = 255
        canvas[frame.shape[0]:] = 255
    else:
        canvas = frame.copy()
    # Each row of cells widened to its pixels once, then broadcast over its ch pixel rows through a view of the
    # canvas (splitting the height axis is always a view): whole rows copied, no upscaled image, no PIL round trip.
    widened = np.repeat(cells, cw, axis=1)  # [rows, cols * cw, 3]
    canvas[top:top + ch * rows, left:left + cw * cols].reshape(rows, ch, cols * cw, 3)[...] = widened[:, None]
    for (_, y), (pixels, dx, dy) in zip(bar_ticks, labels, strict=True):
        y += top
        canvas[y, tick_x:tick_x + 4] = 0  # the tick: a black line 4 pixels long
        _darken(canvas, pixels, tick_x + 5 + dx, y - 6 + dy)
    return canvas
