"""The one colour map: viridis as a 256-entry lookup table, shared by the logger's heatmaps (drawn on the host)
and observers that colour a channel on the device (`instrument.observers.rollout_video`).

It lives in ``core`` because both layers may import it and neither may import the other.
"""

import math
from collections.abc import Mapping
from typing import Any, Type

import numpy as np

__all__ = ["VIRIDIS_LUT", "NAN_COLOUR", "parse_color_range", "not_a_pair"]

# viridis, sampled at 9 evenly spaced points and interpolated linearly.
_VIRIDIS = np.array(
    [
        [68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
        [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37],
    ],
    dtype=np.float64,
)
VIRIDIS_LUT = np.stack(
    [np.interp(np.linspace(0, 1, 256), np.linspace(0, 1, len(_VIRIDIS)), _VIRIDIS[:, c]) for c in range(3)], axis=1
).astype(np.uint8)
"""[256, 3] uint8: entry i is the colour of the value i/255 of the colour range."""
VIRIDIS_LUT.setflags(write=False)

NAN_COLOUR = np.array([128, 128, 128], dtype=np.uint8)
"""Grey: where a value is NaN or infinite."""
NAN_COLOUR.setflags(write=False)


def parse_color_range(where: str, value: Any, error: Type[Exception], more: str = "") -> Any:
    """A colour range as given to a heatmap: None (each image scaled to its own values), ``"running"`` (the
    range seen so far) or ``(lo, hi)`` with finite ``lo < hi`` (returned as floats); else ``error`` naming
    ``where``, what was received and what is accepted (``more`` adds accepted forms to the message)."""
    if value is None or (isinstance(value, str) and value == "running"):
        return value
    accepted = (f"{where}: color_range must be None (each image scaled to its own values), 'running' (the range "
                f"seen so far) or a pair (lo, hi) of numbers{more}, got {value!r}")
    if not_a_pair(value):
        raise error(f"{accepted} (a {type(value).__name__}); give the bounds as numbers, e.g. (0.0, 1.0).")
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise error(f"{accepted}.") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise error(f"{where}: color_range (lo, hi) needs finite numbers with lo < hi, got {value!r}.")
    return (lo, hi)


def not_a_pair(value: Any) -> bool:
    """Whether ``value`` iterates as two items without being a pair of bounds: a string or bytes ("01" would be
    read as (0, 1), b"01" as (48, 49)) or a mapping ({0: .., 1: ..} as its keys). Refused as a colour range
    (`parse_color_range`) and as `RolloutVideo`'s value range alike."""
    return isinstance(value, (str, bytes, bytearray, memoryview, Mapping))
