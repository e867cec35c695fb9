"""`LossScale`: the loss scale of a ``torch.amp.GradScaler`` during one logging step, so that gradients read in
the step are logged as the gradients of the loss, not of the loss times the scale.

Mixed-precision training multiplies the loss by a scale S (65536 at first) before ``backward()``, so every
gradient autograd delivers is S times the loss's until ``scaler.unscale_(optimizer)`` (or ``scaler.step``, which
unscales first) divides that optimizer's parameters' gradients in place. Two readers would see them scaled:
gradient probes, recorded during backward, before any unscaling; and observers that read parameters' gradients
when an optimizer step runs after the ``with inst.step`` block (gradient accumulation, a second optimizer
stepped later). Given the scaler (``Instrumentation(grad_scaler=scaler)``), the session divides probe gradients
by the scale of the step's last ``scaler.scale(loss)`` call, and observers ask `LossScale.scales` which of their
parameters' gradients are still scaled.

How it knows, per parameter: while some session is in a logging step with this scaler (only then), the
``scale``, ``unscale_`` and ``step`` of the scaler's class are wrapped, and put back when the last such step
ends. The wrappers pass every other scaler straight through; on the class, not the instance, they are never
pickled or copied with a scaler. After ``scale`` a session keeps a copy of the scale used (one one-element
tensor on its device; ``update()`` changes the scale in place); after ``unscale_``, or a ``step`` of an optimizer
that unscales inside its own step (fused Adam, AdamW, SGD: ``_step_supports_amp_scaling``), it notes that
optimizer's parameters. A parameter's gradient is then still scaled when a ``scale`` call came in the step and
nothing unscaled it since: not unscaled in the step, or unscaled before the last ``scale`` call and changed after
that call (by the backward that followed). A gradient left untouched by the whole step (kept from an earlier
step) is never taken for a scaled one. No host sync: the scale is read as a device tensor (the public
``get_scale()`` is a ``.item()``), and it reads the scaler's ``_scale``, private but unchanged since torch 1.6.
"""

import functools
import logging
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from instrument.core.devices import to_device
from instrument.errors import ConfigurationError

__all__ = ["LossScale", "divided", "divisors"]

log = logging.getLogger("instrument")

_WRAPPED = ("scale", "unscale_", "step")
_MISSING = object()
_lock = threading.Lock()
_active: Dict[int, List["LossScale"]] = {}  # id(scaler) -> the sessions in a logging step with it
_wrapped: Dict[type, Tuple[int, Dict[str, Any]]] = {}  # scaler class -> (steps using it, its own entries)


