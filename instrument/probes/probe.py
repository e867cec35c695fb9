"""`Probe`: a named, identity pass-through module users embed anywhere in their own forward.

    class Rule(nn.Module):
        def __init__(self):
            super().__init__()
            self.perceive = ...; self.mlp = ...
            self.p_hidden = instrument.Probe("hidden")
        def forward(self, x):
            h = self.p_hidden(self.perceive(x))      # any intermediate value, where no hook can reach
            return x + self.mlp(h)

Off (every non-logging step) the forward is ``if self.enabled: ...; return x``: one bool test, no op in a
TorchScript, frozen or compiled graph. The session sets ``enabled`` only for its logging steps; then the value
is handed to the ``instrument::record`` operator (see `instrument.probes.record`), which keeps it for the
observers (copied only when it has to be) and returns nothing: the probe returns ``x`` itself. While
``torch.jit.trace`` traces it, it records nothing, so a trace taken in a logging step holds no record op (it
would record on every later call). The forward is written so that ``torch.jit.script`` compiles it unchanged
(the Python-only checks sit under ``if not torch.jit.is_scripting()``, which TorchScript skips but parses):
keep this module free of ``from __future__ import annotations``.
"""

import torch
from torch import Tensor, nn

from instrument.errors import ProbeError
from instrument.probes.record import WatchGradient  # the import registers torch.ops.instrument.record
from instrument.probes.transforms import forward_mode

__all__ = ["Probe"]


class Probe(nn.Module):
    """Identity on every step; on logging steps it records its input under ``name`` for observers.

    Observers read the value of the current rollout iteration as ``context.probes[name]``.

    Args:
        name: unique within a watched model; observers look values up by it.
        grad: also record the gradient flowing back into this value (eager and torch.compile only;
            observers get it through ``Observer.observe_gradients``). Scripting refuses it.

    Attributes:
        enabled: True only during a logging step of a session watching the model; never set it by hand
            in a training loop.
    """

    def __init__(self, name: str, grad: bool = False) -> None:
        super().__init__()
        if not isinstance(name, str) or not name or name != name.strip():
            raise ProbeError(
                f"Probe name must be a non-empty string without surrounding spaces, got {name!r}; "
                f"observers find the value as context.probes[name]."
            )
        if not isinstance(grad, bool):
            raise ProbeError(f"Probe grad must be a bool, got {grad!r}.")
        self.name = name
        self.grad = grad
        self.enabled = False

    def forward(self, x: Tensor) -> Tensor:
        if self.enabled:
            if not torch.jit.is_scripting():  # TorchScript checks its types itself (and skips this branch)
                if not isinstance(x, Tensor) or x.is_nested:
                    _refuse(self.name, x)
                if torch.jit.is_tracing():  # a trace taken in a logging step must not hold a record op
                    return x
            # Compiled code may overwrite x's memory after its last use, unseen by version counters: copy there.
            torch.ops.instrument.record(x, self.name, torch.compiler.is_compiling())
            if self.grad:
                if not torch.jit.is_scripting():  # TorchScript skips this branch: it refuses gradient probes
                    if not torch.compiler.is_compiling() and forward_mode():  # jvp, jacfwd: no gradient
                        return x
                    return WatchGradient.apply(x, self.name)
        return x

    def __getstate__(self) -> dict:
        # A copy (copy.deepcopy, torch.save) taken during a logging step must not record into the session: only
        # the session turns a probe on, and it turns on the ones it watches.
        state = dict(super().__getstate__())
        state["enabled"] = False
        return state

    def __prepare_scriptable__(self) -> "Probe":
        # torch.jit.script calls this before compiling; the refusal itself lives with the TorchScript code.
        from instrument.probes.script import check_scriptable, scripting_here

        check_scriptable(self)
        if self.enabled and not scripting_here():  # plain torch.jit.script copies `enabled`: on for good
            raise ProbeError(
                f"torch.jit.script of a module holding probe {self.name!r} while it is on (during a logging step of "
                f"a session that watches it): the scripted copy would keep recording into later steps. Script it "
                f"before or after the step, or with instrument.script(module), which scripts it with its probes off."
            )
        return self  # (torch.jit.script puts what this returns into the parent: it must be this probe)

    def extra_repr(self) -> str:
        return f"{self.name!r}" + (", grad=True" if self.grad else "")


def _refuse(name: str, value: object) -> None:
    """A probe called on something that is not a tensor (outside TorchScript, which checks types itself)."""
    if isinstance(value, Tensor):  # nested: its values are not one tensor, and the record op has no kernel for it
        raise ProbeError(
            f"Probe {name!r} records one regular tensor, got a nested tensor (layout {value.layout}); probe a "
            f"regular tensor instead: x.values() of a jagged one, or each of x.unbind(), one probe each."
        )
    raise ProbeError(
        f"Probe {name!r} records a Tensor, got {type(value).__name__}; put the probe around one tensor (e.g. "
        f"Probe('out')(output) for an LSTM's (output, (h, c))), one probe per tensor."
    )
