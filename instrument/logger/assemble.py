"""Building a `StepRecord` on the writer thread from a step the training thread handed over.

The training thread hands over ``(step, wall_time, scalars, tensor_keys, media, timings, batch, tensors,
wide)``: scalar means (device tensors for ``tensor_keys``) or blocks whose means are taken here, staged media
by ``(kind, tag)``, timer measurements, the started transfer of ``tensors``, and the flags of int64 values
beyond 2**53 (`instrument.logger.values.note_beyond`), read here with the rest of the transfer. Here the
transfer is waited for and every value converted by its `MediaKind`; a value whose conversion fails is reported
through ``on_failure`` and left out, alone.
"""

from typing import Any, Callable, Optional

import numpy as np
from torch import Tensor

from instrument.backends.base import StepRecord
from instrument.logger.blocks import means
from instrument.logger.media import KINDS
from instrument.logger.timer import timing_stats
from instrument.logger.transfer import TransferError

__all__ = ["build_record", "describe"]

OnFailure = Callable[[str, str, int, Any, str, Exception], None]
_SCALAR = "a one-element tensor of numbers the commit's transfer can copy"


def build_record(payload: tuple, on_failure: OnFailure,
                 on_rounded: Optional[Callable[[str, Any], None]] = None) -> StepRecord:
    """Wait for the transfer and convert every value; a value that fails is dropped alone. ``on_rounded(name,
    written value)`` is called for each metric logged from an integer tensor that held a value beyond 2**53."""
    step, wall_time, scalars, tensor_keys, media, timings, batch, tensors, wide = payload
    arrays = batch.arrays() if batch is not None else []
    by_id = {id(t): a for t, a in zip(tensors, arrays, strict=True)}

    def host(value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        copied = by_id.get(id(value), value)
        if isinstance(copied, TransferError):  # this tensor alone could not be copied: its value is dropped
            raise copied
        return copied

    record = StepRecord(step=step, wall_time=wall_time)
    if type(scalars) is list:  # blocks, each a whole log_metrics call (`instrument.logger.blocks`)
        kept = []
        for block in scalars:
            failed = by_id.get(id(block[2])) if len(block) == 3 else None
            if isinstance(failed, TransferError):  # a tensor the batched copy could not take: its keys alone go
                for key in block[1]:
                    on_failure("metric", block[0] + key, step, block[2], _SCALAR, failed)
            else:
                kept.append(block)
        scalars = means(kept, host)
    for i, key in enumerate(tensor_keys):
        if isinstance(arrays[i], TransferError):
            scalars.pop(key, None)  # the staged tensor it stood for
            on_failure("metric", key, step, tensors[i], _SCALAR, arrays[i])
        else:
            scalars[key] = float(arrays[i])
    record.scalars = scalars
    if on_rounded is not None:
        for names, flags in wide.items():
            if isinstance(by_id.get(id(flags)), TransferError):  # the value's own failure was said above
                continue
            for name, beyond in zip(names, np.asarray(host(flags)).reshape(-1).tolist(), strict=True):
                if beyond and name in scalars:
                    on_rounded(name, scalars[name])
    for (kind, tag), (value, extra) in media.items():
        spec = KINDS[kind]
        try:
            getattr(record, spec.field)[tag] = spec.convert(tag, value, extra, host)
        except Exception as exc:  # a value that cannot be converted costs that value only
            on_failure(kind, tag, step, value, spec.expected, exc)
    for name, stats in timings.items():
        if isinstance(stats, tuple):  # (reduce, taken measurements): read here, off the training thread
            try:
                stats = timing_stats(stats[1])
            except Exception as exc:
                on_failure("timer", name, step, stats[1], "completed timings", exc)
                continue
        if stats:
            record.timings[name] = stats
    return record


def describe(value: Any) -> str:
    """What a value is, for messages: its type, and shape and dtype when it has them."""
    if isinstance(value, Tensor):
        if value.is_nested:  # has no shape
            return f"a nested {value.device.type} tensor of {value.size(0)} tensors and dtype {value.dtype}"
        return f"a {value.device.type} tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    if isinstance(value, list):  # the staged rows of log_samples too (a list of their own type)
        return f"a list of {len(value)} items"
    return f"a {type(value).__name__}"
