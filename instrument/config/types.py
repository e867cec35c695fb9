"""Does a literal that gin parsed fit its parameter's annotation? The judge behind `parse.check_types`.

gin parses a binding's value into Python literals (numbers, strings, bools, None, lists, tuples, dicts) or a
reference (``@Name``, ``@Name()``, ``%MACRO``). `mismatch` walks such a value against a type hint and names the
innermost part that contradicts it: ``RolloutVideo.channels = [0, 'one']`` for ``Sequence[int]`` (item 1), or
``ConsoleBackend.keys = 'loss'`` for ``Sequence[str]`` (a str is a Sequence of str to Python, but a string
bound where a list is expected is always a mistake: the code would iterate its characters).

Judged: ``int``, ``float``, ``str``, ``bool``, None, Optional and Union, ``Literal``, sequences, tuples (their
length too), sets and mappings, nested to any depth. It refuses only what the annotation rules out for certain
(and a string for a list), never what it cannot decide: references and macros (resolved when the configurable
is called), ``Any``, ``Callable``, classes such as ``Observer`` or ``Path``, TypeVars, unresolved forward
references. Within a Union one member that fits, or cannot be judged, is enough. As Python's numbers go, an
int fits ``float`` but a bool fits neither ``int`` nor ``float``; as gin's literals go, a list or a tuple fits
``Sequence``, ``List`` and ``Tuple`` alike (``[1, 2]`` and ``(1, 2)`` are the same to the code that reads them).
"""

import ast
import collections.abc as abc
import inspect
import types
import typing
from typing import Any, Callable, Dict, Optional, Sequence, Set, Tuple

from instrument.logger.params import redact_values, scrub

__all__ = ["COMPANIONS", "EXAMPLES", "Mismatch", "describe", "example", "hints_of", "mismatch", "refusal", "suggestion"]

_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_NUMBERS = {int: (int,), float: (int, float), complex: (int, float, complex)}
# Containers judged by their items: a list or tuple is expected; a str, a number or None never fits.
_SEQUENCES = {list, tuple, abc.Sequence, abc.MutableSequence}
_ITERABLES = {abc.Iterable, abc.Collection, abc.Reversible, set, frozenset, abc.Set, abc.MutableSet}
_MAPPINGS = {dict, abc.Mapping, abc.MutableMapping}
_UNIONS = (typing.Union, types.UnionType)


class Mismatch(typing.NamedTuple):
    """The part of a bound value that contradicts the hint: ``where`` in the value (``item 1``, ``key 'a'``;
    empty for the value itself), that ``value``, the ``hint`` it contradicts and ``why`` (for a tuple's length)."""

    where: str
    value: Any
    hint: Any
    why: str = ""


