"""TensorBoard's tags: one kind of value per tag, and one series per tag.

TensorBoard shows one kind of value per tag: a scalar and a histogram (or an image) under one tag left the
histogram unlisted and made the run's scalars unreadable. A text and a samples table (both written as text, the
tag ``<key>/text_summary``) under one tag show one value per step: TensorBoard's UI hides the other. `TagKinds`
keeps the kind a tag first takes for the process's run and moves a value of another kind to ``<key>/<kind>``
(``reward/histogram``, ``picture/scalar``, ``val/table``), with one warning per key, as W&B does. The backend's
own texts (`RESERVED`: the hyperparameter table, the operative config) hold their tags from the start, so a
user's text of that name moves too.

A resumed run keeps them: `TagKinds.save` writes what was decided to `TAGS_FILE` beside the event files whenever it
changes, and a resumed run's backend reads it back (`TagKinds.load`). Decided afresh, the first value of a tag after
the resume took it, whatever it held before: a histogram under a scalar's tag (its scalars unreadable), or a scalar
moved to ``picture/scalar`` before the crash back under ``picture``, beside the images (its series split in two).
"""

import json
import logging
from pathlib import Path
from typing import Any, Dict, Mapping, Set

from instrument.backends.drops import STATE_ERRORS, Drops, read_state, save_state, str_list, str_map

__all__ = ["RESERVED", "TAGS_FILE", "TEXT_TAG", "TagKinds"]

log = logging.getLogger("instrument")

TEXT_TAG = "/text_summary"  # what ``summary.text(key)`` appends: the tag of a text is ``<key>/text_summary``
# The texts the backend writes itself (`TensorBoardBackend.log_hyperparams`) -> what they hold.
RESERVED = {"hyperparameters": "its hyperparameter table", "config/operative": "the operative config"}
_NOUNS = {"table": "samples table"}
TAGS_FILE = "instrument-tags.json"  # `TagKinds.save`: in a TensorBoard run's folder, beside its event files


