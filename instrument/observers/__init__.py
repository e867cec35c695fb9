"""Built-in observers. Each documents the metric keys it emits."""

from instrument.observers.activation_stats import ActivationStats
from instrument.observers.gradient_stats import GradientStats
from instrument.observers.iteration_stats import IterationStats
from instrument.observers.nonfinite import NonFinite
from instrument.observers.rollout_video import RolloutVideo
from instrument.observers.state_histogram import StateHistogram
from instrument.observers.update_norm import UpdateNorm

__all__ = ["ActivationStats", "GradientStats", "IterationStats", "NonFinite", "RolloutVideo", "StateHistogram",
           "UpdateNorm"]
