"""Writing a line to the terminal without breaking a tqdm progress bar.

A bar redraws its line with ``\\r``; a plain ``print`` while it is on screen lands in the middle of the bar
and both come out garbled. ``tqdm.write`` clears the bars, prints the line and redraws them. We use it only
when a bar exists: tqdm is optional, and a program that never imported it cannot have a bar on screen, so
tqdm is never imported here.
"""

import sys
from typing import Optional, TextIO

__all__ = ["write_line", "tqdm_bar_active"]


def tqdm_bar_active() -> bool:
    """Whether a tqdm bar is alive in this process (any ``tqdm.tqdm`` subclass: auto, std, rich...)."""
    tqdm_module = sys.modules.get("tqdm")
    if tqdm_module is None:
        return False
    instances = getattr(getattr(tqdm_module, "tqdm", None), "_instances", None)
    return bool(instances)


def write_line(text: str, stream: Optional[TextIO] = None) -> None:
    """Write ``text`` and a newline to ``stream`` (``sys.stdout`` at call time when None), then flush.

    Through ``tqdm.write`` when a bar is active, so the line appears above the bar and the bar stays intact.
    """
    out = stream if stream is not None else sys.stdout
    if tqdm_bar_active():
        sys.modules["tqdm"].tqdm.write(text, file=out)
    else:
        out.write(text + "\n")
    out.flush()
