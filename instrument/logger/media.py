"""The table of media kinds the logger stages: how each is checked on the caller and converted on the writer.

A media kind is one `MediaKind` entry: ``check`` runs on the calling (training) thread and must be cheap
(shape, dtype, device: metadata only, never a host sync); it raises `InvalidValueError` for a value that can
never be written. ``convert`` runs on the logger's writer thread, on host values, and builds what the backends
get in the `StepRecord` field named ``field``. Device tensors inside a staged value travel in the commit's one
batched transfer; ``convert`` reads their host copies through ``host(tensor)``.

Adding a kind is one entry here and one ``log_<kind>`` method on the `Logger`.
"""

import dataclasses
import logging
import math
import numbers
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from instrument.core.colormap import parse_color_range
from instrument.errors import InvalidValueError
from instrument.logger.plain import plain_tensor
from instrument.logger.render import is_degenerate, render_heatmap, to_hwc_uint8
from instrument.logger.samples import check_samples, convert_samples

__all__ = ["MediaKind", "KINDS", "CanvasSizes", "check_color_range", "check_media", "heatmap_options", "plain_tensor",
           "refuse_shared_tag", "tensors_of", "video_fps"]

Host = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class MediaKind:
    """One kind of staged media.

    Attributes:
        name: the kind (``"image"``), used in messages.
        field: the `StepRecord` attribute the converted value goes to (``"images"``).
        check: ``(tag, value, extra) -> staged value``; on the caller; raises `InvalidValueError`.
        convert: ``(tag, staged value, extra, host) -> record value``; on the writer thread.
        expected: what a valid value looks like, for messages.
    """

    name: str
    field: str
    check: Callable[[str, Any, Any], Any]
    convert: Callable[[str, Any, Any, Host], Any]
    expected: str


def _array_like(kind: str, tag: str, value: Any, expected: str) -> Any:
    """A tensor made plain (`plain_tensor`: detached, dense, dequantized; meta, nested, complex and
    non-numeric tensors refused) or an ndarray; metadata checks only.

    A NumPy value is copied here (a host copy, cheap next to drawing it): the writer converts it after
    `commit` returned, and a buffer the caller refills for the next step must be written as it was when
    logged. Tensors are copied by the commit's transfer (`instrument.logger.transfer`)."""
    if isinstance(value, Tensor):
        return plain_tensor(f"log_{kind}({tag!r})", value, expected)
    try:
        array = np.array(value)  # always a copy (np.asarray would keep the caller's ndarray)
    except Exception as exc:
        raise InvalidValueError(
            f"log_{kind}({tag!r}): got {type(value).__name__}, which is not array-like ({exc}); expected {expected}."
        ) from exc
    if array.dtype.kind not in "biuf":
        raise InvalidValueError(
            f"log_{kind}({tag!r}): got an array of dtype {array.dtype}; expected {expected} (numbers)."
        )
    return array


def _shape(value: Any) -> tuple:
    return tuple(value.shape)


def _check_pixel_dtype(kind: str, tag: str, value: Any, expected: str) -> None:
    """Pixels are floats in [0, 1], uint8 or bool. Other integers are refused: read as floats, 0..255 would be
    clipped to 1 and drawn almost all white, a wrong picture with no error."""
    if isinstance(value, Tensor):
        integer = not (value.dtype.is_floating_point or value.dtype in (torch.uint8, torch.bool))
    else:
        integer = value.dtype.kind in "iu" and value.dtype != np.uint8
    if integer:
        raise InvalidValueError(
            f"log_{kind}({tag!r}): got pixels of dtype {value.dtype}; expected {expected}. Convert 0..255 values "
            f"with .to(torch.uint8) (NumPy: .astype(np.uint8)), or divide by 255 for floats in [0, 1]."
        )


def _is_image_shape(shape: tuple) -> bool:
    if len(shape) == 2:
        return True
    return len(shape) == 3 and (shape[-1] in (1, 3, 4) or shape[0] in (1, 3, 4))