def mismatch(value: Any, hint: Any, where: str = "") -> Optional[Mismatch]:
    """The innermost part of ``value`` (a literal gin parsed) that ``hint`` rules out, or None if it fits or
    cannot be judged."""
    if not isinstance(value, _SCALARS + (list, tuple, dict)):
        return None  # a gin reference or macro (or anything else): judged when it is resolved, not here
    hint = _unwrap(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is None or hint is type(None):
        return None if value is None else Mismatch(where, value, type(None))
    if origin in _UNIONS:
        found = [mismatch(value, a, where) for a in args]
        if any(m is None for m in found):
            return None
        # the member whose shape fits (failing further in, or on a tuple's length) says more than the Union
        deepest = max(found, key=lambda m: (len(m.where), bool(m.why)))
        return deepest if len(deepest.where) > len(where) or deepest.why else Mismatch(where, value, hint)
    if origin is typing.Literal:
        fits = any(a == value and (type(a) is type(value) or not isinstance(a, _SCALARS)) for a in args)
        return None if fits else Mismatch(where, value, hint)
    if _among(hint, _NUMBERS):
        fits = isinstance(value, _NUMBERS[hint]) and not isinstance(value, bool)
        return None if fits else Mismatch(where, value, hint)
    if _among(hint, (bool, str, bytes)):
        return None if isinstance(value, hint) else Mismatch(where, value, hint)
    base = origin if origin is not None else hint
    if _among(base, _SEQUENCES) or _among(base, _ITERABLES):
        if isinstance(value, dict) and _among(base, _ITERABLES):
            return None  # iterating a dict gives its keys: a strange binding, but not ruled out
        if not isinstance(value, (list, tuple)):
            return Mismatch(where, value, hint)
        return _items(value, base, args, where, hint)
    if _among(base, _MAPPINGS):
        if not isinstance(value, dict):
            return Mismatch(where, value, hint)
        if len(args) == 2:
            for key, item in value.items():
                found = mismatch(key, args[0], _at(where, f"key {key!r}")) or mismatch(
                    item, args[1], _at(where, f"value of {key!r}"))
                if found:
                    return found
        return None
    return None  # Any, object, Callable, Type[...], TypeVars, forward references, classes: not judged


def _items(value: Any, base: Any, args: Tuple[Any, ...], where: str, hint: Any) -> Optional[Mismatch]:
    """The items of a list or tuple against a container's item type (or a fixed tuple's types)."""
    if base is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        wanted = () if args == ((),) else args
        if len(value) != len(wanted):
            return Mismatch(where, value, hint, f"{len(value)} item{'s' * (len(value) != 1)}, not {len(wanted)}")
    else:
        wanted = args[:1] * len(value) if args else ()
    for i, (item, item_hint) in enumerate(zip(value, wanted, strict=False)):
        found = mismatch(item, item_hint, _at(where, f"item {i}"))
        if found:
            return found
    return None


def _among(hint: Any, group: Any) -> bool:
    """``hint in group``, False for a hint that cannot be hashed (an ``Annotated`` with a list in it)."""
    try:
        return hint in group
    except TypeError:
        return False


def _at(where: str, part: str) -> str:
    return f"{where}, {part}" if where else part


def _unwrap(hint: Any) -> Any:
    """``Annotated[T, ...]`` and ``NewType('N', T)`` are judged as ``T``."""
    while True:
        if typing.get_origin(hint) is typing.Annotated:
            hint = typing.get_args(hint)[0]
        elif isinstance(hint, typing.NewType):
            hint = hint.__supertype__
        else:
            return hint


def describe(hint: Any) -> str:
    """A hint in words: ``int or None``, ``a list of str``, ``one of 'gif', 'filmstrip'``, ``a dict of str to
    float``, ``a tuple (float, float)``."""
    hint = _unwrap(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is None or hint is type(None):
        return "None"
    if origin in _UNIONS:
        return " or ".join(describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args) if len(args) > 1 else repr(args[0])
    base = origin if origin is not None else hint
    if base is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        return "an empty tuple" if args == ((),) else f"a tuple ({', '.join(describe(a) for a in args)})"
    if _among(base, _SEQUENCES) or _among(base, _ITERABLES):
        kind = "a tuple" if base is tuple else "a list"
        return f"{kind} of {_grouped(args[0])}" if args else kind
    if _among(base, _MAPPINGS):
        return f"a dict of {_grouped(args[0])} to {_grouped(args[1])}" if len(args) == 2 else "a dict"
    return getattr(hint, "__name__", None) or repr(hint).replace("typing.", "")


def _grouped(hint: Any) -> str:
    text = describe(hint)
    return f"({text})" if " or " in text or text.startswith("one of") else text


def example(hint: Any, received: Any = None) -> str:
    """A value of ``hint`` as a gin literal: ``10``, ``['name']``; ``[received]`` when the received value is
    the one item a list was meant to hold (``keys = 'loss'`` -> ``['loss']``)."""
    hint = _unwrap(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    base = origin if origin is not None else hint
    if origin in _UNIONS:
        members = [a for a in args if a is not type(None)] or list(args)
        fitting = [a for a in members if received is not None and _wraps(a, received)]
        return example((fitting or members)[0], received)
    if _wraps(hint, received) and received is not None:
        return f"[{received!r}]" if base is not tuple else f"({received!r},)"
    if origin is typing.Literal:
        return repr(args[0])
    plain: Dict[Any, str] = {int: "10", float: "0.5", complex: "1.0", str: "'name'", bool: "True", bytes: "b''"}
    if _among(hint, plain) or hint is None or hint is type(None):
        return plain.get(hint, "None")
    if base is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        items = [] if args == ((),) else [example(a) for a in args]
        return f"({', '.join(items)}{',' * (len(items) == 1)})"
    if _among(base, _SEQUENCES) or _among(base, _ITERABLES):
        item = example(args[0]) if args else "'name'"  # one item: two equal ones are refused where items are unique
        return f"({item},)" if base is tuple else f"[{item}]"
    if _among(base, _MAPPINGS):
        return f"{{{example(args[0])}: {example(args[1])}}}" if len(args) == 2 else "{'name': 10}"
    if hint is Any or hint is object:
        return "None"
    return "@Name()"  # a class or anything else a literal cannot be: a reference to a configurable


# Examples for parameters whose type admits values their class refuses and whose default is no example (None):
# a suggested fix must itself be accepted. By the name the config calls the class (its gin name) and parameter.
EXAMPLES: Dict[Tuple[str, str], str] = {
    ("RolloutVideo", "value_range"): "(0.0, 1.0)",  # low < high
    ("ConsoleBackend", "width"): "100",  # >= 20
    ("Column", "denominator"): "'total'",
}
# What a suggested value needs bound beside it, where the class accepts it only together with another setting.
COMPANIONS: Dict[Tuple[str, str], Tuple[str, str]] = {
    ("Column", "denominator"): ("fmt", "'frac'"),  # a denominator is meaningful only for a frac column
    ("Column", "each"): ("key", "'loss/{}'"),  # each item goes where the key has '{}'
    ("RolloutVideo", "value_range"): ("channels", "[0]"),  # a range maps one colour-mapped channel
}


def suggestion(fn: Callable[..., Any], name: str, param: str, received: Any = None) -> str:
    """The value to suggest for ``fn``'s ``param`` as a gin literal, one the class accepts, not only the type:
    ``[received]`` when the received value is the one item a list was meant to hold, else the parameter's own
    example (`EXAMPLES`), else its default when that is a literal worth showing, else `example` of its type."""
    hint = hints_of(fn).get(param, Any)
    unwrapped = _unwrap(hint)
    members = typing.get_args(unwrapped) if typing.get_origin(unwrapped) in _UNIONS else (unwrapped,)
    if received is not None and any(_wraps(_unwrap(m), received) for m in members):
        return example(hint, received)
    own = EXAMPLES.get((name.rsplit("/", 1)[-1], param))
    if own is not None:
        return own
    try:
        default = inspect.signature(fn).parameters[param].default
    except (TypeError, ValueError, KeyError):
        default = inspect.Parameter.empty
    if _shown(default) and mismatch(default, hint) is None:
        return repr(default)
    return example(hint, received)


def _shown(default: Any) -> bool:
    """Is ``default`` a gin literal worth suggesting: not None, not an empty container, written as it reads?"""
    if default is None or not isinstance(default, (bool, int, float, str, list, tuple, dict)):
        return False  # None, no default (inspect's marker), bytes, complex, objects
    if isinstance(default, (list, tuple, dict, str)) and not default:
        return False
    try:
        return ast.literal_eval(repr(default)) == default
    except (ValueError, SyntaxError):  # inf, nan, a container holding an object
        return False


def _wraps(hint: Any, received: Any) -> bool:
    """Is ``hint`` a list-like hint whose item type the received scalar fits (so ``[received]`` is the fix)?"""
    base = typing.get_origin(hint) or hint
    args = typing.get_args(hint)
    if not (_among(base, _SEQUENCES) or _among(base, _ITERABLES)) or isinstance(received, (list, tuple, dict)):
        return False
    if base is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        return len(args) == 1 and _known(args[0]) and mismatch(received, args[0]) is None
    item = _unwrap(args[0]) if args else Any
    if typing.get_origin(item) in _UNIONS:  # items of several kinds (a column: a Column, a key, a dict...)
        return any(_known(a) and mismatch(received, a) is None for a in typing.get_args(item))
    return _known(item) and mismatch(received, item) is None


def _known(hint: Any) -> bool:
    """Can a literal be judged against ``hint`` for certain (so "it fits" means it fits, not "cannot tell")?"""
    hint = _unwrap(hint)
    if typing.get_origin(hint) in _UNIONS:
        return all(_known(a) for a in typing.get_args(hint))
    return hint is Any or typing.get_origin(hint) is typing.Literal or _among(hint, _SCALARS)


def hints_of(fn: Callable[..., Any]) -> Dict[str, Any]:
    """The resolved annotations of a function or of a class's ``__init__``, by parameter name.

    One annotation that does not resolve (a forward reference to a name imported only for type checkers)
    leaves that parameter out, not the others.
    """
    target = fn.__init__ if isinstance(fn, type) else fn
    try:
        return typing.get_type_hints(target, include_extras=True)
    except Exception:  # noqa: BLE001 - resolve one by one below
        pass
    hints: Dict[str, Any] = {}
    namespace = getattr(target, "__globals__", {})
    for name, annotation in dict(getattr(target, "__annotations__", {}) or {}).items():
        try:
            hints[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
        except Exception:  # noqa: BLE001 - not judged
            continue
    return hints



def refusal(fn: Callable[..., Any], name: str, param: str, value: Any,
            extra: Sequence[str] = ()) -> Optional[Tuple[str, str, Set[str]]]:
    """``(problem, fix, secrets)`` when the annotation of ``fn``'s ``param`` rules out the bound ``value``
    (``name`` is how the config calls ``fn``), else None. ``secrets`` are the strings of the value that sit under
    a secret-looking name (the built-in patterns and the run's own, ``extra``): the problem leaves them out, and
    so must whatever else quotes the binding. A value
    equal to the parameter's default is never refused: the function already takes it, whatever its annotation
    says (``x: int = None``)."""
    hint = hints_of(fn).get(param, Any)
    try:
        default = inspect.signature(fn).parameters[param].default
        if type(value) is type(default) and bool(value == default):
            return None
    except Exception:  # noqa: BLE001 - no signature or no such parameter or a default that cannot be compared
        pass
    try:
        found = mismatch(value, hint)
    except Exception:  # noqa: BLE001 - a hint the judge trips on is a hint it cannot judge
        return None
    if found is None:
        return None
    secrets: Set[str] = set()
    redact_values({param: value}, extra, found=secrets)
    wanted = describe(hint)
    problem = f"{name}.{param} expects {wanted}, got {value!r} ({type(value).__name__})"
    if found.where:
        problem += f": {found.where} is {found.value!r} ({type(found.value).__name__}), not {describe(found.hint)}"
    elif found.why:
        problem += f": {found.why}"
    fix = suggestion(fn, name, param, value)
    if isinstance(value, str) and fix.startswith(("[", "(")):
        problem += ": a string is not a list here (its characters would be the items)"
    companion = COMPANIONS.get((name.rsplit("/", 1)[-1], param))
    also = f" with {name}.{companion[0]} = {companion[1]}" if companion else ""
    fix_text = f"bind {wanted} there, e.g. {name}.{param} = {fix}{also}."
    return scrub(problem, secrets), scrub(fix_text, secrets), secrets
