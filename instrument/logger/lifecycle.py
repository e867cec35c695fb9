"""The logger's start and end as a user sees them: backends that fail to open, calls after close.

Kept apart from the logger's hot path: these run once per run (or once per mistake).
"""

import logging
from typing import Any

from instrument.errors import ConfigurationError

__all__ = ["closed_use"]

log = logging.getLogger("instrument")


def closed_use(logger: Any, what: str) -> bool:
    """A call on a closed logger. After an explicit `close` it raises; after a signal or the process exit
    closed the logger (training may still be winding down on another thread) it warns once and the value is
    dropped. Returns False (the value is not accepted)."""
    if logger._closed_by == "close":
        raise ConfigurationError(
            f"{what} was logged after this logger was closed (Instrumentation.close / Logger.close); it would "
            f"not be written. Log before closing, or start a new Instrumentation for another run."
        )
    if not logger._warned_closed:
        logger._warned_closed = True
        log.warning("instrument: %s was logged after the run was closed at process shutdown; it is not written "
                    "(further values are dropped silently)", what)
    return False
