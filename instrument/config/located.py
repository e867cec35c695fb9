"""Where a binding is: the file and line (or the ``--bind``) of each ``Name.param = value`` gin read.

Error messages point at the binding at fault (`where_bound`), the run names bindings it never used
(`unused_bindings`), and an include cycle is named line by line (`include_cycle`). gin itself keeps no
locations, so the files are read again here, includes expanded where gin finds them.
"""

import ast
import re
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import gin

from instrument.config.files import CONFIG_DIR, read_text, resolve_config, shown
from instrument.config.secrets import config_secrets, macro_patterns, secret_keys
from instrument.errors import InstrumentError
from instrument.logger.params import is_secret, redact_config_text, scrub, secret_item_values
from instrument.logger.secret_text import uncommented

__all__ = ["bound_pair", "declared_secret_keys", "declared_secrets", "file_holding", "include_cycle", "included_file",
           "line_where", "secret_keys", "unused_bindings", "where_bound"]


def _included(line: str, top: Path, current: Path) -> Optional[Path]:
    """The file an ``include`` line names, where `parse_config` finds it (`includes`): beside the including file,
    from the working directory, among the shipped configs. None for any other line. (``top``, the file given,
    is searched last, as it once was.)"""
    include = re.match(r"\s*include\s+['\"]([^'\"]+)['\"]", line)
    if include:
        for base in (current.parent, Path(), CONFIG_DIR, top):  # Path(): the working directory, named as gin does
            if (base / include.group(1)).is_file():
                return base / include.group(1)
    return None


def included_file(line: str, top: Path, current: Path) -> Optional[Path]:
    """The file the ``include`` line ``line`` of ``current`` names, where gin finds it (``top``: the file given),
    named as gin names it (``sub/inner.gin`` for ``include 'inner.gin'`` in ``sub/top.gin``); None when none."""
    return _included(line, top.parent, current)


def include_cycle(path: Path) -> List[str]:
    """``file, line N`` of each include on the first cycle of includes from ``path``, ending with the file it
    started from; just ``path`` when none is found."""
    def walk(current: Path, trail: List[Tuple[Path, str]]) -> Optional[List[str]]:
        for n, line in enumerate(read_text(str(current)).splitlines(), 1):
            target = _included(line, path.parent, current)  # named as gin names it (`shown`), as elsewhere
            if target is None:
                continue
            here = trail + [(current.resolve(), f"{shown(str(current))}, line {n}")]
            seen = [p for p, _ in here]
            if target.resolve() in seen:  # ends with the name the cycle's first file had
                cycle = [where for _, where in here[seen.index(target.resolve()):]]
                return cycle + [cycle[0].rsplit(", line ", 1)[0]]
            found = walk(target, here) if len(trail) < 50 else None
            if found:
                return found
        return None

    return walk(path, []) or [shown(str(path))]


def file_holding(path: Path, wanted: Callable[[bytes], bool]) -> Optional[Path]:
    """``path`` or the first file it includes (at any depth) whose bytes are ``wanted``; None when none is."""
    seen: List[Path] = []

    def walk(current: Path) -> Optional[Path]:
        if current in seen or len(seen) > 200:
            return None
        seen.append(current)
        try:
            if wanted(current.read_bytes()):
                return current
        except OSError:
            return None
        for line in read_text(str(current)).splitlines():
            target = _included(line, path.parent, current)
            found = walk(target.resolve()) if target is not None else None
            if found:
                return found
        return None

    return walk(path.resolve())


def where_bound(message: str, files: Sequence[str], bindings: Sequence[str]) -> str:
    """Where the value an error message complains about was bound: ``file, line N: statement`` (or the
    ``--bind``), found from gin's ``In call to configurable 'X'`` and a parameter of X the message names.
    Empty when it cannot tell."""
    match = re.search(r"In call to configurable '([^']+)'[^\n]*?(?: in scope '([^']*)')?$", message, re.M)
    if not match:
        return ""
    head = message.split("\n", 1)[0]
    # The parameter the message names first (it says what it got before giving examples of other bindings).
    named = {m.group(1): m.start() for m in reversed(list(re.finditer(r"\b(\w+)\b", head)))}
    params = _bound_params(match.group(1), files, bindings)
    first = min((p for p in params if p in named), key=lambda p: named[p], default=None)
    if first is None:
        return ""
    # gin reads a call in scope 'a/b' from a binding in 'a/b', else 'a', else unscoped: the first that exists.
    parts = (match.group(2) or "").split("/") if match.group(2) else []
    for depth in range(len(parts), -1, -1):
        found = _bound_at(match.group(1), lambda param: param == first, files, bindings, "/".join(parts[:depth]))
        if found:
            return found
    return ""


