"""Built-in observers. Each documents the metric keys it emits."""

from instrument.observers.gradient_stats import GradientStats
from instrument.observers.iteration_stats import IterationStats
from instrument.observers.nonfinite import NonFinite
from instrument.observers.rollout_video import RolloutVideo
from instrument.observers.update_norm import UpdateNorm

__all__ = ["GradientStats", "IterationStats", "NonFinite", "RolloutVideo", "UpdateNorm"]
