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
import tokenize
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import gin

from instrument.config import types
from instrument.config.files import (
    CONFIG_DIR,
    AmbiguousNameError,
    ConfigFileError,
    ConfigImportError,
    ConfigSyntaxError,
    ConfigTypeError,
    GinConfigError,
    ShippedConfig,
    read_text,
    resolve_config,
    shipped_configs,
)
from instrument.config.gin_logging import ImplicitRootHandlers, QuietIncludeProbes
from instrument.config.located import bound_pair, file_holding, include_cycle
from instrument.config.secrets import (
    bound_macros,
    macro_name,
    macro_patterns,
    resolve_secret_macros,
    secret_keys,
)
from instrument.errors import ConfigurationError
from instrument.logger.params import REDACTED, redact_config_text, scrub

__all__ = [
    "CONFIG_DIR",
    "ConfigFileError",
    "ConfigImportError",
    "ConfigSyntaxError",
    "AmbiguousNameError",
    "GinConfigError",
    "ShippedConfig",
    "operative_config",

    "parse_config",
    "resolve_config",
    "shipped_configs",
]

# Where the shipped files are found by `include`, also for users who call gin's own parse functions: after
# gin's '' (a path as written, from the working directory), so a user's own file of the same name wins.
gin.add_config_file_search_path(str(CONFIG_DIR))
_searched = {str(CONFIG_DIR)}

MODULE = "instrument"  # the module instrument's own configurables are registered under (see `registry`)

# Names a config may use before the module that registers them is imported: the fix is that import.
_REGISTERED_ON_IMPORT = {
    "instrument.config.rl": ("RLLogging", "CollectionMetrics", "TrainMetrics", "Counters", "Evaluation"),
    "instrument.demos.nca": ("train_nca",),
    "instrument.demos.cartpole": ("train_cartpole",),
    "instrument.demos.torchrl_ppo": ("train_torchrl_ppo", "build_ppo_trainer"),
}


# Called before every parse_config; the registry adds the RL registration here (when `instrument.rl` was imported).
BEFORE_PARSE: List[Callable[[], None]] = []


def parse_config(files: Sequence[str] = (), bindings: Sequence[str] = ()) -> List[Path]:
    """Parse ``.gin`` files (paths or shipped names) and then ``Name.param = value`` bindings, in order.

    Later files and bindings override earlier ones. An ``include`` resolves beside the file that includes it,
    from the working directory and among the shipped configs. Raises a `GinConfigError` (a ValueError; the
    file kinds are also FileNotFoundError, SyntaxError or ImportError) naming the file and line or binding.
    Returns the resolved paths of ``files``.
    """
    if isinstance(files, (str, Path)) or isinstance(bindings, str):
        raise ConfigurationError(
            f"parse_config takes lists: files={files!r}, bindings={bindings!r}; "
            f"write parse_config(['exp.gin'], ['Instrumentation.log_interval = 5'])."
        )
    paths = [resolve_config(str(f)) for f in files]
    for prepare in BEFORE_PARSE:
        prepare()
    quiet = QuietIncludeProbes()
    logging.getLogger().addFilter(quiet)
    implicit = ImplicitRootHandlers()
    readers = getattr(gin.config, "_FILE_READERS", [])
    saved_readers = list(readers)
    readers[:] = [(_open_config if reader is open else reader, exists) for reader, exists in readers]
    try:
        for path in paths:
            _search_first(str(path.resolve().parent))  # this file's includes look beside it first
            try:
                gin.parse_config_file(str(path))
            except RecursionError as exc:  # gin follows includes by recursion: a cycle never ends
                raise GinConfigError("the config includes itself, through " + " -> ".join(include_cycle(path)),
                                     str(path), "", "remove one of the include lines of that cycle.") from exc
            except _GIN_ERRORS as exc:
                raise _explain(exc, source=str(path)) from exc
        for binding in bindings:
            try:
                gin.parse_config(binding)
            except _GIN_ERRORS as exc:
                raise _explain(exc, source=f"--bind {binding!r}", binding=binding) from exc
    finally:
        readers[:] = saved_readers
        logging.getLogger().removeFilter(quiet)
        implicit.undo()
    check_macros([str(f) for f in files], bindings)
    check_types([str(f) for f in files], bindings)
    check_experiment([str(f) for f in files], bindings)
    return paths


