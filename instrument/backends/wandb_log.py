"""The last step an offline W&B run's transaction log holds, so that a resumed offline run does not log it again.

Online, W&B tells a resumed run its last step; offline it cannot, and each resume writes a new
``offline-run-<time>-<id>`` folder. The step the earlier folders reached is read back from their
``run-<id>.wandb`` files: LevelDB's log format after a 7-byte ``:W&B`` header (32 KiB blocks; each record
fragment has a 7-byte header: checksum, little-endian length, type 1 full / 2 first / 3 middle / 4 last; a
block's tail shorter than a header is padding), each whole record a ``wandb_internal_pb2.Record``. wandb >=
0.19 ships no Python reader for it.

A process killed mid-write leaves a torn last record: reading stops at the first fragment that runs past the
end of the file or breaks the fragment sequence, and a record whose protobuf does not parse is skipped. The
checksums are not verified (the standard library has no CRC32C); those two checks catch a torn tail.
"""

import json
import logging
import re
import struct
from pathlib import Path
from typing import Any, Iterable, List, Optional, Set, Tuple

__all__ = ["history_keys", "last_step", "offline_config", "offline_keys", "offline_last_step", "run_files"]

log = logging.getLogger("instrument")

_MAGIC = b":W&B"
_FILE_HEADER = 7
_BLOCK = 32768
_FRAGMENT_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def run_files(wandb_dir: Path, run_id: str) -> List[Path]:
    """The transaction logs of run ``run_id`` under ``wandb_dir`` (W&B's ``<dir>/wandb``):
    ``offline-run-<time>-<id>[-<n>]/run-<id>.wandb`` (W&B appends ``-1``, ``-2``... to a folder started in
    the same second as another), in the order they were started."""
    folder = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = []
    for path in Path(wandb_dir).glob(f"offline-run-*/run-{run_id}.wandb"):
        match = folder.fullmatch(path.parent.name)
        if match:
            found.append(((match.group(1), int(match.group(2) or 0)), path))
    return [path for _, path in sorted(found)]


def last_step(path: Path) -> Optional[int]:
    """The ``_step`` of the last whole history record in the file at ``path`` (W&B writes steps in increasing
    order); None when it holds none.

    Raises ValueError when the file is not a W&B transaction log, OSError when it cannot be read."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if len(data) < _FILE_HEADER and _MAGIC.startswith(data[: len(_MAGIC)]):
        return None  # killed while writing its header: it holds nothing
    if data[: len(_MAGIC)] != _MAGIC:
        raise ValueError(f"{path} is not a W&B transaction log: it starts with {data[:4]!r}, not {_MAGIC!r}")
    for payload in reversed(list(_payloads(data))):  # W&B writes steps in increasing order: the last one wins
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(payload)
        except Exception:  # a torn or corrupt record: skip it (protobuf's DecodeError)
            continue
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            if item.key == "_step" or list(item.nested_key) == ["_step"]:
                return int(json.loads(item.value_json))
    return None


def history_keys(path: Path) -> Tuple[Set[str], Set[str]]:
    """``(scalar keys, media keys)`` of every whole history record in the file at ``path``: the keys that
    held a number, and those that held a media value (a dict with a ``_type``). W&B's own ``_`` keys are left
    out. Raises as `last_step`."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    scalars: Set[str] = set()
    media: Set[str] = set()
    if data[: len(_MAGIC)] != _MAGIC:
        if len(data) < _FILE_HEADER and _MAGIC.startswith(data[: len(_MAGIC)]):
            return scalars, media
        raise ValueError(f"{path} is not a W&B transaction log: it starts with {data[:4]!r}, not {_MAGIC!r}")
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(payload)
        except Exception:  # a torn or corrupt record: skip it
            continue
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            path = [item.key] if item.key else list(item.nested_key)
            if not path or path[0].startswith("_"):
                continue
            if len(path) > 1:  # W&B spreads a media value's dict over its fields: [key, "_type"], [key, "values"]
                if path[-1] == "_type":
                    media.add(path[0])
                continue
            try:
                value = json.loads(item.value_json)
            except ValueError:
                continue
            (media if isinstance(value, dict) and "_type" in value else scalars).add(path[0])
    return scalars, media


