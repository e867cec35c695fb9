"""MLflow names: the key each metric, hyperparameter and media value is logged under, for the whole run.

MLflow allows fewer characters in a key than instrument does, so keys are sanitised; two keys that sanitise
alike get numbered names instead of one merged series (`unique_name`). An image's key names its files, so it
is ASCII and shorter. Training metrics under ``system/`` move to ``user/``: those keys hold the system
monitor's samples (`instrument.backends.mlflow.MlflowBackend`).

The run holds only the names, so a metric or hyperparameter key logged under another name, and every media key,
is also written down in a run tag (`name_tag`): a resumed run, in a new process, gives each key the name it had
(`restore_names`).
Otherwise the key seen first after the resume would take the plain name (``acc_top1_``), which held the other
key's series.
"""

import hashlib
import json
import logging
import re
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from instrument.backends.base import USER_HEAD

__all__ = ["MAX_IMAGE_KEY", "MAX_KEY", "NAMES_TAGGED", "RunNames", "SYSTEM_HEADS", "is_system", "key_digest",
           "name_tag", "restore_names", "safe_name", "unique_name"]

log = logging.getLogger("instrument")

MAX_KEY = 250
# An image's key names its files: `<key>+step+<step>+timestamp+<ms>+<uuid>+compressed.webp`, up to 102 characters
# after the key, in a file name of at most 255 bytes. MLflow's log_image takes ASCII keys only.
MAX_IMAGE_KEY = 150
SYSTEM_HEADS = ("system/", USER_HEAD)
NAME_TAG = "instrument.key."  # + a digest of kind and name: a run tag whose value is [name, key, kind] (`name_tag`)
# A run tag set on the runs that write `name_tag`s: in those, a held name without a tag is its own key's. A run
# made before them (no such tag) may hold renamed keys untagged: there a held name goes to the first key that maps
# to it, as it did before.
NAMES_TAGGED = {"instrument.names": "tagged"}
_MAX_TAG_VALUE = 5000  # MLflow's limit on a tag's value (8000 since MLflow 2.x; 5000 before)


def unique_name(key: str, names: Dict[str, str], owners: Dict[str, Optional[str]], what: str,
                 limit: int = MAX_KEY, flags: int = 0, folders: Optional[Set[str]] = None) -> str:
    """A key's MLflow name for the whole run. Sanitising can map two keys to one name (``acc[top1]`` and
    ``acc_top1_`` both to ``acc_top1_``), which would merge two metric series into one, or make MLflow refuse
    a batch with a duplicate param: the later key gets a numbered name (``acc_top1__2``) and one warning
    naming both keys. A name the run held before a resume (owner None) is taken by the first key that maps
    to it. ``folders`` (a file store, which keeps each name as a file: every folder the table's names make)
    keeps a name from being a folder of another's file or the reverse (``a`` beside ``a/b``), which fails the
    whole batch: the later key is numbered where it meets the other (``a_2`` or ``a_2/b``)."""
    name = names.get(key)
    if name is not None:
        return name
    name = safe = safe_name(key, limit, flags)
    number, clash = 1, _clash(name, owners, folders)
    head = _file_above(safe, owners) if clash is not None and folders is not None else None  # numbered there
    while clash is not None:
        number += 1
        name = (_path(f"{head[: limit - 8]}_{number}{safe[len(head):]}"[:limit]) if head is not None
                else f"{safe[: limit - 8]}_{number}")
        if _clash(name, owners, folders) is None:
            break
    if number > 1:
        log.warning(
            "instrument: MLflow %s key %r sanitises to %r, %s; it is logged as %r instead, so the two stay apart. "
            "Rename one of the keys to avoid this.", what, key, safe,
            f"the MLflow name of key {owners[clash]!r}" if clash == safe else
            f"which a file store cannot keep beside {clash!r} (each name is a file)", name,
        )
    names[key] = name
    owners[name] = key
    if folders is not None:
        folders.update(_heads(name))
    return name


def _heads(name: str) -> List[str]:
    """The folders a name makes in a file store: ``a/b/c`` makes ``a`` and ``a/b``."""
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _file_above(name: str, owners: Mapping[str, Optional[str]]) -> Optional[str]:
    """The name held as a file where ``name`` needs a folder (``a`` for ``a/b``), or None."""
    return next((head for head in _heads(name) if head in owners), None)


def _clash(name: str, owners: Mapping[str, Optional[str]], folders: Optional[Set[str]]) -> Optional[str]:
    """What keeps ``name`` from a key: the name itself, held by another key; in a file store (``folders``) also
    a held name that is a folder above it, or ``name`` itself when it is a folder of held names."""
    if owners.get(name) is not None:
        return name
    if folders is None:
        return None
    if name in folders:
        return next(other for other in owners if other.startswith(name + "/"))
    return _file_above(name, owners)


def safe_name(name: str, limit: int = MAX_KEY, flags: int = 0) -> str:
    """A key MLflow accepts: allowed characters only (``re.ASCII`` in ``flags``: ASCII letters and digits only,
    as image keys must be), at most ``limit`` of them, and a path that normalises to itself.

    The path is normalised again after the cut: a cut that ends in ``/`` (or leaves a last part ``.`` or
    ``..``) is a name MLflow refuses, which would fail the whole ``log_batch`` of the step. So is a name that
    starts with ``..`` (``...``, ``..hidden/x``: MLflow reads it as a path out of its folder): those two dots
    are written ``__``."""
    cleaned = re.sub(r"[^/\w.\- ]", "_", str(name), flags=flags)
    path = _path(_path(cleaned)[:limit]) or "_"
    return "__" + path[2:] if path.startswith("..") else path


