"""A copy of a probed value laid out as the value is, so that what runs after a probe runs as it would without it.

``clone()`` keeps the strides of a dense tensor but makes a non-dense one (a strided view, ``h[:, ::2]``)
contiguous, and an op after the probe then reduces it in another order: the training numbers of a logging step
differed in their last bits from those of the same step without the probe. The copy is made with the value's own
strides instead (its span allocated, as the view's base was). A broadcast view (a stride of 0) cannot be written
element by element, and inside torch.func transforms strides are the transform's: both keep ``clone()``.
"""

import torch
from torch import Tensor

__all__ = ["same_layout_copy"]


def same_layout_copy(value: Tensor) -> Tensor:
    """A copy of ``value`` with its strides."""
    copy = value.clone()
    if value.is_contiguous():  # the common case: clone kept the layout
        return copy
    try:
        strides = value.stride()
        if copy.stride() == strides or any(stride == 0 and size > 1 for size, stride in zip(
                value.shape, strides, strict=True)):
            return copy
        strided = torch.empty_strided(value.shape, strides, dtype=value.dtype, device=value.device)
        return strided.copy_(value)
    except RuntimeError:  # no strides to read or to write (a transform's wrapper, an overlapping view)
        return copy
