"""The progress component of `RLLogging`: puts a `ProgressBar` backend on the attached logger for the loop.

The bar itself is a backend (`instrument.backends.progress`): it reads committed records. This component gives
it its place in the RL set's lifecycle: at attach it hands the bar the run's length and the prefixes of the
set's components (the bar's declared keys are templates such as ``{collection}/reward/mean``) and adds it to
the logger; at close it closes the bar, because the bar ends with the loop, not with the session.
"""

from typing import TYPE_CHECKING, Mapping, Optional

from instrument.backends.progress import ProgressBar
from instrument.rl.component import RLComponent

if TYPE_CHECKING:
    from instrument.logger.logger import Logger

__all__ = ["ProgressComponent"]


class ProgressComponent(RLComponent):
    """Drives ``bar`` as a member of the RL set.

    Args:
        bar: the progress bar backend.
        total_frames: the run's length, used when the bar has none of its own.
        prefixes: placeholder -> prefix of the set's components (e.g. ``{"collection": "collection/cartpole"}``).
    """

    prefix = "progress"

    def __init__(
        self, bar: ProgressBar, total_frames: Optional[int] = None, prefixes: Optional[Mapping[str, str]] = None
    ) -> None:
        self.bar = bar
        self.total_frames = total_frames
        self.prefixes = dict(prefixes or {})

    def attach(self, logger: "Logger") -> None:
        if self.bar.total_frames is None:
            self.bar.total_frames = self.total_frames
        self.bar.prefixes.update(self.prefixes)
        logger.add_backend(self.bar)

    def close(self) -> None:
        self.bar.close()  # the logger's own close() later finds it closed

    def __repr__(self) -> str:
        return f"ProgressComponent({self.bar!r})"
