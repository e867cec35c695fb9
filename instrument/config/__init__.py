"""gin at the edge: the only package of the library that imports gin (besides the demos, which are leaves).

- `registry`: the gin registrations of instrument's own classes, under the ``instrument`` module.
- `parse`: `parse_config` (files or shipped names, then bindings), the shipped configs, errors with file and
  line, and `operative_config` (installed into the session as its config source).
- `types`: the parse-time type check's judge: does a literal gin parsed fit its parameter's annotation.
- `experiment`: `run` and `backend_set`, the plain functions a config binds to run an experiment.

``import instrument`` imports this package, so the public classes are configurable as they are.
"""

from instrument.config import registry
from instrument.config.experiment import BackendTypeError, ExperimentTypeError, MissingExperimentError
from instrument.config.located import unused_bindings, where_bound
from instrument.config.parse import (
    CONFIG_DIR,
    ConfigFileError,
    ConfigImportError,
    ConfigSyntaxError,
    GinConfigError,
    ShippedConfig,
    clear_config,
    operative_config,
    parse_config,
    require_experiment,
    resolve_config,
    shipped_configs,
)
from instrument.config.registry import backend_set, run, torchrl_hook

#: Earlier names, kept for code written against them.
GIN_DIR = CONFIG_DIR
parse = parse_config

__all__ = [
    "CONFIG_DIR",
    "BackendTypeError",
    "ConfigFileError",
    "ConfigImportError",
    "ConfigSyntaxError",
    "ExperimentTypeError",
    "GIN_DIR",
    "GinConfigError",
    "MissingExperimentError",
    "ShippedConfig",
    "backend_set",
    "clear_config",
    "operative_config",
    "parse",
    "parse_config",
    "registry",
    "require_experiment",
    "resolve_config",
    "run",
    "shipped_configs",
    "unused_bindings",
    "where_bound",
    "torchrl_hook",
]
