"""Built-in observers. Each documents the metric keys it emits."""
