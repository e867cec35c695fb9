"""Blocks: a whole ``log_metrics`` call staged at once, its names and means made on the writer thread.

The common calls need no per-key work on the training thread. A dict of plain Python numbers (floats, bools,
ints that float64 holds exactly) is staged as ``(prefix head, a copy of the dict)``; a dict of one-element
tensors of one dtype on one device (what an observer or a GPU training loop logs) as ``(head, keys, one
stacked copy)``, a single tensor op that also joins the commit's batched transfer as one piece; CPU float and
bool tensors are read at once into a float block instead (no sync there, and cheaper than the stack). Either costs
one pass over the values instead of a conversion per key: on a CPU, 100 floats logged and committed right
after other work (cold caches) take about 85 us instead of 125 us, 100 0-d tensors about 500 us instead of
700 us. The writer thread turns the blocks of an interval into prefixed names and means: values summed in
the order logged (in float64), then divided by their count; a name logged once is its value, exactly. A sum
of finite floats that leaves float64's range goes on exactly (`instrument.core.exact.ExactSum`), so the
mean of finite values is finite. Not `math.fsum`: the per-key table (and a device tensor's sum) adds values
as they are logged, and an interval folded into it must keep the mean its blocks give.

A logger holds blocks only while nothing else is staged in its scalar table; a call that needs the per-key
path (ints beyond 2**53, NumPy numbers, tensors mixed with numbers or of mixed dtypes, reduce ops, weights,
or a value the per-key path must refuse with a clear message) first folds the blocks into the table
(`fold`), so conflicts between calls are still found on the caller.
"""

from collections import Counter
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from instrument.logger.plain import NUMERIC_DTYPES
from instrument.logger.values import EXACT_INT, Wide, add, note_beyond, wide_int

__all__ = ["Block", "MAX_BLOCKS", "float_block", "tensor_block", "fold", "means", "contributions"]

# (head, {key: float}) or (head, (key, ...), 1-D tensor holding one value per key)
Block = Union[Tuple[str, Dict[str, float]], Tuple[str, Tuple[str, ...], Tensor]]

# An interval that logs more blocks than this (a loop logging every step and committing rarely) is folded
# into the per-key table, so staging stays bounded in memory however long the interval.
MAX_BLOCKS = 64


# One-element CPU tensors of these dtypes are read on the caller (`tensor_block`): every value is exact in a float.
_READ_HERE = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool})


def float_block(head: str, copy: Dict[Any, Any]) -> Optional[Block]:
    """``(head, copy)`` when every key is a ``str`` and every value a Python ``float``, ``bool`` or an ``int``
    that float64 holds exactly (``|v| <= 2**53``); those are turned into floats in ``copy``, as the per-key
    path does. None otherwise (``copy`` may then hold some converted values: the same numbers)."""
    for key, value in copy.items():  # cold, a plain loop beats two set(map(type, ...)) scans
        kind = type(value)
        if kind is not float:
            if kind is int and -EXACT_INT <= value <= EXACT_INT:
                copy[key] = float(value)  # a counter such as {"iterations": 32}; replacing a value is safe here
            elif kind is bool:
                copy[key] = 1.0 if value else 0.0
            else:
                return None
        if type(key) is not str:
            return None
    return (head, copy)


