"""The logger core: stages device values, moves them to the host in one batched transfer per commit, reduces
them across ranks, and hands immutable records to the backends."""

from instrument.logger.logger import Logger
from instrument.logger.reduce import CrossRankReducer
from instrument.logger.timer import Timer

__all__ = ["CrossRankReducer", "Logger", "Timer"]