def _open_config(path: str) -> Any:
    """A .gin file as gin reads it, but as UTF-8 with an optional byte-order mark (Notepad's "UTF-8 with BOM")
    dropped, as Python reads its own sources; gin's plain open() made the BOM an "Unexpected token" at line 1."""
    return open(path, encoding="utf-8-sig")


def _search_first(directory: str) -> None:
    """Search ``directory`` for includes right after the working directory, before the shipped configs."""
    prefixes = getattr(gin.config, "_LOCATION_PREFIXES", None)
    if isinstance(prefixes, list):  # gin's own search list; a user's directory must win over a shipped name
        if directory in prefixes:
            prefixes.remove(directory)
        prefixes.insert(1 if prefixes[:1] == [""] else 0, directory)
    elif directory not in _searched:
        gin.add_config_file_search_path(directory)
    _searched.add(directory)


_GIN_ERRORS = (ValueError, KeyError, SyntaxError, tokenize.TokenError, OSError, ImportError, TypeError)
_WHERE = re.compile(r'\n  In file "(?P<file>[^"]+)", line (?P<line>\d+)\n    (?P<stmt>[^\n]*)')
_BINDING_WHERE = re.compile(r"\n  In bindings string line \d+\n    (?P<stmt>[^\n]*)")


def _unquoted(text: str) -> str:
    """``text`` without the quotes gin's exceptions may wrap it in (a KeyError's repr), but only as a pair: a
    message that ends in a quote of its own (``No module named 'x'``) keeps it."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _explain(exc: BaseException, source: str, binding: Optional[str] = None) -> GinConfigError:
    """gin's exception as a `GinConfigError`: innermost file and line, the statement, the problem, a fix."""
    text = str(exc)
    kind = GinConfigError
    decode = re.search(r"can't decode byte 0x[0-9a-f]+ in position (\d+): ([^\n]*)", text)
    if isinstance(exc, UnicodeDecodeError) and decode and binding is None:  # a file saved in another encoding
        start = int(decode[1])  # gin re-raises an include's error as a copy without the bytes: find the file

        def fails_there(data: bytes) -> bool:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as bad:
                return bad.start == start
            return False

        holder = file_holding(Path(source), fails_there)
        if holder is not None:
            data = holder.read_bytes()
            line = data.count(b"\n", 0, start) + 1
            statement = data.split(b"\n")[line - 1].decode("utf-8", "backslashreplace").strip()
            top = holder.resolve() == Path(source).resolve()
            where = f"{source if top else holder.name}, line {line}" + ("" if top else f" (included from {source})")
            return GinConfigError(
                f"the file is not UTF-8: byte 0x{data[start]:02x} at byte offset {start} ({decode[2].strip()})",
                where, statement, "save the file as UTF-8 (your editor's 'encoding' setting), or remove the character.")
    if isinstance(exc, tokenize.TokenError):  # an unclosed bracket or quote: the tokenizer ran out of input
        line, statement = _unclosed(binding if binding is not None else read_text(source))
        where = source if binding is not None or not line else f"{source}, line {line}"
        return ConfigSyntaxError(f"syntax error: {exc.args[0]} (a bracket or quote is never closed)", where,
                                 statement or binding or "", "close the bracket or quote that this statement opens.")
    if isinstance(exc, SyntaxError):
        kind = ConfigSyntaxError
        problem = f"syntax error: {exc.msg}"
        where = f"{exc.filename or source}, line {exc.lineno}" if exc.lineno else source
        if binding is not None:
            where = source
        statement = (exc.text or binding or "").strip()
        if binding is None and exc.lineno:  # an unclosed list runs into the next binding: point at its start
            line, opened = _unclosed(read_text(exc.filename or source))
            if 0 < line < exc.lineno:
                return kind(f"syntax error: a bracket opened on this line is never closed (gin stopped at line "
                            f"{exc.lineno}: {exc.msg})", f"{exc.filename or source}, line {line}", opened,
                            "close the bracket or quote that this statement opens.")
        token = re.search(r"Failed to parse token '([^']*)'", exc.msg or "")
        if token:  # a bare word: nan, inf, float('nan'), an unquoted string
            problem, fix = _bare_word(token[1], statement)
            return kind(problem, where, statement, fix)
        return kind(problem, where, statement, "check the quoting, brackets and '=' of that line "
                    "(values are Python literals, references are @Name or @Name()).")
    locations = list(_WHERE.finditer(text))
    problem = _unquoted(text.split("\n  In ", 1)[0].strip())
    if locations:
        inner = locations[0]
        where = f"{inner['file']}, line {inner['line']}"
        statement = inner["stmt"].strip()
        outer = [f"{m['file']}, line {m['line']}" for m in locations[1:]]
        if outer:
            where += " (included from " + ", ".join(outer) + ")"
    else:
        where = source
        match = _BINDING_WHERE.search(text)
        statement = match["stmt"].strip() if match else (binding or "")
    if isinstance(exc, KeyError):  # gin's selector lookup: a short name that several modules register
        kind = AmbiguousNameError
        fix = ("write the name qualified by its module, as listed (e.g. instrument.Instrumentation.log_interval)."
               if "Ambiguous selector" in problem else _fix_for(problem))
    elif isinstance(exc, ImportError):
        kind = ConfigImportError
        fix = "install the package that provides the module, or correct the name in the import line."
    elif isinstance(exc, OSError):
        kind = ConfigFileError
        problem = problem.split(" Searched config paths", 1)[0]
        names = ", ".join(c.name for c in shipped_configs())
        fix = f"give the path relative to the including file or the working directory, or a shipped config: {names}."
    else:
        fix = _fix_for(problem)
    return kind(problem, where, statement, fix)


