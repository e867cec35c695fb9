"""Moving staged device values to the host in one batched copy per device.

Per-metric ``.item()`` calls each force a device sync; instead everything staged for a step is flattened into
one buffer per device, copied once, and split again on the host.
"""

import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["HostBatch", "TransferError", "start_transfer", "to_host"]


def _wire_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; everywhere else float64 keeps integer counters and small differences exact.
    return torch.float32 if device.type == "mps" else torch.float64


# Integer dtypes travel as int64, every value exact (a float64 would round a sample's seed beyond 2**53); uint64
# travels as its bits (viewed as int64, read back as uint64). Scalar metrics never get here as integers: they
# are converted to float64 when logged (`instrument.logger.values`).
_INT64_WIRE = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32})


# float32, float16 and bfloat16 travel as float32, which holds each of their values exactly, and become float64 on
# the host (`HostBatch.arrays`, on the writer thread): on the device a float64 copy doubled what a histogram or an
# image of a large state costs to stage and to copy (measured on CPU: a 52M-parameter model's gradient and weight
# histograms took 1.6 s and 9x the model's memory on the training thread, most of it that conversion).
_FLOAT32_WIRE = frozenset({torch.float32, torch.float16, torch.bfloat16})


def _wire_of(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What a dtype travels as: uint8 as uint8 (pixels), integers as int64, uint64 as uint64 (its bits as
    int64), float32 and half precision as float32, the rest (float64, bools) as float64 (float32 on MPS)."""
    if dtype == torch.uint8 or dtype == torch.uint64:
        return dtype
    if dtype in _FLOAT32_WIRE:
        return torch.float32
    return torch.int64 if dtype in _INT64_WIRE else _wire_dtype(device)


class TransferError(RuntimeError):
    """A staged tensor the commit's transfer could not copy; `HostBatch.arrays` gives it in that tensor's place,
    and the writer drops that value alone with one message naming it (`instrument.logger.assemble`)."""


def to_host(tensors: Sequence[Tensor]) -> List[np.ndarray]:
    """Return float64 numpy copies of ``tensors`` (same shapes), with one transfer per device."""
    out: List[np.ndarray] = [np.empty(0)] * len(tensors)
    by_device: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for device, indices in by_device.items():
        with torch.no_grad():
            flat = torch.cat([tensors[i].detach().reshape(-1).to(_wire_dtype(device)) for i in indices])
            # host sync: the one batched device->host copy of a commit (per device).
            host = flat.to("cpu").numpy().astype(np.float64, copy=False)
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            out[i] = host[offset : offset + n].reshape(tuple(tensors[i].shape))
            offset += n
    return out


class HostBatch:
    """The host side of one commit's transfer, started on the training thread and read on the writer.

    On the CPU the copy is done when this is built. On CUDA each device's values are packed on the device and
    copied with ``non_blocking=True`` into pinned host memory, and one CUDA event is recorded after the copies:
    the training thread goes on at once and `arrays` (called on the writer thread) waits on that event.
    """

    __slots__ = ("_shapes", "_parts", "_events", "_failed")

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self._failed: Dict[int, TransferError] = {}  # index -> why that tensor could not be copied
        try:
            self._shapes = [t.shape for t in tensors]
            self._parts: List[tuple] = []  # (host buffer, indices)
            self._events: List[torch.cuda.Event] = []  # one per CUDA device, recorded after its copy
            self._start(tensors, range(len(tensors)))
        except Exception:
            # A tensor the checks on the caller let through and the copy cannot handle (an exotic tensor
            # subclass, a dtype a device lacks) must not cost the step: each tensor is copied on its own, and
            # one that fails is given as a `TransferError` in its place, dropped alone on the writer. The
            # scalars the logger stages are plain float64 tensors, which always copy.
            self._shapes, self._parts, self._events = [torch.Size()] * len(tensors), [], []
            for i, t in enumerate(tensors):
                try:
                    self._shapes[i] = t.shape
                    self._start(tensors, [i])
                except Exception as exc:
                    self._failed[i] = TransferError(
                        f"the commit's copy to the host failed for this tensor ({type(exc).__name__}: {exc})"
                    )

    def _start(self, tensors: Sequence[Tensor], which: Sequence[int]) -> None:
        """Pack ``tensors[i]`` for every ``i`` in ``which`` (one buffer per device and wire dtype), start their
        copies and record one event per CUDA device after them."""
        # One pass: (device, dtype) -> ([0-d indices], [other indices]); the wire dtype is decided per group.
        by_dtype: Dict[tuple, Tuple[List[int], List[int]]] = {}
        for i in which:
            t = tensors[i]  # (a loop over indices: the fallback above copies one tensor at a time)
            key = (t.device, t.dtype)
            lists = by_dtype.get(key)
            if lists is None:
                lists = by_dtype[key] = ([], [])
            lists[t.dim() != 0].append(i)
        by_device: Dict[tuple, list] = {}
        for (device, dtype), lists in by_dtype.items():
            # uint8 pixels (images, video frames) travel as uint8, 8x less to copy than float64; integers as int64.
            by_device.setdefault((device, _wire_of(dtype, device)), []).append(lists)
        copied: Dict[torch.device, None] = {}  # CUDA devices with a copy under way
        with torch.no_grad():
            for (device, wire), group in by_device.items():
                flat, indices = _pack(tensors, group, wire)
                if device.type == "cuda":
                    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                    host.copy_(flat, non_blocking=True)  # no host sync: the writer waits on the event
                    copied[device] = None
                elif device.type == "cpu":
                    host = flat  # _pack made a copy the caller cannot change
                else:
                    # host sync: a device without pinned non-blocking copies (e.g. MPS) copies here.
                    host = flat.to("cpu")
                # uint64 travelled as its bits in an int64 buffer: read back through a uint64 view of it
                self._parts.append((host.view(torch.uint64) if wire == torch.uint64 else host, indices))
        for device in copied:  # one event per device, after all of its copies (one stream: they run in order)
            with torch.cuda.device(device):
                event = torch.cuda.Event(blocking=True)  # the writer's wait yields the CPU instead of spinning
                event.record()
                self._events.append(event)

    def arrays(self) -> List[Any]:
        """Numpy copies of the tensors, same shapes and order (uint8 stays uint8, other integers int64, uint64
        uint64, the rest float64); waits for the copy on CUDA. A tensor that could not be copied is given as a
        `TransferError` in its place."""
        for event in self._events:
            event.synchronize()  # host sync: on the writer thread, never on the training thread
        out: List[Any] = [np.empty(0)] * len(self._shapes)
        for buffer, indices in self._parts:
            host = buffer.numpy()
            if host.dtype == np.float32:  # float32 and half precision values (and MPS's wire): exact in float64
                host = host.astype(np.float64)
            offset = 0
            for i in indices:
                shape = self._shapes[i]
                n = math.prod(shape)
                out[i] = host[offset : offset + n].reshape(shape)
                offset += n
        for i, error in self._failed.items():
            out[i] = error
        return out


def _pack(tensors: Sequence[Tensor], groups: list, wire: torch.dtype) -> Tuple[Tensor, List[int]]:
    """One new flat ``wire`` buffer holding the tensors of ``groups`` (one ``([0-d], [others])`` pair of index
    lists per dtype), and the order they lie in it.

    Each dtype is packed in its own dtype first, then converted once: a handful of ops per commit whatever
    the number of tensors (0-d tensors stacked in one op: 100 staged losses cost one op, not three each,
    about 1.5 ms -> 0.1 ms on a CPU; a dozen float32 statistics tensors one ``cat`` and one conversion, not a
    conversion each: on a launch-bound GPU step every op is a kernel launch). Called under ``no_grad``, so
    nothing here joins an autograd graph.
    """
    order: List[int] = []
    pieces: List[Tensor] = []
    for scalars, others in groups:
        if wire == torch.uint64:  # as its bits (views: exact, and int64 stacks and copies on every device)
            group = [tensors[i].view(torch.int64) for i in scalars], [tensors[i].view(torch.int64) for i in others]
        else:
            group = [tensors[i] for i in scalars], [tensors[i] for i in others]
        same: List[Tensor] = [torch.stack(group[0])] if scalars else []
        same += [t.reshape(-1) for t in group[1]]
        # torch.stack and torch.cat copy, and .to(wire) copies when the dtype changes: either way the buffer is
        # new, so the caller may change its tensors once commit returns.
        packed = same[0] if len(same) == 1 and scalars else torch.cat(same)
        pieces.append(packed if wire == torch.uint64 else packed.to(wire))
        order += scalars + others
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)), order


def start_transfer(tensors: Sequence[Tensor]) -> HostBatch:
    """Start the one batched device->host copy of a commit; read it later with `HostBatch.arrays`."""
    return HostBatch(tensors)
