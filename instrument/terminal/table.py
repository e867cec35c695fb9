"""The step table: one aligned row per logging step, with columns that never shift.

`StepTable` is the one place that knows column order, widths, headers and number formats. The training loop
(or `ConsoleBackend`) hands it a dict of raw values keyed by metric key and gets back lines of text::

    table = StepTable([
        Column("step", "step", 6, "d", "training step"),
        Column("train/loss", "loss↓", 9, ".4f", "training loss, mean over the interval"),
        Column("eval/solved", "solved↑", 7, "frac", "episodes solved / episodes run"),
    ])
    for line in table.legend(): print(line)
    for line in table.render({"step": 10, "train/loss": 0.0123, "eval/solved": (3, 8)}): print(line)

    columns:
      step     step         training step
      loss↓    train/loss   training loss, mean over the interval
      solved↑  eval/solved  episodes solved / episodes run
      ...
      step      loss↓  solved↑
        10     0.0123      3/8

Rules, the same for every column:

- Formats: any Python format spec without a width (``+.2f``, ``.1e``, ``d``, ``.1%``), ``frac`` for a
  ``(numerator, denominator)`` pair rendered ``n/d``, and ``str``. Numbers are right-aligned, ``str`` left.
- None, NaN and a key missing from the dict render ``nan`` in every format, so a column whose metric this
  run does not have stays in place.
- A value of the wrong type for its format (a string where ``+.2f`` is asked, 2.5 for ``d``) is reported
  once through the ``instrument`` logger, naming the column, and renders ``?`` so training goes on.
- Overflow policy: a cell is never wider than its column, so every row has exactly the declared widths and
  columns never shift. A number that does not fit is shown in compact scientific notation at the highest
  precision that fits (``1234567`` in a 6-wide column is ``1.23e6``). If even ``1e6`` does not fit, or a
  ``str``/``frac`` value is too long, the cell is filled with ``#`` (numbers, fractions) or cut with a
  trailing ``…`` (text), and a warning naming the column and the value (a long text's start and its
  length) is logged once. We chose scientific notation over widening the row because a widened row shifts
  every column to its right, which is exactly what a table read at a glance must not do.
- Conditional columns are decided once, when the table is built: ``when=False`` drops a column, and
  ``each=(...)`` expands one column per mode or environment (``{}`` in key, header and description is
  replaced by the item). Tables from different runs or arms of an experiment therefore line up.
"""

import dataclasses
import logging
import math
import numbers
import re
from decimal import Decimal
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from instrument.checks import check_int, is_int
from instrument.errors import ConfigurationError
from instrument.terminal.text import cut, display_width, pad, printable, unique_headers

__all__ = [
    "Column",
    "StepTable",
    "ColumnSpec",
    "as_column",
    "resolve_columns",
    "MISSING",
    "WRONG_TYPE",
    "unique_headers",
]

log = logging.getLogger("instrument")

MISSING = "nan"
WRONG_TYPE = "?"
MIN_WIDTH = 3  # "nan" must fit
DEFAULT_WIDTH = 8

