"""Per-iteration tensors kept by reference until log time.

Reducing every iteration as it happens costs a dozen small kernel launches per iteration, and on small states
(a [256, 4] CartPole observation) that launch overhead is most of an observer's cost. Keeping a reference and
reducing all iterations at log time costs one ``torch.stack`` and a few large reductions instead (see
`instrument.observers.stats`). A reference costs no copy, and the tensor is usually alive anyway: autograd saves
it for backward. The stacked copy belongs to the buffer, so the reduction may overwrite it (``scratch=True``)
instead of allocating temporaries. On a CPU, states of ``batch_below`` elements or more are reduced as they
come: the stack of many of them no longer fits in cache (measured on CPU, torch 2.13, 32 iterations: a
[4, 16, 24, 24] state reduces about 4x faster batched than per iteration, a [4, 16, 64, 64] one 1.3x slower).
On a GPU every size is batched (up to ``max_elements``): there the cost of reducing as they come is the kernel
launches, about 30 per reduction, paid again for every iteration (measured on an H200, torch 2.11: the demo
NCA's three hooked layers outputs, 32 iterations, made `ActivationStats` cost 2.2x a bare step).

On a CPU, a stack of more than twice `PIECE_BYTES` (4 MB) is built and reduced in pieces of about 4 MB, one
after the other: each piece and the reduction's temporaries stay in cache instead of streaming through memory,
and no large buffer is allocated afresh (new pages) at every logging step. The reductions are per iteration, so
the results are the same. Measured on CPU, torch 2.13, one thread: 200 [256, 64] activations of an RL policy
(13 MB) reduce in 3.2-4.0 ms in 4 MB pieces instead of 5.8-6.9 ms at once; an 8 MB stack of 32 [4, 16, 32, 32]
states takes the same time either way, and smaller stacks are faster whole (the demo NCA's 4.7 MB: 0.6-0.9 ms
whole, about 1 ms in pieces), so they stay whole. On a GPU the stack is never split: each piece would cost its
kernel launches again.

A rollout that changes a state in place after it was observed would make the kept reference wrong. Each
tensor's version counter is remembered and checked at read time, so that case is detected, never silently
logged; the owner then falls back to reducing as it goes. Every view of a tensor shares its version counter,
so a state that is one slice of a larger buffer (a preallocated trajectory, ``traj[t + 1] = rule(traj[t])``)
would read as changed as soon as the next slice is written: from the first iteration that hands over such a
slice (a tensor that reaches only part of its storage), the iterations are kept as copies instead, and those
kept before it are copied then, while they still hold what was observed.
Inference tensors have no version counter, so they are always reduced as they come. ``max_elements`` bounds the
memory: once the buffered tensors hold that many elements, the owner reduces them early and lets them go. An
iteration whose tensors have another shape than the one before (a batch size that changes within a step: a
rollout, then minibatches) first reduces what is buffered, since one stack holds one shape. Reductions that then
differ in shape (a channel count that changed) are padded by an owner that has a neutral value (NonFinite's count
0), and refused with a clear error by the others (`IterationBuffer.results`).
"""

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from instrument.core.storage import part_of_larger
from instrument.errors import InstrumentError, InvalidValueError

__all__ = ["IterationBuffer", "ModifiedInPlaceError", "PIECE_BYTES", "ShapeChangedError"]

PIECE_BYTES = 4 * 2**20  # on a CPU, the most bytes stacked and reduced at once (see the module docstring)


class ModifiedInPlaceError(InstrumentError, RuntimeError):
    """A buffered tensor was modified in place after it was observed."""


class ShapeChangedError(InvalidValueError):
    """The buffered iterations' reductions differ in shape and the owner has no value to pad them with."""