def offline_last_step(run: Any) -> Optional[int]:
    """The last step the earlier offline folders of this run hold (None: none, or they could not be read;
    then every step is written, with one warning)."""
    try:
        this = Path(run.settings.sync_dir).resolve()
        files = [f for f in run_files(this.parent, run.id) if f.parent.resolve() != this]
        steps = [step for step in map(last_step, files) if step is not None]
    except Exception as exc:  # a missing or foreign file, a W&B that names its folders differently
        log.warning(
            "instrument: WandbBackend could not read the last step of the earlier offline folders of run %s "
            "(%s: %s); every step is written, so steps logged before the interruption may appear twice after "
            "`wandb sync`.", run.id, type(exc).__name__, exc,
        )
        return None
    return max(steps) if steps else None


def offline_keys(run: Any) -> Tuple[set, set]:
    """The scalar and media keys the earlier offline folders of this run hold, so that the resumed run keeps
    each key to one kind as the run before did (a histogram renamed ``reward/histogram`` beside a scalar
    ``reward`` stays renamed); empty sets when they cannot be read (`offline_last_step` said so)."""
    scalars: set = set()
    media: set = set()
    try:
        this = Path(run.settings.sync_dir).resolve()
        for path in run_files(this.parent, run.id):
            if path.parent.resolve() != this:
                found = history_keys(path)
                scalars |= found[0]
                media |= found[1]
    except Exception:
        log.debug("instrument: WandbBackend could not read the keys of the earlier offline folders", exc_info=True)
    return scalars, media


def offline_config(run: Any, key: str) -> Optional[str]:
    """The last string the earlier offline folders of this run hold under the config key ``key`` (None: none, or
    they could not be read)."""
    from wandb.proto import wandb_internal_pb2

    found = None
    try:
        this = Path(run.settings.sync_dir).resolve()
        for path in run_files(this.parent, run.id):
            data = path.read_bytes() if path.parent.resolve() != this else b""
            for payload in _payloads(data) if data[: len(_MAGIC)] == _MAGIC else ():
                record = wandb_internal_pb2.Record()
                try:
                    record.ParseFromString(payload)
                except Exception:  # a torn or corrupt record: skip it
                    continue
                if record.WhichOneof("record_type") == "config":
                    for item in record.config.update:
                        if item.key == key and not item.nested_key:
                            value = json.loads(item.value_json)
                            found = value if isinstance(value, str) else found
    except Exception:
        log.debug("instrument: WandbBackend could not read the config of the earlier offline folders", exc_info=True)
    return found


def _payloads(data: bytes) -> Iterable[bytes]:
    """The whole records of a LevelDB log, up to the first truncated or out-of-sequence fragment."""
    pos, pending = _FILE_HEADER, None
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _FRAGMENT_HEADER:  # the block's padding
            pos += left
        if pos + _FRAGMENT_HEADER > len(data):
            return
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        start = pos + _FRAGMENT_HEADER
        pos = start + length
        if kind == 0 and length == 0:  # zeros: padding at the end of a block, or a region never written
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if pos > len(data) or start % _BLOCK + length > _BLOCK:  # torn, or a length no writer wrote
            return
        chunk = data[start:pos]
        if kind == _FULL and pending is None:
            yield chunk
        elif kind == _FIRST and pending is None:
            pending = [chunk]
        elif kind == _MIDDLE and pending is not None:
            pending.append(chunk)
        elif kind == _LAST and pending is not None:
            yield b"".join(pending + [chunk])
            pending = None
        else:  # an unknown type, or a fragment out of sequence: a bad record; what follows is not trusted
            return
