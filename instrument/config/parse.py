"""Parse ``.gin`` files and bindings: shipped configs by name, and errors a user can act on.

`parse_config` resolves a config given by path or by the name of a shipped one (``nca``, ``rl_cartpole``,
``backends/tensorboard``: the files in ``instrument/configs``, which the wheel carries as package data), lets
``include`` lines find the shipped files from anywhere, and turns gin's exceptions into a `GinConfigError` that
says where (file and line, or which ``--bind``), what was wrong and how to fix it, in a few lines.
`operative_config` gives the session the bound values to log as hyperparameters.
"""

import difflib
import inspect
import logging
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import gin

from instrument.config import types
from instrument.config.experiment import MISSING_EXPERIMENT, MissingExperimentError
from instrument.config.explain import GIN_ERRORS, _parameters, explain, secret_free
from instrument.config.files import (
    CONFIG_DIR,
    AmbiguousNameError,
    ConfigFileError,
    ConfigImportError,
    ConfigSyntaxError,
    ConfigTypeError,
    GinConfigError,
    ShippedConfig,
    resolve_config,
    shipped_configs,
)
from instrument.config.gin_logging import ImplicitRootHandlers, QuietIncludeProbes
from instrument.config.includes import include_search, quiet_readers
from instrument.config.located import bound_pair, declared_secrets, include_cycle
from instrument.config.secrets import (
    bound_macros,
    declare_secret_keys,
    macro_name,
    macro_patterns,
    redacted_text,
    resolve_secret_macros,
    secret_keys,
)
from instrument.errors import ConfigurationError
from instrument.logger.params import REDACTED, redact_argv, redact_config_text, scrub

__all__ = [
    "CONFIG_DIR",
    "ConfigFileError",
    "ConfigImportError",
    "ConfigSyntaxError",
    "AmbiguousNameError",
    "GinConfigError",
    "ShippedConfig",
    "check_bound_macros",
    "clear_config",
    "operative_config",
    "parse_config",
    "require_experiment",
    "resolve_config",
    "shipped_configs",
]

# Where the shipped files are found by `include`, also for users who call gin's own parse functions: after
# gin's '' (a path as written, from the working directory). `parse_config` itself searches beside the including
# file first (see `includes`).
gin.add_config_file_search_path(str(CONFIG_DIR))
quiet_readers()  # gin's own parse functions too: an empty backends/ folder on sys.path is "not found"

MODULE = "instrument"  # the module instrument's own configurables are registered under (see `registry`)

BEFORE_PARSE: List[Callable[[], None]] = []


def parse_config(files: Sequence[str] = (), bindings: Sequence[str] = ()) -> List[Path]:
    """Parse ``.gin`` files (paths or shipped names) and then ``Name.param = value`` bindings, in order.

    Later files and bindings override earlier ones. An ``include`` resolves beside the file that includes it
    first (nested includes beside theirs), then from the working directory, then among the shipped configs.
    Raises a `GinConfigError` (a ValueError; the file kinds are also FileNotFoundError, SyntaxError or
    ImportError) naming the file and line or binding, a secret-looking binding's value left out.
    Returns the resolved paths of ``files``.
    """
    if isinstance(files, (str, Path)) or isinstance(bindings, str):
        shown = [redact_argv([v], secret_keys())[0] if isinstance(v, str) else v for v in (files, bindings)]
        raise ConfigurationError(  # a binding passed as a string is echoed, its secret left out
            f"parse_config takes lists: files={shown[0]!r}, bindings={shown[1]!r}; "
            f"write parse_config(['exp.gin'], ['Instrumentation.log_interval = 5'])."
        )
    try:
        return _parse(files, bindings)
    except GinConfigError as exc:  # as the CLI shows it: a --bind (or a config name) that holds a secret left out
        texts = [*bindings, *(str(f) for f in files)]
        fields = [redacted_text(getattr(exc, f), texts) for f in ("problem", "where", "statement", "fix")]
        if fields != [exc.problem, exc.where, exc.statement, exc.fix]:
            GinConfigError.__init__(exc, *fields)  # in place: its traceback stays as it was
            _drop_cause(exc)
        raise


