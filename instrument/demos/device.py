"""Where a demo trains: the ``device`` argument of `train_nca` and `train_cartpole`, checked before anything runs.

The demos default to the CPU, so ``make demo`` gives the same numbers on every machine. On a GPU machine bind
``train_nca.device = 'cuda'`` (or ``'auto'``: CUDA when torch sees it, then Apple's MPS, else the CPU). A device
this torch cannot use is refused at the call, naming what it saw and what to bind instead, rather than failing
inside the first tensor op with torch's own message.
"""

from typing import Any

import torch

from instrument.errors import ConfigurationError

__all__ = ["demo_device"]

_TYPES = ("cpu", "cuda", "mps")  # devices whose tensors hold values the demos can train on (not meta)


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def demo_device(owner: str, device: Any) -> torch.device:
    """``device`` (a string such as ``'cuda:1'``, ``'auto'`` or a `torch.device`) as a usable `torch.device`.

    ``owner`` is the demo as a binding names it (``train_nca``): the message says ``bind <owner>.device = ...``.
    """
    fix = f"bind e.g. {owner}.device = 'cpu' (or 'cuda', 'cuda:1', 'mps', 'auto')"
    if isinstance(device, str) and device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise ConfigurationError(
            f"{owner} device must be a device name or a torch.device, got {device!r} ({type(device).__name__}); "
            f"{fix}."
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigurationError(f"{owner} device must name a torch device, got {device!r}; {fix}.") from None
    if dev.type not in _TYPES:
        raise ConfigurationError(
            f"{owner} device must be one of {', '.join(_TYPES)} (or 'auto'), got {device!r}: the demo trains on "
            f"real values there; {fix}."
        )
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigurationError(
                f"{owner} device is {device!r}, but this torch sees no CUDA device (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda or 'none'}); bind {owner}.device = 'cpu', or install a CUDA "
                f"build of torch (`make TORCH=torch install`)."
            )
        if dev.index is not None and dev.index >= count:
            raise ConfigurationError(
                f"{owner} device is {device!r}, but this torch sees {count} CUDA device(s) (cuda:0 to "
                f"cuda:{count - 1}); bind {owner}.device = 'cuda:0'."
            )
    if dev.type == "mps" and not _mps_available():
        raise ConfigurationError(f"{owner} device is {device!r}, but MPS is not available here; {fix}.")
    return dev
