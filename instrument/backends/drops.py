"""Per-value fault isolation: a value one backend cannot write costs that value only.

A histogram with no finite value, a text with a lone surrogate, a value some SDK refuses: each is a property
of one value, not of the backend, so it must never cost the rest of the step or any later step. A backend
converts each value on its own (`Drops.each`); a value whose conversion raises is dropped with one warning
naming the backend, the key, what was received and what was expected, and the rest is written. The warning
is given once per backend and key (a diverged run logs the same NaN histogram every step); later drops of
that key are logged at DEBUG. Drops are not backend failures (`Logger.failures`): the backend works.

The helpers below also repair what can be repaired instead of dropping it: `finite` keeps the finite values
of a histogram, `utf8` writes a text with the characters UTF-8 cannot encode escaped.
"""

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np

from instrument.core.names import numbered

__all__ = ["Drops", "DroppedValue", "KEYS_FILE", "STATE_ERRORS", "finite", "load_keys", "read_state", "save_keys",
           "save_state", "str_list", "str_map", "utf8", "utf8_keys", "describe"]

log = logging.getLogger("instrument")


class DroppedValue(ValueError):
    """Raised by a converter to drop one value with a message that says what was received and expected."""

    def __init__(self, received: str, expected: str) -> None:
        super().__init__(f"received {received}; expected {expected}")
        self.received, self.expected = received, expected


class Drops:
    """What one backend dropped or repaired, reported once per key."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._said: Set[Tuple[str, str]] = set()
        # `utf8_keys`, per kind: every name written so far, the keys written under another name (escaped or
        # numbered) and those names
        self.names: Dict[str, Set[str]] = {}
        self.renamed: Dict[str, Dict[str, str]] = {}
        self.made: Dict[str, Set[str]] = {}
        # the names written that hold a backslash: only those can be the name an escaped key would take
        self.marked: Dict[str, Set[str]] = {}
        self.version = 0  # counts the changes to what `key_state` returns

    def key_state(self) -> str:
        """What `utf8_keys` chose, as ASCII JSON, for a resumed run in a new process (`restore_keys`): per kind,
        the keys written under another name and the names written that hold a backslash. Without it a resumed
        run numbered its keys afresh: the key seen first after the resume took the plain escaped name, which
        held the other key's series (two keys swapped names, or one's series went on under two)."""
        return json.dumps({kind: {"renamed": self.renamed.get(kind, {}), "names": sorted(names)}
                           for kind, names in self.marked.items()}, sort_keys=True)

    def restore_keys(self, text: str) -> None:
        """Take back what `key_state` returned; a text that is not such a state is ignored (one warning)."""
        try:
            state = json.loads(text)
            read = []  # every kind checked before any is taken: a damaged text changes nothing
            for kind, held in str_map(state, lambda held: str_map(held, bool)).items():
                read.append((kind, str_map(held["renamed"]), str_list(held["names"])))
            for kind, renamed, names in read:
                self.renamed.setdefault(kind, {}).update(renamed)
                self.made.setdefault(kind, set()).update(renamed.values())
                self.names.setdefault(kind, set()).update(names, renamed.values())
                self.marked.setdefault(kind, set()).update(names, renamed.values())
        except STATE_ERRORS as exc:
            log.warning("instrument: %s could not read back the names it gave escaped keys before the resume (%s: "
                        "%s); such keys are named afresh.", self.backend, type(exc).__name__, exc)

    def mark(self, kind: str, names: Iterable[str]) -> None:
        marked = self.marked.setdefault(kind, set())
        new = {name for name in names if "\\" in name and name not in marked}
        if new:
            marked.update(new)
            self.version += 1

    def each(self, kind: str, items: Iterable[Tuple[str, Any]], convert: Callable[[str, Any], Any],
             expected: str) -> Dict[str, Any]:
        """``{key: convert(key, value)}`` for every item whose conversion did not raise; the others dropped."""
        out: Dict[str, Any] = {}
        for key, value in items:
            try:
                out[key] = convert(key, value)
            except DroppedValue as exc:
                self.drop(kind, key, exc.received, exc.expected)
            except Exception as exc:  # an SDK refusing the value: say what it said
                self.drop(kind, key, f"{describe(value)} ({type(exc).__name__}: {exc})", expected)
        return out

    def drop(self, kind: str, key: str, received: str, expected: str) -> None:
        self.say(key, "drop", logging.WARNING,
                 "instrument: %s dropped the %s %r: received %s; expected %s. The rest of the step is written; "
                 "later drops of this key are logged at DEBUG only.", self.backend, kind, key, received, expected)

    def say(self, key: str, what: str, level: int, message: str, *args: Any) -> None:
        """Log ``message`` at ``level`` the first time (key, what) is seen, at DEBUG after that."""
        first = (key, what) not in self._said
        self._said.add((key, what))
        log.log(level if first else logging.DEBUG, message, *args)


def finite(drops: Drops, kind: str, key: str, values: Any) -> Optional[np.ndarray]:
    """The finite values of a histogram as float64 (one warning per key when some were left out); raises
    `DroppedValue` when none is finite, since no backend can bin NaN or inf."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    keep = np.isfinite(values)
    if keep.all():
        return values
    nan = int(np.isnan(values).sum())
    inf = values.size - int(keep.sum()) - nan
    if not keep.any():
        raise DroppedValue(f"{values.size} values, none finite ({nan} NaN, {inf} inf)",
                           "at least one finite value to bin")
    drops.say(key, "nonfinite", logging.WARNING,
              "instrument: %s wrote the %s %r without its %d NaN and %d inf values (of %d): they cannot be binned, "
              "so it shows the finite values only (its count, min, max and sum too); later such steps are logged "
              "at DEBUG only.", drops.backend, kind, key, nan, inf, values.size)
    return values[keep]