def _bare_word(token: str, statement: str) -> Tuple[str, str]:
    """(problem, fix) for a bare word gin cannot read (``nan``, ``inf``, ``float('nan')``, an unquoted string):
    gin reads Python literals, which have no NaN and write infinity as ``1e999``; the fix names a value the
    parameter takes where it can tell which parameter it is."""
    bound = re.match(r"\s*(?:[\w.]*/)?([\w.]+)\.(\w+)\s*=", statement)
    configurable = gin.config._REGISTRY.get_match(bound[1]) if bound else None
    fits = ""
    if configurable is not None:
        name, param = bound[1].rsplit(".", 1)[-1], bound[2]
        fits = f"{name}.{param} = {types.suggestion(configurable.wrapped, name, param)}"
    number = f"bind a number, e.g. {fits}" if fits else "bind a number"
    infinity = "1e999 (-1e999 for minus infinity), which Python reads as infinity"
    word = token.lower().lstrip("+-")
    if word == "nan":
        return f"syntax error: {token!r} is not a gin value: gin reads Python literals, and NaN has none", number + "."
    if word in ("inf", "infinity"):
        return (f"syntax error: {token!r} is not a gin value: gin reads Python literals, which name no infinity",
                f"write {infinity}, where the parameter takes it; else {number}.")
    if token == "float":
        return ("syntax error: float(...) is a call, not a gin value: gin reads Python literals (NaN has none)",
                f"{number}; infinity is written {infinity}.")
    return (f"syntax error: {token!r} is not a gin value: values are Python literals (numbers, 'strings', True, "
            f"False, None, lists, tuples, dicts) or references (@Name, @Name(), %MACRO)",
            f"quote it for a string ('{token}'), or write @{token} for a configurable"
            + (f"; this parameter takes e.g. {fits}." if fits else "."))


def _unclosed(text: str) -> Tuple[int, str]:
    """The line number and text of the first bracket or quote in ``text`` that is never closed (0, "")."""
    stack: List[Tuple[str, int]] = []
    quote, lineno, i = "", 1, 0
    closers = {")": "(", "]": "[", "}": "{"}
    while i < len(text):
        ch = text[i]
        if ch == "\n":
            lineno += 1
        if quote:
            if ch == "\\":
                i += 1
            elif text.startswith(quote, i):
                stack.pop()
                i += len(quote) - 1
                quote = ""
        elif ch == "#":
            while i + 1 < len(text) and text[i + 1] != "\n":
                i += 1
        elif ch in "'\"":
            quote = text[i : i + 3] if text[i : i + 3] in ("'" * 3, '"' * 3) else ch
            stack.append((quote, lineno))
            i += len(quote) - 1
        elif ch in "([{":
            stack.append((ch, lineno))
        elif ch in closers and stack and stack[-1][0] == closers[ch]:
            stack.pop()
        i += 1
    if not stack:
        return 0, ""
    line = stack[0][1]
    lines = text.splitlines()
    return line, lines[line - 1].strip() if line <= len(lines) else ""


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


