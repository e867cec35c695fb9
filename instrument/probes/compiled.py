"""Everything torch.compile-specific about embedded probes lives here.

Two facts shape it (measured on torch 2.13, see docs/probes.md):

* Dynamo guards on ``Probe.enabled``: the first call with probes off compiles a graph without any probe op,
  and the first logging step compiles a second graph with the opaque ``instrument::record`` op. Nothing else
  recompiles, and the op never breaks the graph.
* Dynamo keeps its compiled variants per code object and checks them newest first. Once an "on" variant
  exists, every "off" call would first evaluate the "on" guards and fail them, costing 8-10% on small
  rollouts. So during a logging step `ForwardSwitch` gives every module on the way from the watched root to
  a probe an instance-level ``forward`` whose code object is a copy of its class's ``forward``: the "on"
  graph is cached on the copy, and "off" calls, which run the original code, see only the "off" variant.
  Leaving the step deletes the instance attributes again, which restores the modules exactly.

The copy is made once per ``forward`` function and reused for every later logging step (a new code object
each step would recompile each step). In eager mode the copy runs exactly like the original.

A third fact: a compiled module's forward hooks are called from inside Dynamo's frame evaluation, and Dynamo
traces them as frames of their own. An observer's host-side work (``float(tensor)``) would then break graphs.
On an eager (or compiled) module the hooks are wrapped by `instrument.probes.step_hook`, on the scripted path by
`run_eagerly`, so Dynamo never traces them: values are recorded inside compiled code, observers run outside it.
"""

import sys
import types
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["ForwardSwitch", "ancestors", "hook_switch", "run_eagerly", "unwrap"]


def run_eagerly(function: Callable) -> Callable:
    """``function`` as is while torch.compile is unused in this process, else excluded from Dynamo tracing.

    torch.compile imports torch._dynamo, so a process that never compiled pays nothing (not even the import).
    """
    if "torch._dynamo" not in sys.modules:
        return function
    return torch.compiler.disable(function, recursive=True)

_COPIES: "weakref.WeakKeyDictionary[types.FunctionType, types.FunctionType]" = weakref.WeakKeyDictionary()
# module -> how many switches have it on now: the copy goes when the last of them turns off
_SWITCHED: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


def unwrap(module: nn.Module) -> nn.Module:
    """The eager module behind a ``torch.compile`` wrapper (``OptimizedModule``), else the module itself."""
    inner = getattr(module, "_orig_mod", None)
    while isinstance(inner, nn.Module):
        module, inner = inner, getattr(inner, "_orig_mod", None)
    return module


def _code_copy(function: types.FunctionType) -> types.FunctionType:
    copy = _COPIES.get(function)
    if copy is None:
        code = function.__code__.replace(co_name=f"{function.__code__.co_name}_instrument_probes_on")
        copy = types.FunctionType(
            code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
        )
        copy.__kwdefaults__ = function.__kwdefaults__
        # A pickle of a bound method is getattr(module, its __name__): "forward" finds the class's at load
        copy.__name__ = "forward"
        copy.__qualname__ = function.__qualname__
        copy.__module__ = function.__module__
        copy.instrument_switched = True  # how `ForwardSwitch` recognises one a copy of a module carried along
        _COPIES[function] = copy
    return copy


def _replaceable(module: nn.Module) -> bool:
    """No instance-level ``forward``, or one a copy carried along: a ``copy.deepcopy`` of the module taken
    during a logging step keeps the switch's forward (marked, and bound to the copy), and ``torch.save`` keeps
    the class's own forward bound to the loaded module. Both run the class's code, so replacing them (and
    dropping them at ``off``) changes nothing but restores the module."""
    current = module.__dict__.get("forward")
    if current is None:
        return True
    function = getattr(current, "__func__", None)
    return getattr(current, "__self__", None) is module and (
        getattr(function, "instrument_switched", False) or function is getattr(type(module), "forward", None)
    )


class ForwardSwitch:
    """Runs the given modules through copies of their ``forward`` code while probes are on."""

    def __init__(self, modules: List[nn.Module]) -> None:
        self._targets: List[Tuple[nn.Module, types.FunctionType]] = []
        seen: Dict[int, nn.Module] = {}
        for module in modules:
            forward = getattr(type(module), "forward", None)
            # A container's (ModuleList, ModuleDict) forward is nn.Module's placeholder: never called, nothing to
            # switch; its copy, named _forward_unimplemented, would make a pickle of the module unloadable.
            if id(module) in seen or not isinstance(forward, types.FunctionType) or forward is nn.Module.forward:
                continue
            seen[id(module)] = module
            self._targets.append((module, _code_copy(forward)))
        self._on: List[Tuple[nn.Module, types.FunctionType]] = []

    def on(self) -> None:
        for module, copy in self._targets:
            count = _SWITCHED.get(module, 0)
            if count or _replaceable(module):  # a user's own instance-level forward is left alone
                if not count:
                    module.__dict__["forward"] = types.MethodType(copy, module)
                _SWITCHED[module] = count + 1
                self._on.append((module, copy))

    def off(self) -> None:
        """Drop the copies this switch put in, once no other switch still has the module on (ActivationStats'
        and the probes' switches share the watched model's path); a forward set on the module meanwhile (a
        user's, an accelerate or peft wrapper's) is left in place."""
        on, self._on = self._on, []
        for module, copy in on:
            count = _SWITCHED.get(module, 1) - 1
            if count > 0:
                _SWITCHED[module] = count
                continue
            _SWITCHED.pop(module, None)
            current = module.__dict__.get("forward")
            if getattr(current, "__func__", None) is copy and getattr(current, "__self__", None) is module:
                del module.__dict__["forward"]


def ancestors(root: nn.Module, paths: Sequence[str], itself: bool = False) -> List[nn.Module]:
    """Every eager module on the way from ``root`` to the module at each dotted path under it, root first (the
    module at the path too when ``itself``); a ScriptModule and what is inside it are left out (no
    instance-level forward to switch there)."""
    out: List[nn.Module] = []
    for path in paths:
        module = root
        out.append(module)
        parts = path.split(".") if path else []
        for part in parts if itself else parts[:-1]:
            module = getattr(module, part)
            if isinstance(module, torch.jit.ScriptModule):
                break
            out.append(module)
    return out


def hook_switch(modules: Sequence[nn.Module]) -> Optional[ForwardSwitch]:
    """A `ForwardSwitch` for a logging step's forward hooks on ``modules`` (each hooked module and its
    ancestors up to the watched root, `ancestors` with ``itself=True``), or None while torch.compile is unused.

    Dynamo does not guard on a module's hooks (torch's ``skip_nnmodule_hook_guards``). Without the switch, a
    compiled caller first compiled during a logging step keeps the graph breaks of the step's hooks (which
    Dynamo never traces, `instrument.probes.step_hook`) in the code it reuses on every later non-logging step
    (measured: 24 hooked layers ran as 48 graphs per step, 2.6-3.9x the bare compiled step), and one first
    compiled on a non-logging step never calls the hooks. With it, a logging step runs copies of the forward
    code: the hooked variant is compiled and cached on the copies, and non-logging steps run the original code
    and its graph without breaks.
    """
    if "torch._dynamo" not in sys.modules or not modules:
        return None
    return ForwardSwitch(list(modules))
