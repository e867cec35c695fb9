"""Videos on the host: GIF encoding with Pillow, a PNG filmstrip, and per-video fault isolation.

Every backend that writes videos encodes them here, with Pillow (a core dependency), so no backend needs an
extra to show a video and the frame rate is the one asked for. (moviepy 1.0.3, which ``SummaryWriter.add_video``
and ``wandb.Video`` use for raw frames, hands imageio >= 2.28 the frame delay in seconds where milliseconds
are expected: its GIFs carry a delay of 0 and browsers play them at their own default rate.)

GIF facts that shape what a reader gets back: frame delays are whole centiseconds (so at most 50 fps plays as
asked; browsers slow delays under 20 ms to 100 ms, so a higher fps is written as 50); each frame is quantised to
its own palette of at most 256 colours (exact when a frame has no more colours than that); and Pillow merges a
frame identical to the one before it into that frame's delay, so a video that holds still has fewer, longer frames
and the same duration.
"""

import io
from typing import Callable, List, Tuple, Type, Union

import numpy as np

from instrument.backends.base import PartialWriteError

__all__ = ["encode_gif", "filmstrip", "write_each", "raise_failures", "MediaWriteError", "VideoWriteError"]


class MediaWriteError(PartialWriteError):
    """Some videos (or other media values: images, texts, tables) of a record could not be written; everything else
    of that record was. ``steps``: how many steps had a value that failed (several records written in one
    `Backend.write_many` call); each counts as a failure of the backend, as when written apart."""


VideoWriteError = MediaWriteError  # its first name, from when only videos were written one by one


def encode_gif(frames: np.ndarray, fps: float) -> bytes:
    """[T, H, W, C] uint8 (C in 3, 4; 4 is composited over white) -> the bytes of a looping animated GIF."""
    from PIL import Image

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] not in (3, 4) or frames.dtype != np.uint8 or not len(frames):
        raise ValueError(
            f"encode_gif expects uint8 frames [T, H, W, 3 or 4], got shape {frames.shape} and dtype {frames.dtype}."
        )
    if frames.shape[-1] == 4:  # GIF has 1-bit transparency only: show alpha over white
        alpha = frames[..., 3:].astype(np.float64) / 255.0
        frames = (frames[..., :3] * alpha + 255.0 * (1.0 - alpha) + 0.5).astype(np.uint8)
    images = [Image.fromarray(np.ascontiguousarray(f)) for f in frames]
    # GIF delays are whole centiseconds: the nearest to 1/fps (2.5 fps: 40 cs), at least 2 (50 fps): browsers play
    # a delay of 1 cs as 10 (100 ms), so 100 fps asked played at 10, slower than 60 fps asked (20 ms, 50 fps).
    delay = 10 * max(2, int(round(100.0 / max(float(fps), 1.0))))
    buffer = io.BytesIO()
    images[0].save(
        buffer, format="GIF", save_all=True, append_images=images[1:], duration=delay, loop=0, optimize=False
    )
    return buffer.getvalue()


def filmstrip(frames: np.ndarray, columns: int = 8, gap: int = 2) -> np.ndarray:
    """[T, H, W, C] uint8 -> one [rows*(H+gap)-gap, cols*(W+gap)-gap, C] image: frames left to right, then the
    next row, on white. A still picture of a whole video, for where a video cannot be shown."""
    frames = np.asarray(frames)
    t, h, w, c = frames.shape
    cols = max(1, min(columns, t))
    rows = -(-t // cols)
    sheet = np.full((rows * (h + gap) - gap, cols * (w + gap) - gap, c), 255, dtype=np.uint8)
    for i, frame in enumerate(frames):
        r, k = divmod(i, cols)
        sheet[r * (h + gap): r * (h + gap) + h, k * (w + gap): k * (w + gap) + w] = frame
    return sheet


def write_each(videos: dict, write: Callable[[str, np.ndarray, int], None]) -> List[Tuple[str, Exception]]:
    """Call ``write(key, frames, fps)`` for every video; a video that raises costs that video only.

    Returns the failures; the caller writes the rest of its record and then calls `raise_failures`, so the
    logger's failure ledger reports and counts them like any other backend fault.
    """
    failures: List[Tuple[str, Exception]] = []
    for key, (frames, fps) in videos.items():
        try:
            write(key, frames, fps)
        except Exception as exc:
            failures.append((key, exc))
    return failures


def raise_failures(
    backend: str, step: Union[int, str], failures: List[Tuple[str, Exception]], what: str = "video(s)",
    steps: int = 1, error: Type[PartialWriteError] = MediaWriteError,
) -> None:
    """Raise one ``error`` naming every video (or other media value, ``what``) of the step that failed (chained
    from the first). ``step``: ``"first-last"`` for several steps written in one call, ``steps`` of which had a
    value that failed."""
    if not failures:
        return
    named = "; ".join(f"{key!r}: {type(exc).__name__}: {exc}" for key, exc in failures)
    one = isinstance(step, int)
    raise error(
        f"{backend}: {len(failures)} {what} of {'step' if one else 'steps'} {step} could not be written ({named}); "
        f"the rest of the {'step was' if one else 'steps were'} written.", steps=steps,
    ) from failures[0][1]