def _cleaned(error: GinConfigError, cause: BaseException) -> Tuple[GinConfigError, Optional[BaseException]]:
    """``error`` with its secrets left out (`secret_free`), and its cause: gin's own exception, or None when a
    secret was left out, since gin's quotes the rejected text in clear and an uncaught error's traceback (a
    script's, the CLI's ``--debug``) prints its cause too."""
    clean = secret_free(error)
    fields = (error.problem, error.where, error.statement, error.fix)
    return clean, cause if (clean.problem, clean.where, clean.statement, clean.fix) == fields else None


def _drop_cause(error: BaseException) -> None:
    error.__cause__ = None
    error.__context__ = None
    error.__suppress_context__ = True


def _parse(files: Sequence[str], bindings: Sequence[str]) -> List[Path]:
    """`parse_config`'s work; its errors are redacted by `parse_config`, once, for every way out of here."""
    paths = [resolve_config(str(f)) for f in files]
    declare_secret_keys(*declared_secrets([str(p) for p in paths], bindings))  # for an error before them
    for prepare in BEFORE_PARSE:
        prepare()
    quiet = QuietIncludeProbes()
    logging.getLogger().addFilter(quiet)
    implicit = ImplicitRootHandlers()
    try:
        with include_search(str(CONFIG_DIR)):  # an include looks beside its own file first, nested too
            for path in paths:
                try:
                    gin.parse_config_file(str(path))
                except RecursionError as exc:  # gin follows includes by recursion: a cycle never ends
                    raise GinConfigError("the config includes itself, through " + " -> ".join(include_cycle(path)),
                                         str(path), "", "remove one of the include lines of that cycle.") from exc
                except GIN_ERRORS as exc:
                    clean, cause = _cleaned(explain(exc, source=str(path)), exc)
                    raise clean from cause
            for binding in bindings:
                try:
                    gin.parse_config(binding)
                except GIN_ERRORS as exc:
                    clean, cause = _cleaned(explain(exc, source=f"--bind {binding!r}", binding=binding), exc)
                    raise clean from cause
    finally:
        logging.getLogger().removeFilter(quiet)
        implicit.undo()
    check_macros([str(f) for f in files], bindings)
    check_types([str(f) for f in files], bindings)
    check_experiment([str(f) for f in files], bindings)
    return paths


def require_experiment() -> None:
    """Refuse a parsed config that binds no ``run.experiment`` (or binds it to None) before `run` is called:
    gin builds run's arguments first, so ``run.instrumentation = @Instrumentation()`` would start a run (its
    folder, its backends' runs) only for `run` to find nothing to call."""
    try:
        bound = gin.query_parameter(f"{MODULE}.run.experiment")
    except ValueError:  # not bound at all
        bound = None
    if bound is None:
        raise MissingExperimentError(MISSING_EXPERIMENT)


def clear_config() -> None:
    """Forget every binding parsed so far (files, ``--bind``, macros), so the next `parse_config` starts clean:
    the CLI's `main` calls it first, so a sweep calling it twice in one process runs each config as given."""
    gin.clear_config()
    declare_secret_keys(())


def check_types(files: Sequence[str] = (), bindings: Sequence[str] = ()) -> None:
    """Refuse a bound literal that its parameter's annotation rules out, naming the file and line (or the
    ``--bind``), what was received, what was expected and a binding that fits: ``train_nca.steps = 'ten'``
    for ``steps: int``, ``RolloutVideo.channels = [0, 'one']`` for ``Sequence[int]``, ``keys = 'loss'`` for
    ``Sequence[str]``, ``video_format = 'mp4'`` for ``Literal['gif', 'filmstrip']``, ``{'a': 'x'}`` for
    ``Mapping[str, float]``, a tuple of the wrong length. Plain types, Optional and Union, Literal, lists,
    tuples, sets and mappings are judged, to any depth (see `instrument.config.types`). Not judged, so never
    refused: references and macros (``@Name()``, ``%MACRO``), unannotated parameters, ``Any``, ``Callable``,
    classes, TypeVars and forward references that do not resolve; nor a value equal to the parameter's default.
    """
    extra = secret_keys()
    for (scope, selector), params in list(getattr(gin.config, "_CONFIG", {}).items()):
        configurable = gin.config._REGISTRY.get_match(selector)
        if configurable is None:
            continue
        name = selector.rsplit(".", 1)[-1]
        for param, value in params.items():
            refused = types.refusal(configurable.wrapped, f"{scope}/{name}" if scope else name, param, value, extra)
            if refused:
                place, statement = bound_pair(selector, lambda p, param=param: p == param, files, bindings, scope)
                raise ConfigTypeError(refused[0], scrub(place, refused[2]), scrub(statement, refused[2]), refused[1])


