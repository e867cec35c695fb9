"""gin's exceptions explained: where (file and line, or which ``--bind``), the problem and a fix, secrets left out.

`explain` turns what gin raised while parsing into a `GinConfigError`; `secret_free` then drops the value of a
secret-looking binding from it (``my_train.api_token = sk_live_...`` unquoted, an unclosed quote after
``api_token = ``, a secret bound to a misspelt parameter), as the CLI does for a ``--bind``.
"""

import ast
import difflib
import re
import tokenize
from pathlib import Path
from typing import List, Optional, Set, Tuple

import gin

from instrument.config import types
from instrument.config.files import (
    AmbiguousNameError,
    ConfigFileError,
    ConfigImportError,
    ConfigSyntaxError,
    GinConfigError,
    read_text,
    shipped_configs,
    shown,
)
from instrument.config.located import file_holding, included_file, line_where
from instrument.config.secrets import declared_macro_patterns, secret_keys
from instrument.logger.params import REDACTED, is_secret, redact_config_text, redact_dict_items, scrub
from instrument.logger.secret_text import secret_words

__all__ = ["GIN_ERRORS", "explain", "secret_free", "unclosed"]

# Names a config may use before the module that registers them is imported: the fix is that import.
_REGISTERED_ON_IMPORT = {
    "instrument.config.rl": ("RLLogging", "CollectionMetrics", "TrainMetrics", "Counters", "Evaluation"),
    "instrument.demos.nca": ("train_nca",),
    "instrument.demos.cartpole": ("train_cartpole",),
    "instrument.demos.torchrl_ppo": ("train_torchrl_ppo", "build_ppo_trainer"),
}


GIN_ERRORS = (ValueError, KeyError, SyntaxError, tokenize.TokenError, OSError, ImportError, TypeError)
_WHERE = re.compile(r'\n  In file "(?P<file>[^\n]+?)", line (?P<line>\d+)\n    (?P<stmt>[^\n]*)')
_BINDING_WHERE = re.compile(r"\n  In bindings string line \d+\n    (?P<stmt>[^\n]*)")


def _unquoted(text: str) -> str:
    """``text`` without the quotes gin's exceptions may wrap it in (a KeyError's repr), but only as a pair: a
    message that ends in a quote of its own (``No module named 'x'``) keeps it."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def explain(exc: BaseException, source: str, binding: Optional[str] = None) -> GinConfigError:
    """gin's exception as a `GinConfigError`: innermost file and line, the statement, the problem, a fix. A
    syntax error in a file keeps its file and line (``origin``) for `secret_free`."""
    error = _explain(exc, source, binding)
    if isinstance(exc, SyntaxError) and binding is None and exc.lineno:
        error.origin = (exc.filename or source, exc.lineno)
    return error


def _explain(exc: BaseException, source: str, binding: Optional[str]) -> GinConfigError:
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
            where = f"{shown(source)}, line {line}" if top else f"{_gin_name(holder, text, source)}, line {line}" + (
                _included_from(text) or f" (included from {shown(source)})")
            return GinConfigError(
                f"the file is not UTF-8: byte 0x{data[start]:02x} at byte offset {start} ({decode[2].strip()})",
                where, statement, "save the file as UTF-8 (your editor's 'encoding' setting), or remove the character.")
    if isinstance(exc, tokenize.TokenError):  # an unclosed bracket or quote: the tokenizer ran out of input
        return _unclosed_at_end(exc, text, source, binding)
    if isinstance(exc, SyntaxError):
        kind = ConfigSyntaxError
        problem = f"syntax error: {exc.msg}"
        # an included file's: gin names no include line for a SyntaxError, so find the includes that read it
        included = binding is None and exc.filename not in (None, source)

        def at(line: int) -> str:
            plain = f"{shown(exc.filename or source)}, line {line}"
            return (line_where(source, exc.filename, line) or plain) if included else plain

        where = at(exc.lineno) if exc.lineno else source
        if binding is not None:
            where = source
        statement = (exc.text or binding or "").strip()
        if binding is None and exc.lineno:  # an unclosed list runs into the next binding: point at its start
            line, opened = unclosed(read_text(exc.filename or source))
            if 0 < line < exc.lineno:
                stopped = re.search(r"Failed to parse token '([^']*)'", exc.msg or "")  # not ``<ast.Name ...>``
                said = f"it cannot read {stopped[1]!r} there" if stopped else re.sub(
                    r"<ast\.\w+ object at 0x[0-9a-fA-F]+>", "a name, not a value", " ".join((exc.msg or "").split()))
                return kind(f"syntax error: a bracket opened on this line is never closed (gin stopped at line "
                            f"{exc.lineno}: {said})", at(line), opened,
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
        where = f"{shown(inner['file'])}, line {inner['line']}"
        statement = inner["stmt"].strip()
        outer = [f"{shown(m['file'])}, line {m['line']}" for m in locations[1:]]
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
        fix = _include_fix(statement)
    else:
        fix = _fix_for(problem)
    return kind(problem, where, statement, fix)


def _included_from(text: str) -> str:
    """`` (included from top.gin, line 2)``: the include lines gin's message names, innermost first; or empty."""
    outer = [f"{shown(m['file'])}, line {m['line']}" for m in _WHERE.finditer(text)]
    return " (included from " + ", ".join(outer) + ")" if outer else ""


