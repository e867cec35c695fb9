"""The colour bar's numbers: which values a heatmap's colour bar labels, and the texts drawn for them.

Pure arithmetic on Python floats (`instrument.logger.render` draws them): the round values between the ends,
at least 14 pixels apart, and each label's number of significant digits.
"""

import math
import sys
from typing import Optional

__all__ = ["colorbar_labels", "colorbar_ticks", "is_degenerate", "ticks_and_step"]


def _fmt(v: float, precision: int = 3) -> str:
    """``v`` to ``precision`` significant digits; a number below a million that ``g`` would write with an exponent
    (12345.6 as ``1.23e+04``) as the whole number it rounds to (``12346``): as short, and more precise."""
    if not math.isfinite(v):
        return "nan"
    text = f"{v:.{precision}g}"
    return f"{v:.0f}" if "e+" in text and abs(v) < 999999.5 else text


def _nice_step(span: float, count: int = 4) -> Optional[float]:
    """A step of 1, 2 or 5 times a power of ten giving about ``count`` intervals over ``span``; None where that
    is below float64's normal numbers (a range of subnormals, such as (0, 1e-323)): its power of ten is 0."""
    raw = span / count
    if not raw >= sys.float_info.min:
        return None
    power = 10.0 ** math.floor(math.log10(raw))
    for factor, below in ((1.0, 1.5), (2.0, 3.0), (5.0, 7.0)):
        if raw / power < below:
            return factor * power
    return 10.0 * power


def is_degenerate(lo: float, hi: float) -> bool:
    """Whether finite ``lo <= hi`` differ by float64 rounding noise only (at most 8 ulps of their magnitude).

    A range taken from the data that narrow (e.g. alive fractions all 1.0 but one 0.9999999999999999) holds
    one value in every sense a reader cares about: it is drawn as a constant image, not as full contrast.
    """
    span = hi - lo  # an infinite span is never noise (math.ulp(inf) is inf, np.spacing's NaN)
    return span < math.inf and span <= 8.0 * math.ulp(max(abs(lo), abs(hi)))


_MAX_TICKS = 64  # a bound, whatever the range: drawing never loops on its values


def colorbar_ticks(lo: float, hi: float, height: int):
    """The colour bar's labelled values: ``lo`` and ``hi`` at its ends and round values between them that leave
    at least 14 pixels to their neighbours. Returns ``[(value, y offset from the bar's top)]``.

    The round values are computed by index (``i * step``), never by adding ``step`` until ``hi`` is reached:
    a step below the float spacing at ``lo`` would never move the sum, and the writer thread would spin.
    """
    return ticks_and_step(lo, hi, height)[0]


def ticks_and_step(lo: float, hi: float, height: int):
    """`colorbar_ticks`, and the step between its round values (None where it has none): `colorbar_labels`
    needs it too. Python's math on single numbers: NumPy's functions cost a microsecond each there."""
    lo, hi = float(lo), float(hi)
    ticks = [(hi, 0), (lo, height - 1)]
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo or height < 42 or is_degenerate(lo, hi):
        return ticks, None
    if not math.isfinite(hi - lo):  # the span overflows float64
        return ticks, None
    step = _nice_step(hi - lo)
    if step is None:
        return ticks, None
    first, last = math.ceil(lo / step), math.floor(hi / step)
    if max(abs(first), abs(last)) > 2**52 or last - first > _MAX_TICKS:  # indices no longer exact
        return ticks, step
    digits = 1 - math.floor(math.log10(step))  # 3 * 0.2 is 0.6000000000000001: labelled values are round
    for i in range(first, last + 1):
        value = round(i * step, digits) if digits > 0 else i * step  # Python floats: exact for any digits
        if not lo <= value < hi:
            continue
        y = int(round((hi - value) / (hi - lo) * (height - 1)))
        if all(abs(y - other) >= 14 for _, other in ticks):
            ticks.append((float(value), y))
    return ticks, step


def colorbar_labels(ticks, one_colour: Optional[bool] = None, step: Optional[float] = None) -> list:
    """The texts drawn beside `colorbar_ticks`'s ``ticks``, in their order: each value rounded to the fewest
    significant digits (3 at least) that resolve the step between round ticks and leave every two neighbouring
    labels different (100.1 .. 100.9 reads 100.9, 100.8, 100.6, ..., not 101 three times, then 100 three times).
    An image drawn in one colour (``one_colour``; None: whether the range is float rounding noise,
    `is_degenerate`, as for a range taken from the data) is labelled to 3 digits. A user's range that narrow is
    drawn in full contrast: its ends are labelled apart. ``step``: the one `colorbar_ticks` used, if known."""
    values = [v for v, _ in ticks]
    lo, hi = min(values), max(values)
    if one_colour is None:
        one_colour = hi > lo and is_degenerate(lo, hi)
    if not (hi > lo and not one_colour and all(map(math.isfinite, values))):
        return [_fmt(v) for v in values]
    precision = 3
    if hi - lo < math.inf:
        magnitude = math.floor(math.log10(max(abs(lo), abs(hi))))
        step = _nice_step(hi - lo) if step is None else step
        if step is not None:  # else 3 digits, more below until neighbouring labels differ
            precision = max(3, magnitude - math.floor(math.log10(step)) + 1)
    # Each value formatted once per precision (`_fmt` inlined: the values are finite). The values are distinct
    # and rounding keeps their order, so two labels alike anywhere means two neighbours alike; 17 significant
    # digits tell any two float64 apart: the loop ends.
    while True:
        digits = min(precision, 17)
        spec = f".{digits}g"
        texts = [format(v, spec) for v in values]
        if "e+" in "".join(texts):  # as `_fmt`: 12345.6 as 12346, not 1.23e+04
            texts = [f"{v:.0f}" if "e+" in t and abs(v) < 999999.5 else t for v, t in zip(values, texts, strict=True)]
        if digits == 17 or len(set(texts)) == len(texts):
            return texts
        precision += 1