class IterationBuffer:
    """Holds tuples of tensors (one tuple per iteration) and hands them back stacked.

    Args:
        reduce: called with the stacked tensors (each [k, ...]) and ``scratch`` whenever the buffer is drained;
            ``scratch=True`` means the tensors are copies it may overwrite. Its result is kept and returned by
            `results`.
        max_elements: drain early once the buffered tensors hold this many elements (None: never).
        batched: False reduces each iteration as it comes (no references kept). Set to False automatically
            after an in-place modification was detected.
        batch_below: on a CPU, only iterations whose tensors hold fewer elements than this are batched; larger
            ones are reduced as they come (on other devices every size is batched).
        stack: turns the buffered columns (one list of tensors per tuple position, in iteration order) into
            the tensors handed to ``reduce``; None stacks each column (``torch.stack``).
    """

    def __init__(
        self,
        reduce: Callable[..., Tensor],
        max_elements: Optional[int] = 64 * 2**20,
        batched: bool = True,
        batch_below: int = 2**17,
        stack: Optional[Callable[[List[List[Tensor]]], Sequence[Tensor]]] = None,
    ) -> None:
        self.reduce = reduce
        self.stack = stack
        self.max_elements = max_elements
        self.batched = batched
        self.batch_below = batch_below
        # One [(tensor, version), ...] per iteration; version None: a copy the buffer made, not checked.
        self._items: List[List[Tuple[Tensor, Optional[int]]]] = []
        self._elements = 0
        self._results: List[Tensor] = []
        self._shapes: list = []  # the shapes of the buffered iterations' tensors (all alike)
        self._copies = False  # the iterations' tensors are slices of larger buffers: copies are kept (`append`)

    def clear(self) -> None:
        self._items, self._results, self._elements, self._shapes = [], [], 0, []
        self._copies = False

    def append(self, *tensors: Tensor, sources: Optional[Sequence[Tensor]] = None) -> None:
        """Keep one iteration's tensors. ``sources``: the tensors to look at for slices of a larger buffer
        instead of ``tensors`` (whose views of a whole state, such as one channel of it, are slices themselves)."""
        # Called on every iteration of a logging step: one plain loop that also builds the entry (a
        # comprehension is a function call of its own on Python 3.11).
        elements, entry, shapes, cpu = 0, [], [], False
        for t in tensors:
            if t.is_inference():  # torch.inference_mode: no version counter to check, so never kept
                entry = None
                break
            elements += t.numel()
            entry.append((t, t._version))
            shapes.append(t.shape)
            cpu = cpu or t.is_cpu
        if entry is None or not self.batched or (cpu and elements >= self.batch_below):
            self.drain()  # keep the iterations in order
            self._results.append(self.reduce(*[t.unsqueeze(0) for t in tensors], scratch=False))
            return
        if shapes != self._shapes:  # a new shape (a batch size that changed mid-step): one stack, one shape
            self.drain()
            self._shapes = shapes
            self._copies = any(part_of_larger(t) for t in (tensors if sources is None else sources))
        elif not self._copies:
            # A rollout may start from a whole tensor and hand over slices from its second iteration on
            # (``traj[t] = rule(x); x = traj[t]``): looked at every iteration until slices come (about 0.5 us a
            # tensor). A storage larger than the tensor tells a slice (also a detached one, which has no
            # ``_base``); a view, or a tensor whose size is not its storage's (a broadcast slice, detached or
            # not), gets the full check.
            try:
                for t in (tensors if sources is None else sources):
                    held = t.untyped_storage().nbytes()
                    if held > t.nbytes or ((held != t.nbytes or t._base is not None) and part_of_larger(t)):
                        self._copies = True
                        self._copy_kept()
                        break
            except (RuntimeError, NotImplementedError):  # no plain storage (a torch.func wrapper): kept as it is
                pass
        if self._copies:
            # Copies, checked for nothing (nothing else writes them; made under inference mode, a slice of a buffer
            # allocated outside it, they would have no version counter to read).
            entry = [(t.clone(), None) for t in tensors]
        self._items.append(entry)
        self._elements += elements
        if self.max_elements is not None and self._elements >= self.max_elements:
            self.drain()

    def _copy_kept(self) -> None:
        """Slices came after whole tensors: the entries kept so far are copied while they still hold what was
        observed (an entry already changed stays as it is, and the drain reports it)."""
        self._items = [
            [(t if version is None else t.clone(), None) for t, version in entry]
            if all(version is None or t._version == version for t, version in entry) else entry
            for entry in self._items
        ]

    def drain(self) -> None:
        """Reduce what is buffered (one batched call; on a CPU one per piece) and release the references."""
        if not self._items:
            return
        items, self._items, self._elements = self._items, [], 0
        changed = False
        for entry in items:  # plain loops: this runs over every buffered iteration of a logging step
            for t, version in entry:
                if version is not None and t._version != version:
                    changed = True
        if changed:
            self.batched = False
            self._results = []
            raise ModifiedInPlaceError(
                "a state tensor was modified in place after it was observed (or, for a slice of a larger "
                "buffer kept before any tensor was seen to be one, another slice of it was written: every view "
                "shares one version counter), so the references kept for the batched reduction "
                "cannot be trusted to hold the observed values; this step's values are dropped and from now on "
                "each iteration is reduced as it comes (slower, but correct)"
            )
        columns = [[entry[i][0] for entry in items] for i in range(len(items[0]))]
        rows = len(items)
        first = columns[0][0]
        if first.device.type == "cpu":  # pieces that stay in cache (see the module docstring)
            # The first column sets the size: the state, or the previous state of a chain of pairs, which a
            # custom ``stack`` stacks as one tensor (the second column then adds nothing to it).
            size = max(1, first.numel() * first.element_size())
            if size * len(items) > 2 * PIECE_BYTES:
                rows = max(1, PIECE_BYTES // size)
        for start in range(0, len(items), rows):
            part = columns if rows >= len(items) else [column[start:start + rows] for column in columns]
            stacked = self.stack(part) if self.stack is not None else [torch.stack(column) for column in part]
            self._results.append(self.reduce(*stacked, scratch=True))

    def results(self, pad: Optional[float] = None) -> Optional[Tensor]:
        """Every iteration's reduction so far, concatenated along dim 0; None when nothing was buffered.

        Iterations whose reductions differ in shape beyond dim 0 (a state or probe whose channel count changed
        within the step) are padded with ``pad`` to the largest, where the owner has a value that means "none
        here" (a count of 0); with ``pad=None`` they raise `ShapeChangedError`, saying which shapes came."""
        self.drain()
        if not self._results:
            return None
        if len(self._results) == 1:
            return self._results[0]
        shapes = [tuple(r.shape[1:]) for r in self._results]
        if len(set(shapes)) == 1:
            return torch.cat(self._results)
        if pad is None:
            raise ShapeChangedError(
                f"the iterations of this logging step reduce to tables of different shapes {sorted(set(shapes))} "
                f"(a state whose channel count changed within the step): one table holds one shape. Keep the "
                f"number of channels fixed within a logging step, or observe the differently shaped part with "
                f"another observer."
            )
        widest = [max(sizes) for sizes in zip(*shapes, strict=True)]
        parts = []
        for r in self._results:
            if list(r.shape[1:]) != widest:
                wider = r.new_full((r.shape[0], *widest), pad)
                wider[(slice(None), *[slice(0, n) for n in r.shape[1:]])] = r
                r = wider
            parts.append(r)
        return torch.cat(parts)