def is_system(key: str) -> bool:
    return key.startswith("system/")


def _path(name: str) -> str:
    """``name`` without empty parts, with the parts ``.`` and ``..`` written ``_`` and ``__``."""
    return "/".join(p if p not in (".", "..") else p.replace(".", "_") for p in name.split("/") if p)


def name_tag(name: str, key: str, kind: str) -> Tuple[str, str]:
    """The run tag ``(tag key, value)`` that says ``key`` (a metric, or a media value of ``kind``) is logged as
    ``name``: ``[name, key, kind]``; for a key over about 5,000 characters, which a tag cannot hold,
    ``[name, null, kind, <sha256 of the key>]`` (`key_digest`): a resumed run knows the key by its digest."""
    value = json.dumps([name, key, kind])  # ASCII: a lone surrogate or any other character is escaped
    if len(value) > _MAX_TAG_VALUE:
        value = json.dumps([name, None, kind, key_digest(key)])
    digest = hashlib.sha1(f"{kind}/{name}".encode("utf-8", "surrogatepass")).hexdigest()[:20]
    return NAME_TAG + digest, value


def key_digest(key: str) -> str:
    """What a name tag holds of a key too long for it (`name_tag`)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def restore_names(tags: Mapping[str, str], metrics: Iterable[str], params: Iterable[str],
                  tables: Callable[[str], Tuple[Dict[str, str], Dict[str, Optional[str]]]],
                  hashed: Optional[Callable[[str], Dict[str, str]]] = None) -> None:
    """A resumed run's names: each key the tags name keeps its name (``tables(kind)``: that kind's key -> name and
    name -> key tables; ``hashed(kind)``: key digest -> name, for the keys a tag holds by their digest); in a run
    that tags its names (`NAMES_TAGGED`), a metric or param name it holds with no tag is its own key's (a key
    MLflow took as it was). Media keys are all tagged."""
    for tag, value in tags.items():
        if tag.startswith(NAME_TAG):
            try:
                name, key, kind, *digest = json.loads(value)
            except (ValueError, TypeError):  # not ours after all: left alone
                continue
            if not (isinstance(name, str) and isinstance(kind, str)):
                continue
            names, owners = tables(kind)
            if isinstance(key, str):
                names[key], owners[name] = name, key
            elif key is None and len(digest) == 1 and isinstance(digest[0], str) and hashed is not None:
                hashed(kind)[digest[0]] = name
                owners[name] = f"<a key of sha256 {digest[0][:16]}...>"  # held: no other key takes the name
    if all(tags.get(tag) == value for tag, value in NAMES_TAGGED.items()):
        for kind, held in (("metric", metrics), ("param", params)):
            names, owners = tables(kind)
            for name in held:
                if owners.get(name) is None:
                    owners[name] = name
                    names.setdefault(name, name)


class RunNames:
    """The MLflow names of one run, per kind (``"metric"``, ``"param"``, and each media kind): key -> name and
    name -> key, and the run tags (`name_tag`) of the keys named since they were last taken (`take_tags`)."""

    def __init__(self) -> None:
        self.tables: Dict[str, Tuple[Dict[str, str], Dict[str, Optional[str]]]] = {}
        self._tags: List[Tuple[str, str]] = []
        self._tagged: Set[Tuple[str, str]] = set()  # (kind, key) whose tag is queued or taken
        self._hashed: Dict[str, Dict[str, str]] = {}  # kind -> {key digest: name}: long keys of a resumed run
        # A file store (`file:`) keeps each name as a file: per kind, the folders its names make (`unique_name`).
        self.folders: Optional[Dict[str, Set[str]]] = None

    def table(self, kind: str) -> Tuple[Dict[str, str], Dict[str, Optional[str]]]:
        return self.tables.setdefault(kind, ({}, {}))

    def name(self, key: str, kind: str, what: Optional[str] = None, limit: int = MAX_KEY, flags: int = 0) -> str:
        """``key``'s name for the whole run; the first time, its tag is queued: for a key logged under another
        name, and for every media key (a resumed run cannot list which media names the run holds)."""
        names, owners = self.table(kind)
        name = names.get(key)
        if name is not None:
            return name
        hashed = self._hashed.get(kind)
        name = hashed.pop(key_digest(key), None) if hashed and len(key) > limit else None
        if name is not None:  # a long key of the run before the resume: its tag holds its digest
            names[key], owners[name] = name, key
            if self.folders is not None:
                self.folders.setdefault(kind, set()).update(_heads(name))
            self._tagged.add((kind, key))
            return name
        folders = None if self.folders is None else self.folders.setdefault(kind, set())
        name = unique_name(key, names, owners, what or kind, limit, flags, folders)
        if (name != key or kind not in ("metric", "param")) and (kind, key) not in self._tagged:
            self._tagged.add((kind, key))
            self._tags.append(name_tag(name, key, kind))
        return name

    def take_tags(self, count: int) -> List[Tuple[str, str]]:
        """Up to ``count`` queued tags, oldest first, left queued until `taken`."""
        return self._tags[:count]

    def taken(self, count: int) -> None:
        del self._tags[:count]

    def restore(self, tags: Mapping[str, str], metrics: Iterable[str], params: Iterable[Any]) -> None:
        """A resumed run's names (`restore_names`); the params it holds are taken to be free until then."""
        self.table("param")[1].update(dict.fromkeys(params))
        restore_names(tags, metrics, params, self.table, lambda kind: self._hashed.setdefault(kind, {}))
        if self.folders is not None:  # the folders the held names make in a file store
            for kind, (_, owners) in self.tables.items():
                self.folders[kind] = {head for held in owners for head in _heads(held)}
