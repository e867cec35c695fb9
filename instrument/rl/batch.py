"""Reading RL batches: nested keys, batch shape, the time dimension and the collector mask.

A batch is a TensorDict (TorchRL), a nested ``dict`` (``{"next": {"reward": r}}``), a flat ``dict`` whose keys
may be tuples (``{("next", "reward"): r}``), or a `KeywordBatch`: tensors given by role
(``rl.observe_batch(reward=r, done=d, mask=m)``), which win over the keys the components are bound to read.
Keyword and mapping entries may be NumPy arrays or Python bools, numbers and lists (`as_tensor`).
tensordict is never imported here: a TensorDict is recognised by its ``batch_size`` attribute, so
plain-tensor users do not need the package.

Shapes follow TorchRL: entries are ``[*batch, *features]``; ``done`` may carry a trailing singleton
(``[*batch, 1]``). The batch shape is the TensorDict's ``batch_size``; for plain mappings it is inferred from
``done`` (see `split_batch`). The time dimension is the batch dimension named ``"time"`` when the TensorDict
has names (TorchRL collectors name it), otherwise the one given. ``"auto"`` without that name guesses the last
one (TorchRL's ``[envs, time]``); with two or more batch dimensions that is a guess (`time_dim_guessed`), since
CleanRL's ``[time, envs]`` buffers look the same, and so it is for plain tensors of one batch dimension (one
environment's ``[time]``, or one step of ``[envs]``): `CollectionMetrics` says so once.
"""

import math
from collections.abc import Mapping
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from instrument.checks import check_int
from instrument.errors import ConfigurationError

__all__ = [
    "NestedKey",
    "KeywordBatch",
    "as_tensor",
    "entry",
    "lookup",
    "key_name",
    "is_tensordict",
    "batch_shape_of",
    "infer_batch_shape",
    "split_features",
    "resolve_time_dim",
    "time_dim_guessed",
]

NestedKey = Union[str, Tuple[str, ...]]


def _as_tuple(key: NestedKey) -> Tuple[str, ...]:
    if isinstance(key, str):
        return (key,)
    if isinstance(key, (tuple, list)) and key and all(isinstance(k, str) for k in key):
        return tuple(key)
    raise ConfigurationError(f"a batch key must be a string or a tuple of strings, got {key!r}.")


def key_name(key: NestedKey) -> str:
    """``("next", "reward")`` -> ``"next/reward"``: the stable metric name of a nested key."""
    return "/".join(_as_tuple(key))


ROLES = ("reward", "done", "mask", "episode_reward")


class KeywordBatch:
    """A batch given as tensors by role (``reward``, ``done``, ``mask``, ``episode_reward``), optionally over
    a batch (``data``) whose other entries stay readable: every component reads the same object through
    `entry` and `lookup`, whatever keys it is bound to."""

    __slots__ = ("data", "roles")

    def __init__(self, data: Any = None, **roles: Optional[Tensor]) -> None:
        unknown = sorted(set(roles) - set(ROLES))
        if unknown:
            raise ConfigurationError(
                f"unknown batch keyword(s) {unknown}; observe_batch takes {list(ROLES)} as keywords, and any "
                f"other entry inside a TensorDict or mapping."
            )
        self.data = data.data if isinstance(data, KeywordBatch) else data
        inherited = dict(data.roles) if isinstance(data, KeywordBatch) else {}
        inherited.update({k: as_tensor(v, f"{k}=") for k, v in roles.items() if v is not None})
        self.roles = inherited

    def __repr__(self) -> str:
        return f"KeywordBatch(roles={sorted(self.roles)}, data={type(self.data).__name__})"


def entry(batch: Any, role: str, key: Optional[NestedKey]) -> Optional[Tensor]:
    """The tensor of ``role`` given as a keyword, else the batch's entry at ``key`` (None when neither)."""
    if isinstance(batch, KeywordBatch) and role in batch.roles:
        return batch.roles[role]
    return lookup(batch, key) if key is not None else None


