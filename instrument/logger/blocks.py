"""Float blocks: the cheapest way to stage a dict of Python floats, summed into means on the writer thread.

The common call, ``log_metrics({"loss": 0.3, ...}, step, prefix="train")`` with plain floats, needs no
per-key work on the training thread: nothing is converted, nothing is on a device. The logger stages such a
call as one block, ``(prefix head, a copy of the dict)``, at the cost of two C-level type scans and a dict
copy, instead of one Python-level loop over the keys (cold, as it is in training after a rollout, about
115 us -> 40 us for 100 floats). The writer thread turns the blocks of an interval into names and means with
the same arithmetic as the per-key path: values summed in the order logged, then divided by their count.

A logger holds blocks only while nothing else is staged in its scalar table; a call that needs the per-key
path (tensors, ints, reduce ops, weights) first folds the blocks into the table (`fold`), so conflicts
between calls are still found on the caller.
"""

from collections import Counter
from typing import Any, Dict, List, Mapping, Tuple

__all__ = ["Block", "MAX_BLOCKS", "floats_only", "fold", "means", "contributions"]

Block = Tuple[str, Dict[str, float]]  # (prefix head such as "train/" or "", {key: float})

# An interval that logs more blocks than this (a loop logging every step and committing rarely) is folded
# into the per-key table, so staging stays bounded in memory however long the interval.
MAX_BLOCKS = 64


def floats_only(metrics: Mapping[Any, Any]) -> bool:
    """True when every key is a ``str`` and every value exactly a Python ``float`` (no subclass, no bool)."""
    for key, value in metrics.items():  # cold, a plain loop beats two set(map(type, ...)) scans
        if type(value) is not float or type(key) is not str:
            return False
    return True


def fold(blocks: List[Block], totals: Dict[str, Any], counts: Dict[str, int]) -> None:
    """Add ``blocks`` to a per-key table of sums (``totals``) and counts (only names seen more than once)."""
    for head, values in blocks:
        for key, value in values.items():
            name = head + key
            if name in totals:
                totals[name] = totals[name] + value
                counts[name] = counts.get(name, 1) + 1
            else:
                totals[name] = value


def means(blocks: List[Block]) -> Dict[str, float]:
    """The mean of every name over ``blocks`` (first-logged order), as the per-key path computes it."""
    if len(blocks) == 1:
        head, values = blocks[0]
        return dict(values) if not head else {head + key: value for key, value in values.items()}
    totals: Dict[str, float] = {}
    counts: Dict[str, int] = {}
    fold(blocks, totals, counts)
    for name, count in counts.items():
        totals[name] = totals[name] / count
    return totals


def contributions(totals: Mapping[str, Any], counts: Mapping[str, int], blocks: List[Block]) -> Counter:
    """How many logged values each name's staged sum holds, in the table and in the blocks together."""
    seen: Counter = Counter({name: counts.get(name, 1) for name in totals})
    for head, values in blocks:
        seen.update(head + key for key in values)
    return seen
