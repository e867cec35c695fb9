"""UpdateNorm: how much each iteration changes the state, and how much of it is alive."""

import logging
from typing import List, Optional

import torch
from torch import Tensor

from instrument.checks import check_int, check_number
from instrument.core.context import StepContext, difference, reduction_dtype, same_view
from instrument.core.observer import Observer, over_ranks
from instrument.observers.buffer import IterationBuffer
from instrument.observers.layout import check_channel_dim, infer_channel_dim, said_channel_dim, warn_layout_once
from instrument.observers.options import check_limit

__all__ = ["UpdateNorm"]

_log = logging.getLogger("instrument")


class UpdateNorm(Observer):
    """L2 norm of ``dx`` per iteration, and the alive fraction for states with an alpha channel.

    The norm is taken per sample over every non-batch dimension, then averaged over the batch (it does not
    depend on the layout). The alive fraction is the share of cells (batch x grid) whose alpha channel
    (``alive_channel``, default 3: RGBA first) exceeds ``alive_threshold``; it needs to know which dimension
    holds the channels:

    - ``channel_dim`` (1 for ``[B, C, H, W]``, -1 for channels-last ``[B, H, W, C]``, as in the original
      growing-NCA notebook), else the session's (``Instrumentation(channel_dim=...)``);
    - with neither, a 4-D state on a square grid says it: ``[B, C, S, S]`` or ``[B, S, S, C]`` with C != S.
      A shape that fits both or neither (``[B, 16, 16, 16]``, a non-square grid) gets one warning and no
      alive fraction: never a number read from the wrong dimension.

    The alive fraction is logged only when the channel dimension has more than ``alive_channel`` entries. In a
    step whose state changes shape (a rollout, then minibatches), it is taken over the iterations that have one:
    ``alive/last`` is the last such iteration's and ``alive/mean`` their mean.

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
        channel_dim: Optional[int] = None,
    ) -> None:
        super().__init__(name)
        owner = f"UpdateNorm({self.name!r})"
        self.alive_channel = check_int(f"{owner}: alive_channel", alive_channel, integral=True,
                                       fix="pass e.g. alive_channel=3 (the index of the alpha channel)")
        self.alive_threshold = check_number(f"{owner}: alive_threshold", alive_threshold,
                                            fix="pass e.g. alive_threshold=0.1")
        self.channel_dim = channel_dim
        self.session_channel_dim: Optional[int] = None  # set by Instrumentation(channel_dim=...)
        self._steps = IterationBuffer(self._reduce, max_elements=check_limit(owner, "max_elements", max_elements,
                                                                             64 * 2**20), stack=self._stack)
        self._has_alpha = False
        self._said_alive = False  # the state has no channel ``alive_channel`` (`_resolve`)
        self._alpha_dim: Optional[int] = None
        self._shape: Optional[tuple] = None
        # True while the buffer holds (previous_state, next_state) pairs, False while it holds (dx[, alpha]).
        self._pairs = False
        # This step's iterations, those with an alive fraction, and the index of the last of those: counted on the
        # host, so that a step mixing states with and without an alpha channel logs the fraction of those that
        # have one (read from the last shape alone, it logged none, or a NaN mean).
        self._iterations = 0
        self._alive_iterations = 0
        self._last_alive = -1

    def reset(self) -> None:
        self._steps.clear()
        self._has_alpha = False
        self._shape = None
        self._pairs = False
        self._iterations = self._alive_iterations = 0
        self._last_alive = -1

    def close(self) -> None:
        self.reset()  # what a step that raised before its log kept (copies, when they are slices)

    def observe(self, context: StepContext) -> None:
        # Keep references only; all iterations are reduced at once in `log` (see instrument.observers.buffer).
        state = context.next_state
        if state.shape != self._shape:  # once per step (and when the shape changes): metadata only
            self._steps.drain()  # what is buffered was resolved for the previous shape
            self._shape = state.shape
            # a complex state has no alive fraction: its alpha channel would be compared with a real threshold
            self._alpha_dim = None if state.is_complex() else self._resolve(tuple(state.shape))
            self._has_alpha = self._alpha_dim is not None
        dx = context.dx_if_known
        previous = context.previous_state
        # Pairs only where a stack of them differences as each iteration would: a first state of another shape
        # (a [1, ...] seed broadcast against the batch) or dtype (a float64 seed before float32 states) is
        # differenced now instead (stacked, it failed, or was promoted and differenced in float64).
        pairs = dx is None and previous.shape == state.shape and previous.dtype == state.dtype
        if dx is None and not pairs:
            dx = context.dx
        if pairs != self._pairs:  # the buffer holds one kind of entry at a time
            self._steps.drain()
            self._pairs = pairs
        if pairs:
            # dx not computed yet: keep both states and take every iteration's difference in one batched
            # subtraction at log time (the same elementwise next - previous, so the same numbers) instead of
            # one small subtraction per iteration. The alpha channel is read from the stacked next states.
            self._steps.append(previous, state)
        elif self._has_alpha:
            # Of the state only the alpha channel is kept: stacking the whole state would copy C times as much.
            self._steps.append(dx, state.select(self._alpha_dim, self.alive_channel), sources=(dx, state))
        else:
            self._steps.append(dx)
        if self._has_alpha:
            self._alive_iterations += 1
            self._last_alive = self._iterations
        self._iterations += 1

    def _stack(self, columns: List[List[Tensor]]) -> List[Tensor]:
        """Stack the buffered columns; a chain of pairs (each iteration starting from the state the one before
        produced, as a rollout does) is stacked as one [k + 1, ...] tensor whose shifted views are the pairs."""
        if self._pairs:
            previous, following = columns
            if all(same_view(previous[i], following[i - 1]) for i in range(1, len(previous))):
                states = torch.stack([previous[0], *following])
                return [states[:-1], states[1:]]
        return [torch.stack(column) for column in columns]

    def _resolve(self, shape: tuple) -> Optional[int]:
        """The dimension holding the alpha channel, or None (no alive fraction)."""
        said = said_channel_dim(self)
        if said is not None:
            dim: Optional[int] = check_channel_dim(self.name, said, shape) if len(shape) > 2 else None
        else:
            dim = infer_channel_dim(shape)
            if dim is None and len(shape) == 4:
                warn_layout_once(
                    self, f"a state of shape {list(shape)} could be [B, C, H, W] or [B, H, W, C], so which "
                    f"dimension holds alive channel {self.alive_channel} is ambiguous; the alive fraction is "
                    f"not logged until the layout is said.",
                )
            dim = None if dim is None else dim % len(shape)
        if dim is not None and shape[dim] <= self.alive_channel and not self._said_alive:
            self._said_alive = True  # a console column or a plot of alive/* would show nothing, unsaid
            # a warning for an alive_channel that was chosen; for the default (3: RGBA's alpha) an RGB or grey state
            # is ordinary, and is said at INFO
            _log.log(logging.WARNING if self.alive_channel != 3 else logging.INFO,
                     "instrument: UpdateNorm(%r) has no alive fraction to log: alive_channel=%d, but the state "
                     "%s has %d channel(s) in dimension %d. Bind UpdateNorm.alive_channel to the alpha channel's "
                     "index, if the state has one. (Said once.)", self.name, self.alive_channel, list(shape),
                     shape[dim], dim)
        if dim is None or shape[dim] <= self.alive_channel:
            return None
        return dim

    def _reduce(self, dx: Tensor, alpha: Optional[Tensor] = None, scratch: bool = False) -> Tensor:
        """[k, *state] dx and [k, B, *grid] alpha -> [k, 2]: batch-mean L2 norm of dx, alive fraction (0 if no
        alpha: `log` counts those iterations out). While pairs are buffered the arguments are [k, *state] previous
        and next states instead. Only a dx this call owns is written in place (a stack, ``scratch``, or a
        difference taken here): the stacked pairs may be overlapping views, and an unbatched dx may be the
        context's own."""
        owned = scratch  # dx is a copy this call may overwrite: a stack the buffer made, or a difference taken here
        if self._pairs:
            previous, following = dx, alpha
            dx = difference(following, previous)  # float32 for small integer or half states, float64 for wide ints
            owned = True
            alpha = None if self._alpha_dim is None else following.select(self._alpha_dim + 1, self.alive_channel)
        k = dx.shape[0]
        # [k, B, ...] -> [k, B, values per sample]; a 1-D state [B] is B samples of one value, a 0-d one one sample.
        # The count per sample is spelt out: -1 cannot be inferred for an empty batch (B = 0: NaN norms are logged).
        per_sample = 1
        for size in dx.shape[2:]:
            per_sample *= size
        flat = dx.reshape(k, dx.shape[1], per_sample) if dx.dim() > 1 else dx.reshape(k, 1, -1)
        wide = reduction_dtype(flat.dtype, flat.device)  # a float64 dx keeps its range and digits, an int64 one too
        if flat.dtype != wide:
            flat, owned = flat.to(wide), True
        if flat.is_complex():
            norms = torch.linalg.vector_norm(flat, dim=2)
        else:
            # A sum of squares, not vector_norm: torch's sum is pairwise on a CPU and vector_norm is not, which put
            # float32 norms of 25,600 values per sample 1e-5 off and of a million 6e-5 (torch 2.13). The same range
            # (neither scales); 2.3x the time of one vector_norm there (0.46 ms instead of 0.20 ms for the bench
            # NCA's 32 iterations), two more small kernels on a GPU.
            norms = (flat.square_() if owned else flat.square()).sum(dim=2).sqrt_()
        norms = norms.mean(1)
        if alpha is not None:
            alive = (alpha > self.alive_threshold).reshape(k, -1).float().mean(dim=1)
        else:
            alive = torch.zeros_like(norms)
        return torch.stack([norms, alive], dim=1)

    def log(self, logger, step: int) -> None:
        table = self._steps.results()
        if table is None:
            return
        norms, alive = table[:, 0], table[:, 1]
        metrics = {"l2/mean": norms.mean(), "l2/first": norms[0], "l2/last": norms[-1], "l2/max": norms.amax()}
        # Which iterations have an alive fraction is known from the states' shapes: no sync to look at values.
        if self._alive_iterations == table.shape[0]:
            metrics.update({"alive/last": alive[-1], "alive/mean": alive.mean()})
        elif self._alive_iterations and self._iterations == table.shape[0]:  # a step of states with and without
            metrics.update({"alive/last": alive[self._last_alive], "alive/mean": alive.sum() / self._alive_iterations})
        logger.log_metrics(metrics, step=step, prefix=self.name, reduce=over_ranks(logger, {"l2/max": "max"}))
        logger.log_histogram(f"{self.name}/l2", norms, step)

