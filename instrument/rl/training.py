"""Training metrics: any dict or TensorDict of losses and statistics, reduced to scalars with stable names.

Keys (under ``train/<group>/``):

========================  =================================================================================
key                       meaning
========================  =================================================================================
``<name>``                mean over every element of every value logged under that name in the interval
                          (a scalar loss logged once per update: the mean over the updates)
``<name>/min``            smallest element in the interval (``reduce_stats=True`` only)
``<name>/max``            largest element in the interval (``reduce_stats=True`` only)
========================  =================================================================================

``<name>`` is the entry's key; nested keys are joined with ``/`` (``("loss", "actor")`` -> ``loss/actor``), so
a name never depends on the shape of the value. Values may be tensors of any shape and dtype (bools count as
0/1), Python numbers or NumPy scalars; None entries are skipped. Everything stays on the device until commit.

One key holds one statistic. Two entries of one call that flatten to one name (``{"a/b": x, "a": {"b": y}}``)
are both skipped in that call; an entry whose key is another entry's ``/min`` or ``/max`` statistic
(``reduce_stats=True``: ``"adv/max"`` beside ``"adv"``) is skipped for as long as the first-seen of the two has
its series (the run). Either way the other entries are added and a `ConfigurationError` names them: raised by
the first call it stops the run (fix the names); under `RLLogging`, after ``on_losses`` has worked once, it is
a reported fault like any other (`instrument.core.step_components`), so a loss dict that changes mid-run never
ends training.
"""

import numbers
from collections import Counter
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from instrument.errors import ConfigurationError
from instrument.rl.batch import is_tensordict
from instrument.rl.component import RLComponent
from instrument.rl.ranks import log_reduced
from instrument.rl.running_stats import RunningStats, wide_dtype

__all__ = ["TrainMetrics"]


class TrainMetrics(RLComponent):
    """Reduces losses and training statistics to scalars under ``train/<group>/``.

    Args:
        group: the ``<group>`` in ``train/<group>/``.
        reduce_stats: also log min and max of every entry.
        include: names (or name prefixes) to keep; None keeps every entry.
        exclude: names (or name prefixes) to drop.
    """

    def __init__(
        self,
        group: str = "main",
        reduce_stats: bool = False,
        include: Optional[Sequence[str]] = None,
        exclude: Sequence[str] = (),
    ) -> None:
        if not group or "/" in group:
            raise ConfigurationError(
                f"TrainMetrics.group must be a non-empty name without '/', got {group!r}."
            )
        self.group = group
        self.prefix = f"train/{group}"
        self.reduce_stats = reduce_stats
        self.include = list(include) if include is not None else None
        self.exclude = list(exclude)
        self._stats: Dict[str, RunningStats] = {}
        # Values kept (flattened copies) until reduced together at log or at a bound (`_keep`), as the collection
        # keeps batches (instrument.rl.pending): one reduction per entry and interval instead of one per call.
        self._kept: Dict[str, List[Tensor]] = {}
        self._kept_size = [0, 0]  # tensors, elements

    def update(self, losses: Any) -> None:
        """`on_losses` under its older name, for a loop without `RLLogging`."""
        self.on_losses(losses)

    def on_losses(self, losses: Any) -> None:
        """Add one dict / TensorDict of values (e.g. the loss module's output for one update). An entry that is
        not a number is skipped and named in one `TypeError` after the others were added; entries that would
        share a key with another (module doc) are skipped and named in one `ConfigurationError`."""
        entries = [(name, value) for name, value in _flatten(losses) if value is not None and self._wanted(name)]
        seen: Dict[str, int] = {}
        if len({name for name, _ in entries}) != len(entries):  # counted only when two entries share a name
            seen = {name: n for name, n in Counter(name for name, _ in entries).items() if n > 1}
        clashes = [f"{seen[name]} entries flatten to the name {name!r} (nested keys are joined with '/'), so their "
                   f"values would be averaged into one; none of them was added: rename all but one" for name in seen]
        refused = []
        for name, value in entries:
            if name in seen:
                continue
            try:
                tensor = _as_tensor(name, value)
                if tensor is None:
                    continue
                acc = self._stats.get(name)
                if acc is None:
                    clash = self._clash(name)
                    if clash:
                        clashes.append(clash)
                        continue
                    acc = self._stats[name] = RunningStats(flatten=True)
                self._keep(name, tensor, owned=tensor is not value)
            except (TypeError, ValueError, OverflowError) as exc:  # that entry only
                text = str(exc)
                refused.append(text if text.startswith("training entry") else f"training entry {name!r}: {text}")
        if clashes:
            raise ConfigurationError(f"TrainMetrics ({self.prefix}): " + "; ".join(clashes + refused)
                                     + " (the other entries were added)")
        if refused:
            raise TypeError("; ".join(refused) + " (the other entries were added)")

    def _keep(self, name: str, tensor: Tensor, owned: bool) -> None:
        """Keep one entry's values (a copy unless made here) until `_reduce_kept`; another device reduces first."""
        flat = tensor.detach().reshape(-1)
        kept = self._kept
        if kept and next(iter(kept.values()))[0].device != flat.device:
            self._reduce_kept()
        if flat.numel() >= 2**18:  # too large to keep: reduced now, after what is kept (no copy, no concatenation)
            self._reduce_kept()
            self._stats[name].add(flat.unsqueeze(-1))
            return
        if not owned:
            flat = flat.clone()  # never the caller's tensor: one updated in place would change what was counted
        kept.setdefault(name, []).append(flat)
        size = self._kept_size
        size[0] += 1
        size[1] += flat.numel()
        if size[0] >= 1024 or size[1] >= 2**18:
            self._reduce_kept()

    def _reduce_kept(self) -> None:
        kept, self._kept, self._kept_size = self._kept, {}, [0, 0]
        for name, parts in kept.items():
            values = parts[0] if len(parts) == 1 else torch.cat(parts)
            self._stats[name].add(values.unsqueeze(-1))

    def _clash(self, name: str) -> str:
        """Why a new entry ``name`` would share a key with an entry already seen (``reduce_stats=True``), or ''."""
        if not self.reduce_stats:
            return ""
        parent, _, stat = name.rpartition("/")
        if stat in ("min", "max") and parent in self._stats:
            return (f"training entry {name!r} would be logged as {self.prefix}/{name}, the key of the {stat} of entry "
                    f"{parent!r} (reduce_stats=True), so one would overwrite the other; it is skipped: rename it, e.g. "
                    f"{parent + '/' + stat + '_per_update'!r}")
        for stat in ("min", "max"):
            if f"{name}/{stat}" in self._stats:
                return (f"training entry {name!r} would log its {stat} as {self.prefix}/{name}/{stat}, the key of "
                        f"entry {name + '/' + stat!r} (reduce_stats=True), so one would overwrite the other; it is "
                        f"skipped: rename one of them")
        return ""

    def _wanted(self, name: str) -> bool:
        def matches(pattern: str) -> bool:
            return name == pattern or name.startswith(pattern.rstrip("/") + "/")

        if any(matches(p) for p in self.exclude):
            return False
        return self.include is None or any(matches(p) for p in self.include)

    def log(self, logger, step: int) -> None:
        metrics: Dict[str, Tensor] = {}
        counts: Dict[str, Tensor] = {}
        ops: Dict[str, str] = {}
        try:
            self._reduce_kept()
            for name, acc in self._stats.items():
                if acc.empty:
                    continue
                summary = acc.summary()
                metrics[name] = summary["mean"]
                counts[name] = acc.count
                if self.reduce_stats:
                    metrics[f"{name}/min"] = summary["min"]
                    metrics[f"{name}/max"] = summary["max"]
                    counts[f"{name}/min"] = counts[f"{name}/max"] = acc.count
                    ops[f"{name}/min"], ops[f"{name}/max"] = "min", "max"
                acc.reset()
        except BaseException:  # this interval is lost (the failure is reported): none of it is counted in the next
            self._kept, self._kept_size = {}, [0, 0]
            for acc in self._stats.values():
                acc.reset()
            raise
        if metrics:  # over ranks: means weighted by each rank's updates, min of mins, max of maxes
            log_reduced(logger, metrics, step, self.prefix, ops, counts)

    def __repr__(self) -> str:
        return f"TrainMetrics(group={self.group!r}, reduce_stats={self.reduce_stats})"


