"""What a logged scalar becomes on its way to the backends, and what is refused.

Every backend stores a scalar as a floating-point number (TensorBoard as float32, W&B and MLflow as float64),
so the logger turns every accepted value into a float on the caller and refuses what no float can hold:

===================================== ===================================================================
received                              logged as
===================================== ===================================================================
``float``, NumPy float, NaN, inf      that float (NaN and inf pass through unchanged)
``int`` / NumPy int, ``|v| <= 2**53`` the exact float
``int`` / NumPy int, ``|v| > 2**53``  the nearest float64 (relative error <= 2**-53), with a one-time
                                      warning naming the key: float64 cannot hold every such integer
``int`` beyond float range            refused (`InvalidValueError`), e.g. ``10**400``
``np.longdouble``, ``Fraction``,      the nearest float64, with a one-time warning naming the key when that is
``Decimal``, other real numbers       not the value itself (``Decimal("0.1")``, a longdouble's extra digits);
                                      beyond the float range refused, as a signalling NaN ``Decimal`` is
``bool``, ``np.bool_``                1.0 or 0.0
``complex`` (Python, NumPy, tensor)   refused: log ``z.real`` and ``z.imag`` (or ``abs(z)``) as two keys
one-element tensor                    a float64 tensor (a copy; float32 on MPS); integers exact to 2**53
                                      (2**24 on MPS), bool tensors as 1.0/0.0 (float64 too); sparse and
                                      quantized ones as their value; a CPU float tensor is read at once (a
                                      float, exact)
int64 tensor, ``|v| >= 2**53``        the nearest float64, with a one-time warning naming the key: each
                                      value is compared on its device and the writer thread reads the result
                                      with the commit's transfer (no host sync); uint64 alike, and on MPS
                                      every integer tensor of 32 bits or more from 2**24
one-element NumPy array               as its element
anything else, empty key ``""``       refused (`InvalidValueError`)
two keys of one call, one name        refused (`refuse_merged_keys`): ``{1: a, "1": b}`` names metric ``"1"``
                                      twice, and its values would be averaged into one
===================================== ===================================================================

An interval's mean is its values summed in the order logged, in float64, divided by their count. A sum of
finite floats that leaves float64's range (``1e308`` logged twice) goes on exactly from there (`ExactSum`),
so the mean of finite values is finite; a device tensor's sum stays on its device (float64, which no
float32, float16 or integer value can leave, float64 values near 1e308 can: then inf).
"""

import decimal
import math
import numbers
import sys
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from instrument.core.devices import to_device
from instrument.core.dtensors import local_value
from instrument.core.exact import ExactSum, overflowed
from instrument.errors import InvalidValueError
from instrument.logger.plain import NUMERIC_DTYPES, sharded_dtensor

__all__ = ["EXACT_INT", "ExactSum", "Wide", "add", "as_scalar", "check_keys", "merge_wide", "note_beyond", "overflowed",
           "refuse_merged_keys", "rounded_message", "wide_int"]

EXACT_INT = 2**53  # every integer up to this magnitude is exactly a float64
# Integer dtypes that can hold values their conversion cannot: each staged value of one is flagged on its device
# when at or beyond what the conversion holds exactly (`note_beyond`), and the writer thread warns once per key
# (`rounded_message`). MPS converts to float32 (no float64 there): exact to 2**24 only.
_WIDE = {torch.float64: ((torch.int64, torch.uint64), EXACT_INT),
         torch.float32: ((torch.int32, torch.uint32, torch.int64, torch.uint64), 2**24)}

Warn = Callable[[str, str], None]
# Flags of an interval: names -> a bool tensor with one flag per name (on the values' device), True where a
# value logged under that name was beyond what its conversion holds exactly; several calls OR their flags.
Wide = Dict[Tuple[str, ...], Tensor]


