"""A copy of a probed value laid out as the value is, so that what runs after a probe runs as it would without it.

``clone()`` keeps the strides of a dense tensor but makes a non-dense one (a strided view, ``h[:, ::2]``)
contiguous, and an op after the probe then reduces it in another order: the training numbers of a logging step
differed in their last bits from those of the same step without the probe. The copy is made with the value's own
strides instead, which allocates the span the view reaches: kept to views that reach at most `MAX_SPAN` times
their own size (every second or fourth element). A sparser view (one token or column of a larger tensor) gets
``clone()``, as does a broadcast view (a stride of 0: it cannot be written element by element), a tensor subclass
whose type a plain strided copy would lose, a sparse tensor (no strides), and a value whose strides cannot be read
or written (an overlapping view, some wrappers).
"""

import torch
from torch import Tensor

from instrument.core.storage import reach

__all__ = ["MAX_SPAN", "same_layout_copy"]

MAX_SPAN = 4  # the most memory a strided copy may take, in multiples of the value's own size


def same_layout_copy(value: Tensor) -> Tensor:
    """A copy of ``value`` with its strides, where that costs at most `MAX_SPAN` times its size."""
    if value.layout != torch.strided or value.is_contiguous():  # sparse or contiguous: clone keeps the layout
        return value.clone()
    try:
        strides = value.stride()
        broadcast = any(stride == 0 and size > 1 for size, stride in zip(value.shape, strides, strict=True))
        if broadcast or reach(value) > MAX_SPAN * value.numel():
            return value.clone()
        strided = torch.empty_strided(value.shape, strides, dtype=value.dtype, device=value.device)
        strided.copy_(value)  # one copy: a clone first, kept only where this fails, cost every view two
        return strided if type(strided) is type(value) else value.clone()
    except RuntimeError:  # no strides to read or to write (a transform's wrapper, an overlapping view)
        return value.clone()
