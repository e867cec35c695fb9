"""Reducing a commit's scalars across `torch.distributed` ranks with one collective.

Each metric names how ranks combine (``reduce=``): ``mean`` (optionally weighted), ``sum``, ``min``, ``max``
or ``l2`` (square root of the sum of squares, e.g. a gradient norm over shards). Lightning's ``sync_dist``
issues one collective per metric; here every scalar of a commit is packed into one float64 vector laid out as

    sum segment   numerators (mean, weighted mean, sum; squares for l2) | denominators (means) | counts
                  | NaN flags of the max segment (a MAX all_reduce need not keep a NaN: gloo's drops it)
    max segment   header [misfit, layout hash, -layout hash, step, -step, closing, -closing, rest, -rest]
                  | values (max) and negated values (min); ``rest`` is what float64 rounded off the step

and exchanged with ONE ``all_gather`` (every rank then sums the first segment and takes the maximum of the
second locally: min is the max of negated values). When ``world_size x length`` exceeds ``gather_limit`` the
bandwidth-optimal form is used instead: one SUM and one MAX ``all_reduce`` (one collective per reduction
kind).
Both forms give every rank the same result, so each rank takes the same branch afterwards.

Ranks need not log the same keys. The layout (the sorted union of every ``(key, op)`` seen on any rank) is
agreed once and kept; each commit packs its values into the current layout, absent keys contribute neutral
values and a zero presence count, and keys no rank logged this time are dropped. A rank whose keys do not all
fit the layout sets the header's misfit flag; then, on every rank at once, the key lists are exchanged with
one ``all_gather_object``, the layout grows to the union, and the vector is exchanged again. That slow path
runs only when a new key appears (the first commit, and rarely later); a steady commit costs one collective.

The header also carries the commit's step (where the caller pairs commits by step: `Logger.commit(step)`) and
whether it is a closing logger's last commit. Reduced, they show whether every rank is at the same step and
whether some rank is closing while another still trains, so a rank that skipped or added a commit (uneven data
shards, a commit inside an ``if``) is seen at once on every rank, which all raise, instead of each later commit
pairing with another rank's next one and mixing their values.

`CrossRankReducer.start` returns the reduced vector on the collective device. The commit reads it on the host at
once (`instrument.logger.handover`: whether the layout must grow, and the values, are needed before anything is
written), a transfer of its own before the commit's batched one. Building the vector copies its host-side values
(Python numbers, CPU tensors) and index lists to the device from pinned memory without blocking (on a GPU), and
values already on that device are gathered there; values on a GPU under gloo come to the host with a blocking
copy (gloo reduces on the CPU).
"""

import dataclasses
import math
import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from instrument.core.devices import to_device
from instrument.errors import ConfigurationError, InstrumentError
from instrument.logger.ranks import collective_device, config_hash, is_distributed, object_collective_device
from instrument.logger.transfer import to_host

__all__ = ["OPS", "Entry", "CrossRankReducer", "PendingReduction", "resolve_ops"]

OPS = ("mean", "sum", "min", "max", "l2")
_STRATEGIES = ("auto", "gather", "allreduce")
_SUM_KINDS = ("mean", "wmean", "sum", "l2")
_MEAN_KINDS = ("mean", "wmean")
# misfit flag, layout hash, layout hash, step, step, closing, closing, rest, rest (every second one negated). A step
# beyond 2**53 rides as float(step) and the exact rest ``step - int(float(step))`` (|rest| <= 2**10), so that two
# ranks at steps 2**53 and 2**53 + 1 (a step of nanoseconds) are told apart, not mixed.
_HEADER = 9

Scalar = Union[float, Tensor]


@dataclasses.dataclass
class Entry:
    """One scalar of a commit on this rank.

    ``kind`` is an op from `OPS`, or ``"wmean"`` for a weighted mean, whose ``value`` is the sum of
    ``weight * value`` over the interval and ``weight`` the sum of weights. For every other kind ``value`` is
    the interval's local value and ``weight`` is 1.
    """

    key: str
    kind: str
    value: Scalar
    weight: Scalar = 1.0