_IMAGE = "an image of shape [H,W], [C,H,W] or [H,W,C] with C in 1, 3 or 4 (floats in [0,1], uint8 or bool)"


def _check_image(tag: str, value: Any, extra: Any) -> Any:
    value = _array_like("image", tag, value, _IMAGE)
    _check_pixel_dtype("image", tag, value, _IMAGE)
    shape = _shape(value)
    if not _is_image_shape(shape) or 0 in shape:
        raise InvalidValueError(f"log_image({tag!r}): expected {_IMAGE} (none of them 0), got shape {shape}.")
    return value


def _host_pixels(value: Any, host: Host) -> np.ndarray:
    """The host copy of an image or video; a uint8 tensor stays uint8 (the transfer carries float64, and
    floats mean [0, 1] to `to_hwc_uint8`: a uint8 tensor sent as 0..255 floats would come out all white)."""
    array = np.asarray(host(value))
    if isinstance(value, Tensor) and value.dtype == torch.uint8 and array.dtype != np.uint8:
        array = array.astype(np.uint8)  # exact: float64 holds every uint8
    return array


def _check_pixel_values(call: str, tag: str, pixels: np.ndarray, said: Any) -> None:
    """Float pixels are read in [0, 1]: say once per tag when some are outside it, or NaN or infinite, since
    they are then drawn as another value (clipped; NaN and -inf as 0, +inf as 255)."""
    if pixels.dtype.kind != "f":
        return
    finite_mask = np.isfinite(pixels)
    finite = pixels[finite_mask]
    if finite.size and (finite.min() < 0.0 or finite.max() > 1.0):
        _say_once(said, tag, "range", "instrument: %s(%r) got floats from %.4g to %.4g; float pixels are read in "
                  "[0, 1], so the rest is clipped (0..255 floats come out white). Pass uint8 pixels, or divide by "
                  "255. (Said once per tag.)", call, tag, finite.min(), finite.max())
    if finite.size != pixels.size:
        _say_once(said, tag, "nonfinite", "instrument: %s(%r) got %d NaN or infinite pixel value(s) of %d; they are "
                  "drawn as 0 (NaN, -inf) and 255 (+inf), so they look like real pixels. Replace them before logging "
                  "(e.g. torch.nan_to_num), or log the values as a heatmap, which draws them grey. (Said once per "
                  "tag.)", call, tag, pixels.size - finite.size, pixels.size)


def _convert_image(tag: str, value: Any, extra: Any, host: Host) -> np.ndarray:
    pixels = _host_pixels(value, host)
    _check_pixel_values("log_image", tag, pixels, extra)
    shape = pixels.shape
    if len(shape) == 3 and shape[0] in (1, 3, 4) and shape[-1] in (1, 3, 4):
        _say_once(extra, tag, "layout", "instrument: log_image(%r) got shape %s, which reads as [C,H,W] and as "
                  "[H,W,C]; it is drawn as [H,W,C]. For a [C,H,W] image pass image.permute(1, 2, 0) (NumPy: "
                  "transpose(1, 2, 0)). (Said once per tag.)", tag, shape)
    return to_hwc_uint8(pixels, tag)


def _say_once(said: Any, tag: str, what: str, message: str, *args: Any) -> None:
    """Warn the first time ``(tag, what)`` is met in ``said`` (the Logger's set: once per run)."""
    if (tag, what) not in said:
        said.add((tag, what))
        logging.getLogger("instrument").warning(message, *args)


_HEATMAP = "a 2-D matrix [rows, cols] (1-D: one column)"


def check_color_range(where: str, color_range: Any) -> Any:
    """None, ``"running"`` or ``(lo, hi)`` with finite ``lo < hi``; else a clear `InvalidValueError`."""
    return parse_color_range(where, color_range, InvalidValueError)