def _flatten(losses: Any, prefix: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Any]]:
    if is_tensordict(losses):
        for key, value in losses.items(include_nested=True, leaves_only=True):
            key = key if isinstance(key, tuple) else (key,)
            yield "/".join(prefix + key), value
        return
    if not isinstance(losses, Mapping):
        raise TypeError(
            f"TrainMetrics takes a dict or TensorDict of losses/statistics, got {type(losses).__name__}; "
            f"wrap a single loss as {{'loss': loss}}."
        )
    for key, value in losses.items():
        parts = tuple(str(part) for part in key) if isinstance(key, tuple) else (str(key),)
        if isinstance(value, Mapping) or is_tensordict(value):
            yield from _flatten(value, prefix + parts)
        else:
            yield "/".join(prefix + parts), value


def _as_tensor(name: str, value: Any) -> Optional[Tensor]:
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() == 0:
            return None
        if value.is_complex():
            raise TypeError(
                f"training entry {name!r} is a complex tensor; log its abs() or real part instead."
            )
        return value if value.is_floating_point() else value.to(wide_dtype(value.device))  # ints exact to 2**53
    if isinstance(value, np.ndarray):  # a copy: read-only, byte-swapped or reversed arrays are losses too
        if value.dtype.kind == "O":  # numbers kept as objects: read as float64 if each is a real number
            try:
                value = np.array(value, dtype=np.float64)
            except (TypeError, ValueError):
                pass
        if value.dtype.kind not in "biuf":  # a complex one read its real part, strings were parsed, dates counted
            raise TypeError(f"training entry {name!r} is a NumPy array of dtype {value.dtype}; expected real numbers "
                            f"(bool, int, uint or float): log its abs() or real part, or leave it out")
        return torch.from_numpy(np.array(value, dtype=np.float64)) if value.size else None
    if isinstance(value, (numbers.Real, np.bool_, np.integer, np.floating)):
        return torch.tensor(float(value), dtype=torch.float64)
    raise TypeError(
        f"training entry {name!r} has type {type(value).__name__}; "
        f"expected a tensor, a number or a nested dict."
    )
