"""Everything TorchScript-specific about embedded probes lives here.

* `script`: ``torch.jit.script`` without its deprecation warning, explaining the one failure users hit most
  with probes: a module file with ``from __future__ import annotations``.
* `freeze`: ``torch.jit.freeze`` with probes compiled out (the frozen graph has exactly the ops of the model
  without probes) or kept toggleable (``keep_probes=True`` preserves each probe's ``enabled`` attribute).
* `scripted_probes`: finds `Probe` submodules of a ScriptModule, also one loaded with ``torch.jit.load``;
  the session toggles their ``enabled`` attribute from Python like on an eager module.
* Watching calls (`observe_calls`, used by the session's state watch during a logging step): a ScriptModule
  refuses Python hooks of its own, so calls made from Python are picked out by a global forward hook that
  exists only during the logging step. Calls made by TorchScript code (a scripted rollout loop calling the
  rule) never reach Python: for those, `script` compiles a call boundary into the module, a typed forward
  hook that, while its ``CallBoundary`` submodule is enabled, calls
  ``instrument::call_end(previous, next, condition, token)``; it survives ``torch.jit.save``/``load`` and is
  removed by freezing. Its Python mirror is dropped (`drop_python_boundaries`), so calls from Python never
  run it.
* `check_scriptable`: refuses gradient probes before scripting (TorchScript drops backward hooks silently).
  `scripting_here` tells ``Probe.__prepare_scriptable__`` that `script` switches its copies' probes off.

TorchScript is deprecated in favour of torch.export (torch 2.5+ warns); the helpers here filter that warning.
"""

import contextlib
import itertools
import linecache
import logging
import secrets
import sys
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from instrument.errors import ProbeError
from instrument.probes import record

__all__ = [
    "CallBoundary", "ScriptedProbe", "check_scriptable", "drop_python_boundaries", "freeze", "has_call_boundary",
    "is_scripted", "observe_calls", "quiet", "script", "scripted_probes", "scripting_here",
]

log = logging.getLogger("instrument")
_DEPRECATION = r"`torch\.jit\.\w+` is deprecated"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence exactly TorchScript's own deprecation warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATION, category=DeprecationWarning)
        yield


def is_scripted(module: nn.Module) -> bool:
    return isinstance(module, torch.jit.ScriptModule)


def scripting_here() -> bool:
    return getattr(_here, "scripting", False)


_PROBE_TYPE = "instrument.probes.probe."
_here = threading.local()  # `script` is scripting on this thread (`scripting_here`)


def _is_probe_type(qualified_name: str) -> bool:
    # __torch__.instrument.probes.probe.Probe, or __torch__.instrument.probes.probe.___torch_mangle_3.Probe
    return _PROBE_TYPE in qualified_name and qualified_name.endswith(".Probe")


class ScriptedProbe:
    """A probe inside a ScriptModule, seen through the C++ module: ``name``, ``grad`` and ``enabled``."""

    def __init__(self, path: str, c_module, traced: bool = False) -> None:
        self.path = path
        self._c = c_module
        if traced or not (c_module.hasattr("name") or c_module.hasattr("enabled")):
            # torch.jit.trace keeps a module's parameters, buffers and submodules, no other attribute
            raise ProbeError(
                f"the probe at {path!r} of this module is no probe any more: the module was made by "
                f"torch.jit.trace, which keeps no probe (a trace records only the ops that ran while tracing, and "
                f"a probe records nothing then), so its values cannot be observed. Script the model with "
                f"instrument.script(model) instead (probes survive it, and torch.jit.save / load), or trace a "
                f"model without probes: a traced module without probes can be watched."
            )
        if not c_module.hasattr("name"):
            raise ProbeError(
                f"the probe at {path!r} of this frozen module has lost its name: freezing folded it into a "
                f"constant. Freeze with instrument.freeze(scripted, keep_probes=True), which preserves each "
                f"probe's name and enabled attributes."
            )
        self.name = str(c_module.getattr("name"))
        self.grad = bool(c_module.getattr("grad")) if c_module.hasattr("grad") else False

    @property
    def enabled(self) -> bool:
        return bool(self._c.getattr("enabled"))

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._c.setattr("enabled", bool(value))

    def __repr__(self) -> str:
        return f"ScriptedProbe({self.name!r}, path={self.path!r})"


