"""Per-channel statistics of many iterations in a few large reductions.

An observer's cost per logging step should be close to what reading the buffered states costs. The states of
all buffered iterations are stacked ([T, *state]) and seen as a [T, B, C, N] view (B: everything before the
channel dimension, N: everything after it), and each statistic is one reduction over N (the contiguous last
dim), then B, of that view: min, max, an in-place shift, the shifted sum, and the sum of squares after a second
in-place shift by that mean. On a GPU, and where B is 1, each is one reduction over B and N together (a kernel
launch saved per statistic: 22 kernels for the whole table instead of 29). No
per-iteration launch, and a transposed copy only for channels-last states with few elements after C.

Why not the obvious kernels (measured on CPU, torch 2.13, one thread, 32 iterations of a [4, 16, 24, 24]
state): ``torch.var_mean`` (Welford) over the last dim runs at about 0.5 GB/s and ``torch.aminmax`` at about
1.3 GB/s, while ``sum``/``amin``/``amax`` run at 35-45 GB/s; ``std_mean`` and ``aminmax`` over [16, 4096] are
9-13x slower than separate passes.

Numerics: the variance is the mean of ``(d - E[d])^2`` for ``d = x - r``, two passes over the buffered states: the
first sums ``d`` (its mean), the second the squares of the deviations from it. ``r`` is a per-iteration, per-channel
reference taken from the data (the mean of a strided sample of the channel: up to 4 batch rows x 32 values; rounded
to a whole number for integer and bool states, whose ``x - r`` is then exact). Subtracting ``r`` removes the
channel's offset before anything is summed, so a state whose mean is large relative to its spread (values ``1e4 +
N(0, 1e-2)`` in float32) keeps its precision: there ``x - r`` is exact. The second pass makes the result independent
of how good ``r`` is: the one-pass ``E[d^2] - E[d]^2`` cancelled when the sample missed the bulk of the values (a
1024 x 1024 grid whose border column is 0 and the rest near 1: the stride of 32768 elements is 32 whole rows, so
every sample was a border cell, and the std was 2e-5 off). The error is that of float32 pairwise sums, well under
1e-5 relative for the std. min and max are taken from ``x`` itself, so they are exact.

Dtypes (`instrument.core.context.reduction_dtype`): float32 and float64 states are reduced in their own dtype;
bool, int8, int16, uint8, uint16, float16 and bfloat16 ones in float32, which holds each of their values exactly;
int32, int64, uint32 and uint64 ones in float64 (float32 on MPS, which has no float64), since float32 holds
integers only to 2**24 (an int64 counter near 2**40 read std 0 and min = max). Their min and max are then exact
up to 2**53 in magnitude, and beyond it the nearest float64, as exact as float64 gets.

Range: ``d`` is also multiplied by a power of two ``s`` per iteration and channel (`pow2_scale`) that brings its
largest magnitude near 1. Multiplying by a power of two is exact, so in the usual range no digit changes;
without it, the float32 squares of a diverging state (std beyond about 1e17) overflow to inf and those of a tiny
spread (below about 1e-24) underflow to 0, while min and max are still finite and nonzero. It costs one pass over
the buffered states (about 0.1 ms for 32 iterations of the demo NCA's state on one CPU thread).
"""

import math

import torch
from torch import Tensor

from instrument.core.context import reduction_dtype
from instrument.errors import InvalidValueError

__all__ = ["channel_stats", "iteration_channel_stats", "pow2_scale", "refuse_complex"]

_SAMPLE = 32  # elements per row averaged for the shift reference
_ROWS = 4  # rows of the batch dimension sampled


def _channel_view(states: Tensor, channel_dim: int) -> Tensor:
    """[T, *state] -> [T, B, C, N] (a view when ``states`` is contiguous)."""
    if states.dim() < 2:  # [T]: a 0-d state, one value of one channel
        states = states.reshape(-1, 1)
    if states.dim() < 3:  # [T, N]: one channel
        return states.reshape(states.shape[0], states.shape[1], 1, 1)
    c = channel_dim % (states.dim() - 1) + 1
    before = after = 1
    for size in states.shape[1:c]:
        before *= size
    for size in states.shape[c + 1:]:
        after *= size
    return states.reshape(states.shape[0], before, states.shape[c], after)


def pow2_scale(spread: Tensor) -> Tensor:
    """A power of two ``s`` per element with ``spread * s`` in about [0.5, 2): exact to multiply by.

    Four small kernels over [T, C] (``log2`` may round to the next integer near a power of two: any power of
    two is exact, the range only has to stay far from overflow). The exponent is clamped a few octaves inside
    the dtype's range, so ``s`` and ``1 / s`` are finite: a zero spread (a constant channel) gets a large
    ``s`` that multiplies zeros, an infinite one a small ``s`` (the channel's mean is then inf and its std NaN,
    as NumPy says), and NaN stays NaN.
    """
    limit = int(math.log2(torch.finfo(spread.dtype).max)) - 8
    return spread.log2().floor_().clamp_(-limit, limit).neg_().exp2_()


