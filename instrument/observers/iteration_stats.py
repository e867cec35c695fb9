"""IterationStats: how every channel of the state evolves over the rollout."""

from typing import List, Optional

import torch
from torch import Tensor

from instrument.core.context import StepContext
from instrument.core.observer import Observer
from instrument.observers.stats import channel_stats

__all__ = ["IterationStats"]

STATS = ("mean", "std", "min", "max")


class IterationStats(Observer):
    """Per-channel mean, std, min and max of the state after every rollout iteration.

    For a state [B, C, ...] the statistics are over the batch and every dimension but C (``channel_dim``).
    Each iteration costs four small reductions on the device; nothing is copied until the logger commits.

    Metric keys (``<name>`` defaults to ``iteration_stats``):

    =============================== ======== ==========================================================
    key                             kind     meaning
    =============================== ======== ==========================================================
    ``<name>/<stat>``               image    iteration x channel heatmap of ``<stat>`` (mean/std/min/max)
    ``<name>/<stat>/c<k>``          scalar   ``<stat>`` of channel k after the last iteration
    ``<name>/iterations``           scalar   number of iterations observed
    =============================== ======== ==========================================================

    Args:
        channel_dim: which dimension of the state holds channels (1 for [B, C, H, W]; -1 for [N, features]).
        images: log the heatmaps (on by default).
        channel_scalars: log last-iteration scalars per channel; False keeps only the heatmaps.
        max_channels: scalars for at most this many channels (the heatmaps always have all of them).
    """

    default_name = "iteration_stats"

    def __init__(
        self,
        name: str = "",
        channel_dim: int = 1,
        images: bool = True,
        channel_scalars: bool = True,
        max_channels: Optional[int] = 16,
    ) -> None:
        super().__init__(name)
        self.channel_dim = channel_dim
        self.images = images
        self.channel_scalars = channel_scalars
        self.max_channels = max_channels
        self._rows: List[Tensor] = []

    def reset(self) -> None:
        self._rows = []

    def observe(self, context: StepContext) -> None:
        self._rows.append(channel_stats(context.next_state, self.channel_dim))

    def log(self, logger, step: int) -> None:
        if not self._rows:
            return
        table = torch.stack(self._rows)  # [iterations, 4, C]
        logger.log_metrics({"iterations": len(self._rows)}, step=step, prefix=self.name)
        for s, stat in enumerate(STATS):
            if self.images:
                logger.log_heatmap(f"{self.name}/{stat}", table[:, s], step, x_label="channel", y_label="iter")
            if self.channel_scalars:
                last = table[-1, s]
                count = last.numel() if self.max_channels is None else min(last.numel(), self.max_channels)
                width = len(str(max(count - 1, 0)))
                logger.log_metrics(
                    {f"{stat}/c{k:0{width}d}": last[k] for k in range(count)}, step=step, prefix=self.name
                )