def _gin_name(holder: Path, text: str, source: str) -> str:
    """The name of the included file ``holder`` as gin names it (``sub/inner.gin``), from the include line that
    reached it; its bare name when that line cannot tell."""
    for m in _WHERE.finditer(text):
        named = included_file(m["stmt"], Path(source), Path(m["file"]))
        if named is not None and named.resolve() == holder.resolve():
            return shown(str(named))
    return holder.name


def _include_fix(statement: str) -> str:
    """The fix for an ``include`` gin found nowhere: the shipped configs as ``include`` names them
    (``'backends/wandb.gin'``), the closest first as a "did you mean" (``.gin`` added where it was left out)."""
    names = [f"{c.name}.gin" for c in shipped_configs()]
    written = re.match(r"\s*include\s+(['\"])(.*)\1", statement)
    hint = ""
    if written and written[2].startswith("~") and Path(written[2]).expanduser().is_file():
        full = str(Path(written[2]).expanduser())
        return (f"gin does not expand '~' in an include: write the path in full ({full!r}), or relative to the "
                "including file or the working directory.")
    if written:
        wanted = written[2] if written[2].endswith(".gin") else f"{written[2]}.gin"
        close = difflib.get_close_matches(wanted, names, n=1, cutoff=0.75)
        hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"{hint}give the path relative to the including file or the working directory, or a shipped config: "
            f"{', '.join(names)}.")


def _unclosed_at_end(exc: BaseException, text: str, source: str, binding: Optional[str]) -> GinConfigError:
    """The file (an included one too) and line of the bracket or quote that runs to the end of the input.

    gin re-raises an included file's TokenError as a copy without its args, naming only the include lines
    (``In file "top.gin", line 2``): the file is the one the innermost include line names."""
    reason = exc.args[0] if exc.args else ""
    if not reason:
        try:
            reason = str(ast.literal_eval(text.split("\n", 1)[0])[0])
        except (ValueError, SyntaxError, TypeError, IndexError):
            reason = "EOF in multi-line statement"
    locations = list(_WHERE.finditer(text)) if binding is None else []
    holder = None
    if locations:
        inner = locations[0]
        holder = included_file(inner["stmt"], Path(source), Path(inner["file"]))
        if holder is None:  # not where gin found it: the first included file that leaves something open
            holder = file_holding(Path(source), lambda data: unclosed(data.decode("utf-8", "replace"))[0] > 0)
    name = str(holder) if holder is not None else source
    line, statement = unclosed(binding if binding is not None else read_text(name))
    where = source if binding is not None or not line else f"{shown(name)}, line {line}"
    if holder is not None and holder.resolve() != Path(source).resolve() and line:
        where += _included_from(text)
    return ConfigSyntaxError(f"syntax error: {reason} (a bracket or quote is never closed)", where,
                             statement or binding or "", "close the bracket or quote that this statement opens.")


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


def unclosed(text: str) -> Tuple[int, str]:
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


_STATEMENT = re.compile(r"^\s*([\w./]+)\s*=\s*(.*)$", re.S)


def secret_free(error: GinConfigError) -> GinConfigError:
    """``error`` with the value of a secret-looking binding left out of its statement, problem and fix, as the
    logged config leaves it out: ``my_train.api_token = sk_live_...`` (unquoted), an unclosed quote after
    ``api_token = ``, a secret-looking dict key's value, and a secret bound to a misspelt or unknown parameter
    whose name, or the parameter it was meant to be, looks secret (``WandbBackend.api_key``, ``api_tokn``)."""
    extra = secret_keys() + declared_macro_patterns()  # a macro the text uses as a secret, before gin read that
    found: Set[str] = set()
    continued = _continued(error, extra, found)
    if continued is not None:  # a line of a statement begun on an earlier line: redacted as the whole statement
        return type(error)(scrub(error.problem, found), error.where, continued, scrub(error.fix, found))
    error = _stopped_in_secret(error, extra, found)
    match = _STATEMENT.match(error.statement or "")
    if not match:  # a line of a value gin quotes alone (``'password': hunter2,`` inside a dict over lines)
        statement = redact_dict_items(error.statement or "", extra, found, loose=True)
        if not found:
            return error
        return type(error)(scrub(error.problem, found), error.where, scrub(statement, found), scrub(error.fix, found))
    name, value = match.groups()
    statement = redact_config_text(error.statement, extra, found, loose=True)
    if is_secret(name, extra) or _meant_secret(name, error.problem, extra):
        statement = f"{name} = '{REDACTED}'"
        found |= {value.strip(), value.strip().strip("'\""), *secret_words(value)} - {""}
    if statement == error.statement and not found:
        return error
    return type(error)(scrub(error.problem, found), error.where, scrub(statement, found), scrub(error.fix, found))


