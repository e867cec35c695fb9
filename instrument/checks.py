"""Argument checks for ints and numbers, written once, with one kind of error message.

Constructors and demo entry points across the library take counts, intervals and shares from gin bindings and
keyword arguments, and each used to hand-write the same test (``isinstance(value, bool) or not isinstance(value,
int) or value < least``) and its own ``ConfigurationError``. The rules drifted apart in small ways (one message
named the type received, another the binding to fix, most neither), so they live here:

- ``bool`` is refused wherever an int or a number is expected (``True`` is an int to Python, never a count);
- `check_int` takes a plain ``int`` and, with ``integral=True`` (where the site took them), any
  ``numbers.Integral`` such as a numpy int, and returns a plain ``int``;
- `check_number` takes an ``int`` or a ``float`` and returns a ``float``; a bound is tested as ``not value >= least``
  (and so on), so NaN fails every bound, while ``inf`` passes a lower one (``flush_secs=inf``: never);
- the error is a `ConfigurationError` that says what was received (its repr and type name), what was expected (the
  bounds, and why when the caller says why) and how to fix it (``fix``: a binding or argument example).

The message reads ``<label> must be <expected> (<why>), got <repr> (<type>); <fix>.``. ``label`` is the option as
the caller's message has always named it (``"MlflowBackend.timeout"``, ``"train_nca steps"``). The logger's hot
paths (``log_metrics``, ``commit``, the step checks) keep their own inline tests: they run on every call.

This module imports nothing from instrument but `instrument.errors`, and neither torch nor gin, so every layer may
use it.
"""

import numbers
from typing import Any, Optional

from instrument.errors import ConfigurationError

__all__ = ["is_int", "check_int", "check_number"]


def is_int(value: Any, integral: bool = False) -> bool:
    """Whether ``value`` is an int and not a bool; with ``integral``, any ``numbers.Integral`` (a numpy int)."""
    return isinstance(value, numbers.Integral if integral else int) and not isinstance(value, bool)


def check_int(
    label: str,
    value: Any,
    *,
    fix: str,
    least: Optional[int] = None,
    most: Optional[int] = None,
    none: bool = False,
    integral: bool = False,
    why: str = "",
    expected: Optional[str] = None,
) -> Any:
    """``value`` as a plain int, or a `ConfigurationError` saying what was received, expected, and how to fix it.

    Args:
        label: the option as the message names it, e.g. ``"ConsoleBackend max_keys"`` or ``"Evaluation.fps"``.
        value: what was passed or bound.
        fix: how to fix it, e.g. ``"bind e.g. ConsoleBackend.max_keys = 8"``.
        least, most: inclusive bounds, each optional.
        none: None is accepted too (and returned); the message says ``or None``.
        integral: accept any ``numbers.Integral`` (numpy ints), not only ``int``.
        why: what the value means or why the bound, shown in parentheses after what is expected.
        expected: the words for what is expected, where the caller's message has long had its own (``"a positive
            int"``, which tests and users match); by default they are made from the bounds (``"an int >= 1"``,
            ``"an int from 0 to 5"``, with ``" or None"`` when ``none``).
    """
    if value is None and none:
        return None
    if is_int(value, integral) and (least is None or value >= least) and (most is None or value <= most):
        return int(value)
    if expected is None:
        if least is not None and most is not None:
            expected = f"an int from {least} to {most}"
        elif least is not None:
            expected = f"an int >= {least}"
        elif most is not None:
            expected = f"an int <= {most}"
        else:
            expected = "an int"
        if none:
            expected += " or None"
    raise ConfigurationError(_message(label, value, expected, why, fix))


def check_number(
    label: str,
    value: Any,
    *,
    fix: str,
    least: Optional[float] = None,
    above: Optional[float] = None,
    most: Optional[float] = None,
    none: bool = False,
    why: str = "",
    noun: str = "a number",
    expected: Optional[str] = None,
) -> Any:
    """``value`` (an int or a float, never a bool) as a float, or a `ConfigurationError` like `check_int`'s.

    Args:
        label, value, fix, none, why, expected: as for `check_int`.
        least: ``value >= least``; above: ``value > above`` (give one of the two); most: ``value <= most``.
            Each one refuses NaN.
        noun: what the value is, before its bounds: ``"a number of seconds"`` reads ``a number of seconds > 0``.
    """
    if value is None and none:
        return None
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (least is None or value >= least)
        and (above is None or value > above)
        and (most is None or value <= most)
    ):
        return float(value)
    if expected is None:
        low = (least, "[", ">=") if least is not None else (above, "(", ">") if above is not None else None
        if low is not None and most is not None:
            expected = f"{noun} in {low[1]}{low[0]}, {most}]"
        elif low is not None:
            expected = f"{noun} {low[2]} {low[0]}"
        elif most is not None:
            expected = f"{noun} <= {most}"
        else:
            expected = noun
        if none:
            expected += " or None"
    raise ConfigurationError(_message(label, value, expected, why, fix))


def _message(label: str, value: Any, expected: str, why: str, fix: str) -> str:
    because = f" ({why})" if why else ""
    return f"{label} must be {expected}{because}, got {value!r} ({type(value).__name__}); {fix.rstrip('.')}."
