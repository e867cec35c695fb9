"""DTensors (``torch.distributed.tensor``, what FSDP2's ``fully_shard`` makes of parameters and gradients).

A DTensor's ``item()``, ``to(...)`` and host copy act on this rank's local tensor: for a ``Shard`` or ``Partial``
placement that is a shard or a partial value, not the global one, and averaging such values over ranks gives a
wrong number without any sign of it. A DTensor whose placements are all ``Replicate()`` holds the global value on
every rank: its local tensor is the value. Found without importing ``torch.distributed.tensor``: where it is not
imported, no DTensor exists.
"""

import sys
from typing import Any, Optional, Tuple

__all__ = ["classic_fsdp", "dtensor_placements", "is_replicated", "local_value"]


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