def iteration_channel_stats(states: Tensor, channel_dim: int = 1, scratch: bool = False) -> Tensor:
    """Per-iteration, per-channel [mean, std, min, max] of ``states`` [T, *state], shape [T, 4, C].

    ``channel_dim`` indexes the state's own dimensions (1 for [B, C, H, W], -1 for [N, features]). std is the
    population standard deviation (divisor N), from shifted sums (see the module docstring). ``scratch=True``
    lets the function overwrite ``states`` (a stacked copy the caller owns) instead of allocating a temporary.
    """
    refuse_complex("iteration_channel_stats", states)
    integral = not states.dtype.is_floating_point  # integers and bools: a whole reference keeps x - r exact
    wide = reduction_dtype(states.dtype, states.device)  # float64 for int32/int64/uint32/uint64, else float32
    if states.dtype != wide:  # half precision, bool or integers: a converted copy, ours to overwrite
        states, scratch = states.to(wide), True
    x = _channel_view(states, channel_dim)  # [T, B, C, N]
    if x.shape[3] < 16 and x.shape[1] > x.shape[3] and x.shape[2] > 1:
        # Channels (nearly) last, e.g. [N, features]: reductions over a strided middle dim are several times
        # slower than over the last one, so pay one copy into [T, 1, C, B * N]. The copy is a clone, never
        # contiguous(), which returns the caller's own tensor when its memory is already laid out so (an
        # environment's [features, N] buffer handed out transposed, a permuted [B, C, H, W] state): the shift
        # below would then rewrite the user's state in place.
        x = x.transpose(1, 2).clone(memory_format=torch.contiguous_format)
        x = x.reshape(x.shape[0], 1, x.shape[1], x.shape[2] * x.shape[3])
        scratch = True
    count = x.shape[1] * x.shape[3]
    if count == 0:
        return torch.full((x.shape[0], 4, x.shape[2]), float("nan"), dtype=x.dtype, device=x.device)
    # A reference near the channel's mean: the mean of a strided sample over a few batch rows and N.
    sample = x[:, :: max(1, x.shape[1] // _ROWS), :, :: max(1, x.shape[3] // _SAMPLE)]
    reference = sample[:, :_ROWS, :, :_SAMPLE].mean(dim=(1, 3), keepdim=True)  # [T, 1, C, 1]
    # An inf or NaN in the sample would make x - reference NaN where x is inf: the shift is only for precision.
    # One kernel, in place (the mean is a new tensor); isfinite + where took three or more.
    reference = reference.nan_to_num_(0.0, 0.0, 0.0)
    if integral:  # a fractional one rounded x - r: int16 values +-32767 and 0 read a mean 1e-4 off
        reference = reference.round_()
    # On a CPU, the contiguous last dim is reduced first, then the (small) batch dim: several times faster than one
    # reduction over both there. Elsewhere (a GPU: each reduction is a kernel launch) and where the batch dim is 1
    # (nothing to reduce), one reduction over both: four kernels fewer, and means instead of sums and divisions,
    # two more.
    both = x.shape[1] == 1 or x.device.type != "cpu"
    low = x.amin(dim=(1, 3)) if both else x.amin(dim=3).amin(dim=1)
    high = x.amax(dim=(1, 3)) if both else x.amax(dim=3).amax(dim=1)
    centre = reference.reshape(low.shape)  # [T, C]
    scale = pow2_scale(torch.maximum(high - centre, centre - low))  # no overflow or underflow in the squares
    shifted = x.sub_(reference) if scratch else x - reference
    shifted.mul_(scale.reshape(reference.shape))
    mean_shifted = shifted.mean(dim=(1, 3)) if both else shifted.sum(dim=3).sum(dim=1) / count  # [T, C]
    # Two passes: the squares are of the deviations from that mean, so nothing cancels however far the sampled
    # reference was from the mean (a border column unlike the rest, sampled alone on an aligned grid).
    shifted.sub_(mean_shifted.reshape(reference.shape))
    squares = shifted.square_()  # (vector_norm is one pass, but not pairwise on CPU)
    var = squares.mean(dim=(1, 3)) if both else squares.sum(dim=3).sum(dim=1) / count
    mean = torch.addcdiv(centre, mean_shifted, scale)  # centre + mean_shifted / scale, one kernel
    return torch.stack([mean, var.sqrt_().div_(scale), low, high], dim=1)


def channel_stats(x: Tensor, channel_dim: int = 1) -> Tensor:
    """Per-channel [mean, std, min, max] of one state ``x``, shape [4, C]."""
    if x.dim() < 2:
        x = x.reshape(-1, 1)
        channel_dim = 1
    return iteration_channel_stats(x.unsqueeze(0), channel_dim)[0]


def refuse_complex(where: str, values: Tensor) -> None:
    """Means, spreads and extremes are of real values: a complex tensor is refused, not cast (which would drop its
    imaginary part)."""
    if values.is_complex():
        raise InvalidValueError(
            f"{where} computes statistics of real values, got a complex tensor ({values.dtype}); pass a real view "
            f"of it (torch.view_as_real(x), or x.abs())."
        )
