"""The probe operators and the recorder they write into.

An enabled `Probe` calls ``torch.ops.instrument.probe(value, name, grad)``, a custom operator whose kernel is
plain Python. Eager mode, TorchScript (also a module saved with ``torch.jit.save`` and loaded in another
process that imports instrument) and torch.compile (where the operator stays opaque: no graph break, no
recompile per call) all call that kernel at run time, so it can hand the value to the session without tracing
or scripting any Python of ours. The kernel stores a detached copy in the `Recorder` the session installed for
the current logging step; with no recorder installed it stores nothing. Observers run later, outside compiled
code.

The operator returns a copy of its input (a custom operator may not return an alias of an input), and its
autograd formula is the identity. With ``grad=True`` the backward formula passes the incoming gradient through
a second opaque operator, ``instrument::probe_grad``, whose body records it: gradient probes need no tensor
hook, so nothing has to be registered or removed.

Both operators are registered when this module is imported (``import instrument`` does it).
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from instrument.core.recompute import in_recompute
from instrument.errors import ProbeError

__all__ = ["Recorder", "active_recorder", "install", "uninstall"]


class Recorder:
    """What embedded probes record during one logging step.

    ``pending`` holds the latest value of each probe since the last `drain` (the dispatcher drains it at every
    observer call, so a context gets the values recorded during its iteration). ``gradients`` holds each
    gradient probe's gradients in the order backward delivered them.
    """

    def __init__(self) -> None:
        self.pending: Dict[str, Tensor] = {}
        self.gradients: Dict[str, List[Tensor]] = {}
        self.recorded = 0
        self.delivered = 0

    def put(self, name: str, value: Tensor) -> None:
        self.pending[name] = value
        self.recorded += 1

    def drain(self) -> Dict[str, Tensor]:
        values, self.pending = self.pending, {}
        self.delivered += len(values)
        return values

    def put_gradient(self, name: str, gradient: Tensor) -> None:
        self.gradients.setdefault(name, []).append(gradient)

    def gradients_in_forward_order(self) -> Dict[str, List[Tensor]]:
        """Backward visits a chained rollout's iterations last to first; reverse to index by iteration."""
        return {name: values[::-1] for name, values in self.gradients.items()}


_active: Optional[Recorder] = None


def active_recorder() -> Optional[Recorder]:
    return _active


def install(recorder: Recorder) -> None:
    """Make ``recorder`` the one enabled probes write into (for one logging step)."""
    global _active
    if _active is not None and _active is not recorder:
        raise ProbeError(
            "another Instrumentation is inside a logging step with embedded probes; probe values go to one "
            "session at a time. Finish that step first, or watch all models with one Instrumentation."
        )
    _active = recorder


def uninstall(recorder: Recorder) -> None:
    global _active
    if _active is recorder:
        _active = None


# ---------------------------------------------------------------------------------------------- the operators
# Defined with the low-level torch.library API rather than @torch.library.custom_op: the latter wraps the
# kernel so that its first call imports torch._dynamo (seconds, even for users who never compile).
_lib = torch.library.Library("instrument", "DEF")
_lib.define("probe(Tensor value, str name, bool grad) -> Tensor")
_lib.define("probe_grad(Tensor gradient, str name) -> Tensor")


def _probe(value: Tensor, name: str, grad: bool) -> Tensor:
    recorder = _active
    if recorder is not None and not in_recompute():
        recorder.put(name, value.detach().clone())
    return value.clone()


def _probe_grad(gradient: Tensor, name: str) -> Tensor:
    recorder = _active
    if recorder is not None:
        recorder.put_gradient(name, gradient.detach().clone())
    return gradient.clone()


def _probe_setup(ctx, inputs, output) -> None:
    _, ctx.probe_name, ctx.probe_grad = inputs


def _probe_backward(ctx, gradient: Tensor):
    if ctx.probe_grad:
        gradient = torch.ops.instrument.probe_grad(gradient, ctx.probe_name)
    return gradient, None, None


_lib.impl("probe", _probe, "CompositeExplicitAutograd")
_lib.impl("probe_grad", _probe_grad, "CompositeExplicitAutograd")
torch.library.register_fake("instrument::probe", lambda value, name, grad: torch.empty_like(value), lib=_lib)
torch.library.register_fake("instrument::probe_grad", lambda grad, name: torch.empty_like(grad), lib=_lib)
torch.library.register_autograd("instrument::probe", _probe_backward, setup_context=_probe_setup, lib=_lib)
