"""The training thread's part of a commit: means of the interval, the cross-rank reduction, the transfer started.

Everything here runs on the committing thread: the reduction is a collective (every rank takes part), and the
transfer must start before the staged device values can change. What follows (conversion, rendering, writing)
is the writer thread's (`instrument.logger.assemble`, `instrument.logger.writer`).
"""

import logging
import math
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
from torch import Tensor

from instrument.logger.blocks import fold
from instrument.logger.media import tensors_of
from instrument.logger.reduce import CrossRankReducer, Entry
from instrument.logger.timer import timing_stats
from instrument.logger.transfer import start_transfer, to_host

__all__ = ["PRESENCE", "handover"]

log = logging.getLogger("instrument")

# Under a process group, ``PRESENCE + name`` (reduced with "sum") counts what the min or max ``name`` summarises
# on each rank (`instrument.rl.ranks`): where no rank counted anything, ``name`` is written as NaN, as on one
# process, instead of the reduction's identity (+inf for a min). Popped before anything is written.
PRESENCE = "\0present/"

_TIMING = "\0timing/"  # the timers' statistics in the reduction (NUL first): a user's timing/... metric stays one
_ROUNDED = "\0rounded/"  # an internal key (NUL first), popped before anything is written


def handover(
    step: int, staged: tuple, reducer: Optional[CrossRankReducer], warn: Optional[Callable[[str, str], None]] = None,
    paired: bool = False, closing: bool = False,
) -> Optional[tuple]:
    """The payload handed to the writer for the staged table ``staged``; ``reducer`` when under a process group;
    ``warn(key, message)`` says a weighted mean is undefined (once per key, the logger's `_warn_once`).
    ``paired``: every rank commits this same step (checked by the reduction); ``closing``: the logger's last commit.

    None when a collective commit leaves nothing to write.
    """
    totals, counts, ops, weights, on_device, media, timers, blocks, wide = staged
    timings: Any = timers
    if reducer is not None:
        if blocks:  # the reduction needs every name here (blocks and a per-key table are never staged together)
            fold(blocks, totals, counts, on_device)
            blocks = []
        scalars = _reduce(reducer, totals, counts, ops, weights, timers, wide, step if paired else None, closing)
        timings = {}
        for key in [k for k in scalars if k.startswith(_TIMING)]:
            name, _, stat = key[len(_TIMING):].rpartition("/")
            timings.setdefault(name, {})[stat] = scalars.pop(key)
        # Every rank's flags, reduced with max: rank 0 writes the reduced value, so it says so for any rank.
        rounded = [key[len(_ROUNDED):] for key in list(scalars) if key.startswith(_ROUNDED) and scalars.pop(key) > 0]
        for key in [k for k in scalars if k.startswith(PRESENCE)]:
            if scalars.pop(key) == 0 and key[len(PRESENCE):] in scalars:
                scalars[key[len(PRESENCE):]] = math.nan
        wide = {tuple(rounded): np.ones(len(rounded), dtype=bool)} if rounded else {}
        if not (scalars or media or timings):
            return None
        tensor_keys: List[str] = []
        tensors: List[Tensor] = []
    elif blocks:  # names and means are made on the writer (`instrument.logger.blocks`)
        scalars, tensor_keys, tensors = blocks, [], []
        for block in blocks:  # a loop, not a comprehension: no extra frame on this hot path
            if len(block) == 3:
                tensors.append(block[2])
    else:
        scalars = totals  # the staged table is ours now: turn sums into means in place
        for name, count in counts.items():
            if name not in weights:
                scalars[name] = scalars[name] / count
        for name, weight in weights.items():
            # Every weight is >= 0, so a total of 0 means nothing was weighed: the weighted mean is undefined
            # and written as NaN, as a device tensor's 0 / 0 and the cross-rank reduction give it (the key
            # alone; never a ZeroDivisionError that would cost the whole step).
            if type(weight) is float and weight == 0.0 and type(scalars[name]) is float:
                scalars[name] = math.nan
                if warn is not None:
                    warn(f"zero weight {name}", f"metric {name!r}: its weights sum to 0 over the interval, so its "
                         f"weighted mean is undefined and is written as NaN; pass weights > 0 (e.g. the batch "
                         f"size) or leave weights out for a plain mean")
            else:
                scalars[name] = scalars[name] / weight
        for name, op in ops.items():
            if op == "l2":  # the root of the sum of squares over one rank: |value|, as with several ranks
                scalars[name] = abs(scalars[name])
        tensor_keys = list(on_device)
        tensors = [scalars[name] for name in tensor_keys]
    for value, _ in media.values():
        tensors.extend(tensors_of(value))
    for flags in wide.values():  # int64 values beyond 2**53, flagged on their device: read on the writer
        if isinstance(flags, Tensor):
            tensors.append(flags)
    batch = start_transfer(tensors) if tensors else None
    return (step, time.time(), scalars, tensor_keys, media, timings, batch, tensors, wide)


def _reduce(reducer: CrossRankReducer, totals, counts, ops, weights, timers, wide, step: Optional[int],
            closing: bool) -> Dict[str, float]:
    """The cross-rank reduction of the interval's scalars, timings and flags of integers beyond 2**53 (as
    ``_ROUNDED + name``, max): one collective (two when a key is new)."""
    entries = []
    for name, total in totals.items():
        if name in weights:
            entries.append(Entry(name, "wmean", total, weights[name]))
        else:
            entries.append(Entry(name, ops.get(name, "mean"), total / counts[name] if name in counts else total))
    for name, (reduce, taken) in timers.items():
        try:
            stats = timing_stats(taken)
        except RuntimeError:  # events that cannot be read (a span begun and ended on different devices): this
            # rank still enters the collective, without them, so the other ranks never wait for it
            log.warning("instrument: the CUDA events of timer %r could not be read; its timings of this commit "
                        "are left out", name, exc_info=True)
            continue
        for key, value in (stats or {}).items():
            entries.append(Entry(f"{_TIMING}{name}/{key}", reduce, value))
    for names, flags in wide.items():
        entries.extend(Entry(_ROUNDED + name, "max", flag) for name, flag in zip(names, flags.unbind(), strict=True))
    pending = reducer.start(entries, step, closing)
    # host sync: the reduced vector is needed here when some rank's keys did not fit (a second collective).
    reduced = reducer.finish(pending, to_host([pending.result])[0])
    return dict(reduced if reduced is not None else reducer.resolve(entries))
