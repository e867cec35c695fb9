"""The core of the pipeline: what an observer sees and the session that drives it."""
