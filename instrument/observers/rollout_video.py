"""RolloutVideo: watch the automaton grow, one video per logging step."""

import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from instrument.checks import check_int, is_int
from instrument.core.colormap import NAN_COLOUR, VIRIDIS_LUT, not_a_pair
from instrument.core.context import StepContext, reduction_dtype
from instrument.core.devices import to_device
from instrument.core.observer import Observer
from instrument.errors import ConfigurationError, InvalidValueError
from instrument.observers.layout import said_channel_dim

__all__ = ["RolloutVideo", "render_frames"]

# GIF frame delays are whole centiseconds and browsers play delays under 20 ms at 10 fps: 50 fps is the top.
MAX_FPS = 50
_BATCH_DIM = ("RolloutVideo.channel_dim must not be 0: dimension 0 is the batch (see `sample`); use 1 for "
              "[B, C, H, W] or -1 for channels-last [B, H, W, C].")

_log = logging.getLogger("instrument")


class RolloutVideo(Observer):
    """Renders chosen channels of one batch element at every rollout iteration into a video.

    Frame 0 is the state the first observed iteration started from (the seed); frame ``t`` is the state after
    iteration ``t * every - 1``. On every logging step the frames are logged once with ``logger.log_video``:
    TensorBoard shows an animated GIF with a step slider, W&B a ``wandb.Video``, MLflow a GIF artifact per step
    (docs/backends.md). How channels become colours:

    - 4 channels (default ``(0, 1, 2, 3)``): RGBA composited over white as the growing-NCA papers draw it,
      ``clip(1 - a + rgb, 0, 1)`` with ``a = clip(alpha, 0, 1)`` (RGB premultiplied by alpha); with
      ``premultiplied=False``, ``clip(rgb, 0, 1) * a + 1 - a``.
    - 3 channels: RGB, clipped to [0, 1].
    - uint8 states are read as 0..255 for 3 and 4 channels (as ``log_image`` reads uint8 pixels); floats, bools and
      other integers as values in [0, 1].
    - 1 channel: through the viridis colour map, over ``value_range`` or (None) the finite min..max of that
      channel over the whole video, so a colour means the same value in every frame of it.

    A pixel with a NaN or infinite value in any rendered channel is grey (128, 128, 128). ``observe`` copies
    only the rendered channels of the chosen sample (a [k, H, W] slice per kept iteration, on the device);
    ``log`` renders all frames in a few batched tensor ops on that device. Nothing is copied to the host until
    the logger's one transfer at commit. Works with the watched-module and the explicit-evolver styles, and
    under gradient checkpointing (each iteration is observed once); scripted and compiled rules work with the
    explicit-evolver style (they cannot carry forward hooks added at run time).

    Metric keys (``<name>`` defaults to ``rollout``):

    =============================== ======== ==========================================================
    key                             kind     meaning
    =============================== ======== ==========================================================
    ``<name>/video``                video    the rollout of sample ``sample``: [T, H*upscale, W*upscale, 3]
                                             uint8 frames at ``fps``
    =============================== ======== ==========================================================

    Args:
        channels: the channels to render: 4 (RGBA), 3 (RGB) or 1 (colour-mapped) indices along ``channel_dim``
            (negative ones count from the last channel).
        sample: which batch element (index along dimension 0) to render.
        every: keep every k-th state (the seed and the states after iterations k-1, 2k-1, ...).
        fps: frames per second of the video, 1 to 50 (GIF delays are whole centiseconds).
        upscale: nearest-neighbour upscale factor (a 32x32 grid is small on screen; 4 makes it 128x128).
        max_frames: keep at most this many frames (later iterations are not rendered; raise ``every`` to cover
            a longer rollout). Bounds memory: each frame is ``len(channels) * H * W`` floats.
        channel_dim: which dimension of the state holds channels: 1 for [B, C, H, W], -1 for channels-last
            [B, H, W, C]; None: the session's (``Instrumentation(channel_dim=...)``), else 1. The state is
            [B, C, H, W] or [B, C, L] in either layout (a 1-D state renders as a one-pixel-high strip).
        premultiplied: for 4 channels, whether RGB is premultiplied by alpha (as in the growing-NCA papers).
        value_range: for 1 channel, the finite (low, high) mapped to the ends of the colour map; None: per video.
        name: the key prefix.
    """

    default_name = "rollout"

    def __init__(
        self,
        channels: Sequence[int] = (0, 1, 2, 3),
        sample: int = 0,
        every: int = 1,
        fps: int = 10,
        upscale: int = 4,
        max_frames: Optional[int] = 256,
        channel_dim: Optional[int] = None,
        premultiplied: bool = True,
        value_range: Optional[Tuple[float, float]] = None,
        name: str = "",
    ) -> None:
        super().__init__(name)
        self.channels = _check_channels(channels)
        self.sample = check_int("RolloutVideo.sample", sample, integral=True, why="an index along the batch dimension",
                                fix="bind e.g. RolloutVideo.sample = 0")
        self.every = check_int("RolloutVideo.every", every, least=1, integral=True, why="keep every k-th state",
                               fix="bind e.g. RolloutVideo.every = 1")
        self.fps = check_int("RolloutVideo.fps", fps, least=1, most=MAX_FPS, integral=True,
                             why=f"frames per second, at most {MAX_FPS}", fix="bind e.g. RolloutVideo.fps = 10")
        self.upscale = check_int("RolloutVideo.upscale", upscale, least=1, integral=True,
                                 why="a whole nearest-neighbour factor", fix="bind e.g. RolloutVideo.upscale = 4")
        self.max_frames = check_int("RolloutVideo.max_frames", max_frames, least=1, none=True, integral=True,
                                    why="a frame count", fix="bind e.g. RolloutVideo.max_frames = 256")
        self.channel_dim = check_int("RolloutVideo.channel_dim", channel_dim, integral=True, none=True,
                                     why="1 for [B, C, H, W], -1 for channels-last; None: the session's",
                                     fix="bind e.g. RolloutVideo.channel_dim = 1")
        if self.channel_dim == 0:
            raise ConfigurationError(_BATCH_DIM)
        self.premultiplied = bool(premultiplied)
        self.value_range = _check_range(value_range)
        if self.value_range is not None and len(self.channels) != 1:
            raise ConfigurationError(
                f"RolloutVideo.value_range applies to a single colour-mapped channel, but channels="
                f"{self.channels} renders {len(self.channels)}; drop value_range or pick one channel."
            )
        self._frames: List[Tensor] = []
        self._said_full = False  # max_frames reached (`_keep`): said once
        self._indices: Dict[Tuple[int, torch.device], Tensor] = {}  # (channel count, device) -> channels to keep
        self._calls = 0  # the iteration index the next observe call is at (at least: `observe`)
        self._luts: Dict[torch.device, Tuple[Tensor, Tensor]] = {}

    def reset(self) -> None:
        self._frames, self._calls = [], 0

    def close(self) -> None:
        self.reset()

    def observe(self, context: StepContext) -> None:
        # The rollout's index, as NonFinite counts it: an explicit evolver that leaves step_index at 0 is counted.
        index = max(self._calls, context.step_index)
        self._calls = index + 1
        if not self._frames:  # the seed: what the first observed iteration started from, whatever its index
            self._keep(context.previous_state, seed=True)
        if (index + 1) % self.every == 0:
            self._keep(context.next_state)

    def _keep(self, state: Tensor, seed: bool = False) -> None:
        if self.max_frames is not None and len(self._frames) >= self.max_frames:
            if not self._said_full:  # a video that stops part-way through the rollout, unsaid, reads as its end
                self._said_full = True
                _log.info("instrument: RolloutVideo(%r) keeps at most max_frames=%d frames: the later iterations of "
                          "this rollout are not in its video. Raise every (now %d) to cover the whole rollout, or "
                          "max_frames. (Said once.)", self.name, self.max_frames, self.every)
            return
        self._frames.append(self._slice(state, seed))

    def _slice(self, state: Tensor, seed: bool = False) -> Tensor:
        """[k, H, W] copy of the rendered channels of the chosen sample (metadata checks only, no host sync).
        ``seed``: the rollout's first state, which may be one [1, ...] state broadcast against the batch."""
        shape = tuple(state.shape)
        said = said_channel_dim(self)  # the observer's, else the session's, else 1
        dim = 1 if said is None else said
        if dim == 0:
            raise ConfigurationError(_BATCH_DIM)
        if state.is_complex():
            raise InvalidValueError(
                f"RolloutVideo({self.name!r}) renders real channel values, got a complex state ({state.dtype}); "
                f"render a real view of it (x.abs() or x.real) with your own evolver."
            )
        if state.dim() not in (3, 4):
            raise InvalidValueError(
                f"RolloutVideo({self.name!r}) renders states shaped [B, C, H, W] or [B, C, L] (channels at "
                f"channel_dim={dim}), got shape {shape}; render a 2-D slice of a volume yourself."
            )
        batch = shape[0]
        # A [1, ...] seed broadcast against the batch is every sample's first state.
        sample = 0 if batch == 1 and seed else self.sample
        if not -batch <= sample < batch:
            raise InvalidValueError(
                f"RolloutVideo({self.name!r}): sample={self.sample} but the state's batch dimension has {batch} "
                f"elements (shape {shape}); choose a sample index below {batch}."
            )
        x = state.select(0, sample).movedim(dim - 1 if dim > 0 else dim, 0)
        count = x.shape[0]
        bad = [c for c in self.channels if not -count <= c < count]
        if bad:
            raise InvalidValueError(
                f"RolloutVideo({self.name!r}): channels {bad} do not exist in a state with {count} channels along "
                f"channel_dim={dim} (shape {shape}); check channels and channel_dim."
            )
        if x.dim() == 2:  # [C, L] -> [C, 1, L]
            x = x.unsqueeze(1)
        index = self._indices.get((count, x.device))
        if index is None:  # made on the host once per channel count and device, negative channels counted from the end
            index = self._indices[(count, x.device)] = to_device(torch.tensor([c % count for c in self.channels]),
                                                                  x.device)
        return x.index_select(0, index)  # a copy: later in-place changes of the state do not reach it

    def log(self, logger, step: int) -> None:
        if not self._frames:
            return
        stack = torch.stack(self._frames)  # [T, k, H, W]
        self._frames = []  # staged as the stack: not kept through the interval
        lut, nan = self._lut(stack.device)
        frames = render_frames(stack, self.premultiplied, self.value_range, lut, nan)
        if self.upscale > 1:
            frames = frames.repeat_interleave(self.upscale, 1).repeat_interleave(self.upscale, 2)
        logger.log_video(f"{self.name}/video", frames, step, fps=self.fps)

    def _lut(self, device: torch.device) -> Tuple[Tensor, Tensor]:
        cached = self._luts.get(device)
        if cached is None:
            cached = self._luts[device] = (
                torch.from_numpy(VIRIDIS_LUT.copy()).to(device), torch.from_numpy(NAN_COLOUR.copy()).to(device)
            )
        return cached