def wide_int(dtype: torch.dtype, converted: torch.dtype) -> bool:
    """Whether integers of ``dtype`` converted to ``converted`` may be rounded (then `note_beyond` them)."""
    wide = _WIDE.get(converted)
    return wide is not None and dtype in wide[0]


def note_beyond(wide: Wide, names: Tuple[str, ...], converted: Tensor) -> None:
    """Flag, in ``wide``, which of the integers converted to ``converted`` were at or beyond what it holds
    exactly (2**53 in float64, 2**24 in float32). Rounding is monotone, so a converted value is at or beyond
    that limit exactly when the integer was, and below it the conversion was exact; comparing after the
    conversion also works for uint64, which torch cannot compare on a CPU. The flags of earlier calls under the
    same names are OR-ed out of place, so a snapshot of ``wide`` (a failed step's mark) keeps its own."""
    flags = converted.abs() >= _WIDE[converted.dtype][1]
    previous = wide.get(names)
    wide[names] = flags if previous is None else previous | flags


def merge_wide(into: Wide, flags: Wide) -> None:
    """OR ``flags`` (one call's) into ``into`` (an interval's), out of place."""
    for names, new in flags.items():
        previous = into.get(names)
        into[names] = new if previous is None else previous | new


def rounded_message(name: str, value: Any) -> str:
    """The one-time warning for a metric logged from an integer tensor that held a value beyond 2**53."""
    return (
        f"metric {name!r} was logged from an integer tensor holding a value at or beyond 2**53 in magnitude "
        f"(2**24 on MPS, which has no float64), where what backends store cannot hold every integer: its last "
        f"digits may have been rounded (written as {value!r}). Log a difference or a scaled value if they matter."
    )


_TINY = sys.float_info.min  # the smallest normal float64


def weighted(value: Any, weight: Any) -> Any:
    """``value * weight`` for a weighted interval sum; an `ExactSum` where two finite floats' product leaves
    float64's range (``1e308 * 2.0``) or its normal numbers (``1e-200 * 1e-200`` is 0, ``1e-160 * 1e-160`` keeps
    a few digits), so that the weighted mean of finite values is the correctly rounded true mean. A weight of 0
    counts nothing, also a NaN or infinite value (the mean of an empty batch, weighed by its size 0): its
    contribution is 0, not ``0 * nan``, so the other values' mean is kept (on this rank and across ranks)."""
    product = value * weight
    if isinstance(product, Tensor):
        if isinstance(weight, Tensor):  # on the device: no host sync
            empty = weight == 0
            if empty.device != product.device:  # a weight on another device (from the host: pinned, no wait)
                empty = (to_device(empty, product.device) if empty.device.type == "cpu" else
                         empty.to(product.device, non_blocking=True))
            return product.masked_fill(empty, 0)
        return torch.zeros_like(product) if weight == 0 else product
    if weight == 0:
        return 0.0 if type(product) is float else product * 0
    if type(product) is float and type(value) is float and type(weight) is float:
        if (product - product or (-_TINY < product < _TINY and value and weight)) and math.isfinite(value) \
                and math.isfinite(weight):
            return ExactSum(Fraction(value) * Fraction(weight))
    return product


def add(before: Any, value: Any) -> Any:
    """``before + value`` for an interval sum, going on exactly where a sum of finite floats leaves float64."""
    total = before + value
    if type(total) is float and total - total:  # inf or NaN
        return overflowed(before, value, total)
    return total


def refuse_merged_keys(metrics: Mapping[Any, Any], head: str) -> None:
    """Refuse a call in which two keys name one metric (``head + str(key)``): ``{1: a, "1": b}`` would average
    ``a`` and ``b`` into metric ``"1"``. Called only for a call with a key that is not a ``str`` (distinct
    ``str`` keys always name distinct metrics)."""
    seen: Dict[str, Any] = {}
    for key in metrics:
        name = head + key if type(key) is str else head + str(key)
        if name in seen:
            first = seen[name]
            odd = key if type(key) is not str else first  # renamed in the example
            raise InvalidValueError(
                f"log_metrics got the keys {first!r} ({type(first).__name__}) and {key!r} ({type(key).__name__}) "
                f"in one call: both name the metric {name!r}, and their values would be merged into one. Give "
                f"each metric its own string key, e.g. {str(odd) + '_' + type(odd).__name__!r} for {odd!r}."
            )
        seen[name] = key