def heatmap_options(tag: Any, x_label: Any, y_label: Any, x_ticks: Any, color_range: Any) -> tuple:
    """``(x_label, y_label, ticks, color_range)`` of a `log_heatmap` call, checked on the caller: labels are
    str, ``x_ticks`` None or a sequence of labels (made str), ``color_range`` as `check_color_range` takes it."""
    where = f"log_heatmap({tag!r})"
    for name, label in (("x_label", x_label), ("y_label", y_label)):
        if not isinstance(label, str):
            raise InvalidValueError(f"{where}: {name} must be a str, got {label!r} ({type(label).__name__}).")
    unordered = (str, bytes, Mapping, Tensor, set, frozenset)  # a tensor's elements would be drawn as 'tensor(0)'
    if x_ticks is not None and (isinstance(x_ticks, unordered) or not hasattr(x_ticks, "__len__")
                                or (isinstance(x_ticks, np.ndarray) and x_ticks.ndim != 1)):
        raise InvalidValueError(
            f"{where}: x_ticks must be None or one label per column (a list such as ['r', 'g', 'b']), got "
            f"{x_ticks!r} ({type(x_ticks).__name__})."
        )
    ticks = None if x_ticks is None else tuple(str(t) for t in x_ticks)
    return x_label, y_label, ticks, check_color_range(where, color_range)


def video_fps(tag: Any, fps: Any) -> Union[int, float]:
    """The frame rate of a `log_video` call, at least 1 frame per second: an int when it is a whole number, else
    a float (2.5 fps plays at 2.5, to the GIF's centisecond frame delays; it was cut to 2)."""
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps) or not fps >= 1:
        raise InvalidValueError(
            f"log_video({tag!r}): fps must be a number of frames per second of at least 1, got {fps!r}."
        )
    return int(fps) if float(fps).is_integer() else float(fps)


def _check_heatmap(tag: str, value: Any, extra: Any) -> Any:
    value = _array_like("heatmap", tag, value, _HEATMAP)
    shape = _shape(value)
    if len(shape) not in (1, 2) or 0 in shape:
        raise InvalidValueError(
            f"log_heatmap({tag!r}): expected {_HEATMAP}, got shape {shape}; reduce or reshape it first, "
            f"e.g. value.mean(0) or value.flatten(1)."
        )
    x_ticks = extra[2]
    cols = shape[1] if len(shape) == 2 else 1
    if x_ticks is not None and len(x_ticks) != cols:
        raise InvalidValueError(
            f"log_heatmap({tag!r}): got {len(x_ticks)} x_ticks for a matrix of {cols} columns; give one label per "
            f"column, or None to number them."
        )
    return value


class CanvasSizes:
    """Per heatmap tag, its largest canvas so far, ``(height, width)``: each heatmap of the tag is drawn on a
    canvas at least that large (`render_heatmap`'s ``at_least``), so the images of one tag keep one size in
    TensorBoard's step slider. A step whose colour-bar labels, row numbers or matrix need more room grows it, and
    it stays grown: it never shrinks back within a run (`Instrumentation.state_dict` keeps it for a resume).

    One per Logger. The writer thread draws; a checkpoint reads it from the training thread: under a lock. At
    most `LIMIT` tags are kept (the least recently drawn forgotten first: such a tag starts again at its own
    size), so a run that logs heatmaps under ever new tags does not grow it without end."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, Tuple[int, int]] = OrderedDict()

    def get(self, tag: str) -> Optional[Tuple[int, int]]:
        """The tag's largest canvas so far, or None."""
        with self._lock:
            return self._sizes.get(tag)

    def grow(self, tag: str, height: int, width: int) -> None:
        """Note a canvas drawn for ``tag``: its size is now at least ``(height, width)``."""
        with self._lock:
            old = self._sizes.pop(tag, (0, 0))  # popped and set again: the most recently drawn last
            self._sizes[tag] = (max(old[0], int(height)), max(old[1], int(width)))
            while len(self._sizes) > self.LIMIT:
                self._sizes.popitem(last=False)

    def snapshot(self) -> Dict[str, Tuple[int, int]]:
        """A copy of every tag's size, for a checkpoint."""
        with self._lock:
            return dict(self._sizes)

    def replace(self, sizes: Mapping[str, Tuple[int, int]]) -> None:
        """Start from ``sizes`` (a checkpoint's) instead of what is kept; the last `LIMIT` of them."""
        with self._lock:
            self._sizes = OrderedDict(list(sizes.items())[-self.LIMIT:])


