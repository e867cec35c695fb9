"""The progress component of `RLLogging`: puts a `ProgressBar` backend on the attached logger for the loop.

The bar itself is a backend (`instrument.backends.progress`): it reads committed records. This component gives
it its place in the RL set's lifecycle: at attach it hands the bar the run's length and the prefixes of the
set's components (the bar's declared keys are templates such as ``{collection}/reward/mean``) and adds it to
the logger; at close it closes the bar, because the bar ends with the loop, not with the session. The close is
queued on the logger's writer thread, behind the records committed before it (the set's last one included),
like every backend call: closed from the training thread, the bar dropped the records still queued and its
last line showed a stale count.
"""

from typing import TYPE_CHECKING, Any, Mapping, Optional

from instrument.backends.progress import ProgressBar
from instrument.rl.component import RLComponent

if TYPE_CHECKING:
    from instrument.logger.logger import Logger

__all__ = ["ProgressComponent"]

CLOSE_TIMEOUT = 30.0  # seconds `ProgressComponent.close` waits for the writer to reach the bar's close


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
        self._logger: Any = None

    def attach(self, logger: "Logger") -> None:
        if self.bar.total_frames is None:
            self.bar.total_frames = self.total_frames
        self.bar.prefixes.update(self.prefixes)
        logger.add_backend(self.bar)
        self._logger = logger

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Close the bar on the writer thread once every record committed before is written (the final one
        draws the final count), and wait for that, at most ``timeout`` seconds (a slow backend ahead of it:
        the bar then closes when the writer gets there). The logger's own close later finds it closed."""
        logger, self._logger = self._logger, None
        if logger is None or self.bar not in logger.backends:  # never added (not the writing rank): not open
            self.bar.close()
            return
        logger.close_backend(self.bar, timeout)

    def __repr__(self) -> str:
        return f"ProgressComponent({self.bar!r})"
