"""UpdateNorm: how much each iteration changes the state, and how much of it is alive."""

from typing import List

import torch
from torch import Tensor

from instrument.core.context import StepContext
from instrument.core.observer import Observer

__all__ = ["UpdateNorm"]


class UpdateNorm(Observer):
    """L2 norm of ``dx`` per iteration, and the alive fraction for states with an alpha channel.

    The norm is taken per sample over every non-batch dimension, then averaged over the batch. The alive
    fraction is the share of cells whose alpha channel (``alive_channel``, default 3: RGBA first) exceeds
    ``alive_threshold``; it is computed only for [B, C, H, W] states with more than ``alive_channel``
    channels.

    Metric keys (``<name>`` defaults to ``update_norm``):

    ============================ ========== ===================================================
    key                          kind       meaning
    ============================ ========== ===================================================
    ``<name>/l2/mean``           scalar     mean over iterations of the batch-mean L2 norm of dx
    ``<name>/l2/first``          scalar     that norm at the first iteration
    ``<name>/l2/last``           scalar     that norm at the last iteration
    ``<name>/l2/max``            scalar     its maximum over iterations
    ``<name>/l2``                histogram  the per-iteration norms of the step
    ``<name>/alive/last``        scalar     alive fraction after the last iteration
    ``<name>/alive/mean``        scalar     alive fraction averaged over iterations
    ============================ ========== ===================================================
    """

    default_name = "update_norm"

    def __init__(self, name: str = "", alive_channel: int = 3, alive_threshold: float = 0.1) -> None:
        super().__init__(name)
        self.alive_channel = alive_channel
        self.alive_threshold = alive_threshold
        self._norms: List[Tensor] = []
        self._alive: List[Tensor] = []

    def reset(self) -> None:
        self._norms = []
        self._alive = []

    def observe(self, context: StepContext) -> None:
        dx = context.dx
        flat = dx.reshape(dx.shape[0], -1) if dx.dim() > 1 else dx.reshape(1, -1)
        self._norms.append(torch.linalg.vector_norm(flat.float(), dim=1).mean())
        state = context.next_state
        if state.dim() == 4 and state.shape[1] > self.alive_channel:
            alpha = state[:, self.alive_channel]
            self._alive.append((alpha > self.alive_threshold).float().mean())

    def log(self, logger, step: int) -> None:
        if not self._norms:
            return
        norms = torch.stack(self._norms)
        metrics = {"l2/mean": norms.mean(), "l2/first": norms[0], "l2/last": norms[-1], "l2/max": norms.amax()}
        if self._alive:
            alive = torch.stack(self._alive)
            metrics.update({"alive/last": alive[-1], "alive/mean": alive.mean()})
        logger.log_metrics(metrics, step=step, prefix=self.name)
        logger.log_histogram(f"{self.name}/l2", norms, step)