class TagKinds:
    """The tag each value of a run is written under (state for one backend's run; writer thread only)."""

    def __init__(self) -> None:
        self._scalar_tags: Set[str] = set()
        self._media_tags: Dict[str, str] = {}  # tag -> the kind of value it holds
        self._renamed: Dict[str, Dict[str, str]] = {}  # kind -> {key: the key a value of that kind is written under}
        self._moved_tags: Set[str] = set()  # tags made for values moved off a taken tag (``reward/histogram``)
        self._moved_scalars: Set[str] = set()  # tags made for scalars moved off a media value's tag (``reward/scalar``)
        for key in RESERVED:  # the backend's own: a user's text (or any value) of that tag moves
            self._media_tags[key + TEXT_TAG] = "text"
            self._moved_tags.add(key + TEXT_TAG)
        self.version = self._saved = 0  # the changes to what `state` returns; the version `save` last wrote

    def state(self) -> str:
        """What was decided, as ASCII JSON (`restore`)."""
        return json.dumps({"scalars": sorted(self._scalar_tags), "media": self._media_tags, "renamed": self._renamed,
                           "moved": sorted(self._moved_tags), "moved_scalars": sorted(self._moved_scalars)},
                          sort_keys=True)

    def restore(self, text: str) -> None:
        """Take back what `state` returned, added to what this run decided; a text that is not such a state
        changes nothing (one warning)."""
        try:
            state = str_map(json.loads(text), bool)
            scalars, moved, moved_scalars = (str_list(state[k]) for k in ("scalars", "moved", "moved_scalars"))
            media = str_map(state["media"])
            renamed = str_map(state["renamed"], str_map)
            for name in (*scalars, *moved, *moved_scalars, *media, *media.values(), *renamed,
                         *(name for keys in renamed.values() for name in (*keys, *keys.values()))):
                name.encode("utf-8")  # `state` writes tags escaped: a lone surrogate is a file it did not write
        except STATE_ERRORS as exc:
            log.warning("instrument: TensorBoardBackend could not read back which kind of value each tag held before "
                        "the resume (%s: %s); tags are given afresh.", type(exc).__name__, exc)
            return
        self._scalar_tags.update(scalars)
        self._media_tags.update(media)
        for kind, keys in renamed.items():
            self._renamed.setdefault(kind, {}).update(keys)
        self._moved_tags.update(moved)
        self._moved_scalars.update(moved_scalars)
        self.version += 1

    def save(self, folder: Any, drops: Drops) -> None:
        """Write `state` to `TAGS_FILE` in ``folder`` when it changed since the last save (`save_state`)."""
        self._saved = save_state(drops, Path(folder) / TAGS_FILE, self.state, self.version, self._saved,
                                 "a resumed run may give its tags afresh")

    def load(self, folder: Any) -> None:
        """Take back what `save` wrote in ``folder`` (a resumed run); none there: nothing to take."""
        text = read_state(Path(folder) / TAGS_FILE, "TensorBoardBackend", "tags are given afresh")
        if text is not None:
            self.restore(text)

    def scalars(self, scalars: Mapping[str, float]) -> Mapping[str, float]:
        """The scalars under their tags: ``<key>/scalar`` for a key a media value of the run holds (one warning)."""
        if ((self._media_tags and not self._media_tags.keys().isdisjoint(scalars))
                or (self._moved_scalars and not self._moved_scalars.isdisjoint(scalars))):
            # a scalar whose key a media value holds moves; so does one whose key a moved scalar took (the user's
            # own ``pic/scalar`` logged after ``pic`` moved there): one tag never mixes two series
            scalars = {self._moved("scalar", k, scalars) if k in self._media_tags or k in self._moved_scalars else k: v
                       for k, v in scalars.items()}
        if not self._scalar_tags.issuperset(scalars):
            self._scalar_tags.update(scalars)
            self.version += 1
        return scalars

    def media(self, kind: str, key: str, scalars: Mapping[str, float]) -> str:
        """The tag of an image, histogram or video: its key, unless a scalar (of the run, or of this step) or a
        value of another kind has it: then ``<key>/<kind>`` for the rest of the run (one warning)."""
        return self._kind(kind, key, key, scalars)

    def text(self, kind: str, key: str, scalars: Mapping[str, float]) -> str:
        """The key a text (``kind`` "text") or a samples table ("table") is written under: TensorBoard writes it
        under the tag ``<key>/text_summary`` and shows one text per step there, so a text and a table of one key
        (or a text of the backend's own tags, `RESERVED`) would hide each other: the later kind moves to
        ``<key>/<kind>`` (``val/table``) for the rest of the run (one warning)."""
        return self._kind(kind, key, key + TEXT_TAG, scalars, TEXT_TAG)

    def _kind(self, kind: str, key: str, tag: str, scalars: Mapping[str, float], suffix: str = "") -> str:
        if self._media_tags.get(tag) == kind and tag not in self._moved_tags:  # a moved value's tag is not the user's
            return key
        if key in self._renamed.get(kind, {}):
            return self._renamed[kind][key]
        if tag not in self._media_tags and tag not in self._scalar_tags and tag not in scalars:
            self._media_tags[tag] = kind
            self.version += 1
            return key
        return self._moved(kind, key, suffix=suffix)

    def _moved(self, kind: str, key: str, row: Any = (), suffix: str = "") -> str:
        moved = self._renamed.setdefault(kind, {})
        if key not in moved:
            name, number = f"{key}/{kind}", 1
            while self._taken(name + suffix, row):
                number += 1
                name = f"{key}/{kind}_{number}"
            moved[key] = name
            self.version += 1
            tag = name + suffix
            if kind == "scalar":
                self._moved_scalars.add(tag)
            else:
                self._media_tags[tag] = kind
                self._moved_tags.add(tag)
            held = key + suffix
            if suffix and key in RESERVED:
                why = (f"TensorBoardBackend writes {RESERVED[key]} under the tag {held!r}, and TensorBoard shows one "
                       f"text per step under a tag (one would hide the other)")
            elif suffix:
                why = (f"the tag {held!r} already holds another value (a text, a samples table or a value of another "
                       f"kind), and TensorBoard shows one kind per tag and one text per step (one would hide the "
                       f"other)")
            else:
                why = (f"the tag {held!r} already holds another kind of value, and TensorBoard shows one kind per tag "
                       f"(the run's scalars could no longer be read)")
            log.warning("instrument: TensorBoardBackend writes the %s %r under the tag %r: %s. (Said once per key.)",
                        _NOUNS.get(kind, kind), key, tag, why)
        return moved[key]

    def _taken(self, tag: str, row: Any) -> bool:
        return tag in self._scalar_tags or tag in self._media_tags or tag in row or tag in self._moved_scalars
