"""Host-side image work: normalising user images and drawing heatmaps with readable axes.

Runs at commit on values already on the host. Drawn with Pillow and a small colour map rather than
matplotlib, so a heatmap costs about a millisecond instead of a figure's tens of milliseconds.
"""

import functools

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from instrument.core.colormap import NAN_COLOUR as _NAN_COLOUR
from instrument.core.colormap import VIRIDIS_LUT as _LUT

__all__ = ["to_hwc_uint8", "render_heatmap"]


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


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has only the bitmap font
        return ImageFont.load_default()


def _fmt(v: float) -> str:
    return f"{v:.3g}" if np.isfinite(v) else "nan"


@functools.lru_cache(maxsize=64)
def _heatmap_frame(rows: int, cols: int, title: str, x_label: str, y_label: str, target_size: int):
    """Everything of a heatmap that does not depend on its values: drawn once per layout, then copied.

    Text drawing is most of a heatmap's cost, and the axes, ticks and colour bar repeat every logging step.
    """
    cw = max(1, target_size // cols)
    ch = max(1, target_size // rows)
    pw, ph = cw * cols, ch * rows
    font = _font(11)
    left, top, bottom, right = 48, 22, 34, 64
    canvas = Image.new("RGB", (left + pw + right, top + ph + bottom), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    draw.text((left, 4), title, fill=(0, 0, 0), font=font)
    for c in range(0, cols, max(1, int(np.ceil(cols / 8)))):  # at most ~8 tick labels per axis
        x = left + c * cw + cw // 2
        draw.line([(x, top + ph), (x, top + ph + 3)], fill=(0, 0, 0))
        draw.text((x - 4, top + ph + 4), str(c), fill=(0, 0, 0), font=font)
    draw.text((left + pw // 2 - 3 * len(x_label), top + ph + 18), x_label, fill=(0, 0, 0), font=font)
    for r in range(0, rows, max(1, int(np.ceil(rows / 8)))):
        y = top + r * ch + ch // 2
        draw.line([(left - 3, y), (left, y)], fill=(0, 0, 0))
        draw.text((left - 26, y - 6), str(r), fill=(0, 0, 0), font=font)
    draw.text((2, top + ph // 2), y_label[:7], fill=(0, 0, 0), font=font)
    bar_x = left + pw + 8
    bar = _LUT[np.linspace(255, 0, ph).astype(np.uint8)][:, None, :].repeat(10, axis=1)
    canvas.paste(Image.fromarray(np.ascontiguousarray(bar)), (bar_x, top))
    return canvas, (left, top), (cw, ch), (bar_x + 13, top - 2), (bar_x + 13, top + ph - 10), font


def render_heatmap(
    matrix: np.ndarray,
    title: str = "",
    x_label: str = "",
    y_label: str = "",
    target_size: int = 256,
) -> np.ndarray:
    """Draw ``matrix`` [rows, cols] as a colour-mapped image with tick labels, axis names and a colour bar.

    Rows run top to bottom (row 0 at the top), which reads naturally for "iteration" axes.
    """
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim == 1:
        m = m[:, None]
    if m.ndim != 2 or m.size == 0:
        raise ValueError(f"log_heatmap({title!r}): expected a non-empty 2-D matrix, got shape {m.shape}.")
    rows, cols = m.shape
    finite = m[np.isfinite(m)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    span = hi - lo if hi > lo else 1.0
    idx = np.clip(((np.nan_to_num(m, nan=lo) - lo) / span * 255.0).round(), 0, 255).astype(np.uint8)
    cells = _LUT[idx]
    cells[~np.isfinite(m)] = _NAN_COLOUR
    frame, origin, (cw, ch), hi_at, lo_at, font = _heatmap_frame(rows, cols, title, x_label, y_label, target_size)
    canvas = frame.copy()
    canvas.paste(Image.fromarray(np.repeat(np.repeat(cells, ch, axis=0), cw, axis=1)), origin)
    draw = ImageDraw.Draw(canvas)
    draw.text(hi_at, _fmt(hi), fill=(0, 0, 0), font=font)
    draw.text(lo_at, _fmt(lo), fill=(0, 0, 0), font=font)
    return np.asarray(canvas, dtype=np.uint8)
