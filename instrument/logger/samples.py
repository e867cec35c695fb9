"""Validation samples as staged on the caller and as written: a table of dicts whose fields may hold tensors.

A field may be a number, a string, a tensor or array, or a list, tuple or dict of those (nested up to
`DEPTH` levels). On the caller every tensor inside is made plain (`plain_tensor`) and collected, so that the
commit's one batched transfer copies it; arrays are copied, and containers are rebuilt around their staged
elements (of their own type where it can be rebuilt: a namedtuple stays one), so a buffer the caller refills
once commit returns never changes what was logged. On the writer each tensor becomes its values, of their own
kind: integers stay exact Python ints, bool tensors ``True``/``False``, floats floats.
"""

import collections
from collections.abc import ItemsView, KeysView, Mapping, Sequence, Set, ValuesView
from typing import Any, Dict, List

import numpy as np
import torch
from torch import Tensor

from instrument.backends.base import SampleTable
from instrument.errors import InvalidValueError
from instrument.logger.plain import plain_tensor

__all__ = ["DEPTH", "StagedRows", "check_samples", "convert_samples"]

DEPTH = 8  # how deep lists, tuples and dicts may nest inside a field (a container holding itself never ends)
_FIELD = "numbers, strings or real tensors"
_PLAIN = frozenset({int, float, str, bool, type(None)})  # elements a container is copied with as they are
_LISTED = (collections.deque, Set, KeysView, ValuesView, ItemsView)  # containers staged as lists


class StagedRows(list):
    """The staged rows of one `log_samples` call, with the tensors found in them (for the transfer)."""

    tensors: List[Tensor]


def check_samples(tag: str, samples: Any, extra: Any) -> StagedRows:
    if isinstance(samples, Mapping) or not isinstance(samples, Sequence):
        raise InvalidValueError(f"log_samples({tag!r}) takes a list of dicts, got {type(samples).__name__}.")
    rows = StagedRows()
    rows.tensors = []
    for i, row in enumerate(samples):
        if not isinstance(row, Mapping):
            raise InvalidValueError(
                f"log_samples({tag!r}): sample {i} is a {type(row).__name__}; each sample must be a dict "
                f"such as {{'input': ..., 'output': ..., 'score': ...}}."
            )
        rows.append({str(k): _staged(tag, i, k, v, 0, rows.tensors) for k, v in row.items()})
    return rows


def _where(tag: str, i: int, key: Any, depth: int) -> str:
    field = f"field {key!r} of sample {i}"
    return f"log_samples({tag!r}): {field}" if depth == 0 else f"log_samples({tag!r}): an element of {field}"


def _staged(tag: str, i: int, key: Any, value: Any, depth: int, tensors: List[Tensor]) -> Any:
    if isinstance(value, Tensor):
        plain = plain_tensor(_where(tag, i, key, depth), value, _FIELD)
        tensors.append(plain)
        return plain
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, _LISTED):  # a deque, a set, a dict view: staged as the list of its elements
        value = list(value)
    if not isinstance(value, (list, tuple, dict)):
        return value
    if depth >= DEPTH:
        raise InvalidValueError(
            f"{_where(tag, i, key, depth)}: lists, tuples and dicts nest more than {DEPTH} levels deep (or refer "
            f"to themselves); expected {_FIELD}, or containers of them. Log a flatter value, e.g. a tensor or a "
            f"string."
        )
    if isinstance(value, dict) and any(isinstance(k, Tensor) for k in value):
        raise InvalidValueError(f"{_where(tag, i, key, depth)}: a dict key is a tensor; expected keys that are "
                                f"numbers or strings (use k.item() as the key).")
    items = value.values() if isinstance(value, dict) else value
    if all(type(v) in _PLAIN for v in items):  # a long list of numbers: one shallow copy
        return _rebuilt(value, list(value.items()) if isinstance(value, dict) else list(value))
    if isinstance(value, dict):
        return _rebuilt(value, [(k, _staged(tag, i, key, v, depth + 1, tensors)) for k, v in value.items()])
    return _rebuilt(value, [_staged(tag, i, key, v, depth + 1, tensors) for v in value])


def _rebuilt(original: Any, items: list) -> Any:
    """A container like ``original`` holding ``items`` (pairs for a dict): a namedtuple or an OrderedDict of its
    own type (their constructors take these items as given), any other a plain list, tuple or dict (a Counter's
    or a subclass's constructor may read them otherwise)."""
    kind = type(original)
    if kind in (list, tuple, dict):
        return kind(items)
    if isinstance(original, tuple) and hasattr(original, "_fields"):
        try:
            return kind(*items)
        except Exception:  # a namedtuple subclass that takes other arguments
            return tuple(items)
    if kind is collections.OrderedDict:
        return collections.OrderedDict(items)
    if isinstance(original, dict):
        return dict(items)
    return list(items) if isinstance(original, list) else tuple(items)


def _host_field(value: Any, staged: Any) -> Any:
    """A field's value as the backends want it: a one-element array or tensor as its element, other arrays as
    lists, the rest as is (integers exact ints, the transfer carrying integer tensors as int64)."""
    if isinstance(value, np.ndarray):
        if isinstance(staged, Tensor) and staged.dtype == torch.bool and value.dtype != np.bool_:
            value = value.astype(np.bool_)  # the transfer carries bools as 0.0 / 1.0
        return value.reshape(()).item() if value.size == 1 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def convert_samples(tag: str, rows: Any, score_key: Any, host: Any) -> SampleTable:
    """On the writer: every staged tensor replaced by its transferred values (``host``).

    A field of some other type is passed on as it is, and a backend writes it as ``str(value)``: one whose
    ``str`` raises is refused here, naming it, so that it costs this table only, not every backend's whole step.
    """
    def field(i: int, name: str, v: Any) -> Any:
        if isinstance(v, dict):
            return _rebuilt(v, [(k, field(i, name, e)) for k, e in v.items()])
        if isinstance(v, (list, tuple)):
            if all(type(e) in _PLAIN for e in v):
                return v  # staged as a copy: nothing to convert
            return _rebuilt(v, [field(i, name, e) for e in v])
        value = _host_field(host(v), v)
        if type(value) not in _PLAIN:
            try:
                str(value)
            except Exception as exc:
                raise InvalidValueError(
                    f"log_samples({tag!r}): field {name!r} of sample {i} holds a {type(value).__name__} whose str() "
                    f"raised {type(exc).__name__}: {exc}; expected {_FIELD}, or an object that prints as text."
                ) from exc
        return value

    converted: List[Dict[str, Any]] = [{f: field(i, f, v) for f, v in row.items()} for i, row in enumerate(rows)]
    return SampleTable(converted, score_key)
