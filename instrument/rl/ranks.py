"""Staging RL statistics so that `torch.distributed` ranks combine them as the statistic means.

The logger reduces every key over ranks with the op it was logged with (default ``mean``). For RL keys the
mean is wrong: frames and episode counts add up over ranks, a minimum is the smallest rank's minimum, and a
mean over episodes weighs each rank by its episodes. A rank with nothing counted (no episode ended) has a NaN
mean/min/max locally, and a NaN from one rank makes the reduced value NaN; so under a process group such a
rank contributes the reduction's identity instead: value 0 with weight 0 to a weighted mean (NaN only when
no rank counted anything: 0 / 0), +inf to a min and -inf to a max, with its count beside it (the logger's
`PRESENCE` keys, summed), so that a min or max no rank counted anything for is NaN, as on one process. All of
it stays on the device.

Without a process group (or with one rank) the values are staged exactly as they are, with the default op,
so a single-process run writes the same numbers (a weighted mean, ``value * n / n``, can differ in the last
bit).
"""

import math
from typing import Any, Mapping, Optional

import torch

from instrument.core.observer import distributed
from instrument.logger.handover import PRESENCE

__all__ = ["distributed", "log_reduced"]


def log_reduced(
    logger: Any,
    metrics: Mapping[str, Any],
    step: int,
    prefix: str,
    ops: Mapping[str, str],
    counts: Optional[Mapping[str, Any]] = None,
) -> None:
    """Stage ``metrics`` with ``ops`` (key -> ``"sum"``/``"min"``/``"max"``; unnamed keys: ``"mean"``) and
    ``counts`` (key -> how many values the key summarises: a weight for a mean, presence for a min/max)."""
    if not distributed(logger):
        logger.log_metrics(metrics, step=step, prefix=prefix)
        return
    staged = dict(metrics)
    reduce = {key: ops.get(key, "mean") for key in staged}
    weights = {}
    presence = {}
    head = prefix.rstrip("/") + "/" if prefix else ""
    for key, count in (counts or {}).items():  # RunningStats counts: tensors on the values' device
        value = staged[key]
        seen = count > 0
        if reduce[key] == "mean":
            staged[key] = torch.where(seen, value, torch.zeros((), dtype=value.dtype, device=value.device))
            weights[key] = count.to(value.dtype)
        elif reduce[key] in ("min", "max"):
            identity = math.inf if reduce[key] == "min" else -math.inf
            staged[key] = torch.where(seen, value, torch.full((), identity, dtype=value.dtype, device=value.device))
            presence[PRESENCE + head + key] = count.to(value.dtype)
    logger.log_metrics(staged, step=step, prefix=prefix, reduce=reduce, weights=weights or None)
    if presence:
        logger.log_metrics(presence, step=step, reduce="sum")

