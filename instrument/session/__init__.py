"""The session: `Instrumentation` drives probes, observers, step components and the logger; `StepScope` and
`WatchHandle` are what its ``step`` and ``watch`` hand back; `run_folder` names and keeps run folders."""

from instrument.session.instrumentation import Instrumentation, set_config_source
from instrument.session.scope import StepScope, WatchHandle

__all__ = ["Instrumentation", "StepScope", "WatchHandle", "set_config_source"]