def _macros_in(value: Any) -> List[str]:
    """The names of the macros (``%NAME``) a bound value uses, in lists, tuples and dicts too."""
    if isinstance(value, dict):
        return [n for item in (*value.keys(), *value.values()) for n in _macros_in(item)]
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in _macros_in(item)]
    if isinstance(value, gin.config.ConfigurableReference) and value.selector == "gin.macro":
        return [value.scoped_selector.rsplit("/", 1)[0]]
    return []


def _fix_for(problem: str) -> str:
    """A hint for gin's ValueErrors: a misspelt parameter, an unknown or unimported configurable."""
    match = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", problem)
    if match:
        name, param = match.groups()
        params = _parameters(name)
        close = difflib.get_close_matches(param, params, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"{hint}{name} takes: {', '.join(params)}." if params else "check the parameter's spelling."
    match = re.search(r"No configurable matching (?:reference )?'@?([^'(]+)", problem)
    if match:
        name = match.group(1).split("/")[-1]
        short = name.split(".")[-1]
        for module, names in _REGISTERED_ON_IMPORT.items():
            if short in names:
                return f"add the line `import {module}` at the top of the .gin file; it registers {short}."
        close = difflib.get_close_matches(short, _known_names(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return (f"{hint}check the spelling, or import the module that registers it with an `import "
                f"package.module` line at the top of the .gin file.")
    return "see gin's message above; `instrument list` shows the shipped configs to start from."


def _parameters(name: str) -> List[str]:
    """The parameter names of a registered configurable (empty when gin's registry cannot tell)."""
    import inspect

    try:
        configurable = gin.config._REGISTRY.get_match(name)  # gin has no public lookup by name
        fn = configurable.wrapped
        sig = inspect.signature(fn.__init__ if inspect.isclass(fn) else fn)
    except Exception:  # noqa: BLE001  (only a hint: a failure here must not hide the user's error)
        return []
    return [p for p in sig.parameters if p != "self" and sig.parameters[p].kind not in (
        inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def _known_names() -> List[str]:
    try:
        return sorted({selector.split(".")[-1] for selector, _ in gin.config._REGISTRY.items()})
    except Exception:  # noqa: BLE001  (only a hint)
        return []


def operative_config() -> Tuple[Dict[str, Any], Optional[str]]:
    """The operative gin config as (``{"Configurable.param": value}``, text) for logging as hyperparameters.

    A macro under a secret-looking name (``api_token = %CREDS``) is given as the value it resolves to, so the
    logger redacts it there and scrubs it from every other value; the macro's own binding (``CREDS = '...'``)
    is redacted here, in the params and the text, since its name says nothing. Empty when nothing was bound:
    a run configured in plain Python logs only its own hyperparameters.
    """
    if not gin.config_str().strip():
        return {}, None
    text = gin.operative_config_str()
    bindings: List[Tuple[str, Any]] = []
    keys: Dict[str, str] = {}  # a binding's name as judged (a macro's own name) -> its key in the params
    parser = gin.config_parser.ConfigParser(text, gin.config.ParserDelegate(skip_unknown=True))
    for statement in parser:
        if isinstance(statement, gin.config_parser.BindingStatement):
            scope = f"{statement.scope}/" if statement.scope else ""
            name = f"{scope}{statement.selector}" + (f".{statement.arg_name}" if statement.arg_name else "")
            keys[name] = f"{scope}{statement.selector}.{statement.arg_name}"  # a macro's ends in '.'
            bindings.append((name, statement.value))
    resolved, names = resolve_secret_macros(bindings, bound_macros(), secret_keys())
    params = {keys[name]: _structured(value) for name, value in resolved.items()}
    for name in names & set(keys):
        params[keys[name]] = REDACTED
    return params, (redact_config_text(text, macro_patterns(names)) if names else text)


def _structured(value: Any) -> Any:
    """Dicts and lists kept as such (so a secret-looking key inside is redacted before anything is
    rendered); plain values as they are; anything else (references, macros) as its repr."""
    if isinstance(value, dict):
        return {str(k): _structured(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_structured(v) for v in value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
