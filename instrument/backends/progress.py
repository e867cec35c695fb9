"""A tqdm progress bar of frames and recent mean reward, fed by committed steps.

The bar is a backend: it reads the frame counter and the reward from each `StepRecord` the logger commits, so
it costs no device sync of its own and moves at every logging iteration. While it is open, console lines go
through ``tqdm.write`` (`instrument.terminal.output.write_line`), so the bar and the console table coexist.

It is off when stderr is not a terminal (CI logs, redirected output) unless bound on with ``enabled=True``.
"""

import collections
import math
import sys
from typing import Deque, Optional, Sequence, TextIO

from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.errors import require

__all__ = ["ProgressBar"]


class ProgressBar(Backend):
    """Shows ``frames`` (of ``total_frames`` when known) and the mean of the last ``window`` committed
    rewards.

    Args:
        total_frames: the run's length in frames, for a percentage and an ETA; None shows a counter.
        enabled: True or False forces the bar on or off; None shows it only when ``stream`` is a terminal.
        frames_key: the committed scalar holding the frame count.
        reward_keys: committed scalars to show as the reward, first present and finite wins (episode return,
            then per-step reward, by default).
        window: how many committed reward values the shown mean covers.
        stream: where the bar draws; None means ``sys.stderr``.
    """

    def __init__(
        self,
        total_frames: Optional[int] = None,
        enabled: Optional[bool] = None,
        frames_key: str = "counters/frames",
        reward_keys: Sequence[str] = ("collection/main/episode/return/mean", "collection/main/reward/mean"),
        window: int = 10,
        stream: Optional[TextIO] = None,
    ) -> None:
        self.total_frames = total_frames
        self.enabled = enabled
        self.frames_key = frames_key
        self.reward_keys = tuple(reward_keys)
        self.window = window
        self.stream = stream
        self.bar = None
        self._rewards: Deque[float] = collections.deque(maxlen=window)
        self._reward_key: Optional[str] = None

    def open(self, run: RunInfo) -> None:
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
        frames = record.scalars.get(self.frames_key)
        if frames is not None and math.isfinite(frames) and frames > self.bar.n:
            self.bar.update(int(frames) - self.bar.n)
        for key in self.reward_keys:
            value = record.scalars.get(key)
            if value is not None and math.isfinite(value):
                if key != self._reward_key:  # a different source: do not average across them
                    self._rewards.clear()
                    self._reward_key = key
                self._rewards.append(value)
                break
        if self._rewards:
            name = "return" if "episode" in (self._reward_key or "") else "reward"
            self.bar.set_postfix_str(f"{name} {sum(self._rewards) / len(self._rewards):.4g}", refresh=False)
        self.bar.refresh()

    @property
    def recent_reward(self) -> Optional[float]:
        """The mean the bar shows, or None before any reward was committed."""
        return sum(self._rewards) / len(self._rewards) if self._rewards else None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __repr__(self) -> str:
        return f"ProgressBar(total_frames={self.total_frames}, enabled={self.enabled})"


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
