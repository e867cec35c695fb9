"""Options shared by the observers that draw heatmaps or name channels: checked once, at construction.

``color_range`` makes heatmap colours comparable across logging steps (the slider in TensorBoard): a fixed
``(lo, hi)``, ``"running"`` (the range seen so far, tracked by the logger on its writer thread), or None (each
image scaled to its own values). An observer with several heatmaps (one per statistic) also takes a mapping
``{stat: range}``: statistics on different scales (a mean and a zero fraction) each get their own.

``channel_names`` replaces the ``c<k>`` labels of a state's channels, in metric keys and heatmap axes.

``max_channels`` (how many channels get scalars or histograms) and ``max_elements`` (how much a buffer keeps
before it reduces early) are ints >= 1 or None (`check_limit`): a negative ``max_channels`` would otherwise cut
channels off the end without a word, and a string would fail only at the first logging step.
"""

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from instrument.checks import check_int
from instrument.core.colormap import parse_color_range
from instrument.errors import ConfigurationError

__all__ = ["ColorRange", "channel_labels", "check_channel_names", "check_limit", "color_ranges"]

ColorRange = Union[None, str, Tuple[float, float]]


def _one_range(owner: str, value: Any) -> ColorRange:
    return parse_color_range(owner, value, ConfigurationError, more=", or a dict statistic -> one of these")


def color_ranges(owner: str, color_range: Any, stats: Sequence[str]) -> Dict[str, ColorRange]:
    """``color_range`` for every statistic in ``stats``: one value for all, or a mapping (unnamed: None)."""
    if isinstance(color_range, Mapping):
        unknown = sorted(set(color_range) - set(stats))
        if unknown:
            raise ConfigurationError(
                f"{owner}: color_range names {unknown}, which are not among its heatmaps {list(stats)}."
            )
        return {stat: _one_range(owner, color_range.get(stat)) for stat in stats}
    value = _one_range(owner, color_range)
    return {stat: value for stat in stats}


def check_channel_names(owner: str, names: Optional[Sequence[str]]) -> Optional[Tuple[str, ...]]:
    """Non-empty, unique strings without ``/`` (each becomes one component of a metric key), or None."""
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ConfigurationError(
            f"{owner}: channel_names must be a list or tuple of strings such as ('x', 'v', 'theta', 'omega'), "
            f"got {names!r}."
        )
    bad = [n for n in names if not isinstance(n, str) or not n or "/" in n]
    if bad:
        raise ConfigurationError(
            f"{owner}: every channel name must be a non-empty string without '/', got {bad!r} in {list(names)!r}."
        )
    if len(set(names)) != len(names):
        raise ConfigurationError(f"{owner}: channel_names must be unique, got {list(names)!r}.")
    return tuple(names)


def channel_labels(owner: str, names: Optional[Tuple[str, ...]], channels: int, count: int) -> Tuple[str, ...]:
    """The labels of the first ``count`` of ``channels`` channels: ``names`` (which must have exactly
    ``channels`` entries) or ``c<k>``, zero-padded to the width of the largest index shown so that keys sort in
    channel order (``c00`` .. ``c15`` for 16)."""
    if names is None:
        width = len(str(max(count - 1, 0)))
        return tuple(f"c{k:0{width}d}" for k in range(count))
    if len(names) != channels:
        raise ConfigurationError(
            f"{owner}: got {len(names)} channel_names {list(names)!r} for a state with {channels} channels; give "
            f"exactly one name per channel (or check channel_dim)."
        )
    return names[:count]


def check_limit(owner: str, option: str, value: Any, example: int) -> Optional[int]:
    """``max_channels`` / ``max_elements``: an int >= 1, or None (no limit)."""
    return check_int(f"{owner}: {option}", value, least=1, none=True, integral=True,
                     fix=f"pass e.g. {option}={example}, or None for no limit")