def check_experiment(files: Sequence[str] = (), bindings: Sequence[str] = ()) -> None:
    """Refuse ``run.experiment = @train_nca()``: with the parentheses gin calls the experiment while it builds
    run's arguments, so the whole training would run before run starts, uninstrumented, and run would get its
    result instead of a function to call. Found here, before anything runs (a macro holding it too)."""
    macros = bound_macros()
    for (scope, selector), params in list(getattr(gin.config, "_CONFIG", {}).items()):
        if selector != f"{MODULE}.run" or "experiment" not in params:
            continue
        value, seen = params["experiment"], 0
        while macro_name(value) in macros and seen < 100:  # `run.experiment = %EXPERIMENT`
            value, seen = macros[macro_name(value)], seen + 1
        if not (isinstance(value, gin.config.ConfigurableReference) and value.evaluate and _trains(value)):
            continue
        place, statement = bound_pair(selector, lambda p: p == "experiment", files, bindings, scope)
        name = "/".join([*value.scopes, value.selector.rsplit(".", 1)[-1]])
        raise GinConfigError(
            f"run.experiment is bound to @{name}(), a call: gin would run {name} while it builds run's "
            f"arguments (the whole training, uninstrumented) and hand run its result, not a function to call",
            place, statement or f"run.experiment = @{name}()",
            f"write run.experiment = @{name} (no parentheses): run calls it with the instrumentation.")


def _trains(reference: Any) -> bool:
    """Whether ``@X()`` calls the experiment itself: ``X`` is a function that takes ``instrumentation`` (what run
    passes it). A class (``@Trainer()``: its instance is what run calls) or a factory that returns the function
    (``@make_experiment()``) is built, not run, and is left to run's own check that it got something callable."""
    fn = getattr(getattr(reference, "configurable", None), "wrapped", None)
    if fn is None or isinstance(fn, type):
        return False
    try:
        return "instrumentation" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def check_macros(files: Sequence[str] = (), bindings: Sequence[str] = ()) -> None:
    """Refuse a ``%NAME`` that no ``NAME = value`` defines (a misspelt macro), naming the macro, where it is
    used and the macros that are defined. gin itself finds it only when the value is used, as a TypeError deep
    in a call (``macro() missing 1 required positional argument: 'value'``)."""
    config = getattr(gin.config, "_CONFIG", {})
    defined = sorted(scope for (scope, selector), params in config.items()
                     if selector == "gin.macro" and "value" in params)
    for (scope, selector), params in list(config.items()):
        for param, value in params.items():
            for name in _macros_in(value):
                if name in defined:
                    continue
                place, statement = bound_pair(selector, lambda p, param=param: p == param, files, bindings, scope)
                close = difflib.get_close_matches(name, defined, n=1)
                hint = f"did you mean %{close[0]}? " if close else ""
                known = f" (defined: {', '.join(defined)})" if defined else " (none is defined)"
                raise GinConfigError(
                    f"the macro %{name} is used but never defined{known}", place,
                    statement or f"{selector}.{param} = %{name}",
                    f"{hint}define it with a line `{name} = value` (in a .gin file, or --bind '{name} = 10'), "
                    f"or correct its name.")


def check_bound_macros(bindings: Sequence[str] = ()) -> None:
    """Refuse a ``--bind`` that defines a macro nothing in the parsed config uses: gin reads a name without a
    ``.`` as a macro, so ``train_nca_steps = 2`` or ``log_interval = 1`` (a misspelt binding) changed nothing,
    silently. Called by the CLI once the whole config is parsed; a program parsing in stages (a macro for a
    file parsed later) calls `parse_config` itself and is not judged."""
    config = getattr(gin.config, "_CONFIG", {})
    used = {name for params in list(config.values()) for value in params.values() for name in _macros_in(value)}
    for binding in bindings:
        for line in binding.splitlines():
            defined = re.match(r"\s*([\w/]+)\s*=", line)
            if defined is None or defined[1] in used or (defined[1], "gin.macro") not in config:
                continue
            name = defined[1]
            meant = _meant_bindings(name.rsplit("/", 1)[-1])
            hint = f"did you mean {' or '.join(meant)}? " if meant else ""
            raise GinConfigError(
                f"{name} = ... defines the macro {name} (a name without a '.'), and nothing uses %{name}: "
                f"this binding changes nothing", f"--bind {binding!r}", line.strip(),
                f"{hint}bind a parameter as Name.param = value (instrument list shows the shipped configs), or "
                f"use the macro where a value goes: Name.param = %{name}.")


