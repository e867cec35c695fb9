"""Writing lines to the terminal without breaking a progress bar.

A tqdm bar redraws itself on its line; a plain ``print`` while it is active tears it apart. `write_line` goes
through ``tqdm.write`` whenever a tqdm bar is open (ours or anyone's, e.g. TorchRL's trainer bar), which
clears
the bar, prints the line above it and redraws it; otherwise it writes straight to the stream. Every console
output of instrument should use it.
"""

import sys
from typing import Optional, TextIO

__all__ = ["write_line", "bar_active"]


def bar_active() -> bool:
    """Whether a tqdm progress bar is open in this process (tqdm is not imported to find out)."""
    tqdm_module = sys.modules.get("tqdm")
    if tqdm_module is None:
        return False
    return bool(getattr(tqdm_module.tqdm, "_instances", None))


def write_line(text: str, stream: Optional[TextIO] = None) -> None:
    """Write ``text`` and a newline to ``stream`` (default: ``sys.stdout`` at call time), then flush."""
    stream = stream or sys.stdout
    if bar_active():
        sys.modules["tqdm"].tqdm.write(text, file=stream)
    else:
        stream.write(text + "\n")
    stream.flush()