def render_frames(
    stack: Tensor,
    premultiplied: bool = True,
    value_range: Optional[Tuple[float, float]] = None,
    lut: Optional[Tensor] = None,
    nan_colour: Optional[Tensor] = None,
) -> Tensor:
    """[T, k, H, W] channel values (k in 1, 3, 4) -> [T, H, W, 3] uint8 frames, on the input's device."""
    if lut is None:
        lut = torch.from_numpy(VIRIDIS_LUT.copy()).to(stack.device)
    if nan_colour is None:
        nan_colour = torch.from_numpy(NAN_COLOUR.copy()).to(stack.device)
    # float64 states (and wide integers) are drawn in float64: in float32, finite values beyond 3.4e38 would be
    # drawn as inf (the grey of NaN) and nearby large values (1e9 + 10) as one colour
    x = stack.to(reduction_dtype(stack.dtype, stack.device))
    if stack.dtype == torch.uint8 and x.shape[1] != 1:  # RGB(A) pixels 0..255, as log_image and log_video read them
        x = x / 255.0
    bad = ~torch.isfinite(x).all(dim=1)  # [T, H, W]
    if x.shape[1] == 1:
        v = x[:, 0]
        if value_range is None:
            finite = torch.isfinite(v)
            lo = torch.where(finite, v, torch.inf).amin()
            hi = torch.where(finite, v, -torch.inf).amax()
            lo = torch.where(torch.isfinite(lo), lo, 0.0)
            hi = torch.where(torch.isfinite(hi), hi, 1.0)
            span = torch.where(hi > lo, hi / 2 - lo / 2, 1.0)  # halves: a span beyond the dtype's max stays finite
        else:  # Python numbers: nothing to copy to the device
            lo, span = value_range[0], value_range[1] / 2 - value_range[0] / 2
        # (v - lo) / 2 / span, in halves; nan_to_num again: an index built from NaN would be INT64_MIN, which the
        # colour table's lookup takes out of bounds (on CUDA a device-side assert that ends the process).
        scaled = (torch.nan_to_num(v) / 2 - lo / 2) / span * 255.0
        index = torch.nan_to_num(scaled, nan=0.0).round().clamp(0, 255).long()
        frames = lut[index]  # [T, H, W, 3] uint8
    else:
        if x.shape[1] == 4:
            alpha = x[:, 3:4].clamp(0.0, 1.0)
            rgb = x[:, :3] if premultiplied else x[:, :3].clamp(0.0, 1.0) * alpha
            rgb = (1.0 - alpha + rgb).clamp(0.0, 1.0)
        else:
            rgb = x.clamp(0.0, 1.0)
        frames = (torch.nan_to_num(rgb).movedim(1, -1) * 255.0 + 0.5).floor().to(torch.uint8)
    return torch.where(bad.unsqueeze(-1), nan_colour, frames)


