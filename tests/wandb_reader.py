"""Reads an offline W&B run file (``run-<id>.wandb``) with W&B's own protobuf record schema.

wandb >= 0.19 no longer ships a Python reader for its transaction log; the container format is LevelDB's log
(32 KiB blocks, 7-byte record headers: checksum, length, type) after a 7-byte ``:W&B`` file header, and each
record is a ``wandb.proto.wandb_internal_pb2.Record``.
"""

import json
import struct
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    return (payload for _, payload in _framed(data))


def _framed(data: bytes):
    """(offset just past the record's last fragment, record bytes) for each whole record."""
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < 7:
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):
            return  # W&B's service is still writing this record: read_run/read_history wait and read again
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield pos, chunk
        elif kind in (_FIRST, _MIDDLE):
            pending += chunk
        elif kind == _LAST:
            yield pos, pending + chunk
            pending = b""
        elif kind == 0:  # zero padding at the end of a block
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0


def _records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    records = []
    for payload in _payloads(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def record_ends(path: Path) -> List[Tuple[int, Any]]:
    """Each record of a whole file with the offset its last byte ends before: cutting the file there keeps it."""
    from wandb.proto import wandb_internal_pb2

    ends = []
    for end, payload in _framed(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        ends.append((end, record))
    return ends


def history_step(record) -> Any:
    """A history record's ``_step`` (None for another record)."""
    if record.WhichOneof("record_type") != "history":
        return None
    return _row(record.history).get("_step")


def _row(history) -> Dict[str, Any]:
    row: Dict[str, Any] = {}
    for item in history.item:
        keys = [item.key] if item.key else list(item.nested_key)
        target = row
        for key in keys[:-1]:  # media values arrive flattened as nested keys: rebuild the dicts
            target = target.setdefault(key, {})
        target[keys[-1]] = json.loads(item.value_json)
    return row


def exit_codes(run_dir: Path) -> List[int]:
    """The exit codes of the exit records in the one offline ``.wandb`` file under ``run_dir`` (one: finished)."""
    (path,) = list(Path(run_dir).rglob("*.wandb"))
    return [r.exit.exit_code for r in _records(path) if r.WhichOneof("record_type") == "exit"]


def read_history(path: Path, timeout: float = 0.0) -> List[Dict[str, Any]]:
    """The history rows of one ``run-<id>.wandb`` file; with a ``timeout``, once it holds the run's exit record
    (or the timeout passed). Without one: what it holds now (a run killed before `finish` has no exit record)."""
    deadline = time.monotonic() + timeout
    records = _records(path)
    while timeout and time.monotonic() < deadline and not any(r.WhichOneof("record_type") == "exit" for r in records):
        time.sleep(0.2)
        records = _records(path)
    return [_row(r.history) for r in records if r.WhichOneof("record_type") == "history"]


def read_run(run_dir: Path, timeout: float = 60.0) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """History rows and config of the single offline run under ``run_dir``.

    W&B's service process writes the file asynchronously; under load it can still be writing when
    ``run.finish()`` returns, so this waits (up to ``timeout`` seconds) for the run's exit record.
    """
    deadline = time.monotonic() + timeout
    while True:
        files = list(Path(run_dir).rglob("*.wandb"))
        assert len(files) <= 1, files
        records = _records(files[0]) if files else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert files, f"no .wandb file under {run_dir}"
    rows: List[Dict[str, Any]] = []
    config: Dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append(_row(record.history))
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return rows, config
