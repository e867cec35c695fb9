"""What an observer sees of one rollout iteration.

A `StepContext` is built once per observed iteration, either by the hook that `Instrumentation.watch`
attaches to a module or by an explicit evolver that calls ``observer(StepContext(...))`` itself. Every tensor
in it is outside autograd (detached, or never in it: then handed over as it is), so an observer can never build
autograd graph into the user's training step.
"""

from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["StepContext", "WIDE_INTEGERS", "difference", "reduction_dtype", "same_view"]


def _detached(value: Optional[Tensor], name: str) -> Optional[Tensor]:
    if value is None:
        return None
    if not isinstance(value, Tensor):
        raise TypeError(
            f"StepContext.{name} must be a torch.Tensor or None, got {type(value).__name__}; "
            f"pass the state tensor itself (for a tuple output, its first element)."
        )
    # A tensor outside autograd (no grad required, so no graph: environment observations, actions) is handed
    # over as it is; detach() would only make another tensor object over the same memory, once per iteration.
    return value.detach() if value.requires_grad else value


def difference(following: Tensor, previous: Tensor) -> Tensor:
    """``following - previous`` in at least float32, unless both are float32 or float64 (or complex): a difference of
    integers wraps around (uint8: 9 - 10 = 255) or overflows (int8), bools do not subtract, and half
    precision overflows (float16: 4e4 - -4e4 is inf). float32 holds the differences of bool, int8, int16, uint8,
    uint16, float16 and bfloat16 values exactly; int32, int64, uint32 and uint64 ones are taken in float64 (float32
    holds integers exactly only to 2**24, so a change of 1 at 2**30 read 0): exact for values within 2**53 in
    magnitude; beyond that each value is first rounded to its nearest float64, as exact as float64 gets. On MPS,
    which has no float64, float32."""
    if following.dtype in _EXACT and previous.dtype in _EXACT:
        return following - previous
    # At least float32; float64 when one side is float64 (whatever its shape) or a wide integer.
    dtype = torch.promote_types(torch.promote_types(following.dtype, previous.dtype), torch.float32)
    if (following.dtype in WIDE_INTEGERS or previous.dtype in WIDE_INTEGERS) and following.device.type != "mps":
        dtype = torch.float64
    return following.to(dtype) - previous.to(dtype)


def reduction_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a state or output of ``dtype`` is reduced in (statistics, norms): float32 and float64 as they are;
    int32, int64, uint32 and uint64 in float64 (float32 on MPS, which has no float64), since float32 holds integers
    exactly only to 2**24; everything else (bool, int8, int16, uint8, uint16, float16, bfloat16) in float32, which
    holds every such value exactly. complex64 and complex128 stay as they are and complex32 becomes complex64: a cast
    to a real dtype would drop the imaginary part. Decided on the dtype alone: no host sync."""
    if dtype in (torch.float32, torch.float64, torch.complex64, torch.complex128):
        return dtype
    if dtype.is_complex:
        return torch.complex64
    if dtype in WIDE_INTEGERS and device.type != "mps":
        return torch.float64
    return torch.float32


def same_view(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same memory the same way (a detached copy of a state is another tensor
    object over the same storage): while both are alive, equal views mean equal values. A tensor without storage
    (a torch.func wrapper, a wrapper subclass) has no memory to compare: False."""
    if a is b:
        return True
    try:
        same_memory = a.data_ptr() == b.data_ptr()
    except RuntimeError:  # "Cannot access data pointer of Tensor that doesn't have storage"
        return False
    return same_memory and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and (
        a.device == b.device
    )


# Integer dtypes with values float32 cannot hold exactly (magnitudes beyond 2**24).
WIDE_INTEGERS = frozenset(
    getattr(torch, name) for name in ("int32", "int64", "uint32", "uint64") if hasattr(torch, name)
)
_EXACT = (torch.float32, torch.float64, torch.complex64, torch.complex128)


class StepContext:
    """One rollout iteration, as observers see it.

    Attributes:
        previous_state: the state the iteration started from.
        next_state: the state it produced.
        dx: ``next_state - previous_state`` unless given explicitly; computed lazily on first access so an
            observer that never reads it costs nothing. For integer, bool and half-precision states it is
            taken in at least float32, and for int32, int64, uint32 and uint64 ones in float64 (`difference`): a
            uint8 frame going from 10 to 9 would otherwise read 255.
        condition: whatever conditioned the iteration (an action, a goal, a class embedding), or None.
        step_index: the index of the iteration within the rollout, 0..n-1.
        freeze_channels: channel indices the update rule must not change (e.g. an NCA's input channels).
        probes: values recorded by embedded probes during this iteration, name -> tensor.
    """

    # Read-only: every observer of an iteration gets the same context (and in the explicit-evolver style it is
    # the caller's own), so one that rebound ``next_state`` would change what the observers after it see. The
    # attributes are properties over these slots; an observer that wants other values makes a new StepContext.
    __slots__ = ("_previous", "_next", "_dx", "_condition", "_index", "_freeze", "_probes")

    def __init__(
        self,
        previous_state: Tensor,
        next_state: Tensor,
        dx: Optional[Tensor] = None,
        condition: Optional[Tensor] = None,
        step_index: int = 0,
        freeze_channels: Optional[Sequence[int]] = None,
        probes: Optional[Mapping[str, Tensor]] = None,
    ) -> None:
        self._previous = _detached(previous_state, "previous_state")
        self._next = _detached(next_state, "next_state")
        if self._previous is None or self._next is None:
            raise TypeError("StepContext needs both previous_state and next_state tensors, got None.")
        self._dx = _detached(dx, "dx")
        self._condition = _detached(condition, "condition")
        self._index = int(step_index)
        self._freeze = tuple(freeze_channels) if freeze_channels is not None else None
        self._probes: Dict[str, Tensor] = (
            {name: value.detach() for name, value in probes.items()} if probes else {}
        )

    @classmethod
    def _of_call(cls, previous: Tensor, following: Tensor, condition: Optional[Tensor], index: int,
                 freeze: Optional[Tuple[int, ...]]) -> "StepContext":
        """A watched module's call, from its hook (once per iteration of a logging step): what ``__init__`` does,
        without checking what the hook already knows (two tensors, an int, a tuple or None) and without
        keyword-argument handling, which took about half of the hook's time to build a context."""
        self = cls.__new__(cls)
        self._previous = previous.detach() if previous.requires_grad else previous
        self._next = following.detach() if following.requires_grad else following
        self._dx = None
        self._condition = None if condition is None else _detached(condition, "condition")
        self._index = index
        self._freeze = freeze
        self._probes = {}
        return self

    @property
    def previous_state(self) -> Tensor:
        return self._previous

    @property
    def next_state(self) -> Tensor:
        return self._next

    @property
    def condition(self) -> Optional[Tensor]:
        return self._condition

    @property
    def step_index(self) -> int:
        return self._index

    @property
    def freeze_channels(self) -> Optional[Tuple[int, ...]]:
        return self._freeze

    @property
    def probes(self) -> Mapping[str, Tensor]:
        return self._probes

    @property
    def dx(self) -> Tensor:
        if self._dx is None:
            self._dx = difference(self._next, self._previous)
        return self._dx

    @property
    def dx_if_known(self) -> Optional[Tensor]:
        """``dx`` if it was given or already computed, else None: an observer that can take the difference
        later, batched over many iterations, reads this instead of paying a subtraction per iteration."""
        return self._dx

    def __repr__(self) -> str:
        shape = tuple(self.next_state.shape)
        return f"StepContext(step_index={self.step_index}, state_shape={shape}, probes={sorted(self.probes)})"