def _bound_params(selector: str, files: Sequence[str], bindings: Sequence[str]) -> List[str]:
    """The parameters of ``selector`` bound anywhere in the config."""
    name = selector.rsplit(".", 1)[-1]
    binding = re.compile(rf"^\s*(?:[\w./]*/)?(?:[\w.]*\.)?{re.escape(name)}\.(?P<param>\w+)\s*=")
    return [m["param"] for _, line in _lines(files, bindings) if (m := binding.match(line))]


def _bound_at(selector: str, wanted: Callable[[str], bool], files: Sequence[str], bindings: Sequence[str],
              scope: Optional[str] = None) -> str:
    """``where: statement`` of `bound_pair`, or empty; the statement redacted as the logged config is (a
    secret bound in a file reaches the terminal otherwise: only ``--bind`` values were left out)."""
    where, statement = bound_pair(selector, wanted, files, bindings, scope)
    if not where:
        return ""
    patterns, found = config_secrets()
    return f"{where}: {scrub(redact_config_text(statement, patterns, set(found)), found)}"


def bound_pair(selector: str, wanted: Callable[[str], bool], files: Sequence[str], bindings: Sequence[str],
                scope: Optional[str] = None) -> Tuple[str, str]:
    """The last ``selector.param = ...`` line (in ``scope`` if given) whose param is ``wanted``, in the order
    gin read them (included files at their ``include`` line): ``(where, statement)``, or two empty strings."""
    name = selector.rsplit(".", 1)[-1]
    binding = re.compile(rf"^\s*(?P<scope>[\w./]*/)?(?:[\w.]*\.)?{re.escape(name)}\.(?P<param>\w+)\s*=")
    found = ("", "")
    for where, line in _lines(files, bindings):  # the last binding wins, as in gin
        m = binding.match(line)
        if m and wanted(m["param"]) and (scope is None or (m["scope"] or "").rstrip("/") == scope):
            found = (where, line.strip())
    return found


def _lines(files: Sequence[str], bindings: Sequence[str]) -> Iterator[Tuple[str, str]]:
    """``(where, line)`` for every line gin read, includes expanded in place, then each ``--bind``."""
    for f in files:
        try:
            path = resolve_config(str(f))
        except InstrumentError:  # it parsed before; nothing to point at
            continue
        yield from _file_lines(path, path.parent, "", 0)
    for b in bindings:  # a --bind may hold several lines, and include a file (read from the working directory)
        where = f"--bind {b!r}"
        for line in b.splitlines() or [b]:
            yield where, line
            included = _included(line, Path(), Path("--bind"))
            if included is not None:
                yield from _file_lines(included, Path(), where, 1)


def _file_lines(path: Path, top: Path, outer: str, depth: int) -> Iterator[Tuple[str, str]]:
    """A file's lines, each included file's lines after its ``include`` line (found where gin finds it)."""
    for n, line in enumerate(read_text(str(path)).splitlines(), 1):
        where = f"{shown(str(path))}, line {n}"  # as gin's own errors name it
        yield where + (f" (included from {outer})" if outer else ""), line
        included = _included(line, top, path) if depth < 20 else None
        if included is not None:
            yield from _file_lines(included, top, where + (f", {outer}" if outer else ""), depth + 1)


def line_where(source: str, filename: str, lineno: int) -> str:
    """``filename, line N (included from top.gin, line 2)`` for line ``lineno`` of the file gin names
    ``filename``, read through the includes of ``source``; empty when no include of it reaches that file."""
    head = f"{shown(filename)}, line {lineno}"
    path = Path(source)
    for where, _ in _file_lines(path, path.parent, "", 0):
        if where == head or where.startswith(head + " "):
            return where
    return ""