def scripted_probes(module: nn.Module) -> List[Tuple[str, ScriptedProbe]]:
    """``(path, probe)`` for every probe in a ScriptModule: scripted, loaded, or frozen with probes kept.

    A scripted or loaded module still has its submodules; a frozen one has only the submodule attributes that
    were preserved, found by following ``prim::GetAttr`` chains from ``self`` in its inlined forward graph.
    """
    found = {
        path: sub._c for path, sub in module.named_modules() if _is_probe_type(sub._c.qualified_name)
    }
    if not found and module._c._has_method("forward"):
        found = _graph_probe_paths(module)
    traced = isinstance(module, torch.jit.TracedModule)
    return [(path, ScriptedProbe(path, c, traced)) for path, c in found.items()]


def _graph_probe_paths(module: nn.Module) -> dict:
    graph = module.graph
    root = next(iter(graph.inputs()))
    owner = {root.unique(): ("", module._c)}
    found = {}

    def walk(block) -> None:
        for node in block.nodes():
            if node.kind() == "prim::GetAttr":
                parent = owner.get(node.input().unique())
                if parent is not None:
                    name = node.s("name")
                    value = parent[1].getattr(name)
                    if isinstance(value, torch._C.ScriptModule):
                        path = f"{parent[0]}.{name}" if parent[0] else name
                        owner[node.output().unique()] = (path, value)
                        if _is_probe_type(value.qualified_name):
                            found[path] = value
            for inner in node.blocks():
                walk(inner)

    walk(graph)
    return found


def check_scriptable(probe: nn.Module) -> None:
    """Called by ``Probe.__prepare_scriptable__`` and when a ScriptModule is watched."""
    if probe.grad:
        raise ProbeError(
            f"gradient probe {probe.name!r} cannot be scripted: TorchScript drops backward hooks silently, "
            f"so instrument refuses gradient probes on scripted modules. Use Probe({probe.name!r}) "
            f"(grad=False) in the model you script, and record gradients in eager mode or with torch.compile."
        )


def _future_annotation_modules(module: nn.Module) -> List[str]:
    found = []
    for sub in module.modules():
        if type(sub).__module__.split(".")[0] == "torch":  # torch's own modules script fine with it
            continue
        source = sys.modules.get(type(sub).__module__)
        feature = getattr(source, "annotations", None)
        if getattr(feature, "compiler_flag", None) is not None and source.__name__ not in found:
            found.append(source.__name__)
    return found


def script(module: nn.Module, call_boundary: bool = True) -> torch.jit.ScriptModule:
    """``torch.jit.script(module)`` without the deprecation warning, with a clearer error for
    ``from __future__ import annotations`` (it turns annotations into strings TorchScript cannot resolve), and
    with a call boundary compiled in (`CallBoundary`): a watched module then delivers one `StepContext` per
    forward call even when other TorchScript code calls it. ``module`` itself is left as it was.

    The boundary needs a forward whose first argument is a Tensor and which returns a Tensor or a tuple starting
    with one; any other module (or ``call_boundary=False``) is scripted as ``torch.jit.script`` does it.
    """
    before, _here.scripting = scripting_here(), True  # its copies' probes are switched off: not refused
    try:
        return _script_all(module, call_boundary)
    finally:
        _here.scripting = before


def _script_all(module: nn.Module, call_boundary: bool) -> torch.jit.ScriptModule:
    _drop_inert_hooks(module)
    plain = _probes_off(_script(module))
    if not call_boundary or is_scripted(module) or _BOUNDARY in module._modules or hasattr(module, _BOUNDARY):
        return plain
    hook = _boundary_hook(plain.forward.schema) if plain._c._has_method("forward") else None
    if hook is None:
        return plain
    module.add_module(_BOUNDARY, CallBoundary())
    handle = module.register_forward_hook(hook)
    try:
        return _probes_off(_script_with_boundary(module))
    except Exception as exc:  # a signature our generated hook does not type right: plain scripting still works
        log.warning(
            "instrument.script: could not compile the call boundary into %s (%s); its calls are observed only "
            "when Python calls it", type(module).__name__, str(exc).strip().splitlines()[0],
        )
        return plain
    finally:
        handle.remove()
        delattr(module, _BOUNDARY)