def check_keys(metrics: Any) -> None:
    """Refuse what is not a mapping, and the empty key (one dict lookup, no per-key work): W&B drops it and
    other backends cannot name it."""
    if type(metrics) is not dict and not isinstance(metrics, Mapping):
        raise InvalidValueError(
            f"log_metrics takes a dict of metric name -> value, got {type(metrics).__name__}; e.g. "
            f"log_metrics({{'loss': loss}}, step=step)."
        )
    if "" in metrics:
        raise InvalidValueError(
            "log_metrics got the empty metric key ''; W&B drops such a value and TensorBoard and MLflow show it "
            "without a name. Give every metric a non-empty key (a prefix alone does not name a metric)."
        )


_FIX = ("Log value.full_tensor() (a collective: call it on every rank), or, for a Partial sum or norm, its "
        "local part value.to_local() with reduce='sum' or reduce='l2' (the logger then combines ranks).")


def as_scalar(name: str, value: Any, warn: Warn, wide: Optional[Wide] = None) -> Union[float, Tensor]:
    """``value`` as a float or a 0-d floating device tensor; ``warn(name, message)`` reports rounding once.

    ``wide``: where an int64 / uint64 tensor is flagged (`note_beyond`): its value is not read here, so the
    writer thread says whether it was too large for float64.
    """
    if isinstance(value, Tensor):
        if type(value) is not Tensor:  # a replicated DTensor: its local tensor; a sharded or partial one refused
            value = local_value(value, lambda placements: sharded_dtensor(f"metric {name!r}", placements, _FIX))
        if value.is_nested:  # has no shape to name
            raise InvalidValueError(
                f"metric {name!r} is a nested tensor (of {value.size(0)} tensors); log_metrics takes scalars "
                f"(one-element tensors or numbers). Reduce it first, e.g. torch.stack([t.mean() for t in "
                f"value.unbind()]).mean(), or log each part under a key of its own."
            )
        if value.numel() != 1:
            raise InvalidValueError(
                f"metric {name!r} is a tensor of shape {tuple(value.shape)}; log_metrics takes scalars "
                f"(one-element tensors or numbers). Reduce it first, e.g. value.mean(), or log_histogram it."
            )
        if value.is_meta:
            raise InvalidValueError(f"metric {name!r} is a meta tensor, which has no value; log a real tensor.")
        if value.layout != torch.strided:  # sparse (COO, CSR, ...): has no reshape
            value = value.to_dense()
        if value.is_quantized:
            value = value.dequantize()
        if value.requires_grad:  # only then: a detach per value is a tensor op, 100 of them cost ~0.3 ms
            value = value.detach()
        if value.dim():
            value = value.reshape(())
        if value.is_floating_point():
            if value.is_cpu and not torch._C._len_torch_function_stack():
                # read at once, as a CPU float block is (no sync; cheaper than a copy): a Python float, whose
                # interval sum goes on exactly where float64 overflows (`ExactSum`), as a tensor's cannot
                return value.item()
            # A copy (the caller may change its tensor in place right after the call), in float64 as blocks are
            # summed on the writer: an interval's sum of float16 values does not overflow, nor float32 round.
            return value.to(torch.float32 if value.device.type == "mps" else torch.float64, copy=True)
        if value.is_complex():
            raise _complex(name, f"a complex tensor ({value.dtype})")
        if value.dtype not in NUMERIC_DTYPES:  # bits, sub-byte and packed float4 types: no number to convert to
            raise InvalidValueError(
                f"metric {name!r} is a tensor of dtype {value.dtype}, which has no numeric value; log_metrics takes "
                f"bool, integer or floating tensors (e.g. value.float(), or value.view(torch.uint8) for raw bits)."
            )
        # Integers exact up to 2**53 (float32 would round above 2**24), bools as 1.0/0.0: float64, like every
        # staged sum, so that floats added to this one later in the interval are not rounded to float32.
        converted = value.to(torch.float32 if value.device.type == "mps" else torch.float64)  # MPS: no float64
        if wide is not None and wide_int(value.dtype, converted.dtype):
            note_beyond(wide, (name,), converted.reshape(1))
        return converted
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise InvalidValueError(f"metric {name!r} is an array of shape {value.shape}; log a scalar instead.")
        return as_scalar(name, value.reshape(()).item(), warn)
    if isinstance(value, (bool, np.bool_)):
        return 1.0 if value else 0.0
    if isinstance(value, (complex, np.complexfloating)):
        raise _complex(name, repr(value))
    if isinstance(value, numbers.Integral):
        exact = int(value)
        try:
            result = float(exact)
        except OverflowError:
            digits = len(str(abs(exact)))
            raise InvalidValueError(
                f"metric {name!r} is an integer of {digits} digits, beyond the float range every backend "
                f"stores (about +-1.8e308); log it scaled (e.g. its log10) or as float('inf')."
            ) from None
        if abs(exact) > EXACT_INT and int(result) != exact:
            warn(
                name,
                f"metric {name!r} is the integer {exact}, beyond 2**53, where float64 (what backends store) "
                f"cannot hold every integer: it is logged as {result!r}. Log a difference or a scaled value "
                f"if the last digits matter.",
            )
        return result
    if isinstance(value, (numbers.Real, np.number, decimal.Decimal)):
        return _as_float(name, value, warn)
    raise InvalidValueError(
        f"metric {name!r} has type {type(value).__name__}; expected a Python or NumPy real number (int, float, "
        f"bool, Fraction, Decimal) or a one-element tensor or array. Convert it, e.g. float(value)."
    )