def unused_bindings(files: Sequence[str] = (), bindings: Sequence[str] = ()) -> List[str]:
    """``where: statement`` of each binding of a configurable that was never called in this process since the
    config was parsed (gin's operative config holds only what was called): a setting of a backend the run does
    not include, say. Secret-looking values are redacted, as in the logged config."""
    def canonical(selector: str) -> str:
        found = gin.config._REGISTRY.get_match(selector)
        return found.selector if found is not None else selector

    extra, found = config_secrets()
    # A call in scope 'a/b' reads the bindings of scopes '', 'a' and 'a/b' (gin's scope prefixes): a binding in
    # scope 'loss' is used only when something was called in 'loss' or under it, not when '@los/Column()' was.
    called = {(scope, canonical(selector)) for scope, selector in list(getattr(gin.config, "_OPERATIVE_CONFIG", {}))}

    def used(scope: str, selector: str) -> bool:
        name = canonical(selector)
        return any(s == name and (not scope or c == scope or c.startswith(scope + "/")) for c, s in called)

    unused = []
    for (scope, selector), params in list(getattr(gin.config, "_CONFIG", {}).items()):
        if used(scope, selector) or selector.split(".")[0] == "gin":  # gin's own macros and constants
            continue
        for param in params:
            place, statement = bound_pair(selector, lambda p, param=param: p == param, files, bindings, scope)
            statement = scrub(redact_config_text(statement or f"{selector}.{param} = ...", extra, set(found)), found)
            unused.append(f"{place}: {statement}" if place else statement)
    return unused


_SECRET_KEYS = re.compile(r"^[ \t]*(?:[\w.]*/)?(?:[\w.]*\.)?Instrumentation\.secret_keys[ \t]*=[ \t]*", re.M)


def declared_secret_keys(files: Sequence[str], bindings: Sequence[str]) -> List[str]:
    """The patterns bound to ``Instrumentation.secret_keys`` anywhere in the text of ``files`` (their includes
    too, found where gin finds them) and ``bindings``, read before gin parses them; a value that is no literal
    list, tuple or string is left out."""
    return declared_secrets(files, bindings)[0]


def declared_secrets(files: Sequence[str], bindings: Sequence[str]) -> Tuple[List[str], List[str]]:
    """`declared_secret_keys`, and the names of the macros the same text uses under a secret-looking name or dict
    key (``Sink.api_key = %TOK``, ``{'password': [%TOK]}``, through macros of macros): a macro's line that gin
    rejects before it reads the line that makes it secret must leave its value out too."""
    texts: List[str] = []
    read: set = set()  # each file once: a file that includes itself twice made 2^20 reads before gin's own error

    def walk(path: Path, top: Path, depth: int) -> None:
        key = path.resolve()
        if key in read:
            return
        read.add(key)
        text = read_text(str(path))
        texts.append(text)
        for line in text.splitlines():
            included = _included(line, top, path) if depth < 20 else None
            if included is not None:
                walk(included, top, depth + 1)

    for f in files:
        try:
            path = resolve_config(str(f))
        except InstrumentError:  # parse_config says so
            continue
        walk(path, path.parent, 0)
    # a line continued with a backslash; not one ending a comment (which continues nothing, in gin as in Python)
    texts = [re.sub(r"\\\r?\n", " ", uncommented(text)) for text in [*texts, *bindings]]
    # where each macro's value starts, not a copy of the text after it (20,000 macro lines copied 1.8 GB)
    macros = {m.group(1): (text, m.end()) for text in texts for m in _MACRO.finditer(text)}
    keys: List[str] = []
    for text in texts:
        for match in _SECRET_KEYS.finditer(text):
            keys.extend(_literal_keys(text, match.end(), macros))
    return keys, _secret_macros(texts, keys)