def _drop_inert_hooks(module: nn.Module) -> None:
    """A copy made during a logging step holds inert stand-ins of the session's hooks (`step_hook.StepHook`)."""
    for sub in module.modules():
        for table, kwargs in (("_forward_hooks", "_forward_hooks_with_kwargs"),
                              ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")):
            hooks = getattr(sub, table, None)
            for key, hook in list((hooks or {}).items()):
                if getattr(hook, "instrument_inert", False):
                    del hooks[key]
                    getattr(sub, kwargs, {}).pop(key, None)


def _probes_off(scripted: torch.jit.ScriptModule) -> torch.jit.ScriptModule:
    """A copy scripted during a logging step starts with its probes off, until a session watching it turns them on."""
    for _, probe in scripted_probes(scripted):
        probe.enabled = False
    return scripted


def _script_with_boundary(module: nn.Module) -> torch.jit.ScriptModule:
    with quiet():
        scripted = torch.jit.script(module)
    drop_python_boundaries(scripted)
    return scripted


def _script(module: nn.Module) -> torch.jit.ScriptModule:
    offenders = _future_annotation_modules(module)
    try:
        with quiet():
            return torch.jit.script(module)
    except ProbeError:
        raise
    except Exception as exc:
        if not offenders:
            raise
        raise ProbeError(
            f"torch.jit.script failed on {type(module).__name__}, and module(s) {offenders} start with "
            f"'from __future__ import annotations'. That import turns every annotation into a string, which "
            f"TorchScript cannot always resolve. Remove the import from those files (or script modules "
            f"defined elsewhere). TorchScript said: {str(exc).strip().splitlines()[0]}"
        ) from exc


def freeze(
    scripted: torch.jit.ScriptModule,
    keep_probes: bool = False,
    preserved_attrs: Optional[Sequence[str]] = None,
    optimize_numerics: bool = True,
) -> torch.jit.ScriptModule:
    """A frozen copy of ``scripted`` (which must be in eval mode, as for ``torch.jit.freeze``).

    ``keep_probes=False`` compiles every probe out: its graph has the same ops as the model without probes.
    ``keep_probes=True`` preserves each probe's ``enabled`` attribute so a session can still turn it on.
    The original module is left as it was.
    """
    if not is_scripted(scripted):
        raise ProbeError(
            f"instrument.freeze expects a ScriptModule (torch.jit.script(model) or torch.jit.load(...)), got "
            f"{type(scripted).__name__}."
        )
    probes = scripted_probes(scripted)
    preserved = list(preserved_attrs or [])
    if keep_probes:
        preserved += [f"{path}.{attr}" for path, _ in probes for attr in ("enabled", "name", "grad")]
    saved = [(probe, bool(probe.enabled)) for _, probe in probes]
    try:
        for probe, _ in saved:
            probe.enabled = False
        with quiet():
            return torch.jit.freeze(scripted, preserved_attrs=preserved, optimize_numerics=optimize_numerics)
    finally:
        for probe, was in saved:
            probe.enabled = was


# ----------------------------------------------------------------------------------------------- call boundaries
_BOUNDARY = "instrument_call"
_BOUNDARY_TYPE = "instrument.probes.script.CallBoundary"
_HOOK_PREFIX = "_instrument_call_end_"


class CallBoundary(nn.Module):
    """The switch of a compiled-in call boundary (a submodule named ``instrument_call``).

    Off (every non-logging step) the compiled hook is one bool test, like a probe that is off, and
    `freeze` removes it entirely. ``token`` tells the session which watch a call belongs to, and ``key`` (a tensor
    attribute: not a buffer, so ``.to()`` leaves it) that the call is the watched module's own: a copy made during
    a logging step (``copy.deepcopy``, ``torch.jit.save``/``load``) keeps the token but gets a key of new storage.
    """

    def __init__(self) -> None:
        super().__init__()
        self.enabled = False
        self.token = 0
        self.key = torch.zeros(1)


_HOOK_GLOBALS: Dict[str, Any] = {
    "__name__": __name__, "torch": torch, "Tensor": Tensor, "Tuple": Tuple, "Optional": Optional, "List": List,
    "Dict": Dict,
}
_hooks: Dict[str, Callable] = {}
_TENSOR_TYPES = ("Tensor", "Optional[Tensor]")


def _boundary_hook(schema: Any) -> Optional[Callable]:
    """A top-level forward hook typed for ``schema`` (TorchScript compiles only exactly typed hooks), or None.

    TorchScript compiles from source, so the hook is written out and its source registered with linecache;
    one function per signature, each uniquely named (hooks are compiled by name).
    """
    args = list(schema.arguments)[1:]
    if len(schema.returns) != 1 or not args or args[0].type.annotation_str != "Tensor":
        return None
    out = schema.returns[0].type
    if out.annotation_str == "Tensor":
        current = "output"
    elif isinstance(out, torch._C.TupleType) and out.elements() and out.elements()[0].annotation_str == "Tensor":
        current = "output[0]"
    else:
        return None
    # The condition, as the eager state hook finds it: a `condition` argument, else a second tensor argument.
    named = [i for i, a in enumerate(args) if a.name == "condition" and a.type.annotation_str in _TENSOR_TYPES]
    if named:
        condition = f"input[{named[0]}]"
    elif len(args) > 1 and args[1].type.annotation_str in _TENSOR_TYPES:
        condition = "input[1]"
    else:
        condition = "None"
    signature = f"input: Tuple[{', '.join(a.type.annotation_str for a in args)}], output: {out.annotation_str}"
    key = f"{signature}|{current}|{condition}"
    if key not in _hooks:
        name = f"{_HOOK_PREFIX}{len(_hooks)}"
        source = (
            f"def {name}(module, {signature}) -> None:\n"
            f"    boundary = module.{_BOUNDARY}\n"
            f"    if boundary.enabled:\n"
            f"        torch.ops.instrument.call_end_keyed(input[0], {current}, {condition}, boundary.token, "
            f"boundary.key)\n"
        )
        filename = f"<instrument call boundary {name}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            exec(compile(source, filename, "exec"), _HOOK_GLOBALS)  # noqa: S102  our own source, from a schema
        except Exception:  # an annotation Python cannot name here (a TorchScript class, say)
            return None
        _hooks[key] = _HOOK_GLOBALS[name]
    return _hooks[key]


def _call_boundary(module: nn.Module) -> Optional[Any]:
    """The C++ `CallBoundary` of a ScriptModule whose boundary hook is compiled in, else None.

    Freezing drops forward hooks: a frozen module has no boundary even when the submodule was preserved.
    """
    c_module = module._c
    if not c_module.hasattr(_BOUNDARY):
        return None
    boundary = c_module.getattr(_BOUNDARY)
    if not isinstance(boundary, torch._C.ScriptModule) or _BOUNDARY_TYPE not in boundary.qualified_name:
        return None
    if not any(hook.name.startswith(_HOOK_PREFIX) for hook in c_module._get_forward_hooks()):
        return None
    return boundary


def has_call_boundary(module: nn.Module) -> bool:
    return is_scripted(module) and _call_boundary(module) is not None


# A boundary keeps its token in the module, so a copy or a torch.jit.save made during a logging step carries it,
# switched on, into other processes: tokens start at a random point in each process, so that such a stale
# boundary never matches a watch of another process (a counter from 1 gave the same tokens in every process,
# and a loaded, unwatched teacher's calls were delivered as the watched student's iterations).
_tokens = itertools.count(secrets.randbits(48) + 1)


class _BoundaryHandle:
    def __init__(self, boundary: Any, token: int) -> None:
        self._boundary, self._token = boundary, token

    def remove(self) -> None:
        if self._boundary is not None:
            self._boundary.setattr("enabled", False)
            record.on_call_end(self._token, None)
            self._boundary = None


def drop_python_boundaries(module: nn.Module) -> None:
    """Make Python calls of ``module`` (and its submodules) skip the compiled boundary hook.

    TorchScript mirrors a ScriptModule's compiled forward hooks into its Python ``_forward_hooks`` (also when
    loading), so every call from Python would run the boundary hook as a separate TorchScript function (a few
    microseconds, even when off) and fail on keyword arguments. Python calls are observed from Python instead
    (`observe_calls`); calls from TorchScript code keep the hook compiled into the caller's graph.
    """
    for sub in module.modules():
        hooks = getattr(sub, "_forward_hooks", None)
        if not hooks:
            continue
        for key, hook in list(hooks.items()):
            if isinstance(hook, torch.jit.ScriptFunction) and hook.name.startswith(_HOOK_PREFIX):
                del hooks[key]


# A ScriptModule's mirrored compiled hooks are keyed 0, 1, ... in its Python _forward_hooks, and
# Module._call_impl treats a key as "takes kwargs" when a global hook with the same handle id does (torch 2.13):
# a global hook registered with a small id would make such a hook be called with the wrong arguments.
_MIN_GLOBAL_HOOK_ID = 64


def _register_global_hook(hook: Callable) -> Any:
    from torch.nn.modules import module as module_impl

    while True:
        handle = module_impl.register_module_forward_hook(hook, with_kwargs=True)
        if handle.id >= _MIN_GLOBAL_HOOK_ID:
            return _GlobalHandle(handle)
        _GlobalHandle(handle).remove()


class _GlobalHandle:
    """Removes a global forward hook entirely: torch's own handle leaves its ``with_kwargs`` flag behind."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def remove(self) -> None:
        from torch.nn.modules import module as module_impl

        self._handle.remove()
        module_impl._global_forward_hooks_with_kwargs.pop(self._handle.id, None)


class _Handles:
    def __init__(self, *handles: Any) -> None:
        self._handles = [h for h in handles if h is not None]

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()


def observe_calls(
    module: nn.Module,
    python_hook: Callable[[nn.Module, Tuple[Any, ...], Dict[str, Any], Any], None],
    call_end: Callable[[Tensor, Tensor, Optional[Tensor]], None],
    python_pre_hook: Optional[Callable[[nn.Module, Tuple[Any, ...], Dict[str, Any]], None]] = None,
    batched: Optional[Callable[[Optional[List[int]]], None]] = None,
) -> Any:
    """Observe every forward call of ScriptModule ``module`` until the returned handle's ``remove()``.

    Calls from Python run ``python_pre_hook`` before and ``python_hook`` after the call, through global hooks
    (a ScriptModule refuses hooks of its own) that exist only until ``remove()`` and ignore every other module:
    the state before the call is then known, also when the forward changes its argument in place. Calls from
    TorchScript code run ``call_end(previous, next, condition)`` through the compiled-in boundary, where the
    module has one (made by `script`; not ``torch.jit.script``, modules saved before boundaries existed, or
    frozen modules); such calls inside ``torch.func.vmap`` run ``batched(shape of one sample)`` instead.
    """
    drop_python_boundaries(module)
    boundary = _call_boundary(module)
    boundary_handle = None
    if boundary is not None:
        token = next(_tokens)
        key = boundary.getattr("key").data_ptr() if boundary.hasattr("key") else None  # None: saved before keys
        record.on_call_end(token, call_end, key, batched)
        boundary.setattr("token", token)
        boundary.setattr("enabled", True)
        boundary_handle = _BoundaryHandle(boundary, token)

    def on_module_call(called: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
        # A global hook runs for every module, also inside any compiled one, where Dynamo would trace it and give
        # up on the comparison with a ScriptModule (the other module would then run uncompiled for good): inside
        # compiled code only a ScriptModule's call can be the watched one.
        if torch.compiler.is_compiling() and not isinstance(called, torch.jit.ScriptModule):
            return
        if called is module:
            python_hook(called, args, kwargs, output)

    def before_module_call(called: nn.Module, args: Tuple[Any, ...], kwargs: Any = None) -> None:
        # Called with kwargs where the module has a keyword pre-hook of the same id (torch's _call_impl)
        if torch.compiler.is_compiling() and not isinstance(called, torch.jit.ScriptModule):
            return
        if called is module and python_pre_hook is not None:
            python_pre_hook(called, args, kwargs if isinstance(kwargs, dict) else {})

    from torch.nn.modules import module as module_impl

    pre = module_impl.register_module_forward_pre_hook(before_module_call) if python_pre_hook is not None else None
    return _Handles(boundary_handle, _register_global_hook(on_module_call), pre)
