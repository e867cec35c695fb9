"""Non-finite elements of each of many gradients, in a few fused launches.

`NonFinite` counts, at every logging step, the non-finite elements of each parameter's gradient: one int64 per
parameter, exact. ``g - g`` is 0 where ``g`` is finite and NaN where it is not (inf - inf is NaN), so the count
is the number of nonzero elements of ``g - g``, its L0 norm. Done per gradient that is three kernels and their
Python (a subtraction, ``nan_to_num_`` and an int64 sum); for a model of 3,000 parameter tensors that was 9,000
launches on the training thread, more than the hand-written ``isfinite(g).all()`` loop it replaces. Here the
float32 and float64 gradients of one device take two ``torch._foreach_*`` calls (the subtraction and the L0
norm: a loop in C++, fused kernels where the device has them), a stack and a conversion, whatever their number.

Exactness: the L0 norm sums 0/1 indicators in the gradient's dtype. float64 holds such counts exactly to 2**53,
float32 only to 2**24, so a float32 gradient of more than 2**24 elements, and every other dtype (float16 and
bfloat16, whose counts would be exact only to 2,048 and 256, and complex), takes the per-gradient path: the
indicator summed as int64. So does a CPU gradient of more than ``CPU_FUSED_MAX`` elements (below).

Memory: the differences are made for a group of at most ``CHUNK`` bytes of gradients at a time (16 MiB), so the
temporaries never hold more than that beside the gradients (one gradient's size, where one is larger; the
per-gradient path holds one gradient's difference too). Past a few hundred gradients a group saves little more.
"""

from typing import Dict, List, Tuple

import torch
from torch import Tensor

__all__ = ["CHUNK", "CPU_FUSED_MAX", "grad_counts"]

CHUNK = 16 << 20  # bytes of gradients differenced at a time: the temporaries the fused path holds at once
# The most elements of a gradient counted on the fused path: float64 counts are exact to 2**53, float32 ones to
# 2**24. On a CPU only small gradients: there the L0 norm has no vectorised kernel, and from about 8,000 elements
# on the per-gradient path's three vectorised passes are faster than the launches it saves (torch 2.13, one thread).
_FUSED = {torch.float64: 1 << 53, torch.float32: 1 << 24}
CPU_FUSED_MAX = 4096


def grad_counts(grads: List[Tensor]) -> Tensor:
    """Non-finite elements of each gradient (dense, floating or complex), an int64 [P] tensor on the first one's
    device, in the order given."""
    device = grads[0].device
    fused: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
    for index, g in enumerate(grads):
        if g.dtype in _FUSED and g.numel() <= (CPU_FUSED_MAX if g.is_cpu else _FUSED[g.dtype]):
            fused.setdefault((g.device, g.dtype), []).append(index)
    if len(fused) == 1 and len(next(iter(fused.values()))) == len(grads):  # the common case: one kind, all fused
        return torch.cat(_fused_counts(grads, next(iter(fused.values())), device))
    counts: List[Tensor] = [torch.empty(0)] * len(grads)
    for members in fused.values():
        for index, count in zip(members, torch.cat(_fused_counts(grads, members, device)).unbind(), strict=True):
            counts[index] = count
    done = {index for members in fused.values() for index in members}
    for index, g in enumerate(grads):
        if index not in done:
            counts[index] = _count(g).to(device)
    return torch.stack(counts)


def _fused_counts(grads: List[Tensor], members: List[int], device: torch.device) -> List[Tensor]:
    """The counts of ``grads[i]`` for ``i`` in ``members`` (one device and dtype), int64 [n] pieces on ``device``."""
    pieces, chunk, size = [], [], 0
    for index in members:
        nbytes = grads[index].numel() * grads[index].element_size()
        if chunk and size + nbytes > CHUNK:
            pieces.append(_l0_of_differences([grads[i] for i in chunk], device))
            chunk, size = [], 0
        chunk.append(index)
        size += nbytes
    if chunk:
        pieces.append(_l0_of_differences([grads[i] for i in chunk], device))
    return pieces


def _l0_of_differences(tensors: List[Tensor], device: torch.device) -> Tensor:
    norms = torch._foreach_norm(torch._foreach_sub(tensors, tensors), 0)
    return torch.stack(norms).to(device=device, dtype=torch.int64)


def _count(g: Tensor) -> Tensor:
    """One gradient's count, int64: the per-gradient path, for the dtypes the fused one cannot count exactly."""
    if g.is_floating_point():
        indicator = g - g
        torch.nan_to_num_(indicator, nan=1.0)
        return indicator.sum(dtype=torch.int64)
    return g.numel() - torch.isfinite(g).sum()  # complex (integer gradients do not exist)