def is_tensordict(batch: Any) -> bool:
    return hasattr(batch, "batch_size") and hasattr(batch, "get") and not isinstance(batch, Tensor)


def lookup(batch: Any, key: NestedKey) -> Optional[Tensor]:
    """The entry at ``key`` (nested), or None when the batch has none."""
    parts = _as_tuple(key)
    if isinstance(batch, KeywordBatch):
        batch = batch.data
    if batch is None:
        return None
    if is_tensordict(batch):
        return batch.get(parts if len(parts) > 1 else parts[0], None)
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"an RL batch must be a TensorDict or a mapping of tensors, got {type(batch).__name__}; "
            f"pass e.g. {{'next': {{'reward': reward, 'done': done}}}} or use the keyword form."
        )
    if parts in batch:
        node = batch[parts]
    elif len(parts) == 1 and parts[0] in batch:
        node = batch[parts[0]]
    else:
        node = batch
        for part in parts:
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
    return node if node is None or isinstance(node, Mapping) else as_tensor(node, f"the entry at {key!r}")


def as_tensor(value: Any, name: str) -> Tensor:
    """``value`` as a tensor: gymnasium and CleanRL hand out NumPy arrays, and a Python bool, number or list
    is a batch entry too. Anything else is refused here, by name, rather than failing inside a component as a
    runtime fault that the session would count and skip (dropping the batch and its frames).

    Python floats become float64 (NumPy's default), so they keep their digits.
    """
    if isinstance(value, Tensor):
        return value
    expected = (
        "expected a torch.Tensor, a NumPy array, or a Python bool, number or (nested) list of them: convert "
        "it with torch.as_tensor(...) or np.asarray(...)"
    )
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if not isinstance(value, (np.ndarray, np.generic, bool, int, float, list, tuple)):
        raise ConfigurationError(f"RL batch {name} is a {kind}; {expected}.")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:  # e.g. a ragged list
        raise ConfigurationError(f"RL batch {name} is a {kind} that is not an array ({exc}); {expected}.") from exc
    if array.dtype.kind not in "biuf":
        raise ConfigurationError(f"RL batch {name} is a {kind} of dtype {array.dtype}; {expected}.")
    if not array.flags.writeable or not array.dtype.isnative or any(s < 0 for s in array.strides):
        # torch refuses a non-native byte order and negative strides, and warns on a read-only array
        array = np.array(array, dtype=array.dtype.newbyteorder("="), order="C", copy=True)
    try:
        return torch.as_tensor(array)
    except TypeError as exc:  # a dtype torch has no tensor for
        raise ConfigurationError(f"RL batch {name} is a {kind} of dtype {array.dtype} ({exc}); {expected}.") from exc


def flag_entry(batch: Any, role: str, key: Optional[NestedKey]) -> Optional[Tensor]:
    """`entry` of ``role`` (``done``, ``mask``): flags, read as ``value != 0``. Bool and integer dtypes, and
    floats (CleanRL keeps ``next_done`` as float32 0.0/1.0): any nonzero value counts as True, 0.5 and NaN too,
    since telling them apart would read the values, a host sync on the training thread. A complex one is
    refused: it holds no flags."""
    value = entry(batch, role, key)
    if value is None or not value.dtype.is_complex:
        return value
    keyword = isinstance(batch, KeywordBatch) and role in batch.roles
    where = "given as a keyword" if keyword else f"at {key!r}"
    raise ConfigurationError(
        f"RL batch {role} ({where}) is a {value.dtype} tensor; {role} must hold flags: a bool tensor, or an "
        f"integer or float one of 0 and 1 (nonzero counts as True). Pass e.g. observe_batch(..., {role}=terminated "
        f"| truncated)."
    )


def batch_shape_of(batch: Any) -> Optional[torch.Size]:
    """A TensorDict's batch size; None for plain mappings (inferred from ``done`` instead)."""
    if isinstance(batch, KeywordBatch):
        batch = batch.data
    return torch.Size(batch.batch_size) if is_tensordict(batch) else None


