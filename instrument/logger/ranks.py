"""Which process is this, and do all processes agree: rank helpers for `torch.distributed` runs.

Under ``torchrun`` every rank runs the same script. Only rank 0 may open backends (files, W&B runs, MLflow
runs), so the logger asks `rank()` before opening any. The rank comes from the default process group when
one is initialised, and otherwise from the ``RANK`` variable ``torchrun`` sets, so an `Instrumentation`
built before ``init_process_group`` still opens nothing on ranks other than 0.

`check_same_config` compares a hash of the operative configuration across ranks, so a rank that parsed
different gin files or bindings fails loudly at the first step instead of logging a silently different run.
"""

import contextlib
import hashlib
import os
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from instrument.errors import ConfigurationError

__all__ = [
    "DIST_AVAILABLE", "initialized", "rank", "world_size", "is_distributed", "collective_device",
    "object_collective_device", "config_hash",
    "check_same_config",
]

# Hashes travel as float64 values; 52 bits keep every one exactly representable.
_HASH_BITS = 52


DIST_AVAILABLE = dist.is_available()  # fixed by the build; asked once (every commit asks is_distributed)


def _c10d() -> Tuple[Optional[Any], Optional[type]]:
    """torch's ``distributed_c10d`` module, where its registry of the default process group (``_world``) lives,
    and the registry's own type when its ``default_pg`` property reads ``_default_pg`` (torch 2.x); else Nones."""
    if not DIST_AVAILABLE:
        return None, None
    try:
        from torch.distributed import distributed_c10d
    except ImportError:  # pragma: no cover - a build without c10d is not DIST_AVAILABLE
        return None, None
    world = getattr(distributed_c10d, "_world", None)
    if not isinstance(getattr(type(world), "default_pg", None), property) or not hasattr(world, "_default_pg"):
        return None, None
    return distributed_c10d, type(world)


_C10D, _WORLD_TYPE = _c10d()


def initialized() -> bool:
    """``dist.is_initialized()``, in two attribute reads where torch's layout allows.

    Every commit asks it. ``dist.is_initialized`` goes through two Python properties in torch's own modules,
    which right after a training step (cold caches) cost the commit several microseconds; the attribute they
    read (``distributed_c10d._world._default_pg``) is read here directly. The registry is looked up at every
    call, since torch may replace it (its threaded test process groups install their own); a registry of any
    other type is asked through `dist.is_initialized`.
    """
    if _C10D is not None:
        world = _C10D._world
        if type(world) is _WORLD_TYPE:
            return world._default_pg is not None
    return DIST_AVAILABLE and dist.is_initialized()


def is_distributed(group: Optional[Any] = None) -> bool:
    """True when a process group is initialised and has more than one rank (only then is anything reduced)."""
    return initialized() and dist.get_world_size(group) > 1


def rank(group: Optional[Any] = None) -> int:
    """This process's rank: from the process group when initialised, else ``$RANK`` (torchrun), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group)
    value = os.environ.get("RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(
            f"the RANK environment variable must be an integer, got {value!r}."
        ) from None


def world_size(group: Optional[Any] = None) -> int:
    """Number of ranks in the group; 1 without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def collective_device(group: Optional[Any] = None) -> torch.device:
    """Where collective buffers must live: for NCCL the group's own device (``init_process_group(device_id=...)``),
    else the current CUDA device, which is per thread (set with ``torch.cuda.set_device`` on each thread that
    commits: a new thread starts at cuda:0); the CPU for gloo and others."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        try:
            bound = (group if group is not None else dist.distributed_c10d._get_default_group()).bound_device_id
        except (AttributeError, RuntimeError):  # a torch without it, or a group object of another kind
            bound = None
        if bound is not None:
            return torch.device(bound)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def object_collective_device(group: Optional[Any] = None) -> Any:
    """A context for torch's object collectives (``all_gather_object``, ``broadcast_object_list``): under NCCL
    they build their tensors on the thread's current CUDA device, which must be the group's own (`collective_device`:
    a group bound to a device refuses any other, and a new thread starts at cuda:0); elsewhere nothing."""
    device = collective_device(group)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def config_hash(text: str) -> int:
    """A 52-bit hash of ``text`` (exact as a float64, so it can ride in a collective)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - _HASH_BITS)


def check_same_config(text: str, group: Optional[Any] = None) -> None:
    """Raise `ConfigurationError` on every rank when ranks hold different configurations; no-op alone.

    One all_gather of one number, once per run. Every rank must call it (it is a collective).
    """
    if not is_distributed(group):
        return
    n = dist.get_world_size(group)
    device = collective_device(group)
    mine = torch.tensor([float(config_hash(text))], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(gathered, mine, group=group)
    # host sync: once per run, at the first step.
    hashes = [int(h) for h in torch.cat(gathered).cpu().tolist()]
    if len(set(hashes)) > 1:
        by_hash: dict = {}
        for r, h in enumerate(hashes):
            by_hash.setdefault(h, []).append(r)
        groups = "; ".join(f"ranks {ranks} have hash {h:013x}" for h, ranks in by_hash.items())
        raise ConfigurationError(
            f"the operative configuration differs across ranks ({groups}). Every rank must parse the same "
            f".gin files and bindings before building its Instrumentation (e.g. call instrument.config.parse "
            f"with the same arguments on every rank; do not bind rank-specific values)."
        )


def same_on_all_ranks(value: Any, group: Optional[Any] = None) -> Any:
    """Rank 0's ``value`` on every rank (one broadcast, once per run); ``value`` itself without a group.

    Every rank must call it (a collective). Used for what each rank makes up alone but all must share, such as
    a default run name with a random suffix.
    """
    if not is_distributed(group):
        return value
    box = [value]
    with object_collective_device(group):
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]
