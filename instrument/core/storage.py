"""What part of its storage a tensor reaches.

Two places need it. Observers keep references to states and check them for in-place changes by the version
counter, which every view of one storage shares: a slice of a larger buffer (``traj[t]``) reads as changed when
another slice is written, so it must be kept as a copy. A gradient probe copies its value with the value's own
strides, which allocates what the view reaches: worth it only for a view that reaches little more than itself.
"""

from torch import Tensor

__all__ = ["part_of_larger", "reach"]


def reach(tensor: Tensor) -> int:
    """The elements ``tensor`` spans in its storage, from its first: ``numel`` for a dense one, more for a strided
    view (``h[:, ::2]``: about twice), fewer for a broadcast one (a stride of 0); 0 for an empty one."""
    span = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if size == 0:
            return 0
        span += (size - 1) * abs(stride)
    return span


def part_of_larger(tensor: Tensor) -> bool:
    """Whether ``tensor`` reaches only part of its storage (``traj[t]`` of a preallocated trajectory, also
    broadcast: ``traj[t].expand(...)``): a write to another part moves the version counter it shares with every
    view of that storage, so a reference to it cannot be checked for changes of its own values."""
    try:
        storage = tensor.untyped_storage().nbytes()
        return bool(tensor.storage_offset()) or reach(tensor) * tensor.element_size() < storage
    except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested, some subclasses): kept as is
        return False
