"""Demo workloads in plain PyTorch: a growing neural cellular automaton and a vectorised CartPole.

They exist so the instrumentation has realistic rollouts to observe; neither imports `instrument` at
module level, so they also run (and can be tested) without it.
"""