def _continued(error: GinConfigError, extra: Tuple[str, ...], found: Set[str]) -> Optional[str]:
    """The line gin rejected, when it goes on a statement begun on an earlier line of its file (a bracket,
    a quote or a backslash left open): that statement is redacted whole from its first line, its secrets go into
    ``found``, and the line is shown with them scrubbed. None for a statement of one line."""
    path, lineno = getattr(error, "origin", ("", 0))
    lines = read_text(path).split("\n") if path else []
    n = lineno - 1
    if not 0 < n < len(lines) or lines[n].strip() != (error.statement or "").strip():
        return None
    statement = _redacted_through(lines, n, error.problem, extra, found)
    if statement is None:
        return None
    first, redacted = statement
    line = redacted[n - first] if len(redacted) == n - first + 1 else lines[n]
    return scrub(line.strip(), found)


def _redacted_through(
    lines: List[str], n: int, problem: str, extra: Tuple[str, ...], found: Set[str]
) -> Optional[Tuple[int, List[str]]]:
    """The first line of the statement that line ``n`` goes on, and that statement's lines through ``n`` redacted
    (none left where its name is secret; every word of a redacted value into ``found``). None: ``n`` is its own."""
    # The nearest line above that starts a statement: `name =` with nothing left open before it (a line of a
    # triple-quoted value may read `note = ...` too).
    first = next((k for k in range(n, -1, -1)
                  if re.match(r"[\w./]+\s*=", lines[k]) and not _left_open("\n".join(lines[:k]))), n)
    if first == n or not _left_open("\n".join(lines[first:n])):
        return None
    text = "\n".join(lines[first:n + 1])
    match = _STATEMENT.match(text)
    if match is None:
        return None
    name, value = match.groups()
    redacted = redact_dict_items(text, extra, found, name, loose=True).split("\n")  # one value over its lines
    if is_secret(name, extra) or _meant_secret(name, problem, extra):  # the whole value: each word of it too
        redacted = []
        found |= {value.strip(), *secret_words(value)}
    return first, redacted


def _stopped_in_secret(error: GinConfigError, extra: Tuple[str, ...], found: Set[str]) -> GinConfigError:
    """``error`` without the token gin stopped at (``gin stopped at line 3: it cannot read 'x' there``, an
    unclosed bracket) where that token lies inside a value redacted from the statement opened above it."""
    stopped = re.search(r"gin stopped at line (\d+): it cannot read ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\") there",
                        error.problem)
    path = getattr(error, "origin", ("", 0))[0]
    if stopped is None or not path:
        return error
    lines = read_text(path).split("\n")
    n = int(stopped[1]) - 1
    token = ast.literal_eval(stopped[2])
    if 0 < n < len(lines) and (_OWN_STATEMENT.match(lines[n]) or [""])[0].split()[:1] == [token]:
        return error  # an include or import line after the unclosed value: a statement of its own, no part of it
    statement = _redacted_through(lines, n, error.problem, extra, found) if 0 < n < len(lines) else None
    if statement is None or token in scrub("\n".join(statement[1]), found):
        return error
    problem = error.problem.replace(stopped[0], f"gin stopped at line {stopped[1]}: it cannot read '{REDACTED}' there")
    return type(error)(problem, error.where, error.statement, error.fix)


# A whole include or import line (a comment after it allowed): gin stops at its first word when a value above it is
# left open, and that word is no part of the value.
_OWN_STATEMENT = re.compile(r"""\s*(?:include\s+(['"])[^'"\n]*\1|import\s+[\w.]+|from\s+[\w.]+\s+import\s+[\w., ]+)"""
                            r"\s*(?:#.*)?$")


def _left_open(text: str) -> bool:
    """``text`` (a statement's first lines) leaves a bracket, a quote or a backslash open at its end."""
    if text.rstrip().endswith("\\"):
        return True
    try:
        list(tokenize.generate_tokens(iter(text.splitlines(keepends=True)).__next__))
    except tokenize.TokenError:
        return True
    except (SyntaxError, ValueError):  # IndentationError and the like: not a continuation we can tell
        return False
    return False


def _meant_secret(name: str, problem: str, extra: Tuple[str, ...]) -> bool:
    """A parameter the configurable does not have, whose closest real parameter looks secret (``api_tokn``)."""
    if "doesn't have a parameter named" not in problem or "." not in name:
        return False
    selector, param = name.rsplit("/", 1)[-1].rsplit(".", 1)
    return any(is_secret(p, extra) for p in difflib.get_close_matches(param, _parameters(selector), n=3))