def resolve_ops(
    keys: Sequence[str], reduce: Union[str, Mapping[str, str]], weights: Any = None
) -> Dict[str, Tuple[str, Any]]:
    """Validate ``reduce=`` and ``weights=`` of one ``log_metrics`` call: key -> (op, weight or None)."""
    if isinstance(reduce, str):
        ops = {k: _check_op(reduce, k) for k in keys}
    elif isinstance(reduce, Mapping):
        unknown = sorted(set(reduce) - set(keys))
        if unknown:
            raise ConfigurationError(
                f"reduce= names {unknown}, which are not among the logged metrics {sorted(keys)}; "
                f"use the metric names as passed to log_metrics (without the prefix)."
            )
        ops = {k: _check_op(reduce.get(k, "mean"), k) for k in keys}
    else:
        raise ConfigurationError(
            f"reduce must be an op name {OPS} or a dict metric name -> op, got {type(reduce).__name__}."
        )
    if weights is None:
        return {k: (op, None) for k, op in ops.items()}
    if isinstance(weights, Mapping):
        unknown = sorted(set(weights) - set(keys))
        if unknown:
            raise ConfigurationError(
                f"weights= names {unknown}, which are not among the logged metrics {sorted(keys)}."
            )
        chosen = dict(weights)
    else:
        chosen = {k: weights for k, op in ops.items() if op == "mean"}
        if not chosen and keys:
            raise ConfigurationError(
                f"weights= was given but no metric is reduced with 'mean' "
                f"(ops: {sorted(set(ops.values()))}); "
                f"weights apply only to 'mean' (a weighted mean, e.g. weighted by batch size)."
            )
    for k in chosen:
        if ops[k] != "mean":
            raise ConfigurationError(
                f"metric {k!r} has a weight but reduce op {ops[k]!r}; weights apply only to 'mean' "
                f"(a weighted mean, e.g. weighted by batch size)."
            )
        _check_weight(k, chosen[k])
    return {k: (op, chosen.get(k)) for k, op in ops.items()}


def _check_op(op: Any, key: str) -> str:
    if op not in OPS:
        raise ConfigurationError(f"unknown reduce op {op!r} for metric {key!r}; expected one of {OPS}.")
    return op


def _check_weight(key: str, weight: Any) -> None:
    if isinstance(weight, Tensor):
        if weight.numel() != 1:
            raise ConfigurationError(
                f"the weight of {key!r} must be one number, got a tensor of shape {tuple(weight.shape)}."
            )
        return
    if (
        isinstance(weight, bool)
        or not isinstance(weight, numbers.Real)
        or not math.isfinite(weight)
        or weight < 0
    ):
        raise ConfigurationError(
            f"the weight of {key!r} must be a finite number >= 0 (e.g. a batch size), got {weight!r}."
        )