def tensor_block(head: str, copy: Dict[Any, Any], wide: Optional[Wide] = None) -> Optional[Block]:
    """``(head, keys, stacked)`` when every key is a ``str`` and every value a one-element tensor, all of one
    dtype (so that nothing is promoted, e.g. a large int64 to float32) on one device; None otherwise. int64 and
    uint64 values are flagged in ``wide`` (`instrument.logger.values.note_beyond`)."""
    values = list(copy.values())
    dtype = values[0].dtype if type(values[0]) is Tensor else None
    if dtype in _READ_HERE and values[0].is_cpu and not torch._C._len_torch_function_stack():
        # CPU floats and bools: read here, as a float block, in the same pass that checks them. Reading a CPU
        # tensor is no sync, the stack would read it now as well, and 100 reads cost less than one stack (about
        # 16 against 25 us) and leave the commit nothing to transfer. Anything else (another dtype or device, a
        # tensor of several elements, where item() raises) goes on to the checks below. Not under a
        # TorchFunctionMode (fake tensors, tracing, a test's host-read check): there a read may mean something
        # else, and the stack is what runs on every other device.
        floats: Dict[Any, Any] = {}
        try:
            for key, value in copy.items():
                if type(value) is not Tensor or type(key) is not str or value.dtype != dtype or not value.is_cpu:
                    break
                floats[key] = value.item()
            else:
                if dtype == torch.bool:
                    floats = {key: 1.0 if flag else 0.0 for key, flag in floats.items()}
                return (head, floats)
        except RuntimeError:
            pass
    for key, value in copy.items():
        if type(value) is not Tensor or type(key) is not str or value.dtype != dtype:
            return None
    if (dtype.is_complex or values[0].layout != torch.strided or values[0].is_quantized  # the per-key path converts
            or dtype not in NUMERIC_DTYPES):  # or refuses, naming the key (bits, sub-byte types)
        return None
    try:
        with torch.no_grad():  # a copy: the caller may change its tensors, and no autograd graph is kept
            stacked = torch.stack(values)
    except RuntimeError:  # shapes or devices differ: the per-key path tells the caller what is wrong
        return None
    if stacked.numel() != len(values) or stacked.is_meta or stacked.layout != torch.strided:
        return None
    if not dtype.is_floating_point:  # as the per-key path: bools as 1.0/0.0, integers exact as float64
        mps = stacked.device.type == "mps"  # MPS has no float64
        stacked = stacked.to(torch.float32 if dtype == torch.bool or mps else torch.float64)
        if wide is not None and wide_int(dtype, stacked.dtype):
            note_beyond(wide, tuple(head + key for key in copy), stacked.reshape(-1))
    return (head, tuple(copy), stacked.reshape(-1))


def fold(blocks: List[Block], totals: Dict[str, Any], counts: Dict[str, int], on_device: Dict[str, None]) -> None:
    """Add ``blocks`` to a per-key table: sums (``totals``), counts (names seen more than once) and the names
    whose sum is a device tensor (``on_device``)."""
    for block in blocks:
        head = block[0]
        if len(block) == 2:
            pairs: Any = block[1].items()
        else:
            # in float64 (as `means` sums on the writer), so that folding never changes an interval's mean
            stacked = block[2].to(torch.float32 if block[2].device.type == "mps" else torch.float64)
            pairs = zip(block[1], stacked.unbind(), strict=True)
            on_device.update(dict.fromkeys(head + key for key in block[1]))
        for key, value in pairs:
            name = head + key
            if name in totals:
                totals[name] = add(totals[name], value)  # exactly on where finite floats leave float64
                counts[name] = counts.get(name, 1) + 1
            else:
                totals[name] = value


def means(blocks: List[Block], host: Callable[[Tensor], Any]) -> Dict[str, float]:
    """On the writer: the mean of every name over ``blocks`` (first-logged order); ``host`` gives the
    transferred float64 copy of a block's tensor."""
    rows = [block[1] if len(block) == 2 else dict(zip(block[1], host(block[2]).tolist(), strict=True))
            for block in blocks]
    if len(blocks) == 1:
        head = blocks[0][0]
        return dict(rows[0]) if not head else {head + key: value for key, value in rows[0].items()}
    totals: Dict[str, float] = {}
    counts: Dict[str, int] = {}
    fold([(block[0], row) for block, row in zip(blocks, rows, strict=True)], totals, counts, {})
    for name, count in counts.items():
        totals[name] = totals[name] / count
    return totals


def contributions(totals: Mapping[str, Any], counts: Mapping[str, int], blocks: List[Block]) -> Counter:
    """How many logged values each name's staged sum holds, in the table and in the blocks together."""
    seen: Counter = Counter({name: counts.get(name, 1) for name in totals})
    for block in blocks:
        seen.update(block[0] + key for key in block[1])
    return seen
