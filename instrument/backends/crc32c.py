"""TensorBoard's record checksums (masked CRC-32C), computed with NumPy instead of a Python loop over bytes.

Every record of an event file ends with a masked CRC-32C of its bytes. Without TensorFlow installed, TensorBoard
computes it with a Python loop over the bytes (``tensorboard.compat.tensorflow_stub.pywrap_tensorflow``): about
0.26 us per byte on a 2-core CPU machine (torch 2.13, tensorboard 2.21), holding the GIL throughout. A logging
step of the bench's NCA writes about 42 KB of heatmap PNGs, so TensorBoard's writer thread held the GIL for
about 11 ms per logging step, time the training thread waits for whenever it runs Python (on a GPU, where a
step is kernel launches, nearly always). `masked_crc32c` returns the same values from a few NumPy operations
(about 0.2 ms for those 42 KB), and `use_fast_checksums` has a ``SummaryWriter``'s records written with it.
The files are byte for byte what TensorBoard writes; TensorBoard's reader checks every checksum it reads.

How: CRC-32C is linear over GF(2). With ``Z`` the step of the CRC register over one zero byte and ``T`` the
byte table, a message ``b_0 .. b_{n-1}`` read from register ``r`` leaves ``Z^n(r) ^ XOR_i Z^(n-1-i)(T[b_i])``.
The message is split into blocks of `_BLOCK` bytes (zeros in front, which change nothing from register 0); each
block's part is one gather from a table of ``Z^j(T[b])`` and one XOR reduction. Up to `_GROUP` neighbouring
parts are then joined at once the same way, each carried over the parts after it (``Z^(k * span)``, as four byte
tables), so a message of up to 128 KiB takes two gathers. The initial register (all ones) is the same as
inverting the first 4 bytes from register 0. About 50 us for an 8 KB PNG, against 2 ms in TensorBoard's loop.
"""

import functools
import os
import struct
import threading
from typing import Any, List, Optional

import numpy as np

__all__ = ["masked_crc32c", "crc32c", "use_fast_checksums"]

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected
_MASK = 0xFFFFFFFF
_BLOCK = 512  # bytes per block: the block table is _BLOCK x 256 uint32 (512 KiB)
_SMALL = 64  # shorter messages (every record's 8-byte length header) take the byte loop: NumPy's setup costs more
_CHUNK = 2048  # blocks gathered at a time (1 MiB of data): bounds the index array for a large video
_GROUP = 256  # block parts joined at a time (the join tables are _GROUP x 1024 uint32, 1 MiB a level)


class _Tables:
    """Built once, on first use (about 10 ms)."""

    def __init__(self) -> None:
        table = np.arange(256, dtype=np.uint32)
        for _ in range(8):
            table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1).astype(np.uint32)
        self.byte = table
        self.byte_list: List[int] = [int(v) for v in table]
        # block[j, b] = Z^(_BLOCK-1-j)(T[b]): byte b at offset j of a block, carried to the block's end
        block = np.empty((_BLOCK, 256), dtype=np.uint32)
        block[-1] = table
        for j in range(_BLOCK - 2, -1, -1):
            block[j] = self.zero_byte(block[j + 1])
        self.block = block.ravel()
        self.block_offsets = (np.arange(_BLOCK, dtype=np.intp) * 256)[None, :]
        # A linear map of the register is the XOR of the images of its four bytes: four 256-entry tables, 1024
        # values. joins[level][k] is Z^(k * span) with span = _BLOCK * _GROUP**level, for k < _GROUP; a part at
        # row position j of g is carried over the g-1-j parts after it.
        self.identity = np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None]
        span = self.identity.copy()
        for _ in range(_BLOCK):
            span = self.zero_byte(span)
        self._spans = [span]  # Z^span of each level
        self._joins: List[np.ndarray] = []
        self.join_offsets = (np.arange(_GROUP - 1, -1, -1, dtype=np.intp)[:, None] * 1024
                             + np.arange(4, dtype=np.intp)[None, :] * 256)  # (_GROUP, 4)
        self._lock = threading.Lock()
        self.join(0)

    def zero_byte(self, values: np.ndarray) -> np.ndarray:
        return self.byte[values & 0xFF] ^ (values >> 8)

    def join(self, level: int) -> np.ndarray:
        with self._lock:  # TensorBoard's writer threads may both reach a new level
            while len(self._joins) <= level:
                span = self._spans[len(self._joins)]
                powers = [self.identity]
                for _ in range(_GROUP - 1):
                    powers.append(_apply(span, powers[-1]))
                self._joins.append(np.stack(powers).ravel())
                self._spans.append(_apply(span, powers[-1]))  # Z^(span * _GROUP): the next level's span
            return self._joins[level]


