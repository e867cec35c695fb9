"""The logger and its backends: device values in, host values out, one batched transfer per commit."""
