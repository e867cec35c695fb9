"""Writing a line to the terminal without breaking a tqdm progress bar.

A bar redraws its line with ``\\r``; a plain ``print`` while it is on screen lands in the middle of the bar
and both come out garbled. ``tqdm.write`` (tqdm's public API for exactly this) clears the bars on the same
stream, prints the line and redraws them; with no bar on screen it is a plain write. We go through it
whenever tqdm is loaded: tqdm is optional, and a program that never imported it cannot have a bar on screen,
so tqdm is never imported here.
"""

import sys
from typing import Optional, TextIO

__all__ = ["write_line"]


def _loaded_tqdm():
    """The ``tqdm.tqdm`` class when tqdm has been imported (by anyone), else None."""
    module = sys.modules.get("tqdm")
    return getattr(module, "tqdm", None) if module is not None else None


def write_line(text: str, stream: Optional[TextIO] = None) -> None:
    """Write ``text`` and a newline to ``stream`` (``sys.stdout`` at call time when None), then flush.

    Through ``tqdm.write`` once tqdm is loaded, so the line appears above any bar and the bar stays intact.
    """
    out = stream if stream is not None else sys.stdout
    bar_class = _loaded_tqdm()
    if bar_class is not None:
        bar_class.write(text, file=out)
    else:
        out.write(text + "\n")
    out.flush()