# ---------------------------------------------------------------------- collectives (one place, countable)
def _all_gather(tensor: Tensor, group: Optional[Any]) -> Tensor:
    """One all_gather; returns [world_size, n]."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return torch.stack(out)


def _all_reduce(tensor: Tensor, op: Any, group: Optional[Any]) -> None:
    dist.all_reduce(tensor, op=op, group=group)


def _all_gather_object(obj: Any, group: Optional[Any]) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size(group)
    with object_collective_device(group):
        dist.all_gather_object(out, obj, group=group)
    return out


# ---------------------------------------------------------------------- layout
class _Layout:
    """Slot positions of every (key, kind) in the packed vector; identical on every rank."""

    def __init__(self, items: Sequence[Tuple[str, str]]) -> None:
        self.items: Tuple[Tuple[str, str], ...] = tuple(sorted(items))
        self.kinds = dict(self.items)
        sums = [k for k, kind in self.items if kind in _SUM_KINDS]
        means = [k for k, kind in self.items if kind in _MEAN_KINDS]
        extremes = [k for k, kind in self.items if kind not in _SUM_KINDS]
        self.num = {k: i for i, k in enumerate(sums)}
        self.den = {k: len(sums) + i for i, k in enumerate(means)}
        self.cnt = {k: len(sums) + len(means) + i for i, (k, _) in enumerate(self.items)}
        self.n_sum = len(sums) + len(means) + len(self.items)
        self.ext = {k: _HEADER + i for i, k in enumerate(extremes)}
        self.n_max = _HEADER + len(extremes)
        self.hash = float(config_hash(repr(self.items)))
        self._masks: Dict[torch.device, Tuple[Tensor, Tensor]] = {}

    def __len__(self) -> int:
        return self.n_sum + 2 * self.n_max  # the max segment's NaN flags ride in the sum segment

    def masks(self, device: torch.device) -> Tuple[Tensor, Tensor]:
        """(which sum slots to square, sign of each max slot) on ``device``; built once per layout."""
        if device not in self._masks:
            square = torch.zeros(self.n_sum, dtype=torch.bool)
            for k, kind in self.items:
                if kind == "l2":
                    square[self.num[k]] = True
            sign = torch.ones(self.n_max, dtype=torch.float64)
            sign[2] = sign[4] = sign[6] = sign[8] = -1.0
            for k, kind in self.items:
                if kind == "min":
                    sign[self.ext[k]] = -1.0
            self._masks[device] = (square.to(device), sign.to(device))
        return self._masks[device]

    def decode(self, host: np.ndarray) -> Dict[str, float]:
        s, nan, m = host[: self.n_sum], host[self.n_sum : self.n_sum + self.n_max], host[self.n_sum + self.n_max :]
        out: Dict[str, float] = {}
        for key, kind in self.items:
            if s[self.cnt[key]] == 0:
                continue  # no rank logged it this time
            if kind in _MEAN_KINDS:
                den = s[self.den[key]]
                out[key] = float(s[self.num[key]] / den) if den != 0 else math.nan
            elif kind == "sum":
                out[key] = float(s[self.num[key]])
            elif kind == "l2":
                out[key] = math.sqrt(max(float(s[self.num[key]]), 0.0))
            elif nan[self.ext[key]] > 0:  # some rank's value was NaN: so is the min or max over ranks
                out[key] = math.nan
            elif kind == "max":
                out[key] = float(m[self.ext[key]])
            else:  # min: the max of negated values, negated back
                out[key] = -float(m[self.ext[key]])
        return out


@dataclasses.dataclass
class PendingReduction:
    """A collective already issued; ``result`` (on the collective device) still has to reach the host."""

    layout: _Layout
    result: Tensor


# ---------------------------------------------------------------------- reducer
class CrossRankReducer:
    """Reduces a commit's `Entry` list across the ranks of ``group`` (None: the default group).

    Lifecycle, driven by the logger at each commit (every rank must commit at the same steps)::

        if reducer.active():
            pending = reducer.start(entries)          # pack + one collective, no host transfer
            host = to_host([pending.result, ...])     # the logger's one batched transfer
            values = reducer.finish(pending, host[0]) # None: a rank logged a new key ->
            if values is None:
                values = reducer.resolve(entries)     # exchange key lists, grow the layout, reduce again

    Args:
        group: the process group; None means the default group.
        strategy: ``"gather"`` (one all_gather, reduced locally), ``"allreduce"`` (one SUM and one MAX
            all_reduce) or ``"auto"``: gather while ``world_size * vector length <= gather_limit``.
        gather_limit: elements a rank may receive in the gather form (default 65536, 512 KiB of float64).
    """

    def __init__(
        self, group: Optional[Any] = None, strategy: str = "auto", gather_limit: int = 1 << 16
    ) -> None:
        if strategy not in _STRATEGIES:
            raise ConfigurationError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}.")
        self.group = group
        self.strategy = strategy
        self.gather_limit = int(gather_limit)
        self._layout = _Layout(())
        self._pairing: Tuple[Optional[int], bool] = (None, False)  # the current commit's (step, closing): `start`

    def active(self) -> bool:
        """True when there is more than one rank; otherwise the logger keeps local values (a no-op)."""
        return is_distributed(self.group)

    @property
    def keys(self) -> Tuple[Tuple[str, str], ...]:
        """The agreed layout: every (key, kind) any rank has logged."""
        return self._layout.items

    def start(self, entries: Sequence[Entry], step: Optional[int] = None, closing: bool = False) -> PendingReduction:
        """Pack and issue one commit's collective. ``step``: the step every rank must commit at once (None: not
        checked, as in a loop whose ranks count their own steps); ``closing``: a closing logger's last commit."""
        self._pairing = (step, closing)
        return self._start(entries)

    def _start(self, entries: Sequence[Entry]) -> PendingReduction:
        layout = self._layout
        step, closing = self._pairing
        device = collective_device(self.group)
        misfit = any(layout.kinds.get(e.key) != e.kind for e in entries)
        sums: List[Scalar] = [0.0] * layout.n_sum
        # an unchecked step is neutral in the maximum of both the step and its negation
        rounded = math.inf if step is None else float(step)  # +-inf: neutral in the maximum of both slots
        rest = math.inf if step is None else float(step - int(rounded))
        extremes: List[Scalar] = [misfit * 1.0, layout.hash, layout.hash, -rounded if step is None else rounded,
                                  rounded, float(closing), float(closing), -rest if step is None else rest, rest]
        extremes += [
            math.inf if kind == "min" else -math.inf for _, kind in layout.items if kind not in _SUM_KINDS
        ]
        for e in entries:
            if layout.kinds.get(e.key) != e.kind:
                continue
            sums[layout.cnt[e.key]] = 1.0
            if e.kind in _SUM_KINDS:
                sums[layout.num[e.key]] = e.value
                if e.kind in _MEAN_KINDS:
                    sums[layout.den[e.key]] = e.weight
            else:
                extremes[layout.ext[e.key]] = e.value
        square, sign = layout.masks(device)
        sum_seg = _assemble(sums, device)
        sum_seg = torch.where(square, sum_seg * sum_seg, sum_seg)
        max_seg = _assemble(extremes, device) * sign
        sum_seg = torch.cat([sum_seg, max_seg.isnan().to(torch.float64)])  # counted apart: see the module doc
        summed = layout.n_sum + layout.n_max
        if self._use_gather(len(layout)):
            gathered = _all_gather(torch.cat([sum_seg, max_seg]), self.group)
            result = torch.cat([gathered[:, :summed].sum(0), gathered[:, summed:].amax(0)])
        else:
            if layout.n_sum:  # no key yet (the first commit's header check): its NaN flags are not read
                _all_reduce(sum_seg, dist.ReduceOp.SUM, self.group)
            _all_reduce(max_seg, dist.ReduceOp.MAX, self.group)
            result = torch.cat([sum_seg, max_seg])
        return PendingReduction(layout, result)

    def finish(self, pending: PendingReduction, host: np.ndarray) -> Optional[Dict[str, float]]:
        """Decode the reduced vector; None when some rank's keys did not fit (call `resolve`)."""
        layout = pending.layout
        header = host[layout.n_sum + layout.n_max : layout.n_sum + layout.n_max + _HEADER]
        if header[1] != layout.hash or -header[2] != layout.hash:
            raise InstrumentError(
                "instrument's metric layouts differ across ranks: every rank must create its Logger the same "
                "way and commit at the same steps (commit is a collective when a process group is "
                "initialised)."
            )
        _check_paired(header)
        if header[0] > 0:
            return None
        return layout.decode(host)

    def resolve(self, entries: Sequence[Entry]) -> Dict[str, float]:
        """Slow path on every rank at once: agree on the union of keys, then reduce again."""
        mine = sorted({(e.key, e.kind) for e in entries})
        everyone = _all_gather_object(mine, self.group)
        by_key: Dict[str, Dict[str, List[int]]] = {}
        for r, items in enumerate(everyone):
            for key, kind in items:
                by_key.setdefault(key, {}).setdefault(kind, []).append(r)
        for key, kind in self._layout.items:
            by_key.setdefault(key, {}).setdefault(kind, [])
        conflicts = {k: v for k, v in by_key.items() if len(v) > 1}
        if conflicts:
            detail = "; ".join(
                f"{k!r}: "
                + ", ".join(f"{_op_name(kind)} on ranks {ranks or 'earlier'}" for kind, ranks in v.items())
                for k, v in sorted(conflicts.items())
            )
            raise ConfigurationError(
                f"metrics are logged with different reduce ops across ranks or steps ({detail}); "
                f"give each metric "
                f"one reduce op (and use weights= consistently) on every rank."
            )
        self._layout = _Layout([(k, next(iter(v))) for k, v in by_key.items()])
        pending = self._start(entries)  # the same commit: the same step and closing flag
        values = self.finish(pending, to_host([pending.result])[0])
        if values is None:  # cannot happen: every rank's keys are in the union
            raise InstrumentError(
                "instrument: ranks did not agree on the metric layout after exchanging keys."
            )
        return values

    def _use_gather(self, length: int) -> bool:
        if self.strategy == "auto":
            return dist.get_world_size(self.group) * length <= self.gather_limit
        return self.strategy == "gather"

    def __repr__(self) -> str:
        return f"CrossRankReducer(strategy={self.strategy!r}, keys={len(self._layout.items)})"