def _meant_bindings(name: str) -> List[str]:
    """``Name.param`` bindings a macro's name may have meant: ``train_nca_steps`` -> ``train_nca.steps``,
    ``log_interval`` -> ``Instrumentation.log_interval`` (the configurables the parsed config binds first).
    Looked up by full selector: a short name two modules register (``otherlib.Instrumentation``) is ambiguous."""
    bound = [selector for (_, selector) in list(getattr(gin.config, "_CONFIG", {})) if selector != "gin.macro"]
    try:
        registered = [selector for selector, _ in gin.config._REGISTRY.items()]
    except Exception:  # noqa: BLE001  (only a hint)
        registered = []
    found = []
    for selector in dict.fromkeys([*bound, *registered]):
        short = selector.rsplit(".", 1)[-1]
        found += [f"{short}.{param}" for param in _parameters(selector)
                  if name in (param, f"{short}_{param}", f"{short}.{param}".lower().replace(".", "_"))]
    return list(dict.fromkeys(found))[:3]


def _macros_in(value: Any) -> List[str]:
    """The names of the macros (``%NAME``) a bound value uses, in lists, tuples and dicts too."""
    if isinstance(value, dict):
        return [n for item in (*value.keys(), *value.values()) for n in _macros_in(item)]
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in _macros_in(item)]
    if isinstance(value, gin.config.ConfigurableReference) and value.selector == "gin.macro":
        return [value.scoped_selector.rsplit("/", 1)[0]]
    return []


def operative_config() -> Tuple[Dict[str, Any], Optional[str]]:
    """The operative gin config as (``{"Configurable.param": value}``, text) for logging as hyperparameters.

    A value bound through a macro (``train_nca.lr = %LR``) is given as the value the macro resolves to, macros
    of macros too; the macro's own binding (``LR = 0.001``) is no key of its own (it stays in the text). A macro
    whose value is secret (used under a secret-looking name, ``api_token = %CREDS``, or named like a secret) is
    redacted wherever it is used and in the text, since its own name may say nothing. Empty when nothing was
    bound: a run configured in plain Python logs only its own hyperparameters.
    """
    if not gin.config_str().strip():
        return {}, None
    text = gin.operative_config_str()
    bindings: List[Tuple[str, Any]] = []
    keys: Dict[str, str] = {}  # a parameter's binding as judged -> its key in the params
    parser = gin.config_parser.ConfigParser(text, gin.config.ParserDelegate(skip_unknown=True))
    for statement in parser:
        if isinstance(statement, gin.config_parser.BindingStatement):
            scope = f"{statement.scope}/" if statement.scope else ""
            name = f"{scope}{statement.selector}" + (f".{statement.arg_name}" if statement.arg_name else "")
            if statement.arg_name:  # a macro's own binding (``LR = 0.001``) is judged, never a key
                keys[name] = name
            bindings.append((name, statement.value))
    macros = bound_macros()
    resolved, names = resolve_secret_macros(bindings, macros, secret_keys())
    params = {keys[name]: _structured(_unmacro(value, macros, names, 0))
              for name, value in resolved.items() if name in keys}
    return params, (redact_config_text(text, macro_patterns(names)) if names else text)


def _unmacro(value: Any, macros: Dict[str, Any], secret: Any, depth: int) -> Any:
    """``value`` with every macro replaced by what it is bound to (`REDACTED` for a secret one), at any depth."""
    name = macro_name(value)
    if name is not None:
        if name in secret:
            return REDACTED
        return _unmacro(macros[name], macros, secret, depth + 1) if name in macros and depth < 100 else value
    if isinstance(value, dict):
        return {k: _unmacro(v, macros, secret, depth) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unmacro(v, macros, secret, depth) for v in value)
    return value


def _structured(value: Any) -> Any:
    """Dicts and lists kept as such (so a secret-looking key inside is redacted before anything is
    rendered); plain values as they are; anything else (references, macros) as its repr."""
    if isinstance(value, dict):
        return {str(k): _structured(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_structured(v) for v in value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
