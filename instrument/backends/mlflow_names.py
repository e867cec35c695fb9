"""MLflow names: the key each metric, hyperparameter and media value is logged under, for the whole run.

MLflow allows fewer characters in a key than instrument does, so keys are sanitised; two keys that sanitise
alike get numbered names instead of one merged series (`unique_name`). An image's key names its files, so it
is ASCII and shorter. Training metrics under ``system/`` move to ``user/``: those keys hold the system
monitor's samples (`instrument.backends.mlflow.MlflowBackend`).
"""

import logging
import re
from typing import Dict, Optional

from instrument.backends.base import USER_HEAD

__all__ = ["MAX_IMAGE_KEY", "MAX_KEY", "SYSTEM_HEADS", "is_system", "safe_name", "unique_name"]

log = logging.getLogger("instrument")

MAX_KEY = 250
# An image's key names its files: `<key>+step+<step>+timestamp+<ms>+<uuid>+compressed.webp`, up to 102 characters
# after the key, in a file name of at most 255 bytes. MLflow's log_image takes ASCII keys only.
MAX_IMAGE_KEY = 150
SYSTEM_HEADS = ("system/", USER_HEAD)


def unique_name(key: str, names: Dict[str, str], owners: Dict[str, Optional[str]], what: str,
                 limit: int = MAX_KEY, flags: int = 0) -> str:
    """A key's MLflow name for the whole run. Sanitising can map two keys to one name (``acc[top1]`` and
    ``acc_top1_`` both to ``acc_top1_``), which would merge two metric series into one, or make MLflow refuse
    a batch with a duplicate param: the later key gets a numbered name (``acc_top1__2``) and one warning
    naming both keys. A name the run held before a resume (owner None) is taken by the first key that maps
    to it."""
    name = names.get(key)
    if name is not None:
        return name
    name = safe = safe_name(key, limit, flags)
    number = 1
    while name in owners and owners[name] is not None:
        number += 1
        name = f"{safe[: limit - 8]}_{number}"
    if number > 1:
        log.warning(
            "instrument: MLflow %s key %r sanitises to %r, the MLflow name of key %r; it is logged as %r "
            "instead, so the two stay apart. Rename one of the keys to avoid this.",
            what, key, safe, owners[safe], name,
        )
    names[key] = name
    owners[name] = key
    return name


def safe_name(name: str, limit: int = MAX_KEY, flags: int = 0) -> str:
    """A key MLflow accepts: allowed characters only (``re.ASCII`` in ``flags``: ASCII letters and digits only,
    as image keys must be), at most ``limit`` of them, and a path that normalises to itself.

    The path is normalised again after the cut: a cut that ends in ``/`` (or leaves a last part ``.`` or
    ``..``) is a name MLflow refuses, which would fail the whole ``log_batch`` of the step."""
    cleaned = re.sub(r"[^/\w.\- ]", "_", str(name), flags=flags)
    return _path(_path(cleaned)[:limit]) or "_"


def is_system(key: str) -> bool:
    return key.startswith("system/")


def _path(name: str) -> str:
    """``name`` without empty parts, with the parts ``.`` and ``..`` written ``_`` and ``__``."""
    return "/".join(p if p not in (".", "..") else p.replace(".", "_") for p in name.split("/") if p)