def _check_paired(header: np.ndarray) -> None:
    """Raise on every rank alike (each sees the same reduced header) when the ranks' commits are out of step."""
    high, low, rest_high, rest_low = header[3], -header[4], header[7], -header[8]
    closing, training = header[5] > 0, -header[6] < 1
    if closing and training:
        problem = ("some rank is closing its logger (its last commit) while another commits a training step: that "
                   "rank ran fewer logging steps, or a commit of it raised before the ranks met (look for its error "
                   "there: a value refused by log_metrics(..., commit=True), a step that went back)")
    elif math.isfinite(high) and math.isfinite(low) and (high != low or rest_high != rest_low):
        if high == low:  # steps beyond 2**53 that float64 rounds alike: the rests tell them apart, exactly
            low, high = int(low) + int(rest_low), int(high) + int(rest_high)
        problem = f"the ranks commit different steps at once ({int(low)} to {int(high)}): a rank skipped or added one"
    else:
        return
    raise InstrumentError(
        f"instrument: the ranks' commits are out of step: {problem}. Every rank must commit at the same logging "
        f"steps (commit is a collective under a process group); otherwise each later commit pairs with another "
        f"rank's next one and mixes their values, so nothing of this commit is written. Give every rank the same "
        f"number of steps (e.g. DistributedSampler(drop_last=True), or stop all ranks together) and call commit "
        f"on every rank, also with nothing staged."
    )


def _op_name(kind: str) -> str:
    return "weighted mean" if kind == "wmean" else kind


def _assemble(values: Sequence[Scalar], device: torch.device) -> Tensor:
    """A float64 vector on ``device`` from numbers and 0-d tensors: one copy per source device and dtype."""
    out = torch.tensor([v if not isinstance(v, Tensor) else 0.0 for v in values], dtype=torch.float64)
    out = to_device(out, device)
    groups: Dict[Tuple[torch.device, torch.dtype], Tuple[List[int], List[Tensor]]] = {}
    for i, v in enumerate(values):
        if isinstance(v, Tensor):
            idx, ts = groups.setdefault((v.device, v.dtype), ([], []))
            idx.append(i)
            ts.append(v.detach().reshape(()))
    for (source, _), (idx, ts) in groups.items():
        if source.type == "cpu":  # host values to the collective's device: pinned, without a wait
            stacked = to_device(torch.stack(ts).to(torch.float64), device)
        else:
            # host sync: with gloo and CUDA values, this is the commit's device->host copy of the scalars.
            stacked = torch.stack(ts).to(device=device, dtype=torch.float64)
        out.index_copy_(0, to_device(torch.tensor(idx), device), stacked)
    return out