def utf8(drops: Drops, kind: str, key: str, text: str) -> str:
    """``text`` as it is when UTF-8 can encode it; otherwise with each character it cannot encode (a lone
    surrogate, as ``os.fsdecode`` leaves for a non-UTF-8 file name) written as a ``\\udcXX`` escape, with one
    warning per key. Every backend stores text as UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    drops.say(key, "utf8", logging.WARNING,
              "instrument: %s wrote the %s %r with the characters UTF-8 cannot encode (lone surrogates, e.g. from "
              "os.fsdecode of a non-UTF-8 name) as backslash escapes.", drops.backend, kind, key)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def utf8_keys(drops: Drops, kind: str, values: Dict[str, Any]) -> Dict[str, Any]:
    """``values`` itself when UTF-8 can encode every key (one C-level check); otherwise a copy with each key
    UTF-8 cannot encode (a metric named after an ``os.fsdecode``-d file) written as `utf8` writes a text, with
    one warning per key, so that the SDK (protobuf) takes the step's other keys instead of refusing them all.

    An escaped name never takes a name another key of ``kind`` has in this step or had earlier in the run (a key
    that already is the escaped text, backslash and all): it is numbered (``<escaped>__2``, ...), and a key seen
    later under a name an escaped key already took is numbered in turn, so no two keys share a series. Said once
    per key; the same name at every step."""
    names = drops.names.setdefault(kind, set())
    renamed, made = drops.renamed.setdefault(kind, {}), drops.made.setdefault(kind, set())
    try:
        joined = "".join(values)
        joined.encode("utf-8")
        if not renamed or (renamed.keys().isdisjoint(values) and made.isdisjoint(values)):
            names.update(values)
            if "\\" in joined:  # a name an escaped key could take: kept for a resume (`Drops.key_state`)
                drops.mark(kind, values)
            return values
    except TypeError:  # a key that is not a str: left to the backend, as before
        return values
    except UnicodeEncodeError:
        pass
    out: Dict[str, Any] = {}
    for key, value in values.items():
        name = renamed.get(key)
        if name is None:
            name = _escaped(key)
            if name != key or key in made:
                name = _numbered(drops, kind, key, name, names, values, out)
                renamed[key] = name
                made.add(name)
        out[name] = value
    names.update(out)
    drops.mark(kind, out)
    return out


def _escaped(key: str) -> str:
    try:
        key.encode("utf-8")
        return key
    except UnicodeEncodeError:
        return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _numbered(drops: Drops, kind: str, key: str, name: str, names: Set[str], values: Dict[str, Any],
              out: Dict[str, Any]) -> str:
    """``name`` for ``key``, numbered (``__2``, ...) while another key of the step or the run has it; said once."""
    def taken(candidate: str) -> bool:
        return candidate in names or (candidate in values and candidate != key) or candidate in out

    base = name
    if taken(name):
        name = numbered(name, taken)
    if base != key:
        drops.say(key, "utf8 key", logging.WARNING,
                  "instrument: %s wrote the %s %r as %r: its key has characters UTF-8 cannot encode (lone "
                  "surrogates, e.g. from os.fsdecode of a non-UTF-8 name), which it cannot store%s; decode such "
                  "names with errors='replace' (or name the metric yourself) to choose the key.",
                  drops.backend, kind, key, name,
                  f", and {base!r} is already the name of another key of this step or the run" if name != base else "")
    else:
        drops.say(key, "utf8 key", logging.WARNING,
                  "instrument: %s wrote the %s %r as %r: a key with characters UTF-8 cannot encode (lone "
                  "surrogates) is already written under %r, escaped; so the two are kept apart.",
                  drops.backend, kind, key, name, key)
    return name


KEYS_FILE = "instrument-keys.json"  # `save_keys`: in a TensorBoard run's folder, beside its event files


# What a state file that is not what `save_state` wrote raises when read back (nested too deep: RecursionError).
STATE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, RecursionError)


def str_list(value: Any) -> List[str]:
    """``value``, a JSON list of str; TypeError otherwise (a str or a dict is not taken for its characters or keys)."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise TypeError(f"expected a list of str, got {describe(value)}: {str(value)[:80]}")
    return value


