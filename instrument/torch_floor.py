"""The oldest torch release instrument runs on, checked once, when ``instrument`` is imported.

pip enforces ``torch>=2.10`` from the package's metadata. This check is for the installs that bypass it: ``pip
install --no-deps``, a conda environment whose torch pip does not manage, a checkout on ``PYTHONPATH``. The floor
is where the test suite passes (run on torch 2.10 and 2.13); below it, what failed (the suite run on torch 2.4.1
and 2.6.0, torch 2.5.1's hook signature and the Inductor source of 2.7.1 to 2.10.0 read):

- torch 2.9 and older: Inductor drops an operator without outputs unless its schema mutates an input, even one
  registered with ``torch.fx.node.has_side_effect``, so a probe in a ``torch.compile``-d module records nothing,
  with no error (its gradient probe too; seen on 2.6). Inductor honours the registration from torch 2.10 on.
- torch 2.6: Dynamo traces the global forward hooks that observe a watched TorchScript module's calls into every
  other compiled module and gives up on that module.
- torch 2.5 and older: no global forward hook takes keyword arguments, so watching a TorchScript module fails at
  the first logging step.
- torch 2.4: the import fails (no ``flexible_layout`` operator tag) and probes under ``torch.func.vmap`` fail (no
  ``torch.library.register_vmap``).

So the import refuses at once and says what to install, instead of a run failing or losing its probe values hours
in. A release string that does not start with ``major.minor`` (a private build) is let through: nothing to compare.
"""

import re
from typing import Optional, Tuple

import torch

__all__ = ["MIN_TORCH", "check_torch", "release"]

MIN_TORCH = (2, 10)


def release(version: str) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of a torch version string: ``"2.10.0+cu128"``, ``"2.11.0a0+git1234"``, ``"2.10"``."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(match[1]), int(match[2])) if match else None


def check_torch(version: Optional[str] = None) -> None:
    """Raise ImportError, naming both releases and the fix, when ``version`` (torch's own) is older than the floor."""
    version = str(torch.__version__ if version is None else version)
    found = release(version)
    if found is not None and found < MIN_TORCH:
        floor = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"instrument needs torch >= {floor}, but this environment has torch {version}. Upgrade torch "
            f"(pip install 'torch>={floor}', with the index URL of your CUDA build if you use one), or use this "
            f"environment without instrument."
        )
