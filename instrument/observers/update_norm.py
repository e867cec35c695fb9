"""UpdateNorm: how much each iteration changes the state, and how much of it is alive."""

from typing import Optional

import torch
from torch import Tensor

from instrument.core.context import StepContext
from instrument.core.observer import Observer
from instrument.observers.buffer import IterationBuffer

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

    def __init__(
        self,
        name: str = "",
        alive_channel: int = 3,
        alive_threshold: float = 0.1,
        max_elements: Optional[int] = 64 * 2**20,
    ) -> None:
        super().__init__(name)
        self.alive_channel = alive_channel
        self.alive_threshold = alive_threshold
        self._steps = IterationBuffer(self._reduce, max_elements=max_elements)
        self._has_alpha = False

    def reset(self) -> None:
        self._steps.clear()
        self._has_alpha = False

    def observe(self, context: StepContext) -> None:
        # Keep references only; all iterations are reduced at once in `log` (see instrument.observers.buffer).
        # Of the state only the alpha channel is kept: stacking the whole state would copy C times as much.
        state = context.next_state
        self._has_alpha = state.dim() == 4 and state.shape[1] > self.alive_channel
        if self._has_alpha:
            self._steps.append(context.dx, state[:, self.alive_channel])
        else:
            self._steps.append(context.dx)

    def _reduce(self, dx: Tensor, alpha: Optional[Tensor] = None, scratch: bool = False) -> Tensor:
        """[k, *state] dx and [k, B, H, W] alpha -> [k, 2]: batch-mean L2 norm of dx, alive fraction (NaN if
        no alpha)."""
        k = dx.shape[0]
        flat = dx.reshape(k, dx.shape[1], -1) if dx.dim() > 2 else dx.reshape(k, 1, -1)
        norms = torch.linalg.vector_norm(flat.float(), dim=2).mean(1)
        if alpha is not None:
            alive = (alpha > self.alive_threshold).float().mean(dim=(1, 2, 3))
        else:
            alive = torch.full_like(norms, float("nan"))
        return torch.stack([norms, alive], dim=1)

    def log(self, logger, step: int) -> None:
        table = self._steps.results()
        if table is None:
            return
        norms, alive = table[:, 0], table[:, 1]
        metrics = {"l2/mean": norms.mean(), "l2/first": norms[0], "l2/last": norms[-1], "l2/max": norms.amax()}
        if self._has_alpha:  # known from the state's shape: no sync to look at values
            metrics.update({"alive/last": alive[-1], "alive/mean": alive.mean()})
        logger.log_metrics(metrics, step=step, prefix=self.name)
        logger.log_histogram(f"{self.name}/l2", norms, step)
