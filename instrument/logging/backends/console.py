"""Console: one compact line per committed step."""

import math
import sys
from typing import Optional, Sequence, TextIO

from instrument.logging.backends.base import Backend, StepRecord
from instrument.logging.terminal import write_line

__all__ = ["ConsoleBackend"]


def _fmt(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


class ConsoleBackend(Backend):
    """Prints ``step N | key value | ...`` for each commit.

    Args:
        keys: metric keys (or key prefixes) to show, in order; None shows every scalar, sorted.
        max_keys: at most this many values per line, so a line stays readable.
        stream: where to write; None means ``sys.stdout`` at write time.
    """

    def __init__(self, keys: Optional[Sequence[str]] = None, max_keys: int = 8, stream: Optional[TextIO] = None):
        self.keys = list(keys) if keys is not None else None
        self.max_keys = max_keys
        self.stream = stream

    def _selected(self, record: StepRecord):
        if self.keys is None:
            items = sorted(record.scalars.items())
        else:
            items = [(k, v) for want in self.keys for k, v in sorted(record.scalars.items())
                     if k == want or k.startswith(want.rstrip("/") + "/")]
        return items[: self.max_keys]

    def write(self, record: StepRecord) -> None:
        parts = [f"step {record.step:>6}"] + [f"{k} {_fmt(v)}" for k, v in self._selected(record)]
        write_line(" | ".join(parts), self.stream or sys.stdout)

    def __repr__(self) -> str:
        return f"ConsoleBackend(keys={self.keys!r}, max_keys={self.max_keys})"
