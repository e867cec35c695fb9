"""Tensors made plain for the commit's transfer: detached, dense, real, of a dtype with a numeric value.

What has an exact meaning is converted where it is logged (a sparse tensor made dense, a quantized one its
values); what has none is refused there, with a message naming the call, what it got and what it expected.
"""

import torch
from torch import Tensor

from instrument.core.dtensors import local_value
from instrument.errors import InvalidValueError

__all__ = ["NUMERIC_DTYPES", "plain_tensor", "sharded_dtensor"]


# Tensor dtypes whose values the commit's transfer carries: bool, integers (exact, as int64) and floats (as
# float64). Quantized tensors are dequantized on the caller; the rest (bits, sub-byte and packed float4 types)
# have no conversion to a number and are refused at the call.
_INTEGER_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64,
                             torch.uint8, torch.uint16, torch.uint32, torch.uint64})
NUMERIC_DTYPES = _INTEGER_DTYPES | frozenset(
    getattr(torch, name) for name in ("bool", "float16", "bfloat16", "float32", "float64", "float8_e4m3fn",
                                      "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


def sharded_dtensor(where: str, placements: tuple, fix: str) -> InvalidValueError:
    """The refusal of a DTensor that is not replicated (``where``: ``"metric 'loss'"`` or the media call)."""
    return InvalidValueError(
        f"{where} is a DTensor with placements {placements}: its local tensor on this rank is a shard or a partial "
        f"value, not the global value, and logging it would write rank-local numbers. Expected a plain tensor, or a "
        f"DTensor whose placements are all Replicate() (it holds the global value on every rank). {fix}"
    )


def plain_tensor(where: str, value: Tensor, expected: str) -> Tensor:
    """``value`` detached as a dense, non-quantized real tensor the commit's transfer can copy; metadata checks
    and conversions that keep every value exactly (no host sync), as `log_metrics` does for scalars.

    Sparse tensors become dense (``to_dense``), quantized ones their values (``dequantize``); meta, nested,
    complex tensors and dtypes with no numeric value (bits, sub-byte, packed float4) raise `InvalidValueError`
    naming ``where`` (e.g. ``"log_histogram('grads')"``). A replicated DTensor becomes its local tensor (the
    global value); any other DTensor is refused: its local tensor is a shard or a partial value."""
    if type(value) is not Tensor:
        value = local_value(value, lambda placements: sharded_dtensor(
            where, placements, "Log value.full_tensor() (a collective: call it on every rank) instead."))
    if value.is_meta:
        raise InvalidValueError(
            f"{where}: got a meta tensor of shape {tuple(value.shape)}, which has no data; expected {expected}. "
            f"Log a materialised tensor."
        )
    if value.is_nested:
        raise InvalidValueError(
            f"{where}: got a nested tensor (of {value.size(0)} tensors, {value.layout} layout); expected "
            f"{expected} as one dense tensor. Log each of its tensors (value.unbind()) on its own, or pad them to "
            f"one shape first (value.to_padded_tensor(0.0))."
        )
    if value.is_complex():
        raise InvalidValueError(
            f"{where}: got a complex tensor ({value.dtype}); expected {expected} as real numbers. Log its parts "
            f"(value.real and value.imag) or its magnitude (value.abs())."
        )
    value = value.detach()
    if value.layout != torch.strided:  # sparse (COO, CSR, CSC, BSR, BSC) or mkldnn: the same values, dense
        try:
            value = value.to_dense()
        except Exception as exc:
            raise InvalidValueError(
                f"{where}: got a tensor of layout {value.layout}, which could not be made dense ({exc}); "
                f"expected {expected} as a dense tensor."
            ) from exc
    if value.is_quantized:  # the real values it stands for (scale and zero point applied)
        value = value.dequantize()
    if value.layout != torch.strided or value.dtype not in NUMERIC_DTYPES:
        raise InvalidValueError(
            f"{where}: got a tensor of dtype {value.dtype} and layout {value.layout}, which has no numeric value "
            f"to copy; expected {expected} as a dense tensor of bool, integers or floats (e.g. value.float(), "
            f"or value.view(torch.uint8) for raw bits)."
        )
    return value
