"""A tqdm progress bar of frames and recent mean reward, fed by committed steps.

The bar is a backend: it reads the frame counter and the reward from each `StepRecord` the logger commits, so
it costs no device sync of its own and moves at every logging iteration. While it is open, console lines go
through ``tqdm.write`` (`instrument.terminal.output.write_line`), so the bar and the console table coexist.

The keys it shows are declared, not guessed: ``frames_key`` and ``reward_keys`` (a mapping label -> key, tried
in order) may hold ``{placeholders}`` filled from ``prefixes``. The defaults read ``{counters}/frames`` and
``{collection}/episode/return/mean``, then ``{collection}/reward/mean``; `RLLogging` sets ``prefixes`` to its
components' prefixes, so a ``CollectionMetrics(group="cartpole")`` is followed without rewriting any key.

It is off when stderr is not a terminal (CI logs, redirected output) unless bound on with ``enabled=True``.
"""

import collections
import math
import sys
from collections.abc import Mapping
from typing import Deque, Dict, Optional, Sequence, TextIO, Union

from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.checks import check_int
from instrument.errors import ConfigurationError, require

__all__ = ["ProgressBar", "DEFAULT_PREFIXES", "DEFAULT_REWARD_KEYS"]

DEFAULT_PREFIXES: Dict[str, str] = {"collection": "collection/main", "counters": "counters"}
DEFAULT_REWARD_KEYS: Dict[str, str] = {
    "return": "{collection}/episode/return/mean",
    "reward": "{collection}/reward/mean",
}
_STATS = ("mean", "min", "max")


class ProgressBar(Backend):
    """Shows ``frames`` (of ``total_frames`` when known) and the mean of the last ``window`` committed rewards.

    Args:
        total_frames: the run's length in frames, for a percentage and an ETA; None shows a counter.
        enabled: True or False forces the bar on or off; None shows it only when ``stream`` is a terminal.
        frames_key: the committed scalar holding the frame count (``{placeholders}`` from ``prefixes``).
        reward_keys: label -> committed scalar to show as ``<label> <mean>``; the first present and finite one
            wins (episode return, then per-step reward, by default). A plain list of keys labels each by its
            name (``.../episode/return/mean`` -> ``return``).
        window: how many committed reward values the shown mean covers.
        stream: where the bar draws; None means ``sys.stderr``.
        prefixes: the values of the ``{placeholders}`` in the keys (default ``collection`` ->
            ``collection/main``, ``counters`` -> ``counters``); `RLLogging` sets its components' prefixes.
    """

    def __init__(
        self,
        total_frames: Optional[int] = None,
        enabled: Optional[bool] = None,
        frames_key: str = "{counters}/frames",
        reward_keys: Union[Mapping, Sequence[str], None] = None,
        window: int = 10,
        stream: Optional[TextIO] = None,
        prefixes: Optional[Mapping] = None,
    ) -> None:
        if reward_keys is None:
            reward_keys = DEFAULT_REWARD_KEYS
        elif isinstance(reward_keys, str) or not isinstance(reward_keys, (Mapping, Sequence)):
            raise ConfigurationError(
                f"ProgressBar.reward_keys must be a mapping label -> key or a list of keys, got "
                f"{reward_keys!r}."
            )
        elif not isinstance(reward_keys, Mapping):
            reward_keys = {_label(key): key for key in reward_keys}
        check_int("ProgressBar.window", window, least=1, why="the committed reward values the mean covers",
                  fix="bind e.g. ProgressBar.window = 10")
        self.total_frames = total_frames
        self.enabled = enabled
        self.frames_key = frames_key
        self.reward_keys: Dict[str, str] = dict(reward_keys)
        self.prefixes: Dict[str, str] = {**DEFAULT_PREFIXES, **dict(prefixes or {})}
        self.window = window
        self.stream = stream
        self.bar = None
        self._rewards: Deque[float] = collections.deque(maxlen=window)
        self._reward_key: Optional[str] = None
        shown = self.shown_keys()  # a bad placeholder fails here, not at the first commit
        self._frames_at = shown.pop("frames")
        self._shown = shown

    def shown_keys(self) -> Dict[str, str]:
        """The keys the bar reads, placeholders filled: ``{"frames": ..., <label>: ..., ...}``."""
        shown = {"frames": self._resolve(self.frames_key)}
        shown.update((label, self._resolve(key)) for label, key in self.reward_keys.items())
        return shown

    def open(self, run: RunInfo) -> None:
        shown = self.shown_keys()
        self._frames_at = shown.pop("frames")
        self._shown = shown
        stream = self.stream or sys.stderr
        on = self.enabled if self.enabled is not None else _isatty(stream)
        if not on:
            return
        tqdm = require("tqdm", "rl", "ProgressBar").tqdm
        self.bar = tqdm(
            total=self.total_frames,
            unit="frames",
            unit_scale=True,
            dynamic_ncols=True,
            file=stream,
            desc=run.name,
            leave=True,
        )

    def write(self, record: StepRecord) -> None:
        if self.bar is None:
            return
        frames = record.scalars.get(self._frames_at)
        if frames is not None and math.isfinite(frames) and frames > self.bar.n:
            self.bar.update(int(frames) - self.bar.n)
        for label, key in self._shown.items():
            value = record.scalars.get(key)
            if value is not None and math.isfinite(value):
                if label != self._reward_key:  # a different source: do not average across them
                    self._rewards.clear()
                    self._reward_key = label
                self._rewards.append(value)
                break
            if value is not None and label == self._reward_key:
                break  # the source shown so far, NaN this time (no episode ended): it stays, and nothing is added
        if self._rewards:
            mean = sum(self._rewards) / len(self._rewards)
            self.bar.set_postfix_str(f"{self._reward_key} {mean:.4g}", refresh=False)
        self.bar.refresh()

    def set_total(self, total_frames: Optional[int]) -> None:
        """Set the run's length, also on a bar already drawing (a trainer knows it only when registered)."""
        self.total_frames = total_frames
        if self.bar is not None:
            self.bar.total = total_frames
            self.bar.refresh()

    @property
    def recent_reward(self) -> Optional[float]:
        """The mean the bar shows, or None before any reward was committed."""
        return sum(self._rewards) / len(self._rewards) if self._rewards else None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _resolve(self, key: str) -> str:
        try:
            return str(key).format_map(self.prefixes)
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigurationError(
                f"ProgressBar key {key!r} has a placeholder that cannot be filled ({exc!r}); the known "
                f"placeholders are {sorted('{' + p + '}' for p in self.prefixes)}."
            ) from None

    def __repr__(self) -> str:
        return f"ProgressBar(total_frames={self.total_frames}, enabled={self.enabled})"


def _label(key: str) -> str:
    """``collection/main/episode/return/mean`` -> ``return``: the key's name without its statistic."""
    parts = [p for p in str(key).split("/") if p]
    if len(parts) > 1 and parts[-1] in _STATS:
        parts = parts[:-1]
    return parts[-1] if parts else str(key)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
