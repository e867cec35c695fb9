"""Collected batches kept by `CollectionMetrics` until they are reduced together.

Reducing each batch as it comes costs about a hundred small dispatched ops per batch (masked sums, minima and
maxima of three running statistics, the episode segmentation's cumulative sum and bucket sums), on every
iteration, logging or not. A batch's prepared tensors (time first, or flattened when no episode is summed from
its rewards) are instead kept here and concatenated along the first dimension when the component logs, when
``max_elements`` elements or ``max_batches`` batches are kept, or when a batch of another layout comes (one
concatenation holds one layout). One reduction of the concatenation gives the same statistics: counts, minima and
maxima are the same values, sums are float64 sums of the same values, and the episode segmentation of
consecutive batches of one layout concatenated along time is the segmentation batch by batch with its carry.

What is kept is a copy (one ``clone`` per entry the caller owns), never the caller's tensor: a collector that
refills its output buffer in place would otherwise change what was already counted. Nothing is read on the host.
"""

from typing import Callable, Hashable, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["PendingBatches"]

Fields = Sequence[Optional[Tensor]]


class PendingBatches:
    """Tuples of tensors of one layout, kept until `drain` hands ``process`` their concatenation.

    Args:
        process: called with the concatenated fields (None stays None) and their key whenever batches are drained.
        max_elements: drain once the kept tensors hold this many elements.
        max_batches: drain once this many batches are kept.
    """

    def __init__(
        self, process: Callable[[Fields, Hashable], None], max_elements: int = 2**18, max_batches: int = 256
    ) -> None:
        self.process = process
        self.max_elements = max_elements
        self.max_batches = max_batches
        self._rows: List[Fields] = []
        self._key: Optional[Hashable] = None
        self._elements = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def key(self) -> Optional[Hashable]:
        """The layout of the batches kept (None when none is)."""
        return self._key

    def add(self, fields: Fields, key: Hashable, owned: Sequence[bool]) -> None:
        """Keep one batch's fields; ``key`` names their layout (batches of one key concatenate), ``owned`` says
        which fields are already this component's own tensors (the others are copied)."""
        if self._rows and key != self._key:
            self.drain()
        elements = sum(f.numel() for f in fields if f is not None)
        if elements >= self.max_elements:  # too large to keep: what is kept first, then this one as it is (no
            self.drain()  # copy, no concatenation: a huge rollout after a small batch cost three times its size)
            self.process(fields, key)
            return
        kept = tuple(f if f is None or own else f.clone() for f, own in zip(fields, owned, strict=True))
        self._rows.append(kept)
        self._key = key
        self._elements += elements
        if self._elements >= self.max_elements or len(self._rows) >= self.max_batches:
            self.drain()

    def drain(self) -> None:
        """Reduce every kept batch now (in one concatenation) and forget them."""
        rows, key = self._rows, self._key
        self.clear()
        if not rows:
            return
        if len(rows) == 1:
            self.process(rows[0], key)
            return
        self.process(tuple(None if col[0] is None else torch.cat(col) for col in zip(*rows, strict=True)), key)

    def clear(self) -> None:
        self._rows, self._key, self._elements = [], None, 0
