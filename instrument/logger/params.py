"""Hyperparameters as backends want them: flat, scalar-valued and free of secrets.

Redaction works on the structured values before anything is rendered: a secret-looking key is redacted at
any depth of nested dicts and lists, and every string found under one is then also scrubbed from whatever
is rendered as text (the operative config, however gin wrapped a value over lines; other string values; the
command line). Keys are matched case-insensitively, ``-`` read as ``_``, against glob patterns
(`SECRET_PATTERNS`, extended per run by ``Instrumentation(secret_keys=...)``). Numbers, booleans and None
are never redacted: ``max_tokens = 512`` or ``use_auth_token = True`` are settings, not credentials.
"""

import ast
import fnmatch
import logging
import pprint
import re
import warnings
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from instrument.core.names import numbered
from instrument.logger.secret_text import secret_words, uncommented

__all__ = ["flatten_params", "redact_secrets", "redact_config_text", "redact_dict_items", "redact_values",
           "redact_argv", "scrub", "is_secret", "secret_item_values", "set_secret_source", "REDACTED",
           "SECRET_PATTERNS"]

REDACTED = "<redacted>"
# The usual credential names: generic ones, then AWS, GCP, Azure, Hugging Face and W&B. "reward_key" names a
# dict key, not a credential, so "key" counts only alone or in the credential compounds below.
SECRET_PATTERNS: Tuple[str, ...] = (
    "*token*", "*secret*", "*password*", "*passwd*", "*api_key*", "*apikey*", "authorization", "*credential*",
    "key", "*private_key*", "*access_key*", "*auth_key*", "*connection_string*", "*session_key*",
    "aws_access_key_id", "*account_key*", "*storage_key*", "*sas_key*", "*service_account*",
    "google_application_credentials", "hf_token", "hugging_face_hub_token", "wandb_api_key",
)
_SCALAR = (str, int, float, bool, type(None))
_MIN_SCRUB = 4  # shorter strings under a secret key are redacted there, but not hunted for in other text


# instrument's own settings whose names look secret and are not: the patterns themselves
# (``Instrumentation.secret_keys``), and the metric key of each console column (``{'key': 'train/loss'}``
# under ``columns``). Redacted, the logged config could not reproduce the run, and error messages would hide
# what they received.
_NOT_SECRET_LEAVES = frozenset({"secret_keys"})
_NOT_SECRET_UNDER = {"columns": frozenset({"key"})}


def _leaf(name: Any) -> str:
    return re.split(r"[/.]", str(name))[-1].lower().replace("-", "_")


def is_secret(name: Any, extra: Sequence[str] = (), parent: Any = "") -> bool:
    """Whether the last component of ``name`` (``a/b.c`` -> ``c``) matches a secret pattern; ``parent`` is the
    name of the setting or key that holds ``name`` (``ConsoleBackend.columns`` for a column's ``key``)."""
    leaf = _leaf(name)
    if leaf in _NOT_SECRET_LEAVES or leaf in _NOT_SECRET_UNDER.get(_leaf(parent), ()):
        return False
    return any(fnmatch.fnmatchcase(leaf, p.lower()) for p in (*SECRET_PATTERNS, *extra))


def _plain(value: Any) -> bool:
    return isinstance(value, (bool, int, float, type(None)))


