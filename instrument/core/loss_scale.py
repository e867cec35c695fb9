"""`LossScale`: the loss scale of a ``torch.amp.GradScaler`` during one logging step, so that gradients read in
the step are logged as the gradients of the loss, not of the loss times the scale.

Mixed-precision training multiplies the loss by a scale S (65536 at first) before ``backward()``, so every
gradient autograd delivers is S times the loss's until ``scaler.unscale_(optimizer)`` (or ``scaler.step``, which
unscales first) divides the parameters' gradients in place. Two readers would see them scaled: gradient probes,
recorded during backward, before any unscaling; and observers that read parameters' gradients when the optimizer
step runs after the ``with inst.step`` block (gradient accumulation). Given the scaler
(``Instrumentation(grad_scaler=scaler)``), the session divides probe gradients by the scale in force when the step
began (the scale its backward used: ``scaler.update()``, which changes it, runs after backward), and observers
ask `LossScale.pending` whether the parameters' gradients are still scaled when they read them.

Lifecycle, driven by the session on logging steps only: ``begin()`` as the step starts (one copy of the scale, a
one-element tensor, on its device), ``unscale`` / ``pending`` while the step ends, ``end()`` after it.

It reads the scaler's ``_scale`` and ``_per_optimizer_states``, private but unchanged since torch 1.6: the public
``get_scale()`` is a host sync, and only the per-optimizer states tell whether gradients were unscaled.
``update()`` replaces that dict, so a dict other than the one seen at the step's start means the optimizer step
and the update ran inside the block, which unscaled the gradients of every optimizer stepped.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from instrument.errors import ConfigurationError

__all__ = ["LossScale", "divided"]

Scale = Union[Tensor, float]


class LossScale:
    """One session's view of a ``torch.amp.GradScaler`` (see the module docstring)."""

    def __init__(self, scaler: Any) -> None:
        if not isinstance(scaler, torch.amp.GradScaler):
            raise ConfigurationError(
                f"grad_scaler takes the torch.amp.GradScaler your training loop scales its loss with, got "
                f"{type(scaler).__name__} ({scaler!r}). Pass the same object you call scaler.scale(loss) on, or "
                f"None when the loss is not scaled."
            )
        self.scaler = scaler
        self._states: Any = None  # the scaler's per-optimizer dict when the step began (`pending`)
        self._start: Optional[Scale] = None  # the scale when the step began; None: not scaling

    @property
    def enabled(self) -> bool:
        return bool(self.scaler.is_enabled())

    def begin(self) -> None:
        """A logging step starts: keep the scale its backward will use."""
        scaler = self.scaler
        self._states = getattr(scaler, "_per_optimizer_states", None)
        if not self.enabled:
            self._start = None
            return
        scale = getattr(scaler, "_scale", None)
        # No scale tensor yet: the first scaler.scale(loss) makes one holding the initial scale.
        self._start = scale.detach().clone() if isinstance(scale, Tensor) else float(scaler._init_scale)

    def end(self) -> None:
        self._states = self._start = None

    def unscale(self, gradients: Mapping[str, Sequence[Tensor]]) -> Dict[str, List[Tensor]]:
        """Gradient probes' values divided by the scale the step's backward used (dtype and device kept).

        Division by a power of two (GradScaler's scales are, with its default factors) is exact barring
        underflow; a scaled gradient that overflowed stays inf, as the gradient GradScaler saw."""
        start = self._start
        if start is None:
            return {name: list(values) for name, values in gradients.items()}
        with torch.no_grad():
            return {name: [divided(g, start) for g in values] for name, values in gradients.items()}

    def pending(self) -> Optional[Scale]:
        """The scale the parameters' gradients are still multiplied by, or None when they are not scaled now.

        Not scaled: the scaler is off or was never used; ``scaler.update()`` ran inside the step (after
        ``scaler.step``, which unscales); or ``unscale_``/``step`` ran for an optimizer in it. Scaled otherwise:
        backward ran with the scaled loss and the optimizer step comes after the block."""
        scaler = self.scaler
        scale = getattr(scaler, "_scale", None)
        if not self.enabled or not isinstance(scale, Tensor):
            return None
        states = getattr(scaler, "_per_optimizer_states", None)
        if states is None or states is not self._states:
            return None
        if any(state.get("stage") is not None and state["stage"].value != 0 for state in states.values()):
            return None  # an optimizer's gradients were unscaled (stage UNSCALED or STEPPED)
        return scale



def divided(tensor: Tensor, scale: Scale) -> Tensor:
    """``tensor / scale`` in ``tensor``'s dtype, on its device (a one-element CPU scale divides any device's)."""
    if isinstance(scale, Tensor) and scale.device != tensor.device and scale.device.type != "cpu":
        scale = scale.to(tensor.device, non_blocking=True)
    return tensor / scale