# [[fill]align][sign][z][#][0][width][grouping][.precision][type] -- Python's format-spec mini-language.
_SPEC = re.compile(
    r"^(?:(?P<fill>.)?(?P<align>[<>=^]))?(?P<sign>[-+ ])?(?P<z>z)?(?P<alt>\#)?(?P<zero>0)?(?P<width>\d+)?"
    r"(?P<grouping>[,_])?(?:\.(?P<precision>\d+))?(?P<type>[bcdeEfFgGnosxX%])?$",
    re.DOTALL,
)
_INT_TYPES = frozenset("bdoxX")
# Formats whose overflow is never put in (decimal) scientific notation: a character, and whole numbers in another
# base, where 0x12345 in a 4-wide 'x' column read "7e4", a hex number (0x7e4 = 2020) to the eye.
_NO_SCIENTIFIC = frozenset("cboxX")
_FLOAT_TYPES = frozenset("eEfFgGn%")
_SPECIAL_FORMATS = ("frac", "str")


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of the step table.

    Args:
        key: the metric key whose value the column shows (``train/loss``); with ``each``, may hold ``{}``.
        header: the column title; may carry a direction mark (↑ better higher, ↓ better lower). Defaults to
            the last segment of ``key``. Must fit in ``width``.
        width: terminal cells the column always takes (a wide character such as ``损`` or most emoji takes
            two); 0 means the header's width, at least 8. At least 3 ("nan").
        fmt: a Python format spec without width (``.4f``, ``+.2f``, ``.1e``, ``d``), ``frac`` or ``str``.
        description: one line for the legend.
        denominator: for ``frac`` columns fed from single scalars (as `ConsoleBackend` is): the metric key of
            the denominator, or a fixed number. Raw-dict users may instead pass ``(n, d)`` pairs as the value.
        each: expand into one column per item (modes, environments), substituting ``{}`` with the item.
        when: False drops the column when the table is built (a feature that is off in this run).
        match: ``key`` is a regular expression: the column shows the first metric key of a step that it
            matches whole, chosen at the first step that has one (``iteration_stats/max/c0*3`` is channel 3
            whether the observer writes ``c3`` or ``c03``). `ConsoleBackend` resolves it; the legend shows it.
    """

    key: str
    header: str = ""
    width: int = 0
    fmt: str = ".4g"
    description: str = ""
    denominator: Union[str, int, float, None] = None
    each: Tuple[str, ...] = ()
    when: bool = True
    match: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ConfigurationError(f"Column key must be a non-empty metric key string, got {self.key!r}.")
        name = f"Column {self.key!r}"
        if not isinstance(self.header, str):
            raise ConfigurationError(f"{name}: header must be a string, got {self.header!r}.")
        if not (is_int(self.width) and self.width == 0):  # 0: automatic
            check_int(f"{name}: width", self.width, least=MIN_WIDTH, expected=f"an int >= {MIN_WIDTH} or 0",
                      why="room for 'nan'; 0: automatic", fix="give e.g. width=10, or 0")
        _check_fmt(name, self.fmt)
        if self.denominator is not None and self.fmt != "frac":
            raise ConfigurationError(
                f"{name}: denominator is only meaningful with fmt='frac', got fmt={self.fmt!r}."
            )
        if self.denominator is not None and not isinstance(self.denominator, (str, numbers.Real)):
            raise ConfigurationError(
                f"{name}: denominator must be a metric key or a number, "
                f"got {type(self.denominator).__name__}."
            )
        if isinstance(self.each, str) or not all(isinstance(item, str) for item in self.each):
            raise ConfigurationError(
                f"{name}: each must be a sequence of strings (e.g. ('train', 'eval')), got {self.each!r}."
            )
        object.__setattr__(self, "each", tuple(self.each))
        if not isinstance(self.when, bool):
            raise ConfigurationError(f"{name}: when must be True or False, got {self.when!r}.")
        if not isinstance(self.match, bool):
            raise ConfigurationError(f"{name}: match must be True or False, got {self.match!r}.")
        if self.match and not self.each:
            try:
                re.compile(self.key)
            except re.error as exc:
                raise ConfigurationError(
                    f"{name}: with match=True the key is a regular expression, and this one is not valid "
                    f"({exc}); fix it (escape a literal '.', '(' or '[' with a backslash) or drop match."
                ) from exc
        if self.each:
            if "{}" not in self.key:
                raise ConfigurationError(f"{name}: with each=..., put '{{}}' in the key where the item goes.")
            self._expand_each()  # header and width are checked per item, even when ``when`` is False
            return
        header = printable(self.header or self.key.rstrip("/").rsplit("/", 1)[-1])  # a newline would split the header
        width = self.width or max(display_width(header), DEFAULT_WIDTH)
        if display_width(header) > width:
            raise ConfigurationError(
                f"{name}: header {header!r} is {display_width(header)} characters"
                f"{' wide on a terminal' if display_width(header) != len(header) else ''}, wider than width={width}; "
                f"shorten the header or widen the column."
            )
        object.__setattr__(self, "header", header)
        object.__setattr__(self, "width", width)

    @property
    def align_left(self) -> bool:
        return self.fmt == "str"

    def expand(self) -> List["Column"]:
        """The columns this one stands for: none when ``when`` is False, one per item of ``each``."""
        if not self.when:
            return []
        return self._expand_each() if self.each else [self]

    def _expand_each(self) -> List["Column"]:
        def sub(text: str, item: str) -> str:
            return text.replace("{}", item)

        return [
            Column(
                key=sub(self.key, item),
                header=sub(self.header, item) if self.header else "",
                width=self.width,
                fmt=self.fmt,
                description=sub(self.description, item),
                denominator=sub(self.denominator, item)
                if isinstance(self.denominator, str)
                else self.denominator,
                match=self.match,
            )
            for item in self.each
        ]


ColumnSpec = Union[Column, str, Mapping[str, Any], Sequence[Any]]


def as_column(spec: ColumnSpec) -> Column:
    """A `Column` from a Column, a key string, a dict of Column arguments, or a tuple
    ``(key, header, width, fmt, description)`` (a prefix of it is enough). Dicts and tuples are what gin
    literals give, so a ``.gin`` file can declare columns inline."""
    if isinstance(spec, Column):
        return spec
    try:
        if isinstance(spec, str):
            return Column(key=spec)
        if isinstance(spec, Mapping):
            return Column(**dict(spec))
        if isinstance(spec, (tuple, list)):
            return Column(*spec)
    except TypeError as exc:
        raise ConfigurationError(
            f"cannot make a Column from {spec!r}: {exc}. Use (key, header, width, fmt, description) "
            f"or a dict with those names."
        ) from exc
    raise ConfigurationError(
        f"a column must be a Column, a metric key, a dict or a (key, header, width, fmt, description) tuple; "
        f"got {type(spec).__name__}."
    )


def resolve_columns(specs: Iterable[ColumnSpec]) -> List[Column]:
    """Coerce specs and decide conditional columns once: drop ``when=False``, expand ``each``."""
    return [col for spec in specs for col in as_column(spec).expand()]


class StepTable:
    """Renders dicts of raw values as fixed-width rows; see the module docstring for the rules.

    Args:
        columns: `Column` objects or specs `as_column` accepts, in display order.
        header_every: reprint the header before every this many rows; 0 prints it once.
        sep: text between columns.
    """

    def __init__(self, columns: Iterable[ColumnSpec], header_every: int = 20, sep: str = "  ") -> None:
        self.columns: Tuple[Column, ...] = tuple(resolve_columns(columns))
        if not self.columns:
            raise ConfigurationError("a StepTable needs at least one column (all were empty or when=False).")
        self.header_every = check_int("header_every", header_every, least=0, why="0: header once",
                                      fix="pass e.g. header_every=20")
        self.sep = sep
        self.rows = 0
        self._reported: Set[Tuple[str, str]] = set()

    @property
    def line_width(self) -> int:
        return sum(c.width for c in self.columns) + len(self.sep) * (len(self.columns) - 1)

    def header(self) -> str:
        return self.sep.join(_pad(c.header, c) for c in self.columns)

    def legend(self) -> List[str]:
        """Lines decoding every column: header, metric key, description; then the marks used in cells."""
        keys = [_legend_key(c) for c in self.columns]
        hw = max(display_width(c.header) for c in self.columns)
        kw = max(display_width(k) for k in keys)
        lines = ["columns:"]
        for column, key in zip(self.columns, keys, strict=True):
            lines.append(f"  {pad(column.header, hw, True)}  {pad(key, kw, True)}  {column.description}".rstrip())
        marks = []
        if any("↑" in c.header or "↓" in c.header for c in self.columns):
            marks.append("↑ higher is better, ↓ lower is better")
        marks.append("nan: no value this step; ?: a value of the wrong type (see the log)")
        marks.append("numbers too wide for a column are shown as 1.2e5")
        lines += [f"  ({m})" for m in marks]
        return lines

    def row(self, values: Mapping[str, Any]) -> str:
        """One row: every column exactly its width, in declared order. Does not count toward headers."""
        return self.sep.join(self.cell(c, values.get(c.key)) for c in self.columns)

    def render(self, values: Mapping[str, Any]) -> List[str]:
        """The header when one is due (first row, every ``header_every`` rows, and when a ``step`` too wide for
        its column widens it: a step is never rounded to ``1.001e7``, as rows of a frame-counted run were)."""
        lines = []
        widened = self._fit_step(values.get("step"))
        if widened or self.rows == 0 or (self.header_every and self.rows % self.header_every == 0):
            lines.append(self.header())
        lines.append(self.row(values))
        self.rows += 1
        return lines

    def _fit_step(self, step: Any) -> bool:
        if not isinstance(step, numbers.Integral) or isinstance(step, bool):
            return False
        digits = len(str(int(step)))
        for i, column in enumerate(self.columns):
            if column.key == "step" and column.fmt == "d" and digits > column.width:
                wider = dataclasses.replace(column, width=digits)
                self.columns = self.columns[:i] + (wider,) + self.columns[i + 1:]
                return True
        return False

    def cell(self, column: Column, value: Any) -> str:
        """``value`` rendered for ``column``, padded to exactly ``column.width``."""
        text = self._text(column, value)
        if display_width(text) > column.width or _false_inf(column, value, text):
            text = self._overflow(column, value, text)
        return _pad(text, column)

    # ------------------------------------------------------------------ internals
    def _text(self, column: Column, value: Any) -> str:
        if _missing(value):
            return MISSING
        fmt = column.fmt
        if fmt == "str":  # a text's escape, carriage return or newline would reach the terminal or split the row
            return printable(str(value))
        if fmt == "frac":
            pair = _pair(value)
            if pair is None:
                return self._wrong(column, value, "a (numerator, denominator) pair of numbers")
            if _missing(pair[0]) or _missing(pair[1]):
                return MISSING
            return f"{_plain(pair[0])}/{_plain(pair[1])}"
        if isinstance(value, (str, bytes)) or not isinstance(value, numbers.Real):
            return self._wrong(column, value, f"a number for format {fmt!r}")
        kind = _spec_type(fmt)
        if kind in _INT_TYPES or kind == "c":
            if isinstance(value, numbers.Integral):
                value = int(value)
            elif math.isinf(value):
                return "inf" if value > 0 else "-inf"
            elif float(value).is_integer():
                value = int(value)
            else:
                return self._wrong(
                    column, value, f"a whole number for format {fmt!r} (use '.1f' for fractions)"
                )
        try:
            return format(value, fmt)
        except (ValueError, TypeError, OverflowError):
            return self._wrong(column, value, f"a value format {fmt!r} accepts")

    def _overflow(self, column: Column, value: Any, text: str) -> str:
        width = column.width
        if column.fmt == "str":
            self._once(
                column,
                "overflow",
                logging.WARNING,
                "instrument: column %r (width %d) cut the text %s (%d characters); widen the column to see it "
                "whole.",
                column.header,
                width,
                _short_repr(text[:200], 80),  # a text of megabytes is not repeated in the message whole
                len(text),
            )
            return cut(text, width - 1) + "…"
        if column.fmt == "frac":
            n, d = _pair(value)  # type: ignore[misc]
            for p in range(3, -1, -1):
                short = f"{_sci(n, p)}/{_sci(d, p)}"
                if len(short) <= width:
                    return short
        elif _spec_type(column.fmt) not in _NO_SCIENTIFIC and _decimal(value).is_finite():
            x = _decimal(value) * (100 if column.fmt.endswith("%") else 1)  # exact: 1e306 * 100 is no inf
            sign = "+" if "+" in column.fmt and x >= 0 else ""
            suffix = "%" if column.fmt.endswith("%") else ""
            for p in range(max(width - 3, 0), -1, -1):
                short = f"{sign}{_sci(x, p)}{suffix}"
                if len(short) <= width:
                    return short
        self._once(
            column,
            "hash",
            logging.WARNING,
            "instrument: column %r (width %d) is too narrow for %r%s; showing '#'. Widen the column.",
            column.header,
            width,
            value,
            "" if _spec_type(column.fmt) in _NO_SCIENTIFIC else " even in scientific notation",
        )
        return "#" * width

    def _wrong(self, column: Column, value: Any, expected: str) -> str:
        self._once(
            column,
            "type",
            logging.ERROR,
            "instrument: column %r (key %r, format %r) got %s %s, expected %s; it renders '?' wherever it gets "
            "such a value (said once). Fix the value you log or the column's fmt.",
            column.header,
            column.key,
            column.fmt,
            type(value).__name__,
            _short_repr(value),
            expected,
        )
        return WRONG_TYPE

    def _once(self, column: Column, what: str, level: int, msg: str, *args: Any) -> None:
        token = (column.key + "\0" + column.header, what)
        if token not in self._reported:
            self._reported.add(token)
            log.log(level, msg, *args)


def _check_fmt(name: str, fmt: Any) -> None:
    if not isinstance(fmt, str):
        raise ConfigurationError(f"{name}: fmt must be a string such as '.4f', 'frac' or 'str', got {fmt!r}.")
    if fmt in _SPECIAL_FORMATS:
        return
    match = _SPEC.match(fmt)
    if match is None or match["type"] in ("s", "c"):
        raise ConfigurationError(
            f"{name}: fmt {fmt!r} is not a number format spec; expected e.g. '.4f', '+.2f', '.1e', 'd', "
            f"'.1%', "
            f"or 'frac' / 'str'."
        )
    if match["width"] or match["align"] or match["zero"]:
        raise ConfigurationError(
            f"{name}: fmt {fmt!r} sets a width or alignment; the table owns those. Put the width in "
            f"Column(width=...) and keep only e.g. '+.2f' in fmt."
        )
    sample = 1 if match["type"] in _INT_TYPES else 1.5
    try:
        format(sample, fmt)
    except ValueError as exc:
        raise ConfigurationError(f"{name}: fmt {fmt!r} is not valid: {exc}.") from exc


def _spec_type(fmt: str) -> str:
    return fmt[-1] if fmt and fmt[-1] in _INT_TYPES | _FLOAT_TYPES | {"c"} else ""


def _missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        try:
            return math.isnan(value)
        except (TypeError, ValueError):
            return False
    return False


def _pair(value: Any) -> Optional[Tuple[Any, Any]]:
    if isinstance(value, (tuple, list)) and len(value) == 2:
        n, d = value
        ok = all(
            v is None or (isinstance(v, numbers.Real) and not isinstance(v, (str, bytes))) for v in (n, d)
        )
        return (n, d) if ok else None
    return None


def _plain(x: Any) -> str:
    """A fraction part: whole numbers without a decimal point, others with 3 significant digits."""
    if isinstance(x, numbers.Integral):
        return str(int(x))
    x = float(x)
    if math.isfinite(x) and x.is_integer():
        return str(int(x))
    return format(x, ".3g")


def _false_inf(column: Column, value: Any, text: str) -> bool:
    """Python's '%' formatting multiplies in floats: ``format(1e307, '.0%')`` is ``'inf%'``. Not for us."""
    return "inf" in text and column.fmt.endswith("%") and isinstance(value, numbers.Real) and (
        _decimal(value).is_finite()
    )


def _decimal(x: Any) -> Decimal:
    """``x`` exactly, with no overflow: a Python int of any size or any float (numpy's too)."""
    return Decimal(int(x)) if isinstance(x, numbers.Integral) else Decimal(float(x))


def _sci(x: Any, precision: int) -> str:
    """Compact scientific notation: ``1.23e6``, ``-4e-7`` (no '+', no leading exponent zeros)."""
    value = x if isinstance(x, Decimal) else _decimal(x)
    if not value.is_finite():
        return str(float(value))
    mantissa, exponent = f"{value:.{precision}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _pad(text: str, column: Column) -> str:
    return pad(text, column.width, column.align_left)


def _legend_key(column: Column) -> str:
    if column.fmt == "frac" and column.denominator is not None:
        return printable(f"{column.key} / {column.denominator}")
    return printable(column.key)


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