# float() of these is the value itself: no comparison needed
_EXACT_FLOATS = frozenset({float, np.float64, np.float32, np.float16})


def _as_float(name: str, value: Any, warn: Warn) -> float:
    """A real number that is not an integer as a float64: a ``np.longdouble``, ``Fraction`` or ``Decimal``
    float64 cannot hold is rounded and said once per key, one beyond the float range refused."""
    if type(value) in _EXACT_FLOATS:
        return float(value)
    if isinstance(value, decimal.Decimal) and value.is_snan():
        raise InvalidValueError(
            f"metric {name!r} is a signalling NaN Decimal ({value!r}), which float() refuses; log "
            f"Decimal('NaN') or float('nan') if a NaN is what you mean."
        )
    try:
        result = float(value)
    except OverflowError:  # Fraction
        result = math.inf
    if result != value and result == result:  # rounded (NaN compares unequal to itself: passed through)
        shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
        if result - result:  # inf from a finite value
            raise InvalidValueError(
                f"metric {name!r} is {shown}, beyond the float range every backend stores (about +-1.8e308); "
                f"log it scaled (e.g. its log10) or as float('inf')."
            )
        warn(
            name,
            f"metric {name!r} is {shown}, which float64 (what backends store) cannot hold exactly: it is logged "
            f"as {result!r}. Log float(value) to round it yourself, or a difference or a scaled value if the "
            f"digits matter.",
        )
    return result


def _complex(name: str, received: str) -> InvalidValueError:
    return InvalidValueError(
        f"metric {name!r} is complex ({received}); backends store real numbers. Log its parts as two metrics, "
        f"e.g. {{'{name}/real': z.real, '{name}/imag': z.imag}}, or abs(z)."
    )
