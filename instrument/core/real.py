"""Is a value one real number? The check shared by the places that take a user's number as it comes.

An episode runner's return and a system monitor subclass's sample may each be a Python number, a NumPy scalar
or a one-element array or tensor; both are refused by name when they are anything else (a complex number, a
string array, a vector), since a conversion would otherwise log a real part, a parse or a count of days.
"""

import numbers
from typing import Any

import numpy as np
import torch

__all__ = ["is_one_real"]


def is_one_real(value: Any) -> bool:
    """True for a real number (bools included), a NumPy real scalar, or a one-element tensor or NumPy array of
    a bool, integer or floating dtype. Metadata only: nothing is read from a device."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    if isinstance(value, np.ndarray):
        return value.size == 1 and value.dtype.kind in "biuf"
    return isinstance(value, (numbers.Real, np.bool_))
