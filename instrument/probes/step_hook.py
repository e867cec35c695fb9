"""`step_hook`: how every hook instrument registers on an eager module for one logging step (forward hooks and
pre-hooks) is wrapped.

Two things it guarantees, in every process:

* **A copy of the module never takes the session along.** ``copy.deepcopy(model)`` or ``torch.save(model)``
  during a logging step copies the module's hook table. The hook refers to the session (observers, locks),
  which must not follow a copy and does not pickle; a copy gets `inert_hook` in its place, which does nothing
  and which `instrument.script` drops when it scripts such a copy. The original module is unaffected.
* **Dynamo never traces the observers.** A module called inside compiled code has its forward hooks called
  from there, and Dynamo would trace them as frames of their own: an observer's host-side work
  (``float(tensor)``) would break graphs. Once Dynamo is imported (torch.compile imports it, and so does
  stepping a ``torch.optim.Adam``), the hook's ``__call__`` is a `torch.compiler.disable` function, so
  everything the hook calls runs eagerly, outside any graph. Without Dynamo in the process nothing can be
  compiling, and the plain class skips that wrapper (about 3 us per call on CPU, torch 2.13) and the import.
"""

import sys
from typing import Any, Callable, Dict, Optional

import torch

__all__ = ["StepHook", "inert_hook", "remove_inert", "step_hook"]


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a step's hook becomes in a copy of the module: nothing, and at its first call it takes itself off the
    module it is called for (torch passes the module first), so a copy made during a logging step (a target
    network) pays torch's hooked call path once, not at every later call (4 us a call measured on CPU)."""
    if args and isinstance(args[0], torch.nn.Module) and not torch.compiler.is_compiling():  # never in a trace
        remove_inert(args[0])


def remove_inert(module: torch.nn.Module) -> None:
    """Take every `inert_hook` off ``module``'s own forward hook and pre-hook tables (its submodules keep theirs)."""
    for table, flags in (("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
                         ("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",))):
        hooks = getattr(module, table, None)
        for key, hook in list((hooks or {}).items()):
            if getattr(hook, "instrument_inert", False):
                hooks.pop(key, None)  # two threads making the copy's first call at once both get here
                for flag in flags:
                    getattr(module, flag, {}).pop(key, None)


inert_hook.instrument_inert = True  # how `instrument.probes.script` recognises it in a copy's hook tables


def _load_inert() -> Callable:
    return inert_hook


class StepHook:
    """Calls ``fn`` with the hook's arguments; a copy or a pickle of it is `inert_hook`."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Callable:
        return inert_hook

    def __reduce__(self) -> Any:
        return (_load_inert, ())


_UNTRACED: Optional[type] = None  # StepHook with a __call__ Dynamo skips, made once Dynamo is imported


def step_hook(fn: Callable) -> StepHook:
    """``fn`` as a `StepHook`; with Dynamo imported, one whose call Dynamo never traces."""
    global _UNTRACED
    if "torch._dynamo" not in sys.modules:
        return StepHook(fn)
    if _UNTRACED is None:

        class UntracedStepHook(StepHook):
            __slots__ = ()
            __call__ = torch.compiler.disable(StepHook.__call__, recursive=True)

        _UNTRACED = UntracedStepHook
    return _UNTRACED(fn)
