"""Demo workloads in plain PyTorch: a growing neural cellular automaton, a vectorised CartPole, TorchRL PPO.

Leaves of the library: nothing in `instrument` imports them. Each registers its own entry points with gin
when imported, so a shipped config starts with the import of the demo it runs (``import
instrument.demos.nca`` in ``configs/nca.gin``). They observe nothing themselves: the instrumentation is what
``instrumentation=`` hands them.
"""
