"""Counters: frames, iterations and episodes since the run began, carried across resumes.

Keys (under ``counters/``):

================  ==========================================================================================
key               meaning
================  ==========================================================================================
``frames``        environment frames collected (steps kept by the collector mask, times ``frame_skip``)
``iterations``    training iterations completed
``episodes``      episodes that ended
================  ==========================================================================================

Frames are counted from shapes (no device work) unless the batch has a collector mask, whose sum stays on the
device; reading `Counters.frames` then costs one host sync (frame-based schedules and ``step_unit="frames"``
read it, logging does not). Episodes stay on the device until commit: reading `frames` leaves them there, so
without a mask it costs nothing. `state_dict` returns plain ints, read in one batched transfer, so a checkpoint
stores them in any format and a resumed run continues counting exactly.
"""

import numbers
from collections.abc import Mapping
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from instrument.checks import check_int
from instrument.errors import ConfigurationError
from instrument.logger.transfer import to_host
from instrument.rl.batch import (
    KeywordBatch,
    NestedKey,
    batch_shape_of,
    flag_entry,
    infer_batch_shape,
    split_features,
)
from instrument.rl.component import RLComponent
from instrument.rl.ranks import log_reduced

__all__ = ["Counters"]

_STATE_KEYS = ("frames", "iterations", "episodes")


class Counters(RLComponent):
    """Counts frames (with ``frame_skip``), iterations and episodes.

    Args:
        frame_skip: environment frames per collected step (an action repeated ``frame_skip`` times).
        done_key, mask_key: where a batch keeps the end-of-episode flag and the collector mask.
    """

    prefix = "counters"
    exclusive_prefix = True  # two at one prefix log the same keys (`instrument.core.step_components.same_keys`)

    def __init__(
        self,
        frame_skip: int = 1,
        done_key: NestedKey = ("next", "done"),
        mask_key: Optional[NestedKey] = ("collector", "mask"),
    ) -> None:
        check_int("Counters.frame_skip", frame_skip, least=1, expected="a positive int",
                  why="the environment frames in one step", fix="bind e.g. Counters.frame_skip = 1")
        self.frame_skip = frame_skip
        self.done_key, self.mask_key = done_key, mask_key
        self.iterations = 0
        self.counting = False  # a batch was counted in the iteration in progress (since the last end_iteration)
        self._frames = 0
        self._episodes = 0
        self._frames_device: Optional[Tensor] = None
        self._episodes_device: Optional[Tensor] = None

    # ------------------------------------------------------------------ counting
    def on_batch(
        self,
        batch: Any = None,
        frames: Optional[int] = None,
        *,
        done: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
    ) -> None:
        """Count one batch. ``frames`` (already including frame_skip), when given, is taken as it is;
        ``done``/``mask`` keywords win over the batch's entries (as in a `KeywordBatch`)."""
        if done is not None or mask is not None:
            batch = KeywordBatch(batch, done=done, mask=mask)
        done = flag_entry(batch, "done", self.done_key)
        mask = flag_entry(batch, "mask", self.mask_key)
        shape = batch_shape_of(batch)
        if shape is None and done is not None:
            shape = infer_batch_shape(done, None)
        if frames is not None:
            self._frames += check_int("frames", frames, least=0, expected="a non-negative int", integral=True,
                                      why="the batch's frames, frame skip included",
                                      fix="pass e.g. frames=256, or leave frames out to count the batch")
        elif mask is not None:
            kept = mask.to(torch.bool).sum(dtype=torch.int64) * self.frame_skip
            self._frames_device = kept if self._frames_device is None else self._frames_device + kept
        elif shape is not None:
            self._frames += _numel(shape) * self.frame_skip
        else:
            raise ConfigurationError(
                "Counters cannot tell how many frames this batch holds: pass frames=..., a TensorDict, or a "
                f"batch with done at {self.done_key!r}."
            )
        self.counting = True
        if done is not None:
            ended = (
                split_features(done, shape, "done").to(torch.bool).any(dim=-1) if shape is not None else done
            )
            if mask is not None:
                ended = ended & split_features(mask, shape, "mask")[..., 0].to(torch.bool)
            count = ended.sum(dtype=torch.int64)
            self._episodes_device = count if self._episodes_device is None else self._episodes_device + count

    def end_iteration(self, counters: Optional["Counters"] = None) -> bool:
        """One more iteration completed (``counters`` is this object when `RLLogging` calls it)."""
        self.iterations += 1
        self.counting = False
        return False

    # ------------------------------------------------------------------ reading
    @property
    def frames(self) -> int:
        """Frames so far, as an int (one host sync when a collector mask was counted since the last read, none
        otherwise: the episode count stays on the device, read at commit)."""
        self._fold(episodes=False)
        return self._frames

    @property
    def episodes(self) -> int:
        """Episodes so far, as an int (one host sync when episodes were counted since the last read)."""
        self._fold()
        return self._episodes

    @property
    def frames_known(self) -> bool:
        """Whether `frames` can be read without a host sync: no collector mask was counted since the last read
        (episodes counted on the device do not matter, `frames` leaves them there)."""
        return self._frames_device is None

    def _fold(self, episodes: bool = True) -> None:
        """Add the counts still on the device to the ints: the frames, and the episodes unless ``episodes`` is
        False (a frame schedule reading `frames` every iteration must not read them: a sync each time)."""
        frames_device = self._frames_device
        episodes_device = self._episodes_device if episodes else None
        pending = [t for t in (frames_device, episodes_device) if t is not None]
        if not pending:
            return
        # host sync: the device counts are read once here (checkpoints, frame schedules), never per metric.
        host = iter(to_host(pending))
        if frames_device is not None:
            self._frames += int(next(host))
            self._frames_device = None
        if episodes_device is not None:
            self._episodes += int(next(host))
            self._episodes_device = None

    def log(self, logger, step: int) -> None:
        metrics = {
            "frames": _total(self._frames, self._frames_device),
            "iterations": self.iterations,
            "episodes": _total(self._episodes, self._episodes_device),
        }
        # each rank counts its own frames and episodes: they add up; every rank runs the same iterations
        log_reduced(logger, metrics, step, self.prefix, {"frames": "sum", "episodes": "sum", "iterations": "max"})

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> Dict[str, Any]:
        self._fold()
        return {"frames": self._frames, "iterations": self.iterations, "episodes": self._episodes}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        source = "Counters.state_dict() (RLLogging.state_dict()['counters'])"
        if not isinstance(state, Mapping):
            raise ConfigurationError(f"Counters.load_state_dict takes the dict {source} returns, got "
                                     f"{type(state).__name__} {state!r:.80}.")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ConfigurationError(
                f"Counters.load_state_dict: the state lacks {missing}; got keys {sorted(state)}. Load the state "
                f"{source} returned."
            )
        for key in _STATE_KEYS:
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ConfigurationError(
                    f"Counters.load_state_dict: {key} must be a non-negative int, got {value!r} "
                    f"({type(value).__name__}); {source} holds plain ints: load the state it returned "
                    f"(a count read back as a tensor: int(t.item()))."
                )
        self._frames = int(state["frames"])
        self.iterations = int(state["iterations"])
        self._episodes = int(state["episodes"])
        self._frames_device = self._episodes_device = None

    def __repr__(self) -> str:
        return f"Counters(frame_skip={self.frame_skip}, iterations={self.iterations})"


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _total(host: int, device: Optional[Tensor]):
    if device is None:
        return host
    # float64 keeps counts exact to 2**53 through the logger's transfer (float32 stops at 2**24).
    wide = torch.float32 if device.device.type == "mps" else torch.float64
    return device.to(wide) + host
