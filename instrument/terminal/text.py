"""Text for the step table: how wide a string is on a terminal, padding to that width, and short headers.

A terminal gives an East Asian wide or fullwidth character (``損``, ``ｌ``) and most emoji two cells, a
combining mark (the accent of ``é`` written as ``e`` + U+0301) and a zero-width character none. `StepTable`
pads and measures by these cells, not by ``len``, so a header with such characters keeps its column in place.
"""

import re
import unicodedata
from typing import Dict, Sequence

__all__ = ["cut", "display_width", "pad", "printable", "unique_headers"]


# Unicode's control characters (category Cc), the bidirectional embeddings, overrides and isolates (U+202E turns
# the rest of a line around in a terminal that does bidi; the marks U+200E, U+200F and U+061C, which Hebrew and
# Arabic text uses and which reorder nothing beyond their neighbours, are kept) and lone surrogates
# (``os.fsdecode``: no encoding can write them)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str, keep: str = "") -> str:
    """``text`` with each control character written as its escape (``\\n``, ``\\r``, ``\\t``, ``\\x1b``,
    ``\\x00``, ``\\u202e``, a lone surrogate's ``\\ud800``), as a name or a logged text is shown on a terminal: a
    newline in a metric key split the table's header and legend, and an escape or a carriage return was written raw
    to the terminal. ``keep``: characters left as they are (a panel keeps a text's line breaks). Display only: keys
    and values are stored as given."""
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(lambda m: m.group() if m.group() in keep else repr(m.group())[1:-1], text)


def _cell_width(char: str) -> int:
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def display_width(text: str) -> int:
    """The cells ``text`` takes on a terminal (``len`` for plain ASCII)."""
    if text.isascii():
        return len(text)
    return sum(_cell_width(c) for c in text)


def pad(text: str, width: int, left: bool) -> str:
    """``text`` padded with spaces to ``width`` terminal cells: on the right when ``left``, else on the left."""
    fill = " " * max(width - display_width(text), 0)
    return text + fill if left else fill + text


def cut(text: str, width: int) -> str:
    """The longest start of ``text`` that takes at most ``width`` terminal cells."""
    out, used = [], 0
    for char in text:
        used += _cell_width(char)
        if used > width:
            break
        out.append(char)
    return "".join(out)


_GENERIC = re.compile(r"^(mean|min|max|std|first|last|count|sum|total|value|c\d+)$")


def unique_headers(keys: Sequence[str]) -> Dict[str, str]:
    """Short, distinct headers for metric keys: the fewest trailing path segments that tell them apart,
    and at least two when the last one alone says little (``mean``, ``max``, ``c3``)."""
    headers: Dict[str, str] = {}
    for key in keys:
        parts = key.split("/")
        start = 2 if len(parts) > 1 and _GENERIC.match(parts[-1]) else 1
        for n in range(start, len(parts) + 1):
            candidate = "/".join(parts[-n:])
            clash = any(other != key and "/".join(other.split("/")[-n:]) == candidate for other in keys)
            if not clash:
                break
        headers[key] = candidate
    return headers
