"""Calls a hook sees from inside torch's function transforms and tracer, and how to read them.

* ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, ``jvp``, ``vmap``) hand hooks wrapped tensors. A
  grad-tracking wrapper holds the very values of the tensor it wraps (`plain` unwraps it); a tensor batched by
  ``vmap`` is one sample of a batch that only the transform holds (`plain` says `BATCHED`; `physical` gives the
  whole batch behind it, the layout left as it is). Work done in a hook inside a transform would make new
  wrappers of that level, dead (no storage) once it returns: hooks do it `outside_transforms`.
* ``torch.jit.trace`` runs the module while tracing (``torch._C._is_tracing()``) and, with ``check_trace=True``,
  once more as plain Python to compare (`in_trace_check`). Neither call is a rollout iteration.

The torch names read here are private (torch 2.13); each has a fallback that leaves the hooks as they were
without it, so a torch that renames one loses only what it gave.
"""

import contextlib
import inspect
import sys
import types
from typing import Any, ContextManager, Optional

import torch
from torch import Tensor

__all__ = ["BATCHED", "in_trace_check", "outside_transforms", "physical", "plain", "transformed"]

_functorch = torch._C._functorch
BATCHED = object()  # `plain`: a tensor batched by torch.func.vmap

try:  # a torch without it runs the hooks inside the transform, as before
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack as _clear_transforms
except ImportError:  # pragma: no cover - depends on the torch version
    _clear_transforms = contextlib.nullcontext


def transformed() -> bool:
    """Whether a torch.func transform is running on this thread (outside one, no tensor is wrapped)."""
    return _functorch.maybe_current_level() is not None


def plain(tensor: Any) -> Any:
    """``tensor`` without torch.func's grad-tracking wrappers (same values); `BATCHED` for a vmapped one."""
    while isinstance(tensor, Tensor) and _functorch.is_functorch_wrapped_tensor(tensor):
        if _functorch.is_batchedtensor(tensor):
            return BATCHED
        tensor = _functorch.get_unwrapped(tensor)
    return tensor


def physical(tensor: Tensor) -> Tensor:
    """The plain tensor behind every wrapper of ``tensor``: for a vmapped one the whole batch, each vmapped
    dimension where the transform keeps it (for statistics over all elements, where the layout does not count)."""
    while _functorch.is_functorch_wrapped_tensor(tensor):
        tensor = _functorch.get_unwrapped(tensor)
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
    returns, check included): told by the check's helper a few frames up (at most 16: the traced module's
    forward may call the hooked one)."""
    if _TRACE_CHECK is None or getattr(torch.jit._trace, "_trace_module_map", None) is None:
        return False
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return False
        if frame.f_code is _TRACE_CHECK:
            return True
        frame = frame.f_back
    return False
