"""Which strings of the parsed config are secret, with gin macros resolved.

Redaction judges a value by the name it is bound to. A macro hides that name: ``my_train.api_token = %CREDS``
binds a reference, and ``CREDS = 'sk-...'`` binds the credential under a name no pattern matches. So a macro
that sits under a secret-looking name (at any depth of dicts and lists, through macros of macros) is resolved
to its value there, and its own binding is treated as secret: the value is then redacted, and scrubbed from
every other text, wherever it appears (the logged config and hyperparameters, the CLI's messages).
"""

import re
from typing import Any, Dict, Iterable, Sequence, Set, Tuple

import gin

from instrument.logger.params import REDACTED, is_secret, redact_config_text, redact_values, scrub
from instrument.logger.secret_text import secret_words

__all__ = ["bound_macros", "config_secrets", "declare_secret_keys", "declared_macro_patterns", "macro_name",
           "macro_patterns", "redacted_text", "resolve_secret_macros", "secret_keys"]


_declared: Dict[str, Tuple[str, ...]] = {"keys": (), "macros": ()}


def declare_secret_keys(keys: Iterable[str], macros: Iterable[str] = ()) -> None:
    """The patterns the config's text binds to ``Instrumentation.secret_keys``, and the macros it uses under a
    secret-looking name (``api_key = %TOK``), read before gin parses it (`located.declared_secrets`): an error
    before gin reaches that binding (later in the file, a --bind, which gin parses after the files) must leave out
    what it names too. `parse_config` sets them, `clear_config` forgets them."""
    _declared["keys"] = tuple(dict.fromkeys(keys))
    _declared["macros"] = tuple(dict.fromkeys(macros))


def declared_macro_patterns() -> Tuple[str, ...]:
    """Patterns matching the bindings of the macros the config's text uses as secrets (`declare_secret_keys`), for
    an error message only: ``TOK = '...' oops`` rejected before gin read ``api_key = %TOK``."""
    return macro_patterns(_declared["macros"])


def secret_keys() -> Tuple[str, ...]:
    """The run's own secret patterns (``Instrumentation.secret_keys``) where the parsed config binds them, or its
    text does (`declare_secret_keys`), to redact along with the built-in ones: an error message quoting a binding
    must leave out what the run's log would."""
    try:
        keys = gin.query_parameter("Instrumentation.secret_keys") or ()
    except Exception:  # noqa: BLE001 - not bound (or not registered): the built-in patterns only
        keys = ()
    macros = bound_macros()
    for _ in range(100):  # ``= %KEYS``: the macro's value (through macros of macros; a cycle gin refuses)
        if macro_name(keys) not in macros:
            break
        keys = macros[macro_name(keys)]
    if isinstance(keys, str):
        bound: Tuple[str, ...] = (keys,)
    elif isinstance(keys, (list, tuple)):  # ``['my_cred', %MORE]``: each macro item resolved once
        items = [macros.get(macro_name(k), k) if macro_name(k) is not None else k for k in keys]
        bound = tuple(k for k in items if isinstance(k, str))
    else:
        bound = ()
    return tuple(dict.fromkeys((*bound, *_declared["keys"])))


def macro_name(value: Any) -> Any:
    """The name of the macro ``value`` refers to (``%CREDS`` -> ``CREDS``), None for anything else."""
    if isinstance(value, gin.config.ConfigurableReference) and value.selector == "gin.macro":
        return value.scoped_selector.rsplit("/", 1)[0]
    return None


def bound_macros() -> Dict[str, Any]:
    """Every macro the parsed config defines, by name, with the value bound to it (maybe another macro)."""
    config = getattr(gin.config, "_CONFIG", {})
    return {scope: params["value"] for (scope, selector), params in list(config.items())
            if selector == "gin.macro" and "value" in params}


def resolve_secret_macros(
    bindings: Iterable[Tuple[str, Any]], macros: Dict[str, Any], extra: Tuple[str, ...] = ()
) -> Tuple[Dict[str, Any], Set[str]]:
    """``{name: value}`` of ``bindings`` with every macro under a secret-looking name replaced by its value,
    and the names of the macros whose value is secret: used there, or named like a secret themselves
    (``API_TOKEN = '...'``). Numbers, booleans and None are never secret, as elsewhere."""
    names: Set[str] = set()
    resolved = {}
    for name, value in bindings:
        secret = is_secret(name, extra)
        if secret and name in macros and not _plain(macros[name]):
            names.add(name)
        resolved[name] = _resolve(value, macros, secret, name, extra, names, 0)
    return resolved, names


def _resolve(value: Any, macros: Dict[str, Any], secret: bool, parent: str, extra: Tuple[str, ...],
             names: Set[str], depth: int) -> Any:
    name = macro_name(value)
    if name is not None:
        if not secret or name not in macros or depth > 100:  # a cycle of macros: gin refuses it at the call
            return value
        out = _resolve(macros[name], macros, True, parent, extra, names, depth + 1)
        if not _plain(out):
            names.add(name)
        return out
    if isinstance(value, dict):
        return {k: _resolve(v, macros, secret or is_secret(k, extra, parent), k, extra, names, depth)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_resolve(v, macros, secret, parent, extra, names, depth) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _plain(value: Any) -> bool:
    return isinstance(value, (bool, int, float, type(None)))


def macro_patterns(names: Iterable[str]) -> Tuple[str, ...]:
    """Secret patterns that match the bindings of the macros ``names`` (``CREDS = '...'``) in a config text."""
    return tuple(sorted({re.split(r"[/.]", n)[-1] for n in names}))


def config_secrets() -> Tuple[Tuple[str, ...], Set[str]]:
    """What the parsed config holds that is secret: the patterns to redact a binding's text with (the run's
    own and the secret macros' names) and every secret string bound (to scrub from any other text)."""
    extra = secret_keys()
    macros = bound_macros()
    bindings = [(f"{scope}/{selector}.{param}" if scope else f"{selector}.{param}", value)
                for (scope, selector), params in list(getattr(gin.config, "_CONFIG", {}).items())
                if selector != "gin.macro" for param, value in params.items()]
    resolved, names = resolve_secret_macros([*bindings, *macros.items()], macros, extra)
    found: Set[str] = set()
    redact_values(resolved, extra, found)
    for name in names:  # a secret macro's own value, however it is named
        redact_values({"token": _resolve(macros[name], macros, True, name, extra, set(), 0)}, (), found)
    return extra + macro_patterns(names), found


def redacted_text(message: str, binds: Sequence[str]) -> str:
    """``message`` with every secret the config binds left out: the value of a secret-looking binding of ``binds``
    (a ``--bind``, or a config name typed like one; under a built-in pattern, one of the run's own, or a macro
    used as a secret), each word of it too, and every string bound under a secret-looking name in a file, macros
    resolved (a user's own error may quote the value). Only the secret's words: ``'epochs'`` beside a secret dict
    key stays. The CLI's messages and `parse_config`'s errors alike."""
    patterns, found = config_secrets()
    patterns = (*patterns, *declared_macro_patterns())
    for bind in binds:
        secrets: Set[str] = set()
        if redact_config_text(bind, patterns, secrets, loose=True) == bind:
            continue
        name, _, value = bind.partition("=")
        found |= secrets | ({value.strip(), *secret_words(value)} if is_secret(name.strip(), patterns) else set())
    return scrub(message, {s for s in found if s and s != REDACTED})
