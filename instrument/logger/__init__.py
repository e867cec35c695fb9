"""The logger core: stages device values, moves them to the host in one batched transfer per commit, reduces
them across ranks, and hands immutable records to the backends."""
