"""Where an ``include`` line finds its file while `parse_config` parses: beside the file that includes it first.

gin resolves an include against one global list of folders (``''``, the working directory, first), so a file of
the same name in the working directory replaced the one beside the including file, and a nested include relative
to a file in a subfolder was not found at all. While `include_search` is active, every file gin opens puts its
own folder first in that list for the includes it holds (nested too), then the working directory, then the
shipped configs; the list is put back when the file is parsed.

gin's other readers (its Python-package reader, ``include 'package.sub/file.gin'``) are kept, but one that fails
on a name it cannot judge (an empty ``backends/`` folder in the working directory imports as a namespace package
without a file, and gin's reader raised a TypeError on it) counts as "not found" rather than ending the parse.
"""

import contextlib
import os
from typing import Any, Callable, Iterator, List

import gin

__all__ = ["include_search", "quiet_readers"]


class _Opened:
    """A config file as gin opens it (``with reader(path) as f``): as UTF-8 with an optional byte-order mark
    dropped (gin's plain open() made Notepad's BOM an "Unexpected token" at line 1), and, while gin parses it,
    its own folder searched first for its includes."""

    def __init__(self, path: str, prefixes: List[str], after: List[str]) -> None:
        self.path, self.prefixes, self.after = path, prefixes, after
        self.saved: List[str] = []
        self.file: Any = None

    def __enter__(self) -> Any:
        self.file = open(self.path, encoding="utf-8-sig")
        self.saved = list(self.prefixes)
        self.prefixes[:] = list(dict.fromkeys([os.path.dirname(self.path), "", *self.after]))
        return self.file

    def __exit__(self, *exc: Any) -> None:
        self.prefixes[:] = self.saved
        self.file.close()


def _quiet(exists: Callable[[str], bool]) -> Callable[[str], bool]:
    if getattr(exists, "_instrument_quiet", False):
        return exists

    def check(path: str) -> bool:
        try:
            return bool(exists(path))
        except Exception:  # noqa: BLE001 - a reader that cannot judge the name has not found it
            return False

    check._instrument_quiet = True  # type: ignore[attr-defined]
    return check


def quiet_readers() -> None:
    """Make gin's own readers other than open() answer "not found" for a name they cannot judge, for every
    parse, also gin's own parse functions called without `parse_config` (an empty ``backends/`` folder on
    sys.path made gin's package reader raise a TypeError for ``include 'backends/tensorboard.gin'``)."""
    readers = getattr(gin.config, "_FILE_READERS", None)
    if isinstance(readers, list):
        readers[:] = [(read, exists if read is open else _quiet(exists)) for read, exists in readers]


@contextlib.contextmanager
def include_search(shipped: str) -> Iterator[None]:
    """While active: includes resolve beside the including file, then from the working directory, then among
    the folders gin was told to search (the shipped configs, ``shipped``, always among them)."""
    readers = getattr(gin.config, "_FILE_READERS", None)
    prefixes = getattr(gin.config, "_LOCATION_PREFIXES", None)
    if not isinstance(readers, list) or not isinstance(prefixes, list):  # another gin: its own search applies
        yield
        return
    saved_readers, saved_prefixes = list(readers), list(prefixes)
    after = list(dict.fromkeys([p for p in prefixes if p] + [shipped]))

    def reader(path: str) -> _Opened:
        return _Opened(path, prefixes, after)

    readers[:] = [(reader, os.path.isfile) if read is open else (read, _quiet(exists)) for read, exists in readers]
    prefixes[:] = ["", *after]
    try:
        yield
    finally:
        readers[:] = saved_readers
        prefixes[:] = saved_prefixes
