"""Moving staged device values to the host in one batched copy per device.

Per-metric ``.item()`` calls each force a device sync; instead everything staged for a step is flattened into
one buffer per device, copied once, and split again on the host.
"""

from typing import Dict, List, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["to_host"]


def _wire_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; everywhere else float64 keeps integer counters and small differences exact.
    return torch.float32 if device.type == "mps" else torch.float64


def to_host(tensors: Sequence[Tensor]) -> List[np.ndarray]:
    """Return float64 numpy copies of ``tensors`` (same shapes), with one transfer per device."""
    out: List[np.ndarray] = [np.empty(0)] * len(tensors)
    by_device: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for device, indices in by_device.items():
        with torch.no_grad():
            flat = torch.cat([tensors[i].detach().reshape(-1).to(_wire_dtype(device)) for i in indices])
            # host sync: the one batched device->host copy of a commit (per device).
            host = flat.to("cpu").numpy().astype(np.float64, copy=False)
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            out[i] = host[offset : offset + n].reshape(tuple(tensors[i].shape))
            offset += n
    return out
