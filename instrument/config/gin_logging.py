"""What parsing a config does to the process's logging, undone: gin's own log lines and their side effects.

gin logs through the root logger while it looks for included files: an ERROR for every search path that does not
hold the file (even when a later one does), and module-level ``logging.info`` calls that, on a root logger
without handlers, make the stdlib call ``logging.basicConfig()`` itself, which printed instrument's later
warnings as ``WARNING:instrument:...``.
"""

import logging
import sys
from typing import Any, List

__all__ = ["ImplicitRootHandlers", "QuietIncludeProbes"]


class QuietIncludeProbes(logging.Filter):
    """Drops gin's "Path not found" errors while it tries each search path for an include.

    gin logs one at ERROR on the root logger for every search path that does not hold an included file, even
    when a later path does; a file that is really missing still raises, naming the file and line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and record.msg == "Path not found: %s")


class ImplicitRootHandlers:
    """While a config is parsed: note the root handlers that ``logging.basicConfig`` adds when the stdlib calls it
    implicitly (a module-level ``logging.info``, as gin's include lookup makes, on a root logger without handlers),
    and `undo` removes just those: they printed instrument's later warnings as ``WARNING:instrument:...``. A
    ``basicConfig`` the user's own code calls (a module a ``.gin`` file imports) is its own and stays."""

    def __init__(self) -> None:
        self.added: List[logging.Handler] = []
        self.original = logging.basicConfig
        logging.basicConfig = self._basic_config  # type: ignore[assignment]

    def _basic_config(self, *args: Any, **kwargs: Any) -> None:
        root = logging.getLogger()
        before = list(root.handlers)
        self.original(*args, **kwargs)
        if not args and not kwargs and sys._getframe(1).f_globals.get("__name__") == "logging":
            self.added += [handler for handler in root.handlers if handler not in before]

    def undo(self) -> None:
        if logging.basicConfig == self._basic_config:
            logging.basicConfig = self.original  # type: ignore[assignment]
        root = logging.getLogger()
        for handler in self.added:
            if handler in root.handlers:
                root.removeHandler(handler)
