"""Terminal rendering: the console step table, validation-sample panels, run logs and tqdm-safe output."""

from instrument.terminal.output import write_line
from instrument.terminal.runlog import RunLog, setup_run_logging
from instrument.terminal.table import Column, StepTable

__all__ = ["Column", "RunLog", "StepTable", "setup_run_logging", "write_line"]
