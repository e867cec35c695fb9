"""StateHistogram: the distribution of each channel's values, after the last iteration or at chosen ones.

A mean and a std hide what a histogram shows at once: a channel saturating at the ends of its range, a
bimodal alive/dead split, a long tail growing over training. ``observe`` keeps a reference to the states of
the chosen iterations only (no copy unless it must, no reduction); at log time each channel's values go to the
logger as one histogram, copied to the host with the step's other values and binned there by the backend.
"""

import logging
from collections import deque
from typing import Deque, Dict, Optional, Sequence, Tuple, Union

from torch import Tensor

from instrument.checks import check_int
from instrument.core.context import StepContext
from instrument.core.observer import Observer
from instrument.core.storage import part_of_larger
from instrument.errors import ConfigurationError
from instrument.observers.buffer import ModifiedInPlaceError
from instrument.observers.layout import check_channel_dim, said_channel_dim
from instrument.observers.options import channel_labels, check_channel_names, check_limit
from instrument.observers.stats import refuse_complex

_log = logging.getLogger("instrument")

__all__ = ["StateHistogram"]


class StateHistogram(Observer):
    """Per-channel value histograms of the state after the last rollout iteration (and at chosen iterations).

    For a state [B, C, ...] channel k's histogram holds every value of ``state.select(channel_dim, k)`` (the
    whole batch and every position). ``iterations`` picks which states: ``-1`` is the state after the last
    iteration, ``0`` after the first, ``-2`` after the one before the last. Indices are the rollout's: each
    context's ``step_index``, where it is past the observer calls so far (a watched call counted but not
    delivered, or an explicit evolver that numbers its iterations), else the number of those calls (an explicit
    evolver that leaves it at 0). An iteration not observed (too short a rollout) logs nothing for it. The kept
    states are references, checked at log time for in-place changes (then this step's histograms are dropped
    with an error and later steps copy the chosen states), and let go once logged; inference-mode states and
    slices of a larger buffer (``traj[t]``, whose version counter every slice shares) are copied.

    Metric keys (``<name>`` defaults to ``state_hist``):

    =============================== ========== ==========================================================
    key                             kind       meaning
    =============================== ========== ==========================================================
    ``<name>/c<k>``                 histogram  channel k's values after the last iteration (``-1``)
    ``<name>/c<k>/it<i>``           histogram  channel k's values after iteration ``i``, for each other
                                               entry ``i`` of ``iterations`` (written as given: ``it0``,
                                               ``it-2``)
    =============================== ========== ==========================================================

    ``k`` is zero-padded as in `IterationStats` (``c00`` .. ``c15`` for 16 channels); with ``channel_names``
    the channel's name replaces ``c<k>``.

    Args:
        channel_dim: which dimension of the state holds channels (1 for [B, C, H, W]; -1 for [N, features]);
            None: the session's (``Instrumentation(channel_dim=...)``), else 1. A 0-d or 1-d state is one channel.
        iterations: which iterations' states to histogram (default ``(-1,)``: the last one only).
        max_channels: histograms for at most this many channels (the first ones); None: all.
        channel_names: one name per channel, used instead of ``c<k>``.
    """

    default_name = "state_hist"

    def __init__(
        self,
        name: str = "",
        channel_dim: Optional[int] = None,
        iterations: Union[int, Sequence[int]] = (-1,),
        max_channels: Optional[int] = 16,
        channel_names: Optional[Sequence[str]] = None,
    ) -> None:
        super().__init__(name)
        owner = f"StateHistogram({self.name!r})"
        if isinstance(iterations, int):
            iterations = (iterations,)
        if (
            isinstance(iterations, str)
            or not iterations
            or any(type(i) is not int for i in iterations)
            or len(set(iterations)) != len(iterations)
        ):
            raise ConfigurationError(
                f"{owner}: iterations must be a non-empty sequence of distinct ints such as (0, -1) (-1: the last "
                f"iteration), got {iterations!r}."
            )
        self.channel_dim = check_int(f"{owner}: channel_dim", channel_dim, none=True,
                                     why="1 for [B, C, H, W], -1 for [N, features]; None: the session's",
                                     fix="bind e.g. StateHistogram.channel_dim = 1")
        self.iterations: Tuple[int, ...] = tuple(iterations)
        self._said_beyond: set = set()  # entries of ``iterations`` a step had no state for, said once each
        self._said_empty = False  # a state with no elements was said (nothing to bin)
        self.max_channels = check_limit(owner, "max_channels", max_channels, 16)
        self.channel_names = check_channel_names(owner, channel_names)
        self._from_start = {i for i in self.iterations if i >= 0}
        self._from_end = max((-i for i in self.iterations if i < 0), default=0)
        self._copy = False  # set once an in-place change was caught: keep copies from then on
        self.reset()

    def reset(self) -> None:
        self._count = 0  # one past the highest iteration index seen (`observe`)
        self._observed = 0  # observe calls
        self._kept: Dict[int, Tuple[Tensor, int]] = {}  # iteration (from the start) -> (state, version)
        self._recent: Deque[Tuple[int, Tensor, int]] = deque(maxlen=max(self._from_end, 1))

    def _keep(self, state: Tensor) -> Tuple[Tensor, int]:
        # Inference tensors have no version counter to check; a slice of a larger buffer (``traj[t]``) shares its
        # counter with the other slices, which the rollout goes on writing.
        if self._copy or state.is_inference() or part_of_larger(state):
            return state.clone(), -1
        return state, state._version

    def observe(self, context: StepContext) -> None:
        # The rollout's index: a watched call counted but not delivered (docs/observers.md) leaves a gap, and the
        # iterations after it keep theirs. An explicit evolver that leaves step_index at 0 is counted instead.
        index = max(self._count, context.step_index)
        self._count = index + 1
        self._observed += 1
        if index in self._from_start or self._from_end:
            refuse_complex(f"StateHistogram({self.name!r})", context.next_state)  # bins of real values
            kept = self._keep(context.next_state)
            if index in self._from_start:
                self._kept[index] = kept
            if self._from_end:
                self._recent.append((index, *kept))

    def _state(self, iteration: int) -> Optional[Tensor]:
        index = iteration if iteration >= 0 else self._count + iteration
        if index < 0 or index >= self._count:
            return None
        kept = self._kept.get(index) if iteration >= 0 else next(
            ((t, v) for i, t, v in self._recent if i == index), None
        )
        if kept is None:
            return None
        state, version = kept
        if version != -1 and state._version != version:
            self._copy = True
            raise ModifiedInPlaceError(
                f"StateHistogram({self.name!r}): the state of iteration {index} was modified in place after it "
                f"was observed, so the reference kept for its histogram no longer holds the observed values; "
                f"this step's histograms are dropped and from now on the chosen states are copied."
            )
        return state

    def log(self, logger, step: int) -> None:
        try:
            self._log(logger, step)
        finally:  # the kept states go with the step (a whole state each): not alive until the next logging step
            self._kept.clear()
            self._recent.clear()

    def close(self) -> None:
        self.reset()  # a step that raised before its log kept its states

    def _log(self, logger, step: int) -> None:
        states = {i: self._state(i) for i in self.iterations}  # all checked before anything is staged
        for iteration, state in states.items():
            if state is None:
                if self._count and iteration not in self._said_beyond:  # the step ran fewer iterations
                    self._said_beyond.add(iteration)
                    _log.warning(
                        "instrument: StateHistogram(%r) has no state for iterations=%r entry %d: the logging step "
                        "at %d observed %d iteration(s), numbered up to %d, none of them that one, so no histogram "
                        "of it was logged. Pick an iteration within the rollout (-1: the last). (Said once per "
                        "entry.)", self.name, self.iterations, iteration, step, self._observed, self._count - 1)
                continue
            if state.numel() == 0:  # an empty batch or grid: no value to bin (the logger refuses an empty histogram)
                if not self._said_empty:
                    self._said_empty = True
                    _log.info("instrument: StateHistogram(%r): the state at step %d has shape %s, no values, so no "
                              "histogram of it is logged. (Said once.)", self.name, step, list(state.shape))
                continue
            if state.dim() < 2:
                state = state.reshape(-1, 1)
                dim = 1
            else:
                said = said_channel_dim(self)
                dim = 1 if said is None else check_channel_dim(self.name, said, state.shape)
            channels = state.shape[dim]
            count = channels if self.max_channels is None else min(channels, self.max_channels)
            labels = channel_labels(f"StateHistogram({self.name!r})", self.channel_names, channels, count)
            suffix = "" if iteration == -1 else f"/it{iteration}"
            for k, label in enumerate(labels):
                logger.log_histogram(f"{self.name}/{label}{suffix}", state.select(dim, k), step)