def _convert_heatmap(tag: str, value: Any, extra: Any, host: Host) -> np.ndarray:
    x_label, y_label, x_ticks, color_range, running, sizes = extra
    matrix = np.asarray(host(value), dtype=np.float64)
    if color_range == "running":  # the range of every matrix drawn under this tag so far (this thread only)
        finite = matrix[np.isfinite(matrix)]
        seen = running.get(tag)
        if finite.size:
            lo, hi = float(finite.min()), float(finite.max())
            seen = (min(lo, seen[0]), max(hi, seen[1])) if seen else (lo, hi)
            running[tag] = seen
        color_range = seen if seen and seen[1] > seen[0] and not is_degenerate(*seen) else None
    image = render_heatmap(matrix, title=tag, x_label=x_label, y_label=y_label, color_range=color_range,
                           x_ticks=x_ticks, at_least=sizes.get(tag))
    sizes.grow(tag, *image.shape[:2])
    return image


_HISTOGRAM = "numbers of any shape (flattened)"


def _check_histogram(tag: str, value: Any, extra: Any) -> Any:
    value = _array_like("histogram", tag, value, _HISTOGRAM)
    if 0 in _shape(value):  # no backend can bin nothing: every one would leave it out
        raise InvalidValueError(
            f"log_histogram({tag!r}): got no values (shape {_shape(value)}); expected at least one number. "
            f"Skip the call when there is nothing to show."
        )
    return value


def _convert_histogram(tag: str, value: Any, extra: Any, host: Host) -> np.ndarray:
    """float64, except integers, which stay exact as int64 (uint64 as uint64: sample ids beyond 2**53 stay
    apart); a narrower integer dtype is widened, so a backend's arithmetic on them does not wrap around."""
    array = np.asarray(host(value)).reshape(-1)
    if isinstance(value, Tensor) and value.dtype == torch.bool:  # the transfer carries bools as 0.0 / 1.0
        return array.astype(np.float64)
    if array.dtype.kind in "iu":
        return array if array.dtype == np.uint64 else array.astype(np.int64, copy=False)
    return array.astype(np.float64)


def _check_text(tag: str, value: Any, extra: Any) -> str:
    """A str, as a plain str (a subclass's own ``__str__`` is not consulted). Anything else is refused rather
    than written as ``str(value)``: of a device tensor that is a host sync and a summary with ``...`` in it, of
    an object a repr nobody chose, and a number belongs in ``log_metrics``, where it can be plotted."""
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, Tensor):  # described by metadata only: its repr would copy it to the host
        got = f"a tensor ({value.dtype}, shape {list(value.shape)}, on {value.device.type})"
    elif value is None or isinstance(value, (bool, float)) or (isinstance(value, int) and abs(value) < 10**18):
        got = f"{type(value).__name__} {value!r}"
    elif isinstance(value, (bytes, bytearray)):
        got = f"{type(value).__name__} of length {len(value)} (decode it: value.decode('utf-8'))"
    else:
        got = f"a {type(value).__module__}.{type(value).__qualname__}"
    raise InvalidValueError(
        f"log_text({tag!r}) got {got}; expected a str (markdown where the backend renders it). Pass the text "
        f"you mean (log_text({tag!r}, f'...', step)); log numbers with log_metrics, arrays with log_image or "
        f"log_heatmap."
    )


def _convert_text(tag: str, value: Any, extra: Any, host: Host) -> str:
    return value


_VIDEO = "frames shaped [T, H, W, C] with C in 1, 3 or 4 (uint8, bool or floats in [0,1])"


