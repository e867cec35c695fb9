"""DTensors (``torch.distributed.tensor``, what FSDP2's ``fully_shard`` makes of parameters and gradients).

A DTensor's ``item()``, ``to(...)`` and host copy act on this rank's local tensor: for a ``Shard`` or ``Partial``
placement that is a shard or a partial value, not the global one, and averaging such values over ranks gives a
wrong number without any sign of it. A DTensor whose placements are all ``Replicate()`` holds the global value on
every rank: its local tensor is the value. Found without importing ``torch.distributed.tensor``: where it is not
imported, no DTensor exists.
"""

import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["by_kind", "classic_fsdp", "dtensor_placements", "global_value", "is_replicated", "kinds", "local_value"]


def dtensor_placements(value: Any) -> Optional[Tuple[Any, ...]]:
    """``value.placements`` when ``value`` is a DTensor, else None (cheap: no import)."""
    module = sys.modules.get("torch.distributed.tensor")
    kind = getattr(module, "DTensor", None) if module is not None else None
    if kind is None or not isinstance(value, kind):
        return None
    return tuple(value.placements)


def is_replicated(placements: Tuple[Any, ...]) -> bool:
    """Whether every placement is ``Replicate()``: the local tensor is then the global value."""
    return all(placement.is_replicate() for placement in placements)


def local_value(value: Any, refuse: Any) -> Any:
    """``value`` itself when it is no DTensor; its local tensor when it is a replicated one; otherwise
    ``refuse(placements)`` (which raises)."""
    placements = dtensor_placements(value)
    if placements is None:
        return value
    if is_replicated(placements):
        return value.to_local()
    raise refuse(placements)


def classic_fsdp(param: Any) -> bool:
    """Whether ``param`` was flattened by a classic ``FullyShardedDataParallel`` (not FSDP2): its flat parameter,
    or, with ``use_orig_params=True``, an original parameter made a view into this rank's shard of it. FSDP marks
    both (``_fsdp_flattened``), also where the watched module is one inside the wrapper, whose parameter names
    carry no sign of it; FSDP2 marks none (its parameters are DTensors)."""
    return getattr(param, "_fsdp_flattened", False) is True


def by_kind(tensors: Sequence[Any], fn: Callable[[List[Any]], Sequence[Any]], scalars: bool = True
            ) -> Optional[List[Any]]:
    """``fn`` applied to each kind of ``tensors`` apart (plain tensors; the DTensors of each device mesh), when
    there is more than one kind, else None (call ``fn`` on them all). torch's fused ``_foreach`` kernels refuse a
    list that mixes plain tensors and DTensors (``fully_shard`` on a submodule only leaves the others plain) or
    DTensors of two meshes. ``fn`` returns one result per tensor; they come back in the order given, and with
    ``scalars`` (one-element results: norms, counts) a DTensor's result as a plain tensor holding its global value
    (`global_value`: one collective per mesh, made by every rank alike)."""
    groups = kinds(tensors, range(len(tensors)))
    if len(groups) < 2:
        return None
    out: List[Any] = [None] * len(tensors)
    for members in groups:
        results = list(fn([tensors[i] for i in members]))
        if scalars and dtensor_placements(tensors[members[0]]) is not None:  # one collective per mesh, not each
            import torch

            results = list(global_value(torch.stack(results)).unbind())
        for index, result in zip(members, results, strict=True):
            out[index] = result
    return out


def kinds(tensors: Sequence[Any], indices: Iterable[int]) -> List[List[int]]:
    """``indices`` grouped by the kind of ``tensors[i]``: plain tensors, and the DTensors of each device mesh."""
    groups: Dict[Optional[int], List[int]] = {}
    for i in indices:
        groups.setdefault(None if dtensor_placements(tensors[i]) is None else id(tensors[i].device_mesh), []).append(i)
    return list(groups.values())


def global_value(value: Any) -> Any:
    """A DTensor's global value as a plain tensor, on every rank of its mesh (a collective unless it is
    replicated); anything else as it is."""
    placements = dtensor_placements(value)
    if placements is None:
        return value
    return value.to_local() if is_replicated(placements) else value.full_tensor()
