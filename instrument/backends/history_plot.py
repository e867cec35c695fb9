"""The run history's figures (`RunHistoryBackend.plot_metrics`, `plot_timelog`), drawn with matplotlib's
`Figure` (no pyplot, so no global state and no GUI backend) from copies the history made under its lock.

Every text drawn from a metric key or a stage name is literal (``parse_math=False``): keys are the user's
strings, and matplotlib would read two ``$`` in them as math (``cost/$_$`` makes ``savefig`` raise). A line
needs two neighbouring finite points, so a marker goes on each point drawn alone (a single value, one between
NaNs), and values that cannot be drawn (NaN, inf, and finite values beyond +-1e307, whose span matplotlib cannot
compute) are counted in the panel's title instead of vanishing.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from instrument.errors import require

__all__ = ["PANEL_INCHES", "plot_metrics", "plot_timelog"]

PANEL_INCHES = 2.2  # the height of one plot_metrics panel
# The largest magnitude drawn. matplotlib computes an axis' span, margins and ticks in float64: finite values whose
# span overflows ([0, 1e308], [-6e307, 6e307]) made the whole figure fail when drawn ("arange: cannot compute
# length"). Within +-1e307 every span (2e307 at most) leaves it room.
DRAWN_LIMIT = 1e307


def plot_metrics(series: Sequence[Tuple[str, np.ndarray, np.ndarray]], title: Optional[str]):
    """One panel per ``(key, steps, values)``, value against step; the matplotlib Figure."""
    figure_cls = require("matplotlib.figure", "analysis", "RunHistoryBackend.plot_metrics").Figure
    fig = figure_cls(figsize=(6.4, PANEL_INCHES * len(series)), layout="constrained")
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, steps, values) in zip(axes, series, strict=True):
        left_out = _draw(ax, steps, values, key)
        ax.set_ylabel(key.rsplit("/", 1)[-1], fontsize=8, parse_math=False)
        ax.set_title(key + _not_drawn(left_out, len(values)), fontsize=9, loc="left", parse_math=False)
        _style(ax)
    _whole_steps(axes[0], [steps for _, steps, _ in series])
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title, parse_math=False)
    return fig


def plot_timelog(timelog: Dict[str, List[Tuple[int, float, int]]], title: Optional[str]):
    """Mean seconds per stage against step, one line per stage; the matplotlib Figure."""
    figure_cls = require("matplotlib.figure", "analysis", "RunHistoryBackend.plot_timelog").Figure
    fig = figure_cls(figsize=(6.4, 3.2), layout="constrained")
    ax = fig.subplots()
    left_out: Dict[str, int] = {}
    total = 0
    for stage, entries in sorted(timelog.items()):
        means = np.fromiter((m for _, m, _ in entries), dtype=np.float64, count=len(entries))
        for what, count in _draw(ax, [s for s, _, _ in entries], means, stage).items():
            left_out[what] = left_out.get(what, 0) + count
        total += len(entries)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds (mean per call)")
    if timelog:
        for text in ax.legend(fontsize=8).get_texts():
            text.set_parse_math(False)
    _style(ax)
    _whole_steps(ax, [[s for s, _, _ in entries] for entries in timelog.values()])
    ax.set_title((title or "stage timings") + _not_drawn(left_out, total), fontsize=10, loc="left",
                 parse_math=False)
    return fig


def _draw(ax, steps, values: np.ndarray, label: str) -> Dict[str, int]:
    """The series as one line, with a small marker on each drawn point that has no drawn neighbour (the line
    alone would not show it). Returns how many values of each kind (NaN, +inf, -inf, finite beyond
    +-`DRAWN_LIMIT`) could not be drawn."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    huge = finite & (np.abs(values) > DRAWN_LIMIT)
    drawn = finite & ~huge
    alone = drawn & ~np.r_[False, drawn[:-1]] & ~np.r_[drawn[1:], False]
    shown = np.where(drawn, values, np.nan)  # a gap, as NaN already is: inf would stretch the axis
    ax.plot(steps, shown, lw=1.2, marker="o", ms=3.5, markevery=alone.tolist(), label=label)
    return {"NaN": int(np.isnan(values).sum()), "+inf": int(np.isposinf(values).sum()),
            "-inf": int(np.isneginf(values).sum()), f"beyond +-{DRAWN_LIMIT:g}": int(huge.sum())}


def _not_drawn(left_out: Dict[str, int], total: int) -> str:
    """`` (2 of 5 values not drawn: 1 NaN, 1 +inf)`` or nothing: a hidden divergence is said, not guessed."""
    counts = [f"{n} {what}" for what, n in left_out.items() if n]
    if not counts:
        return ""
    n = sum(left_out.values())
    return f"  ({n} of {total} value{'s' if total != 1 else ''} not drawn: {', '.join(counts)})"


def _style(ax) -> None:
    """Steps are whole numbers: no tick at step 0.5."""
    ticker = require("matplotlib.ticker", "analysis", "RunHistoryBackend plots")
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _whole_steps(ax, steps: Sequence[Sequence[int]]) -> None:
    """Widen an axis whose steps span less than two to one step either side: matplotlib gives integer ticks only
    where at least two fit, and would label a single step's axis -0.06 .. 0.06."""
    seen = [int(s) for each in steps for s in (min(each), max(each)) if len(each)]
    if seen and max(seen) - min(seen) < 2:
        ax.set_xlim(min(seen) - 1, max(seen) + 1)