def split_features(value: Tensor, batch_shape: Sequence[int], name: str) -> Tensor:
    """Reshape ``value`` of shape ``[*batch, *features]`` to ``[*batch, K]`` (K = product of the features)."""
    batch_shape = tuple(batch_shape)
    n = len(batch_shape)
    if tuple(value.shape[:n]) != batch_shape:
        raise ConfigurationError(
            f"{name} has shape {tuple(value.shape)}, which does not start with the batch shape "
            f"{batch_shape}; entries must be shaped [*batch, *features] like done / the TensorDict batch size."
        )
    # the features' count, not -1: with a 0 in the batch shape (a batch of no steps) -1 is undetermined
    return value.reshape(*batch_shape, math.prod(value.shape[n:]))


def infer_batch_shape(done: Tensor, other: Optional[Tensor]) -> torch.Size:
    """The batch shape of a plain-tensor batch, from ``done`` and another entry (e.g. the reward).

    TorchRL style: ``done`` ``[*B, 1]`` with an entry of the same rank (``[*B, K]``) or of shape ``B`` -> batch
    ``B``. Otherwise ``done``'s own shape is the batch shape (an entry ``[*done.shape, K]`` has K features).
    """
    if done.dim() >= 2 and done.shape[-1] == 1:
        if other is None or other.dim() == done.dim() or tuple(other.shape) == tuple(done.shape[:-1]):
            return done.shape[:-1]
    return done.shape


def _names(batch: Any) -> Optional[list]:
    if isinstance(batch, KeywordBatch):
        batch = batch.data
    names = getattr(batch, "names", None) if is_tensordict(batch) else None
    return None if names is None else list(names)


def time_dim_guessed(batch: Any, time_dim: Union[int, str, None], batch_shape: Sequence[int]) -> bool:
    """True when `resolve_time_dim` guesses: ``"auto"``, two or more batch dimensions and none named ``"time"``
    (plain tensors, or a TensorDict without names). ``[envs, time]`` (TorchRL) and ``[time, envs]`` (CleanRL's
    rollout buffers) have the same shape, and the guess (the last, TorchRL's) sums a CleanRL buffer's episodes
    across environments. Also a plain-tensor batch of one dimension: one environment's ``[time]`` and one step of
    ``[envs]`` (a per-step loop) look the same, and the guess (time) sums that loop's episodes across
    environments. (A TensorDict of one dimension is TorchRL's: a single environment's ``[time]``.)"""
    if time_dim != "auto" or not batch_shape:
        return False
    names = _names(batch)
    if len(batch_shape) == 1:
        plain = batch.data if isinstance(batch, KeywordBatch) else batch
        return not is_tensordict(plain)
    return names is None or "time" not in names


def resolve_time_dim(
    batch: Any, time_dim: Union[int, str, None], batch_shape: Sequence[int]
) -> Optional[int]:
    """The non-negative index of the time dimension in ``batch_shape``, or None when there is none.

    ``"auto"`` uses the TensorDict dimension named ``"time"`` when there is one, else the last batch dimension
    (TorchRL collectors put time last; a guess with two or more, `time_dim_guessed`). ``None`` means every call
    holds one time step of every environment.
    """
    n = len(batch_shape)
    if time_dim is None:
        return None
    if time_dim == "auto":
        names = _names(batch)
        if names is not None and "time" in names:
            return names.index("time")
        time_dim = -1
    check_int("time_dim", time_dim, expected="an int, 'auto' or None", fix="bind e.g. CollectionMetrics.time_dim = 0")
    if n == 0:
        return None
    if not -n <= time_dim < n:
        raise ConfigurationError(
            f"CollectionMetrics.time_dim={time_dim} is out of range for a batch of shape {tuple(batch_shape)}; "
            f"bind a dimension in [{-n}, {n - 1}] (the one that is time), 'auto' (TorchRL: the last) or None "
            f"(one time step per call)."
        )
    return time_dim % n
