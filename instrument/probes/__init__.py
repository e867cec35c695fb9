"""Probes: where values enter the pipeline (forward hooks on watched modules, embedded Probe modules)."""
