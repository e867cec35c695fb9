"""Calls a hook sees from inside torch's function transforms and tracer, and how to read them.

* ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, ``jvp``, ``vmap``) hand hooks wrapped tensors. A
  grad-tracking wrapper holds the very values of the tensor it wraps (`plain` unwraps it); a tensor batched by
  ``vmap`` is one sample of a batch that only the transform holds (`plain` says `BATCHED`; `physical` gives the
  whole batch behind it, the layout left as it is). Work done in a hook inside a transform would make new
  wrappers of that level, dead (no storage) once it returns: hooks do it `outside_transforms`.
* ``torch.jit.trace`` runs the module while tracing (``torch._C._is_tracing()``) and, with ``check_trace=True``,
  once more as plain Python to compare (`in_trace_check`). Neither call is a rollout iteration.

The torch names read here are private (torch 2.13); each is looked up once, at import, with a fallback that
leaves the hooks as they were without it, so a torch that renames one loses only what it gave.
"""

import contextlib
import inspect
import sys
import types
from typing import Any, ContextManager, Optional

import torch
from torch import Tensor

__all__ = [
    "BATCHED", "chunked_vmap_call", "forward_mode", "in_trace_check", "outside_transforms", "physical", "plain",
    "transformed",
]

BATCHED = object()  # `plain`: a tensor batched by torch.func.vmap
try:  # a torch without them: no transform is ever seen as running, and hooks treat every tensor as plain
    _level = torch._C._functorch.maybe_current_level
    _is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    _is_batched = torch._C._functorch.is_batchedtensor
    _unwrapped = torch._C._functorch.get_unwrapped
except AttributeError:  # pragma: no cover - depends on the torch version
    _level = None

try:  # a torch without it runs the hooks inside the transform, as before
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack as _clear_transforms
except ImportError:  # pragma: no cover - depends on the torch version
    _clear_transforms = contextlib.nullcontext

try:  # the transform levels running, for `forward_mode`; without them only forward_ad's dual levels are seen
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters as _interpreters

    _JVP = TransformType.Jvp
except ImportError:  # pragma: no cover - depends on the torch version
    _interpreters = None


def transformed() -> bool:
    """Whether a torch.func transform is running on this thread (outside one, no tensor is wrapped)."""
    return _level is not None and _level() is not None


def forward_mode() -> bool:
    """Whether forward-mode AD runs (a ``torch.func`` jvp level: ``jvp``, ``jacfwd``, ``hessian``; or a
    ``torch.autograd.forward_ad`` dual level), in which an autograd Function needs a ``jvp``. A gradient probe
    then passes its value on untouched: no gradient flows back in forward mode. (A ``jvp`` on `WatchGradient`
    itself would make Dynamo break the graph at every gradient probe.)"""
    if getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0:
        return True
    if not transformed() or _interpreters is None:
        return False
    return any(interpreter.key() == _JVP for interpreter in _interpreters())


def plain(tensor: Any) -> Any:
    """``tensor`` without torch.func's grad-tracking wrappers (same values); `BATCHED` for a vmapped one."""
    while _level is not None and isinstance(tensor, Tensor) and _is_wrapped(tensor):
        if _is_batched(tensor):
            return BATCHED
        tensor = _unwrapped(tensor)
    return tensor


def physical(tensor: Tensor) -> Tensor:
    """The plain tensor behind every wrapper of ``tensor``: for a vmapped one the whole batch, each vmapped
    dimension where the transform keeps it (for statistics over all elements, where the layout does not count)."""
    while _level is not None and _is_wrapped(tensor):
        tensor = _unwrapped(tensor)
    return tensor


def outside_transforms() -> ContextManager[Any]:
    """Leave every torch.func transform level while a hook works: inside one, each op on a plain tensor would
    return a wrapper of that level, dead once the transform returns (no storage: ``data_ptr()`` fails)."""
    return _clear_transforms()


def _trace_check_code() -> Optional[types.CodeType]:
    """The code of the helper with which torch.jit.trace's sanity check runs the traced module, then the module
    itself, on the example inputs (torch 2.13: nested in torch.jit._trace._check_trace); None if not found."""
    try:
        check = inspect.unwrap(torch.jit._trace._check_trace)  # under @torch.no_grad()
        return next(code for code in check.__code__.co_consts
                    if isinstance(code, types.CodeType) and code.co_name == "run_mod_and_filter_tensor_outputs")
    except (AttributeError, StopIteration):
        return None


_TRACE_CHECK = _trace_check_code()


def in_trace_check() -> bool:
    """Whether torch.jit.trace's check runs the module as plain Python (not tracing then), for a hook that calls
    this directly. Looked for only while torch.jit.trace traces a module (it sets ``_trace_module_map`` until it
    returns, check included): told by the check's helper anywhere up this thread's stack (the hooked module may
    sit deep inside the traced one), so the walk costs only while a trace is being taken."""
    if _TRACE_CHECK is None or getattr(torch.jit._trace, "_trace_module_map", None) is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _TRACE_CHECK:
            return True
        frame = frame.f_back
    return False


def chunked_vmap_call() -> Any:
    """``(call, chunk)``: the frames of the ``vmap(..., chunk_size=k)`` call running on this thread and of its
    chunk running now (torch 2.13: ``_chunked_vmap`` and the ``_flat_vmap`` under it), else None. A call's
    chunks share its frame, each chunk has its own, and a later call has new ones (their identities are not
    reused while the caller holds them)."""
    frame, chunk = sys._getframe(1), None
    while frame is not None:
        code = frame.f_code
        if "_functorch" in code.co_filename:
            if code.co_name == "_flat_vmap" and chunk is None:
                chunk = frame
            elif code.co_name == "_chunked_vmap":
                return (frame, chunk) if chunk is not None else None
        frame = frame.f_back
    return None
