"""Probes: where values enter the pipeline (forward hooks on watched modules, embedded Probe modules).

`script` (TorchScript with the probes compiled in) is exported from ``instrument`` itself: here that name is the
module ``instrument.probes.script``, which the package keeps as its attribute.
"""

from instrument.probes.probe import Probe
from instrument.probes.script import freeze

__all__ = ["Probe", "freeze"]