def str_map(value: Any, check: Optional[Callable[[Any], Any]] = None) -> Dict[str, Any]:
    """``value``, a JSON object of str keys whose values are str (or pass ``check``, which raises on a value it
    refuses; ``bool`` takes any); TypeError otherwise."""
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value) or (
            check is None and not all(isinstance(item, str) for item in value.values())):
        raise TypeError(f"expected an object of str, got {describe(value)}: {str(value)[:80]}")
    for item in value.values() if check is not None else ():
        check(item)
    return value


def save_keys(drops: Drops, folder: Any, saved: int) -> int:
    """Write ``drops.key_state()`` to `KEYS_FILE` in ``folder`` when it changed since version ``saved``; returns
    the version now saved (`save_state`)."""
    return save_state(drops, Path(folder) / KEYS_FILE, drops.key_state, drops.version, saved,
                      "a resumed run may name its escaped keys afresh")


def load_keys(drops: Drops, folder: Any) -> None:
    """Take back the names `save_keys` wrote in ``folder`` (a resumed run); none there: nothing to take."""
    text = read_state(Path(folder) / KEYS_FILE, drops.backend, "escaped keys are named afresh")
    if text is not None:
        drops.restore_keys(text)


def save_state(drops: Drops, path: Path, state: Callable[[], str], version: int, saved: int, lost: str) -> int:
    """Write ``state()`` (ASCII) to ``path`` when ``version`` moved on from ``saved``, whole: a temporary file
    replaces it, so a crash leaves the old state or the new one. Returns the version now saved. A write that
    fails is said once (``lost``: what a resumed run then misses) and tried again with the next record."""
    if version == saved:
        return saved
    part = path.with_name(path.name + ".part")
    try:
        part.write_text(state(), encoding="ascii")
        os.replace(part, path)
    except OSError as exc:
        drops.say(str(path), "state file", logging.WARNING, "instrument: %s could not write %s (%s); %s.",
                  drops.backend, path, exc, lost)
        try:
            part.unlink()
        except OSError:
            pass
        return saved
    return version


def read_state(path: Path, backend: str, lost: str) -> Optional[str]:
    """What `save_state` wrote at ``path``; None when there is none, or when it cannot be read (one warning that
    names the file and why; ``lost``: what the resumed run does instead)."""
    try:
        return path.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("instrument: %s could not read %s (%s: %s); %s.", backend, path, type(exc).__name__, exc, lost)
        return None


def describe(value: Any) -> str:
    """A short description of a value for a message: its type, and shape and dtype for arrays."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(value).__name__} of shape {tuple(shape)} and dtype {dtype}"
    if isinstance(value, str):
        return f"a str of {len(value)} characters"
    return type(value).__name__
