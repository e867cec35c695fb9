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
``bool``, ``np.bool_``                1.0 or 0.0
``complex`` (Python, NumPy, tensor)   refused: log ``z.real`` and ``z.imag`` (or ``abs(z)``) as two keys
one-element tensor                    a float64 tensor (a copy; float32 on MPS); integers exact to 2**53,
                                      bool tensors as 1.0/0.0 (float64 too); sparse and quantized ones as
                                      their value
int64 tensor, ``|v| >= 2**53``        the nearest float64, with a one-time warning naming the key: each
                                      value is compared on its device and the writer thread reads the result
                                      with the commit's transfer (no host sync); uint64 alike
one-element NumPy array               as its element
anything else, empty key ``""``       refused (`InvalidValueError`)
===================================== ===================================================================
"""

import numbers
from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from instrument.errors import InvalidValueError

__all__ = ["EXACT_INT", "WIDE_INTS", "Wide", "as_scalar", "beyond_exact", "check_keys", "rounded_message"]

EXACT_INT = 2**53  # every integer up to this magnitude is exactly a float64
# Integer dtypes that can hold values float64 cannot: each staged value of one is flagged on its device when
# at or beyond 2**53 in magnitude (`beyond_exact`), and the writer thread warns once per key (`rounded_message`).
WIDE_INTS = (torch.int64, torch.uint64)

Warn = Callable[[str, str], None]
# Flags of one staging call: (names, a bool tensor with one flag per name, on the values' device).
Wide = List[Tuple[Tuple[str, ...], Tensor]]


def beyond_exact(converted: Tensor) -> Tensor:
    """Where integers converted to ``converted`` (float64) were at or beyond 2**53 in magnitude, where float64
    may round them: a bool tensor like it. Rounding is monotone, so the converted value is at or beyond 2**53
    exactly when the integer was (and below it, the conversion was exact); comparing after the conversion also
    works for uint64, which torch cannot compare on a CPU."""
    return converted.abs() >= EXACT_INT


def rounded_message(name: str, value: Any) -> str:
    """The one-time warning for a metric logged from an integer tensor that held a value beyond 2**53."""
    return (
        f"metric {name!r} was logged from an integer tensor holding a value at or beyond 2**53 in magnitude, "
        f"where float64 (what backends store) cannot hold every integer: its last digits may have been rounded "
        f"(written as {value!r}). Log a difference or a scaled value if they matter."
    )


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


def as_scalar(name: str, value: Any, warn: Warn, wide: Optional[Wide] = None) -> Union[float, Tensor]:
    """``value`` as a float or a 0-d floating device tensor; ``warn(name, message)`` reports rounding once.

    ``wide``: where the flag of an int64 / uint64 tensor is appended (`beyond_exact`): its value is not read
    here, so the writer thread says whether it was too large for float64.
    """
    if isinstance(value, Tensor):
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
            # A copy (the caller may change its tensor in place right after the call), in float64 as blocks are
            # summed on the writer: an interval's sum of float16 values does not overflow, nor float32 round.
            return value.to(torch.float32 if value.device.type == "mps" else torch.float64, copy=True)
        if value.is_complex():
            raise _complex(name, f"a complex tensor ({value.dtype})")
        # Integers exact up to 2**53 (float32 would round above 2**24), bools as 1.0/0.0: float64, like every
        # staged sum, so that floats added to this one later in the interval are not rounded to float32.
        converted = value.to(torch.float32 if value.device.type == "mps" else torch.float64)  # MPS: no float64
        if wide is not None and value.dtype in WIDE_INTS:
            wide.append(((name,), beyond_exact(converted.reshape(1))))
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
    if isinstance(value, (numbers.Real, np.number)):
        return float(value)
    raise InvalidValueError(
        f"metric {name!r} has type {type(value).__name__}; expected a Python number or a one-element tensor."
    )


def _complex(name: str, received: str) -> InvalidValueError:
    return InvalidValueError(
        f"metric {name!r} is complex ({received}); backends store real numbers. Log its parts as two metrics, "
        f"e.g. {{'{name}/real': z.real, '{name}/imag': z.imag}}, or abs(z)."
    )
