"""Text for the step table: short, distinct headers for metric keys."""

import re
from typing import Dict, Sequence

__all__ = ["unique_headers"]

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
