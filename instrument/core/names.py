"""A name kept apart from the names already taken: ``<name>__2``, ``<name>__3``, ...

Where two values would share one name (two hyperparameters that flatten alike, a hyperparameter named like W&B's
config text, an escaped key that is already another key's text), the later one is numbered instead, so both
values are kept. One helper, so every such name reads the same.
"""

from typing import Callable

__all__ = ["numbered"]


def numbered(name: str, taken: Callable[[str], bool]) -> str:
    """``<name>__<n>`` with the smallest ``n >= 2`` that is not ``taken``."""
    number = 2
    while taken(f"{name}__{number}"):
        number += 1
    return f"{name}__{number}"