def _check_channels(channels) -> Tuple[int, ...]:
    try:
        values = tuple(channels)
    except TypeError:
        values = None
    if (
        values is None
        or len(values) not in (1, 3, 4)
        or not all(is_int(c, integral=True) for c in values)
    ):
        raise ConfigurationError(
            f"RolloutVideo.channels must be 1, 3 or 4 channel indices (colour-mapped, RGB, RGBA), got "
            f"{channels!r}; e.g. (0, 1, 2, 3) for an NCA's RGBA or (4,) for one hidden channel."
        )
    return tuple(int(c) for c in values)


def _check_range(value_range) -> Optional[Tuple[float, float]]:
    if value_range is None:
        return None
    if not_a_pair(value_range):
        raise ConfigurationError(
            f"RolloutVideo.value_range must be None or (low, high) finite numbers with low < high, got "
            f"{value_range!r} (a {type(value_range).__name__}, not a pair of bounds); give the bounds as numbers, "
            f"e.g. (0.0, 1.0)."
        )
    try:
        lo, hi = (float(v) for v in value_range)
    except (TypeError, ValueError):
        lo = hi = float("nan")
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):  # NaN too; an infinite end maps all to one colour
        raise ConfigurationError(
            f"RolloutVideo.value_range must be None or (low, high) finite numbers with low < high, got "
            f"{value_range!r}; e.g. (0.0, 1.0), or None for the channel's own finite min..max."
        )
    return lo, hi
