"""Moving a tensor made on the host to a device without making the host wait for the device."""

import torch
from torch import Tensor

__all__ = ["to_device"]


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host``, a CPU tensor made just now (from Python numbers, an index list), on ``device``.

    To a GPU it goes through pinned memory, without blocking: a copy from pageable memory waits for the stream
    (``non_blocking=False``: cudaStreamSynchronize) or may (``non_blocking=True``: CUDA calls such a copy "might be
    synchronous with respect to host"); from pinned memory it is queued, and torch's host allocator keeps the
    pinned block until the copy has run. To another accelerator (MPS, XPU) a non-blocking copy, as torch offers
    it there; to the CPU the tensor itself.
    """
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device, non_blocking=device.type != "cpu")
