"""Everything TorchScript-specific about embedded probes lives here.

* `script`: ``torch.jit.script`` without its deprecation warning, explaining the one failure users hit most
  with probes: a module file with ``from __future__ import annotations``.
* `freeze`: ``torch.jit.freeze`` with probes compiled out (the frozen graph has exactly the ops of the model
  without probes) or kept toggleable (``keep_probes=True`` preserves each probe's ``enabled`` attribute).
* `scripted_probes`: finds `Probe` submodules of a ScriptModule, also one loaded with ``torch.jit.load``;
  the session toggles their ``enabled`` attribute from Python like on an eager module.
* `check_scriptable`: refuses gradient probes before scripting. TorchScript drops backward hooks silently,
  and instrument would rather refuse than risk a gradient probe that quietly records nothing.

TorchScript is deprecated in favour of torch.export (torch 2.5+ warns on every call); the helpers here filter
exactly that warning.
"""

import contextlib
import sys
import warnings
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from instrument.errors import ProbeError

__all__ = ["ScriptedProbe", "check_scriptable", "freeze", "is_scripted", "script", "scripted_probes", "quiet"]

_DEPRECATION = r"`torch\.jit\.\w+` is deprecated"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence exactly TorchScript's own deprecation warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATION, category=DeprecationWarning)
        yield


def is_scripted(module: nn.Module) -> bool:
    return isinstance(module, torch.jit.ScriptModule)


_PROBE_TYPE = "instrument.probes.probe."


def _is_probe_type(qualified_name: str) -> bool:
    # __torch__.instrument.probes.probe.Probe, or __torch__.instrument.probes.probe.___torch_mangle_3.Probe
    return _PROBE_TYPE in qualified_name and qualified_name.endswith(".Probe")


class ScriptedProbe:
    """A probe inside a ScriptModule, seen through the C++ module: ``name``, ``grad`` and ``enabled``."""

    def __init__(self, path: str, c_module) -> None:
        self.path = path
        self._c = c_module
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
    return [(path, ScriptedProbe(path, c)) for path, c in found.items()]


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


def script(module: nn.Module) -> torch.jit.ScriptModule:
    """``torch.jit.script(module)`` without the deprecation warning and with a clearer error for
    ``from __future__ import annotations`` (it turns annotations into strings TorchScript cannot resolve)."""
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