def redact_values(value: Any, extra: Sequence[str] = (), found: Optional[Set[str]] = None, parent: Any = "") -> Any:
    """``value`` with everything under a secret-looking key replaced by `REDACTED`, at any depth of dicts,
    lists and tuples; the strings replaced are added to ``found``. ``parent``: the name ``value`` is bound to."""
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if is_secret(key, extra, parent) and not _plain(item):
                _strings(item, found)
                out[key] = REDACTED
            else:
                out[key] = redact_values(item, extra, found, key)
        return out
    if isinstance(value, (list, tuple)):  # the items of a list are under the list's own name
        items = [redact_values(item, extra, found, parent) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _strings(value: Any, found: Optional[Set[str]]) -> None:
    if found is None:
        return
    if isinstance(value, (str, bytes)):
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        if len(text) >= _MIN_SCRUB:
            found.add(text)
    elif isinstance(value, Mapping):
        for item in value.values():
            _strings(item, found)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            _strings(item, found)
    elif not _plain(value):
        _strings(str(value), found)


def scrub(text: str, found: Iterable[str]) -> str:
    """``text`` with every occurrence of a known secret string replaced by `REDACTED` (longest first)."""
    for secret in sorted(found, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def flatten_params(params: Mapping[str, Any], prefix: str = "", sep: str = "/") -> Dict[str, Any]:
    """Flatten nested mappings into ``a/b/c`` keys; a NumPy number or one-element tensor becomes its Python
    number (a tensor's repr rounds to 4 digits), other non-scalar leaves their ``repr``. Two keys that flatten
    to one name (``{"a/b": 1, "a": {"b": 2}}``, ``1`` and ``"1"``) keep both values: the later one is named
    ``<name>__2``, with a warning."""
    flat: Dict[str, Any] = {}
    for name, value in _leaves(params, prefix, sep):
        if name in flat:
            taken, name = name, numbered(name, flat.__contains__)
            logging.getLogger("instrument").warning(
                "instrument: two hyperparameters flatten to the name %r; the later one is logged as %r so that "
                "both values are kept. Rename one of them.", taken, name)
        flat[name] = value
    return flat


def _leaves(params: Mapping[Any, Any], prefix: str, sep: str) -> Iterable[Tuple[str, Any]]:
    for key, value in params.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, name, sep)
        elif isinstance(value, Mapping):  # an empty group (model_kwargs = {}) is a value too: it was left out
            yield name, "{}"
        else:
            yield name, _number(value)


_NOT_A_NUMBER = object()


def _scalar(value: Any) -> Any:
    """``value`` as a Python scalar: a scalar as it is, a NumPy number or a one-element tensor as its Python
    number; `_NOT_A_NUMBER` for anything else."""
    if isinstance(value, np.generic):  # first: np.float64 and np.str_ are a float and a str whose repr says so
        item = value.item()
        return item if isinstance(item, _SCALAR) and value.dtype.kind in "biufU" else _NOT_A_NUMBER
    if isinstance(value, _SCALAR):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and not value.is_meta:
        return value.item()  # host sync: once, when the hyperparameters are logged
    return _NOT_A_NUMBER


def _number(value: Any) -> Any:
    """A leaf as backends take it: a scalar (`_scalar`: a tensor's repr would round to 4 digits), a list or
    tuple of scalars as its str (of Python scalars: ``[0.9, 0.999]``, never ``[np.float64(0.9), ...]``),
    anything else as its repr."""
    scalar = _scalar(value)
    if scalar is not _NOT_A_NUMBER:
        return scalar
    if isinstance(value, (list, tuple)):
        items = [_scalar(v) for v in value]
        if all(item is not _NOT_A_NUMBER for item in items):
            return str(tuple(items) if isinstance(value, tuple) else items)  # a tuple shown as one
    return repr(value)


def redact_secrets(
    params: Mapping[str, Any], extra: Sequence[str] = (), found: Optional[Set[str]] = None
) -> Dict[str, Any]:
    """Flat ``params`` with every secret-looking key redacted, then every known secret string scrubbed from
    the other string values (a secret that also appears inside another value, e.g. a URL)."""
    found = set() if found is None else found
    out = redact_values(dict(params), extra, found)
    return {k: scrub(v, found) if isinstance(v, str) and v != REDACTED else v for k, v in out.items()}


# A gin binding's first line: optional scope, ``Name.param = value`` (the value may go on over more lines).
_BINDING = re.compile(r"^(\s*)([\w./]+)(\s*=\s*)(.*)$")
# Inside a value gin could not have us evaluate (references, macros): ``'secret_key': 'string'``.
_DICT_ITEM = re.compile(r"""(['"])([^'"]+)\1(\s*:\s*)('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")
# A quoted dict key and its colon, on a line gin rejects; the value after it is read by `_value_end`. The key may
# hold the other quote or an escape (``"api_key'"``) and be adjacent literals, which Python joins (``'api' '_key'``).
_ONE_LITERAL = r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\""
_DICT_KEY = re.compile(rf"((?:{_ONE_LITERAL})(?:(?:\s|\\\r?\n)*(?:{_ONE_LITERAL}))*)(\s*:\s*)")


def _scan(text: str, start: int, closed: bool) -> int:
    """One pass over the value at ``start``, brackets and strings (escapes, triple quotes) read as Python does:
    where it ends, the next ``,`` or closing bracket at its own depth (the end of ``text`` when none, or when a
    string is never closed); with ``closed``, just after the bracket that brings the depth back to 0 (-1 when
    none does). `_value_end` and `_closes` share it, so the two never read a value differently."""
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch in "'\"":
            quote = text[i:i + 3] if text[i:i + 3] == ch * 3 else ch
            i += len(quote)
            while i < len(text) and not text.startswith(quote, i):
                i += 2 if text[i] == "\\" else 1
            if i >= len(text):
                break
            i += len(quote)
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}" or ch == "," and depth == 0 and not closed:
            if depth == 0 and not closed:
                return i
            depth -= 1
        if closed and depth == 0:
            return i + 1
        i += 1
    return -1 if closed else len(text)


def _value_end(text: str, start: int) -> int:
    """Where the value starting at ``start`` ends (`_scan`): a never-closed string or bracket runs to the end."""
    return _scan(text, start, closed=False)


def _closes(value: str) -> bool:
    """``value`` (from its opening bracket) is closed by its last character, read as `_value_end` reads it."""
    return _scan(value, 0, closed=True) == len(value)


def _secret_key(literals: str, extra: Sequence[str], parent: Optional[str]) -> bool:
    """Whether the key the string literals ``literals`` spell looks secret: as Python reads them (adjacent ones
    joined, escapes decoded; their text between the quotes, joined, where it cannot), or its last literal alone
    (on a line gin rejects, the literal before it may be a value whose comma is missing)."""
    pieces = [piece[1:-1] for piece in re.findall(_ONE_LITERAL, literals)]
    try:
        with warnings.catch_warnings():  # an invalid escape ('\\q') warns: the key is still what it spells
            warnings.simplefilter("ignore")
            key = ast.literal_eval(literals.replace("\\\n", " "))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        key = None
    key = key if isinstance(key, str) else "".join(pieces)
    return is_secret(key, extra, parent) or bool(pieces) and is_secret(pieces[-1], extra, parent)


def secret_item_values(text: str, extra: Sequence[str], parent: Optional[str] = None) -> List[str]:
    """The text of each value under a secret-looking quoted dict key in ``text``, read as `redact_dict_items` reads
    it: where a config's text uses a macro as a secret (``{'api_key': %TOK}``) before gin has read it."""
    values, pos = [], 0
    while (m := _DICT_KEY.search(text, pos)) is not None:
        pos = m.end()
        if _secret_key(m.group(1), extra, parent):
            values.append(text[pos:_value_end(text, pos)])
    return values


def _closed_string(value: str) -> bool:
    try:
        return isinstance(ast.literal_eval(value), str)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False


def redact_dict_items(
    text: str, extra: Sequence[str], found: Set[str], parent: Optional[str] = None, loose: bool = False
) -> str:
    """``text`` (a value gin could not have us evaluate, or with ``loose`` a line it rejects) with the value under
    each secret-looking quoted dict key replaced whole: a string, a bare word, a container, a string never closed
    (to the end). Its strings go into ``found`` whole, as the literal path's do (a nested dict's keys and a
    container's numbers are no secret). Only with ``loose`` does a bare word, an unclosed string or an unclosed
    container also give its whole text and each word in it: a valid binding's words would blank the same words
    in unrelated parameters. A reference or macro (@, %), a number, a boolean or None is kept, as elsewhere."""
    out, pos = [], 0
    while (m := _DICT_KEY.search(text, pos)) is not None:
        start = m.end()
        out.append(text[pos:start])
        pos = start
        if not _secret_key(m.group(1), extra, parent) or text[start:start + 1] in ("@", "%"):
            continue
        end = _value_end(text, start)
        value = text[start:end].rstrip()
        if not value or value in ("True", "False", "None") or re.fullmatch(r"[-+]?[\d.]+(e[-+]?\d+)?", value):
            continue
        if value[0] in "'\"" and _closed_string(value):
            _strings(_literal_strings(value), found)
        elif value[0] in "([{" and _closes(value) and not loose:
            _strings(_container_strings(value), found)
        elif loose:  # a bare word, a container, an unclosed string: the whole of it, its strings and each word
            code = uncommented(value)  # a comment's words are no secret (`secret_words`)
            keys = re.sub(r"""(['"])[^'"\n]*\1\s*:""", " ", code)  # a nested dict's keys are no secret
            _strings([value, value.strip("'\""), *secret_words(keys), *_container_strings(code)], found)
        else:
            _strings([value, value.strip("'\"")], found)
        out.append(f"'{REDACTED}'")
        pos = start + len(value)
    return "".join(out) + text[pos:]


# A string literal (triple-quoted or one-line), then a ':' when it is a dict key.
_STRING_LITERAL = re.compile(
    r"""('''(?:[^\\]|\\.)*?'''|\"\"\"(?:[^\\]|\\.)*?\"\"\"|'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")(\s*:)?""")


def _container_strings(value: str) -> List[Any]:
    """The strings a container's text holds, as `_strings` takes them from its value: the literal's own or,
    where it holds a reference or macro, each string literal in it that is not a dict key."""
    try:
        return [ast.literal_eval(value)]
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    strings: List[Any] = []
    for literal, key in _STRING_LITERAL.findall(value):
        if not key:
            try:
                strings.append(ast.literal_eval(literal))
            except (ValueError, SyntaxError):
                strings.append(literal.strip("'\""))
    return strings


def redact_config_text(
    text: str, extra: Sequence[str] = (), found: Optional[Set[str]] = None, loose: bool = False
) -> str:
    """Redact a gin config text binding by binding (``X.api_key = '...'``, ``X.env = {'WANDB_API_KEY': ...}``,
    values gin wrapped over several lines), then scrub every known secret string from what is left.

    The operative config is logged verbatim to every backend, so a token bound in a .gin file would otherwise
    reach W&B or MLflow in clear. Lines are gin's: only ``\\n`` (or ``\\r\\n``) ends one. Other characters
    `str.splitlines` also breaks at (``\\x0b``, ``\\x85``, U+2028) may stand inside a gin string literal; a
    split there cut a secret's value in two, leaving its tail unredacted, and every one of them came back as
    ``\\n``. A line gin rejects (text pasted with U+2028 between two bindings, which the CLI quotes in its
    syntax error) is then read again in pieces split at those characters, so a binding after one is redacted
    too. Outside a binding that holds a secret (rewritten whole), the text is kept character for character.
    ``loose``: a line gin rejects (`redact_dict_items`: the words of a value under a secret dict key are found too).
    """
    found = set() if found is None else found
    lines = _redacted_lines(text.split("\n"), extra, found, loose)  # "\r\n" lines keep their "\r" (`_redacted_lines`)
    for n, line in enumerate(lines):
        parts = _OTHER_BREAKS.split(line)  # [piece, break, piece, ...]
        if len(parts) > 1:
            pieces, breaks = _redacted_lines(parts[0::2], extra, found, loose), parts[1::2]
            if len(pieces) != len(breaks) + 1:  # a binding continued over pieces was rewritten as one
                breaks = [breaks[0]] * (len(pieces) - 1)
            lines[n] = "".join(piece + brk for piece, brk in zip(pieces, breaks + [""], strict=True))
    return "\n".join(scrub(line, found) for line in lines)


# What `str.splitlines` breaks at beside "\n" and "\r" (gin breaks at neither: they may stand inside a value).
_OTHER_BREAKS = re.compile("([\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029])")


def _redacted_lines(lines: List[str], extra: Sequence[str], found: Set[str], loose: bool = False) -> List[str]:
    """``lines`` with each binding that holds a secret rewritten (every other line kept as it is)."""
    out: List[str] = []
    i = 0
    while i < len(lines):
        match = _BINDING.match(lines[i]) if not lines[i].lstrip().startswith("#") else None
        if not match:
            out.append(lines[i])
            i += 1
            continue
        j = i + 1  # continuation lines: indented, or after a backslash, up to the next binding or blank line
        while j < len(lines) and lines[j].strip() and not lines[j].lstrip().startswith("#") and (
            lines[j][:1].isspace() or lines[j - 1].rstrip().endswith("\\") or lines[j].lstrip()[:1] in ")]}"
        ):
            j += 1
        indent, name, eq, first = match.groups()
        value = "\n".join([first] + lines[i + 1 : j])
        redacted = _redact_binding(indent, name, eq, value, extra, found, loose)
        if redacted == f"{indent}{name}{eq}{value}":
            out.extend(lines[i:j])
        else:  # rewritten: each of its lines ends as the binding's last line did
            end = "\r" if lines[j - 1].endswith("\r") else ""
            out.extend(line.rstrip("\r") + end for line in redacted.split("\n"))
        i = j
    return out


def _redact_binding(
    indent: str, name: str, eq: str, value: str, extra: Sequence[str], found: Set[str], loose: bool = False
) -> str:
    try:
        parsed = ast.literal_eval(re.sub(r"\\\r?\n", " ", value).strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        parsed = _UNPARSED
    if is_secret(name, extra):
        if parsed is not _UNPARSED and _plain(parsed):
            return f"{indent}{name}{eq}{value}"
        _strings(parsed if parsed is not _UNPARSED else _literal_strings(value), found)
        return f"{indent}{name}{eq}'{REDACTED}'"
    if parsed is _UNPARSED:  # a reference, a macro or a line gin rejects: redact the dict items we can see
        return f"{indent}{name}{eq}{redact_dict_items(value, extra, found, name, loose)}"
    redacted = redact_values(parsed, extra, found, name)
    if redacted == parsed:
        return f"{indent}{name}{eq}{value}"
    return f"{indent}{name}{eq}{pprint.pformat(redacted, width=100, sort_dicts=False)}"


_UNPARSED = object()


def _literal_strings(text: str) -> List[str]:
    """The string literals in ``text`` (their values), or ``text`` itself when it has none."""
    values = []
    for literal in re.findall(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*\"""", text):
        try:
            values.append(ast.literal_eval(literal))
        except (ValueError, SyntaxError):
            values.append(literal[1:-1])
    return values or [text.strip()]


SecretSource = Callable[[], Tuple[Tuple[str, ...], Set[str]]]
_secret_source: Optional[SecretSource] = None


def set_secret_source(source: Optional[SecretSource]) -> None:
    """Install what the parsed config holds that is secret: ``source()`` returns the patterns its secret names
    match (a secret macro's name, ``CREDS``) and the secret strings it binds. `instrument.config` installs it
    (this layer never imports gin): a value bound as ``--bind "CREDS = '...'"`` and used as ``api_token =
    %CREDS`` has no secret-looking name on the command line itself."""
    global _secret_source
    _secret_source = source


def redact_argv(argv: Sequence[str], extra: Sequence[str] = ()) -> List[str]:
    """A command line with secrets redacted: gin bindings in it, as an argument of their own (``--bind
    'X.password = "..."'``) or as an option's value (``--bind=X.password='...'``, argparse's ``=`` form), and
    ``--password=...`` / ``--password ...`` options. A string a binding's secret holds is also scrubbed from
    every other argument, and so is every secret the parsed config holds (`set_secret_source`). W&B records
    the command line of every run."""
    out: List[str] = []
    found: Set[str] = set()
    if _secret_source is not None:
        patterns, strings = _secret_source()
        extra, found = (*extra, *patterns), set(strings)
    redact_next = False
    for arg in argv:
        if redact_next:
            out.append(REDACTED)
            redact_next = False
            continue
        option = re.match(r"^(--?)([\w.-]+)(=(.*))?$", arg, re.DOTALL)
        if option and is_secret(option.group(2), extra):
            if option.group(3) is None:
                redact_next = True
                out.append(arg)
            else:
                out.append(f"{option.group(1)}{option.group(2)}={REDACTED}")
            continue
        if option and option.group(3) is not None:  # --bind=X.token='...': the value is a binding of its own
            out.append(f"{option.group(1)}{option.group(2)}={redact_config_text(option.group(4), extra, found)}")
            continue
        out.append(redact_config_text(arg, extra, found) if "=" in arg else arg)
    return [scrub(arg, found) for arg in out]


def redact_hyperparams(
    params: Mapping[str, Any], config_text: Optional[str], extra: Sequence[str] = ()
) -> Tuple[Dict[str, Any], Optional[str]]:
    """What `Logger.log_hyperparams` hands to the backends: the structured values redacted first, then the
    config text (binding by binding), then the flat params with every secret string found scrubbed."""
    found: Set[str] = set()
    structured = redact_values(dict(params), extra, found)
    text = redact_config_text(config_text, extra, found) if config_text else config_text
    flat = redact_secrets(flatten_params(structured), extra, found)
    return flat, scrub(text, found) if text else text