def _secret_macros(texts: List[str], keys: List[str]) -> List[str]:
    """The macros ``texts`` use under a secret-looking name or dict key (``keys``: the run's own patterns); a macro
    bound to a secret macro's value is one too."""
    statements = []  # (name, value): each statement runs to the next line that starts one
    for text in texts:
        starts = list(_BINDING_START.finditer(text))
        ends = [s.start() for s in starts[1:]] + [len(text)] if starts else []
        for m, end in zip(starts, ends, strict=True):
            statements.append((m.group(1), text[m.end():end]))
    by_leaf: Dict[str, List[str]] = {}  # a bound name's last component -> the values bound to such names
    for bound, value in statements:
        by_leaf.setdefault(re.split(r"[/.]", bound)[-1].lower().replace("-", "_"), []).append(value)
    # Used under a secret name or dict key; then, through each secret macro's own binding (``TOK = %OTHER``),
    # what it uses, as deep as gin follows macros: each macro visited once, looked up by its name.
    queue = [name for bound, value in statements
             for part in ([value] if is_secret(bound, keys) else secret_item_values(value, keys, bound))
             for name in re.findall(r"%([\w./]+)", part)]
    secret: Dict[str, None] = {}
    while queue:
        name = queue.pop()
        if name in secret:
            continue
        secret[name] = None
        for value in by_leaf.get(macro_patterns([name])[0].lower(), ()):
            queue.extend(re.findall(r"%([\w./]+)", value))
    return list(secret)


_BINDING_START = re.compile(r"^[ \t]*([\w./]+)[ \t]*=", re.M)
_MACRO = re.compile(r"^[ \t]*(\w+)[ \t]*=[ \t]*", re.M)
_MACRO_USE = re.compile(r"\s*(?:%(\w+))?")  # the blanks before a value, and its macro
_STRING = re.compile(r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"")


def _literal_end(rest: str, i: int = 0) -> Optional[Tuple[int, str]]:
    """Where the string, list or tuple at index ``i`` of ``rest`` ends, and its text with its ``#`` comments left
    out (one pass: brackets paired, strings with their escapes and triple quotes skipped, a comment skipped to
    its line's end: a quote or bracket in it is no token); None when none starts there or it is never closed."""
    depth, kept = 0, []
    while i < len(rest):
        ch, start = rest[i], i
        if ch in "'\"":
            quote = rest[i:i + 3] if rest[i:i + 3] == ch * 3 else ch
            close = i + len(quote)
            while close < len(rest) and not rest.startswith(quote, close):
                if rest[close] == "\n" and len(quote) == 1:
                    return None
                close += 2 if rest[close] == "\\" else 1
            if close >= len(rest):
                return None
            i = close + len(quote)
        elif ch == "#" and depth:
            newline = rest.find("\n", i)
            i = len(rest) if newline < 0 else newline
            kept.append(" ")
            continue
        elif ch in "([":
            depth, i = depth + 1, i + 1
        elif ch in ")]" and depth:
            depth, i = depth - 1, i + 1
        elif depth == 0 or ch in ")]":
            return None
        else:
            i += 1
        kept.append(rest[start:i])
        if depth == 0:
            return i, "".join(kept)
    return None


def _literal_keys(rest: str, start: int = 0, macros: Optional[Dict[str, Tuple[str, int]]] = None,
                  depth: int = 0) -> List[str]:
    """The strings of the literal list, tuple or string at index ``start`` of ``rest`` (empty when there is
    none): a macro (``%KEYS``) read from its ``KEYS = [...]``, whose text and value's index are in ``macros``, and
    a list that holds macros (``['my_cred', %MORE]``) read for every string literal in it."""
    macros = macros or {}
    macro = _MACRO_USE.match(rest, start)
    if macro and macro.group(1):
        found = macros.get(macro.group(1))
        return _literal_keys(*found, macros, depth + 1) if found is not None and depth < 20 else []
    scanned = _literal_end(rest, macro.end() if macro else start)
    if scanned is None:
        return []
    literal = scanned[1]  # its comments left out: a string in '# was ['old']' is no key
    try:
        value = ast.literal_eval(literal)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        if "%" not in literal:
            return []
        value = [s[1:-1] for s in _STRING.findall(literal)]  # as written: a pattern has no escapes
        value += [k for name in re.findall(r"%(\w+)", literal) if name in macros and depth < 20
                  for k in _literal_keys(*macros[name], macros, depth + 1)]
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [k for k in value if isinstance(k, str)]
    return []
