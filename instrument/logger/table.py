"""The per-key staged table: what `Logger.log_metrics` stages when a call is not staged whole as a block.

An interval's scalars are kept as one entry per prefixed name: the sum of what was logged (a Python float, or
a device tensor until the commit's batched transfer), how many values it holds, its cross-rank reduce op and
its weight sum. Calls of floats or of one-element tensors of one dtype skip this table (`instrument.logger.blocks`);
everything else comes here: ints beyond 2**53, NumPy numbers, mixed tensors and numbers, ``reduce`` ops other
than mean, ``weights``, and values that must be refused with a message naming their key.

Every value of a call is converted and checked before any is staged, so a call refused for one value leaves
nothing of itself behind.
"""

from typing import Any, Mapping, Optional

from torch import Tensor

from instrument.errors import ConfigurationError
from instrument.logger.values import (
    EXACT_INT,
    ExactSum,
    Wide,
    add,
    as_scalar,
    merge_wide,
    overflowed,
    refuse_merged_keys,
    weighted,
)

__all__ = ["StagedTable"]


class StagedTable:
    """Mixin of `Logger` (its ``_totals``, ``_counts``, ``_ops``, ``_weights``, ``_on_device``, ``_names``,
    ``_wide`` and ``_warn_once``); every method runs under the logger's staging lock."""

    def _stage_keys(self, metrics: Mapping[Any, Any], head: str, ops: Optional[Mapping[Any, Any]],
                    plain: bool) -> None:
        """Stage a call key by key (``ops``: key -> (op, weight), None for plain means)."""
        if plain and not (self._ops or self._weights):  # the hot path: no per-key objects
            totals, counts, on_device = self._totals, self._counts, self._on_device
            names = self._names.get(head)  # prefixed key names, built once per (prefix, key)
            if names is None or len(names) > 4096:  # bounded: keys made up on the fly do not pile up
                if names is None and len(self._names) >= 256:  # nor do prefixes (one per episode, say)
                    self._names.clear()
                names = self._names[head] = {}
            pairs = []  # converted first: a call refused for one value stages none of its values
            wide: Wide = {}
            odd = False
            for key, value in metrics.items():
                if type(key) is str:
                    name = names.get(key)
                    if name is None:
                        name = names[key] = head + key
                else:  # never cached: 1, 1.0 and True are one dict key, but three metric names
                    name = head + str(key)
                    odd = True
                kind = type(value)
                if kind is not float:
                    if kind is int and -EXACT_INT <= value <= EXACT_INT:
                        value = float(value)
                    else:
                        value = as_scalar(name, value, self._warn_once, wide)
                pairs.append((name, value))
            if odd:  # a key that is not a str: two keys may name one metric (1 and "1")
                refuse_merged_keys(metrics, head)
            if wide:
                merge_wide(self._wide, wide)
            for name, value in pairs:
                if name in totals:
                    total = totals[name] + value
                    if type(total) is float:  # both were floats
                        if total - total:  # inf or NaN: from two finite floats only when the sum left float64
                            total = overflowed(totals[name], value, total)
                    elif type(total) is not ExactSum:  # a tensor (already marked, unless it is value)
                        on_device[name] = None
                    totals[name] = total
                    counts[name] = counts.get(name, 1) + 1
                else:
                    totals[name] = value
                    if type(value) is not float:
                        on_device[name] = None
            return
        staged = []
        wide: Wide = {}
        odd = False
        for key, value in metrics.items():
            if type(key) is str:
                name = head + key
            else:
                name, odd = head + str(key), True
            op, weight = ("mean", None) if ops is None else ops[key]
            value = as_scalar(name, value, self._warn_once, wide)
            weight = weight if weight is None else as_scalar(f"weight of {name}", weight, self._warn_once)
            self._check_op(name, op, weight)
            staged.append((name, value, op, weight))
        if odd:
            refuse_merged_keys(metrics, head)
        if wide:
            merge_wide(self._wide, wide)
        for args in staged:
            self._stage_scalar(*args)

    def _check_op(self, name: str, op: str, weight: Any) -> None:
        """One reduce op (and always or never a weight) per metric and interval (under the lock)."""
        if name in self._totals:
            before_op, before_w = self._ops.get(name, "mean"), name in self._weights
            if op != before_op or (weight is not None) != before_w:
                before = " and a weight" if before_w else ""
                now = " and a weight" if weight is not None else ""
                raise ConfigurationError(
                    f"metric {name!r} was logged with reduce={before_op!r}{before} and now with reduce={op!r}"
                    f"{now} in one logging interval; log each metric with one reduce op, always with or always "
                    f"without a weight."
                )

    def _stage_scalar(self, name: str, value: Any, op: str, weight: Any) -> None:
        """The general path: a reduce op other than mean, or a weight (under the lock, `_check_op` passed)."""
        if weight is not None:
            value = weighted(value, weight)  # an ExactSum where the product of finite floats overflows
        if name in self._totals:
            self._totals[name] = add(self._totals[name], value)
            if weight is not None:
                self._weights[name] = self._weights[name] + weight
            self._counts[name] = self._counts.get(name, 1) + 1
        else:
            self._totals[name] = value
            if weight is not None:
                self._weights[name] = weight
            if op != "mean":
                self._ops[name] = op
        if isinstance(self._totals[name], Tensor) or (weight is not None and type(self._weights[name]) is not float):
            self._on_device[name] = None
