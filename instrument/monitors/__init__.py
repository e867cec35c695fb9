"""Time-driven producers of metrics: they sample on their own clock, not on training steps."""