def _wrapper(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def call(scaler: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(scaler, *args, **kwargs)
        for session in tuple(_active.get(id(scaler), ())):
            if session.scaler is scaler:
                try:  # the user's training step: what a session notes must never stop it
                    getattr(session, "_after_" + name.rstrip("_"))(*args, **kwargs)
                except Exception:
                    log.debug("instrument: noting GradScaler.%s failed", name, exc_info=True)
        return out

    call.instrument_wrapped = original
    return call


def _wrap(scaler: Any) -> None:
    cls = type(scaler)
    count, own = _wrapped.get(cls, (0, {}))
    if not count:
        for name in _WRAPPED:
            own[name] = cls.__dict__.get(name, _MISSING)
            original = getattr(cls, name)  # a base class's wrapper (a subclass's steps overlap a GradScaler's):
            setattr(cls, name, _wrapper(name, getattr(original, "instrument_wrapped", original)))  # its original
    _wrapped[cls] = (count + 1, own)


def _unwrap(scaler: Any) -> None:
    cls = type(scaler)
    count, own = _wrapped.get(cls, (0, {}))
    if count > 1:
        _wrapped[cls] = (count - 1, own)
        return
    _wrapped.pop(cls, None)
    for name, entry in own.items():
        if entry is _MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, entry)


GradState = Optional[Tuple[Tensor, int]]  # a parameter's gradient and its version counter, None: no gradient


def _grad_state(p: Tensor) -> GradState:
    grad = p.grad
    return None if grad is None else (grad, grad._version)


def _same(p: Tensor, state: GradState) -> bool:
    """``p``'s gradient is the tensor ``state`` holds, unchanged since (same object, same version)."""
    grad = p.grad
    if state is None or grad is None:
        return state is None and grad is None
    return grad is state[0] and grad._version == state[1]


class LossScale:
    """One session's view of a ``torch.amp.GradScaler`` (see the module docstring). Lifecycle, driven by the
    session on logging steps only: ``begin()`` as the step starts (wraps the scaler), ``track`` from observers'
    ``attach``, then ``unscale`` / ``scales`` / ``current`` while the step ends, ``end()`` (unwraps it)."""

    def __init__(self, scaler: Any) -> None:
        if not isinstance(scaler, torch.amp.GradScaler):
            raise ConfigurationError(
                f"grad_scaler takes the torch.amp.GradScaler your training loop scales its loss with, got "
                f"{type(scaler).__name__} ({scaler!r}). Pass the same object you call scaler.scale(loss) on, or "
                f"None when the loss is not scaled."
            )
        self.scaler = scaler
        self._wrapping = False  # this session is in a logging step with the scaler's class wrapped
        self._start: Optional[Union[Tensor, float]] = None  # the scale when the step began; None: not scaling
        self._used: Optional[Tensor] = None  # the scale of the step's last scale() call
        self._calls = 0  # scale() and unscale_() calls in this step, in order
        self._scaled_at = 0  # the number of the last scale() call (0: none in this step)
        # id(param) -> [call number of its unscaling, param, its GradState at the next scale() call, the scale
        # it keeps: None, or where a fused step skipped, a tensor of the scale where it found an inf, else 1]
        self._unscaled: Dict[int, List[Any]] = {}
        self._at_begin: Dict[int, GradState] = {}  # id(param) -> its gradient when the step began (`track`)

    @property
    def enabled(self) -> bool:
        return bool(self.scaler.is_enabled())

    def begin(self) -> None:
        """A logging step starts: keep the scale, and wrap the scaler class's ``scale``, ``unscale_`` and
        ``step`` until `end`."""
        self._release()  # a start cut short left the class wrapped for this session
        self._used, self._calls, self._scaled_at, self._unscaled, self._at_begin = None, 0, 0, {}, {}
        if not self.enabled:
            self._start = None
            return
        scaler = self.scaler
        scale = getattr(scaler, "_scale", None)
        # No scale tensor yet: the first scaler.scale(loss) makes one holding the initial scale.
        self._start = scale.detach().clone() if isinstance(scale, Tensor) else float(scaler._init_scale)
        with _lock:
            _wrap(scaler)
            _active.setdefault(id(scaler), []).append(self)
            self._wrapping = True

    def end(self) -> None:
        self._release()
        self._start = self._used = None
        self._unscaled, self._at_begin = {}, {}

    def _release(self) -> None:
        if not self._wrapping:
            return
        with _lock:
            self._wrapping = False
            sessions = _active.get(id(self.scaler), [])
            if self in sessions:
                sessions.remove(self)
            if not sessions:
                _active.pop(id(self.scaler), None)
            _unwrap(self.scaler)

    def _after_scale(self, *args: Any, **kwargs: Any) -> None:
        scale = getattr(self.scaler, "_scale", None)
        if isinstance(scale, Tensor):
            self._calls += 1
            self._scaled_at = self._calls
            self._used = scale.detach().clone()  # update() changes the scaler's in place
            for entry in self._unscaled.values():  # what an unscaled gradient is until a backward changes it
                entry[2] = _grad_state(entry[1])

    def _after_unscale(self, optimizer: Any = None, *args: Any, left: Optional[Tensor] = None, **kwargs: Any) -> None:
        """``optimizer``'s gradients were unscaled (``left``: the scale they keep, where a fused step skipped)."""
        self._calls += 1
        for group in getattr(optimizer, "param_groups", ()):
            for p in group["params"]:
                self._unscaled[id(p)] = [self._calls, p, None, left]

    def _after_step(self, optimizer: Any = None, *args: Any, **kwargs: Any) -> None:
        # An optimizer that unscales inside its own step (fused kernels) is never given to unscale_: the step
        # unscales its gradients in place, unless it found an inf (a skipped step: they stay scaled, `left`).
        # Others went through unscale_, noted already; so did a fused one unscaled before its step.
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            return
        params = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
        if any(self._unscaled.get(id(p), [0])[0] > self._scaled_at for p in params):
            return
        state = getattr(self.scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
        found = list(state.get("found_inf_per_device", {}).values())
        used = self._used if self._used is not None else self._start
        left = None
        if found and isinstance(used, Tensor):
            found_inf = sum(f.to(used.device, non_blocking=True) for f in found)
            left = torch.where(found_inf > 0, used, torch.ones_like(used))
        self._after_unscale(optimizer, left=left)

    def track(self, params: Sequence[Tensor]) -> None:
        """Note ``params``' gradients as the step begins: one the step leaves untouched is not its backward's."""
        for p in params:
            self._at_begin[id(p)] = _grad_state(p)

    def unscale(self, gradients: Mapping[str, Sequence[Tensor]]) -> Dict[str, List[Tensor]]:
        """Gradient probes' values divided by the scale of the step's last ``scale`` call (else the scale when
        the step began), on their devices. Division by a power of two (GradScaler's scales are, with its
        default factors) is exact barring underflow; a scaled gradient that overflowed stays inf."""
        scale = self._used if self._used is not None else self._start
        if scale is None:
            return {name: list(values) for name, values in gradients.items()}
        with torch.no_grad():
            return {name: [divided(g, scale) for g in values] for name, values in gradients.items()}

    def scales(self, params: Sequence[Tensor]) -> List[Optional[Tensor]]:
        """Per parameter, the scale its gradient is still multiplied by, or None where it is not scaled now."""
        used = self._used
        if used is None or not self.enabled:
            return [None] * len(params)
        out: List[Optional[Tensor]] = []
        for p in params:
            if id(p) in self._at_begin and _same(p, self._at_begin[id(p)]):
                out.append(None)  # untouched by this step: a gradient kept from before it
                continue
            entry = self._unscaled.get(id(p))
            if entry is not None and (entry[0] > self._scaled_at or (entry[2] is not None and _same(p, entry[2]))):
                out.append(entry[3])  # unscaled after the last scale() call, or unchanged since that call
                continue
            out.append(used)
        return out

    def current(self) -> Optional[Tensor]:
        """A copy of the scaler's scale now (after any ``update()`` in the step), None when it has none."""
        scale = getattr(self.scaler, "_scale", None)
        return scale.detach().clone() if self.enabled and isinstance(scale, Tensor) else None


def divisors(scales: Sequence[Optional[Tensor]], like: Tensor) -> Tensor:
    """A [len(scales)] tensor on ``like``'s device: each scale, 1 where it is None (in float32 at least: 65536
    is inf in float16)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    used = next(s for s in scales if s is not None)
    if any(s is not None and s is not used for s in scales):  # several scales (a fused step that skipped)
        one = torch.ones((), dtype=dtype, device=like.device)
        return torch.stack([one if s is None else _on(s, like.device).to(dtype) for s in scales])
    mask = to_device(torch.tensor([s is not None for s in scales]), like.device)  # no host sync
    return torch.where(mask, _on(used, like.device).to(dtype), 1.0)


def divided(tensor: Tensor, scale: Union[Tensor, float]) -> Tensor:
    """``tensor / scale`` on ``tensor``'s device, in its dtype (a 0-d half-precision tensor, a norm, is widened
    to the scale's float32)."""
    return tensor / (_on(scale, tensor.device) if isinstance(scale, Tensor) else scale)


def _on(scale: Tensor, device: torch.device) -> Tensor:
    """The one-element ``scale`` usable with a tensor on ``device`` (a CPU one works with any device's)."""
    if scale.device == device or scale.device.type == "cpu":
        return scale
    # host sync: a device's scale divides a CPU tensor (gradients offloaded to the host): the copy must have
    # landed before the CPU reads it, which a non-blocking copy does not promise. One element, logging steps only.
    return scale.to(device)
