"""Which dimension of a state holds its channels: said by the observer, said by the session, or read off the shape.

A growing-NCA state is ``[B, C, H, W]`` in some code and ``[B, H, W, C]`` in other (the original notebook and
its ports): read with the wrong layout, "channel 3" is grid row 3 and every per-channel number is wrong
without any error. So the layout is resolved in this order:

1. the observer's own ``channel_dim`` (e.g. ``UpdateNorm(channel_dim=-1)``),
2. the session's (``Instrumentation(channel_dim=-1)``, gin-bindable), given to every observer whose own
   ``channel_dim`` is None as ``session_channel_dim``,
3. the observer's fallback: `infer_channel_dim` from the shape, or a fixed default (see each observer).
"""

import logging
from typing import Any, Optional, Sequence

from instrument.errors import ConfigurationError

__all__ = ["said_channel_dim", "infer_channel_dim", "check_channel_dim", "warn_layout_once"]

log = logging.getLogger("instrument")


def said_channel_dim(observer: Any) -> Optional[int]:
    """The observer's own ``channel_dim``, else the session's; None when neither says."""
    own = getattr(observer, "channel_dim", None)
    return own if own is not None else getattr(observer, "session_channel_dim", None)


def infer_channel_dim(shape: Sequence[int]) -> Optional[int]:
    """For a 4-D state on a square grid: 1 for ``[B, C, S, S]``, -1 for ``[B, S, S, C]`` (C != S); None when the
    shape fits both layouts or neither (e.g. ``[B, 16, 16, 16]`` or a non-square grid)."""
    if len(shape) != 4:
        return None
    first, middle, last = shape[1], shape[2], shape[3]
    first_is_channel = middle == last and first != middle
    last_is_channel = first == middle and last != middle
    if first_is_channel != last_is_channel:
        return 1 if first_is_channel else -1
    return None


def check_channel_dim(name: str, dim: int, shape: Sequence[int]) -> int:
    """``dim`` as a non-negative index into ``shape``; refuses the batch dimension and out-of-range ones."""
    if not -len(shape) <= dim < len(shape) or dim % len(shape) == 0:
        raise ConfigurationError(
            f"observer {name!r} has channel_dim={dim}, but the state has shape {list(shape)}: expected a "
            f"dimension after the batch (1 for [B, C, H, W], -1 for [B, H, W, C])."
        )
    return dim % len(shape)


def warn_layout_once(observer: Any, message: str) -> None:
    """One warning per observer instance (its ``_layout_warned`` flag), naming it and how to say the layout."""
    if getattr(observer, "_layout_warned", False):
        return
    observer._layout_warned = True
    log.warning(
        "instrument: observer %r: %s Say the layout once: Instrumentation(channel_dim=1) for [B, C, H, W] or "
        "channel_dim=-1 for [B, H, W, C] (or the observer's own channel_dim=...).",
        getattr(observer, "name", type(observer).__name__), message,
    )
