"""`ProbeSet`: the embedded probes of one watched model, found once and switched per logging step.

`Instrumentation.watch` builds one per watched module. It finds every `Probe` in an eager module tree, in a
``torch.compile`` wrapper (through its ``_orig_mod``) and in a ScriptModule (also a loaded or frozen one), and
checks that names are unique. On a logging step the session calls `on` (set ``enabled``, and for eager and
compiled models route the forward through `ForwardSwitch`) and `off` when the step ends, also when it raises.
"""

import threading
from typing import Any, Dict, List, Sequence, Tuple

from torch import nn

from instrument.core.dispatch import observer_name
from instrument.errors import ConfigurationError, ProbeError
from instrument.probes import compiled, script
from instrument.probes.probe import Probe

__all__ = ["ProbeSet"]

# `probe_identity` -> [probe, how many sets have it on]: sets of one session or several share a probe's ``enabled``
_holders: Dict[Any, List[Any]] = {}
_holders_lock = threading.Lock()


class ProbeSet:
    """Probes of one watched model by name.

    Attributes:
        probes: name -> probe module (eager `Probe` or its scripted counterpart).
        paths: name -> dotted path of the probe in the watched model.
        scripted: whether the model is a ScriptModule.
    """

    def __init__(self, module: nn.Module, label: str = "") -> None:
        if not isinstance(module, nn.Module):
            raise ConfigurationError(
                f"watch() expects a torch.nn.Module (eager, scripted or compiled), "
                f"got {type(module).__name__}."
            )
        self.module = module
        root = compiled.unwrap(module)
        self.label = label or type(root).__name__
        self.scripted = script.is_scripted(root)
        if self.scripted:
            script.drop_python_boundaries(root)  # Python calls are observed from Python (script.observe_calls)
            found = script.scripted_probes(root)
            for _, probe in found:
                script.check_scriptable(probe)
        else:
            found = _eager_tree_probes(root)
        self.probes: Dict[str, nn.Module] = {}
        self.paths: Dict[str, str] = {}
        for path, probe in found:
            name = str(probe.name)
            if name in self.probes:
                raise ProbeError(
                    f"two probes named {name!r} in watched model {self.label}: at {self.paths[name]!r} and "
                    f"{path!r}. Probe names must be unique within a watched model; give each Probe its own "
                    f"name."
                )
            self.probes[name] = probe
            self.paths[name] = path
        self._held: List[Any] = []  # the probes it counted on in `_holders` (`on`)
        self._switch = None if self.scripted or not self.probes else compiled.ForwardSwitch(
            compiled.ancestors(root, list(self.paths.values()))
        )

    @property
    def names(self) -> List[str]:
        return list(self.probes)

    @property
    def has_grad(self) -> bool:
        return any(bool(p.grad) for p in self.probes.values())

    def on(self) -> None:
        with _holders_lock:
            if self._held:  # on already (and counted once)
                return
            for probe in self.probes.values():
                entry = _holders.setdefault(probe_identity(probe), [probe, 0])
                entry[1] += 1
                self._held.append(probe)  # as it goes: an `on` that raises half way is undone by `off` exactly
                probe.enabled = True
        if self._switch is not None:
            self._switch.on()

    def off(self) -> None:
        """Switch the probes off, but those another set still holds on: the same probe watched twice by one
        session (a model and a submodule of it), or by another session whose logging step is open (an evaluation
        session on its own thread): one set's `off` mid-step turned that step's probes off for the rest of it."""
        if self._switch is not None:
            self._switch.off()
        with _holders_lock:
            held, self._held = self._held, []
            for probe in held:
                entry = _holders.get(probe_identity(probe))
                if entry is None or entry[1] <= 1:
                    _holders.pop(probe_identity(probe), None)
                    probe.enabled = False
                else:
                    entry[1] -= 1

    def __len__(self) -> int:
        return len(self.probes)


def probe_identity(probe: Any) -> Any:
    """What makes two found probes one: an eager `Probe` is itself, but a probe inside a ScriptModule is seen through
    a `ScriptedProbe` made anew by each watch, and two of them are one probe when they wrap the same TorchScript
    module (whose hash is its object's identity)."""
    return ("scripted", hash(probe._c)) if isinstance(probe, script.ScriptedProbe) else id(probe)


def _eager_tree_probes(root: nn.Module) -> List[Tuple[str, Any]]:
    """``(path, probe)`` of every probe under an eager ``root``: `Probe` modules, and the probes of ScriptModule
    submodules (``self.inner = instrument.script(Rule())``), whose probes are not `Probe` instances there."""
    found: List[Tuple[str, Any]] = []
    scripted: List[str] = []  # paths of ScriptModule submodules: their own submodules are found through them
    for path, sub in root.named_modules():
        if any(path.startswith(prefix) for prefix in scripted):
            continue
        if isinstance(sub, Probe):
            found.append((path, sub))
        elif script.is_scripted(sub):
            scripted.append(path + ".")
            for inner, probe in script.scripted_probes(sub):
                script.check_scriptable(probe)
                found.append((f"{path}.{inner}", probe))
    return found


def check_unique_names(watched: Sequence["ProbeSet"], new: "ProbeSet") -> None:
    """Probe names are unique across the models one session watches: a value goes to one name."""
    for probes in watched:
        for name in sorted(set(new.probes) & set(probes.probes)):
            if probe_identity(new.probes[name]) != probe_identity(probes.probes[name]):
                raise ProbeError(
                    f"probe {name!r} of {new.label} (at {new.paths[name]!r}) has the same name as a "
                    f"probe of already watched {probes.label} (at {probes.paths[name]!r}); probe names "
                    f"must be unique across the models one Instrumentation watches."
                )


def check_probe_requests(observers: Sequence[Any], available: Sequence[str]) -> None:
    """Every probe an observer asks for (``observer.probes``) exists in a watched model."""
    for observer in observers:
        wanted = getattr(observer, "probes", ()) or ()
        if isinstance(wanted, str):
            wanted = (wanted,)
        missing = [name for name in wanted if name not in available]
        if missing:
            raise ProbeError(
                f"observer {observer_name(observer)!r} asks for probe(s) {missing}, but no watched model "
                f"has a probe of that name (probes found: {sorted(available) or 'none'}). Add "
                f"instrument.Probe({missing[0]!r}) to the model and watch it with inst.watch(model)."
            )