def _apply(linear: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The linear map ``linear`` (four byte tables) applied to each uint32 of ``values``."""
    return (linear[0][values & 0xFF] ^ linear[1][(values >> 8) & 0xFF] ^ linear[2][(values >> 16) & 0xFF]
            ^ linear[3][values >> 24])


_tables: Optional[_Tables] = None
_build_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """Locks a writer thread of the parent held at the fork would stop the child's own TensorBoard writes."""
    global _build_lock
    _build_lock = threading.Lock()
    if _tables is not None:
        _tables._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _get_tables() -> _Tables:
    global _tables
    if _tables is None:
        with _build_lock:
            if _tables is None:
                _tables = _Tables()
    return _tables


def crc32c(data: bytes) -> int:
    """The CRC-32C of ``data`` (bytes or any buffer of bytes), as TensorBoard's ``crc32c``."""
    tables = _get_tables()
    view = memoryview(data).cast("B")
    n = len(view)
    if n < _SMALL:
        crc, table = _MASK, tables.byte_list
        for b in view:
            crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
        return crc ^ _MASK
    pad = -n % _BLOCK
    message = np.zeros(n + pad, dtype=np.uint8)
    message[pad:] = np.frombuffer(view, dtype=np.uint8)
    message[pad:pad + 4] ^= 0xFF  # the all-ones initial register, read as the first 4 bytes inverted
    blocks = message.reshape(-1, _BLOCK)
    chunks = [np.bitwise_xor.reduce(tables.block[blocks[i:i + _CHUNK] + tables.block_offsets], axis=1)
              for i in range(0, len(blocks), _CHUNK)]
    parts = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    level = 0
    while len(parts) > 1:  # join up to _GROUP neighbouring parts at a time
        group = min(len(parts), _GROUP)
        front = -len(parts) % group
        if front:  # zero parts in front: from register 0 they change nothing
            parts = np.concatenate((np.zeros(front, dtype=np.uint32), parts))
        rows = parts.astype("<u4", copy=False).view(np.uint8).reshape(-1, group * 4)  # each part's four bytes
        index = rows + tables.join_offsets[-group:].reshape(1, -1)
        parts = np.bitwise_xor.reduce(tables.join(level)[index], axis=1)
        level += 1
    return int(parts[0]) ^ _MASK


def masked_crc32c(data: bytes) -> int:
    """The masked CRC-32C an event file stores after each record's length and data (TensorBoard's
    ``masked_crc32c``)."""
    x = crc32c(data)
    return ((((x >> 15) | (x << 17)) & _MASK) + 0xA282EAD8) & _MASK


@functools.cache
def _fast_record_writer(base: type) -> type:
    """The subclass of TensorBoard's ``RecordWriter`` (imported lazily, hence made here, once)."""

    class FastRecordWriter(base):  # type: ignore[misc, valid-type]
        """TensorBoard's ``RecordWriter``, the same record layout, checksummed by `masked_crc32c`."""

        def write(self, data: bytes) -> None:
            header = struct.pack("<Q", len(data))
            self._writer.write(header + struct.pack("<I", masked_crc32c(header)) + data
                               + struct.pack("<I", masked_crc32c(data)))

    return FastRecordWriter


def use_fast_checksums(summary_writer: Any) -> bool:
    """Have ``summary_writer`` (a ``torch.utils.tensorboard.SummaryWriter``) checksum its records with
    `masked_crc32c` from now on: its record writer becomes a subclass of TensorBoard's whose ``write`` differs
    only in that. Reaches through private attributes of torch and tensorboard; where they moved it changes
    nothing and returns False (the records are then checksummed by TensorBoard's own loop, only slower)."""
    try:
        record_writer = summary_writer._get_file_writer().event_writer._async_writer._writer
        from tensorboard.summary.writer.record_writer import RecordWriter
    except (AttributeError, ImportError):
        return False
    fast = _fast_record_writer(RecordWriter)
    if type(record_writer) is RecordWriter:
        record_writer.__class__ = fast
    return type(record_writer) is fast