def _check_video(tag: str, value: Any, extra: Any) -> Any:
    value = _array_like("video", tag, value, _VIDEO)
    _check_pixel_dtype("video", tag, value, _VIDEO)
    shape = _shape(value)
    if len(shape) != 4 or shape[-1] not in (1, 3, 4) or 0 in shape:
        raise InvalidValueError(f"log_video({tag!r}): expected {_VIDEO} (none of them 0), got shape {shape}.")
    return value


def _convert_video(tag: str, value: Any, extra: Any, host: Host) -> tuple:
    fps, said = extra
    frames = _host_pixels(value, host)
    _check_pixel_values("log_video", tag, frames, said)
    shape = frames.shape
    if len(shape) == 4 and shape[1] in (1, 3, 4) and shape[-1] in (1, 3, 4):
        _say_once(said, tag, "layout", "instrument: log_video(%r) got shape %s, which reads as [T,C,H,W] and as "
                  "[T,H,W,C]; it is drawn as [T,H,W,C]. For [T,C,H,W] frames pass video.permute(0, 2, 3, 1) (NumPy: "
                  "transpose(0, 2, 3, 1)). (Said once per tag.)", tag, shape)
    return np.stack([to_hwc_uint8(f, tag) for f in frames]), fps


KINDS: Dict[str, MediaKind] = {
    kind.name: kind
    for kind in (
        MediaKind("image", "images", _check_image, _convert_image, _IMAGE),
        MediaKind("heatmap", "images", _check_heatmap, _convert_heatmap, _HEATMAP),
        MediaKind("histogram", "histograms", _check_histogram, _convert_histogram, _HISTOGRAM),
        MediaKind("text", "texts", _check_text, _convert_text, "text"),
        MediaKind("video", "videos", _check_video, _convert_video, _VIDEO),
        MediaKind("samples", "samples", check_samples, convert_samples, "a list of dicts"),
    )
}


# The other kinds that write the same `StepRecord` field (image and heatmap both write ``images``).
_PEERS: Dict[str, Tuple[str, ...]] = {
    name: tuple(other for other in KINDS if other != name and KINDS[other].field == kind.field)
    for name, kind in KINDS.items()
}


def check_media(kind: str, tag: str, value: Any, extra: Any) -> Any:
    """The value to stage for ``log_<kind>(tag, value)``: its kind's ``check`` (on the caller, cheap), after
    refusing a tag that is not a non-empty str."""
    if type(tag) is not str:
        raise InvalidValueError(
            f"log_{kind} got the tag {tag!r} ({type(tag).__name__}); expected a non-empty str such as 'val/{kind}'."
        )
    if not tag:
        raise InvalidValueError(f"log_{kind} got the empty tag ''; give the {kind} a non-empty tag.")
    return KINDS[kind].check(tag, value, extra)


def refuse_shared_tag(kind: str, tag: str, staged: Mapping[Tuple[str, str], Any]) -> None:
    """Raise `InvalidValueError` when ``tag`` is staged (in ``staged``, by ``(kind, tag)``) as another kind that
    writes the same record field: on the writer one would overwrite the other (an image and a heatmap)."""
    for other in _PEERS[kind]:
        if (other, tag) in staged:
            raise InvalidValueError(
                f"log_{kind}({tag!r}): {'an' if other[0] in 'aeiou' else 'a'} {other} is already staged under the "
                f"tag {tag!r} since the last commit, and both would be written as "
                f"record.{KINDS[kind].field}[{tag!r}], one overwriting the other. Use another tag for one of them "
                f"(e.g. {tag + '/' + kind!r}), or commit in between."
            )


def tensors_of(value: Any) -> List[Tensor]:
    """The device tensors inside a staged value (a tensor, or the rows of a samples table)."""
    if isinstance(value, Tensor):
        return [value]
    return list(getattr(value, "tensors", ()))  # `instrument.logger.samples.StagedRows`
