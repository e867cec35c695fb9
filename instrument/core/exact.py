"""A sum of finite floats that goes on exactly once it leaves float64's range.

Three values of 1e308 sum to inf in float64, and their mean would be logged as inf although every value was
finite. The logger's interval means and the console's run summary both keep such a sum exactly from the step it
overflows (a `fractions.Fraction`), so that the mean is the correctly rounded float of the true mean. Pure
Python: no tensor is read here.
"""

import math
from fractions import Fraction
from typing import Any

__all__ = ["ExactSum", "overflowed"]


class ExactSum:
    """An interval sum of finite Python floats that left float64's range (``1e308 + 1e308``): kept exactly
    from there on, so that the mean (``/ count``) is the correctly rounded float of the true mean, finite as
    every value was. Only made in that rare case (`overflowed`); immutable, as a snapshot of the staged table
    shares its values. A non-finite float added later is summed on its own (``special``): the mean is then
    that inf or NaN, as float64 gives it."""

    __slots__ = ("exact", "special")

    def __init__(self, exact: Fraction, special: float = 0.0) -> None:
        self.exact = exact
        self.special = special

    def __add__(self, value: Any) -> Any:
        if type(value) is ExactSum:  # a weighted value whose product already left float64's range
            return ExactSum(self.exact + value.exact, self.special + value.special)
        if isinstance(value, float):
            if math.isfinite(value):
                return ExactSum(self.exact + Fraction(value), self.special)
            return ExactSum(self.exact, self.special + value)
        # a tensor: the sum goes on on its device in float64 (from +-inf here), as any device sum
        return value + self._nearest()

    __radd__ = __add__  # a float sum plus an overflowed weighted value

    def __truediv__(self, count: Any) -> float:
        """The mean: ``count`` is the number of values, or a weighted mean's sum of weights (a float)."""
        if self.special != 0.0:  # inf or NaN (both infinities: NaN), whatever the finite values add
            return self.special
        if isinstance(count, float) and not math.isfinite(count):  # weights summing beyond float64: undefined here
            return math.nan
        return float(self.exact / Fraction(count))

    def __float__(self) -> float:  # the nearest float64 (+-inf beyond its range), for a cross-rank reduction
        return self._nearest()

    def _nearest(self) -> float:
        try:
            return float(self.exact)
        except OverflowError:
            return math.inf if self.exact > 0 else -math.inf

    def __repr__(self) -> str:
        return f"ExactSum({self._nearest()!r})"


def overflowed(before: Any, value: Any, total: float) -> Any:
    """``before + value`` gave ``total``, inf or NaN: an `ExactSum` when both were finite floats (their sum
    left float64's range), else ``total`` (an inf or NaN was logged: the mean is that)."""
    if type(before) is float and type(value) is float and math.isfinite(before) and math.isfinite(value):
        return ExactSum(Fraction(before) + Fraction(value))
    return total
