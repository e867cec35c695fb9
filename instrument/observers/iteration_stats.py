"""IterationStats: how every channel of the state evolves over the rollout."""

from typing import Any, Optional, Sequence

from instrument.core.context import StepContext
from instrument.core.observer import Observer, over_ranks
from instrument.errors import InvalidValueError
from instrument.observers.buffer import IterationBuffer
from instrument.observers.layout import check_channel_dim, infer_channel_dim, said_channel_dim, warn_layout_once
from instrument.observers.options import channel_labels, check_channel_names, check_limit, color_ranges
from instrument.observers.stats import iteration_channel_stats

__all__ = ["IterationStats"]

STATS = ("mean", "std", "min", "max")


class IterationStats(Observer):
    """Per-channel mean, std, min and max of the state after every rollout iteration.

    For a state [B, C, ...] the statistics are over the batch and every dimension but C (``channel_dim``).
    ``observe`` only keeps a reference to the state; all iterations are reduced in one batched call at log time
    (see `instrument.observers.buffer`: in-place changes are detected, memory is capped by ``max_elements``).
    Nothing is copied to the host until the logger commits.

    Metric keys (``<name>`` defaults to ``iteration_stats``):

    =============================== ======== ==========================================================
    key                             kind     meaning
    =============================== ======== ==========================================================
    ``<name>/<stat>``               image    iteration x channel heatmap of ``<stat>`` (mean/std/min/max)
    ``<name>/<stat>/c<k>``          scalar   ``<stat>`` of channel k after the last iteration
    ``<name>/iterations``           scalar   number of iterations observed
    =============================== ======== ==========================================================

    ``k`` is zero-padded to the width of the largest index shown (``c00`` .. ``c15``). With ``channel_names``
    the channel's name replaces ``c<k>`` in the keys (``iteration_stats/mean/x``) and on the heatmaps' x axis.

    Args:
        channel_dim: which dimension of the state holds channels (1 for [B, C, H, W]; -1 for [B, H, W, C] or
            [N, features]). None (the default) takes the session's (``Instrumentation(channel_dim=...)``),
            else 1; a 4-D state that looks channels-last under that default gets a one-time warning.
        images: log the heatmaps (on by default).
        channel_scalars: log last-iteration scalars per channel; False keeps only the heatmaps.
        max_channels: scalars for at most this many channels (the heatmaps always have all of them).
        max_elements: reduce early once the kept states hold this many elements (bounds memory).
        color_range: the heatmaps' colour scale: None (each image scaled to its own values), ``(lo, hi)``
            (fixed: a colour means the same value at every logging step), ``"running"`` (the range seen so far
            under that heatmap's key), or a dict ``{stat: one of these}`` (unnamed stats: None).
        channel_names: one name per channel (``("x", "v", "theta", "omega")`` for CartPole observations),
            used instead of ``c<k>``; a state with another channel count is reported as an error.
    """

    default_name = "iteration_stats"

    def __init__(
        self,
        name: str = "",
        channel_dim: Optional[int] = None,
        images: bool = True,
        channel_scalars: bool = True,
        max_channels: Optional[int] = 16,
        max_elements: Optional[int] = 64 * 2**20,
        color_range: Any = None,
        channel_names: Optional[Sequence[str]] = None,
    ) -> None:
        super().__init__(name)
        owner = f"IterationStats({self.name!r})"
        self.color_range = color_ranges(owner, color_range, STATS)
        self.channel_names = check_channel_names(owner, channel_names)
        self.channel_dim = channel_dim
        self.session_channel_dim: Optional[int] = None  # set by Instrumentation(channel_dim=...)
        self._dim: Optional[int] = None  # resolved at the first observe of each step
        self.images = images
        self.channel_scalars = channel_scalars
        self.max_channels = check_limit(owner, "max_channels", max_channels, 16)
        self._states = IterationBuffer(self._reduce, max_elements=check_limit(owner, "max_elements", max_elements,
                                                                              64 * 2**20))

    def reset(self) -> None:
        self._states.clear()
        self._dim = None

    def close(self) -> None:
        self.reset()  # what a step that raised before its log kept (copies, when they are slices)

    def observe(self, context: StepContext) -> None:
        state = context.next_state
        if self._dim is None:  # the layout, once per step: metadata only
            if state.is_complex():
                raise InvalidValueError(
                    f"IterationStats({self.name!r}) got a complex state ({state.dtype}, shape {list(state.shape)}); "
                    f"its mean, std, min and max are of real values. Observe a real view of it instead "
                    f"(torch.view_as_real(x), or x.abs()) with s.observer(StepContext(...)), or leave IterationStats "
                    f"out for this state (UpdateNorm and NonFinite take complex states)."
                )
            said = said_channel_dim(self)
            self._dim = check_channel_dim(self.name, said, state.shape) if said is not None and state.dim() >= 2 else 1
            if said is None and infer_channel_dim(state.shape) == -1:
                warn_layout_once(self, f"the state has shape {list(state.shape)}, which looks channels-last "
                                 f"[B, H, W, C], but channel_dim defaults to 1: channel k is read as grid row k.")
        self._states.append(state)

    def _reduce(self, states, scratch: bool = False):
        return iteration_channel_stats(states, channel_dim=self._dim, scratch=scratch)

    def log(self, logger, step: int) -> None:
        table = self._states.results()  # [iterations, 4, C]
        if table is None:
            return
        channels = table.shape[2]
        count = channels if self.max_channels is None else min(channels, self.max_channels)
        labels = channel_labels(f"IterationStats({self.name!r})", self.channel_names, channels, count)
        logger.log_metrics({"iterations": table.shape[0]}, step=step, prefix=self.name)
        if self.images and channels:  # a state of no channels (shape [B, 0, ...]) has no heatmap to draw
            # One copy makes each stat's [iterations, channels] matrix contiguous: the commit's transfer then
            # packs them as views, instead of copying each strided column apart (a kernel each on a GPU).
            by_stat = table.transpose(0, 1).contiguous()
            for s, stat in enumerate(STATS):
                logger.log_heatmap(
                    f"{self.name}/{stat}", by_stat[s], step, x_label="channel", y_label="iter",
                    x_ticks=self.channel_names, color_range=self.color_range[stat],
                )
        if self.channel_scalars:
            # One call for every stat and channel: the logger stages it with one stack (one kernel on a GPU),
            # and unbind makes all the 0-d views at once, not one index op each.
            rows = [row.unbind() for row in table[-1, :, :count].unbind()]
            # Over ranks (each its own batch): min of the minima, max of the maxima, mean of the rest.
            ops = {f"{stat}/{label}": stat for stat in ("min", "max") for label in labels}
            logger.log_metrics(
                {f"{stat}/{label}": rows[s][k] for s, stat in enumerate(STATS) for k, label in enumerate(labels)},
                step=step, prefix=self.name, reduce=over_ranks(logger, ops),
            )
