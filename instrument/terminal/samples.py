"""Validation samples on the host: choosing which to print, and flattening them for tables.

A sample is a dict such as ``{"input": ..., "output": ..., "score": ..., **extra}``. The console shows a few:
the best and the worst by score, interleaved, because the extremes are what a reader learns from (the best
shows what works, the worst where the model fails); tables (W&B, TensorBoard, JSONL, MLflow) get them all.
"""

import math
import numbers
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["select_samples", "columns", "cell", "markdown_table", "finite_number"]


def select_samples(
    rows: Sequence[Dict[str, Any]], n: int, score_key: str = "score"
) -> List[Tuple[str, Dict[str, Any]]]:
    """Up to ``n`` rows labelled ``"best #k"`` / ``"worst #k"``, interleaved best, worst, best, ...

    Rows without a finite numeric score are shown only when fewer than ``n`` rows have one (label ``"#i"``).
    """
    if n <= 0:
        return []
    scored = sorted(
        ((float(r[score_key]), i) for i, r in enumerate(rows) if finite_number(r.get(score_key))),
        key=lambda t: (-t[0], t[1]),
    )
    best = scored[: (min(n, len(scored)) + 1) // 2]
    taken = {i for _, i in best}
    worst = [t for t in reversed(scored) if t[1] not in taken][: min(n, len(scored)) - len(best)]
    chosen: List[Tuple[str, Dict[str, Any]]] = []
    for k in range(max(len(best), len(worst))):
        if k < len(best):
            chosen.append((f"best #{k + 1}", rows[best[k][1]]))
        if k < len(worst):
            chosen.append((f"worst #{k + 1}", rows[worst[k][1]]))
    taken |= {i for _, i in worst}
    for i, row in enumerate(rows):
        if len(chosen) >= n:
            break
        if i not in taken:
            chosen.append((f"#{i}", row))
    return chosen


def columns(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Every field name, in first-seen order."""
    out: List[str] = []
    for row in rows:
        out += [c for c in row if c not in out]
    return out


def cell(value: Any) -> Any:
    """A value a table (W&B, JSON) accepts: str, number, bool or None; anything else as its str.

    Integers stay exact: an int (or NumPy int) is an int up to ``2**63`` in magnitude (what W&B and most JSON
    readers hold exactly as int64) and its decimal digits as a str beyond that (a float would round a seed or
    an id past ``2**53``, and one past the float range cannot be a float at all). Other reals are floats, with
    NaN, inf and those beyond the float range written as their str.
    """
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        number = int(value)
        return number if -_INT64 <= number < _INT64 else _digits(number)
    if isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:
            return str(value)
        return number if math.isfinite(number) else str(value)
    return str(value)


_INT64 = 2**63


def _digits(number: int) -> str:
    try:
        return str(number)
    except ValueError:  # more digits than Python converts (sys.set_int_max_str_digits): hex has no such limit
        return hex(number)


def markdown_table(rows: Sequence[Dict[str, Any]]) -> str:
    """A markdown table (TensorBoard renders it) of every row and field."""
    cols = columns(rows)
    if not cols:
        return ""

    def fmt(v: Any) -> str:
        # a float in full (its shortest round-trip form), as JSONL, W&B and MLflow store it: a table is read
        # to compare samples, and 4 digits made 0.0999755859375 read 0.09998 and 60000.0 read 6e+04
        text = "" if v is None else (float.__repr__(v) if isinstance(v, float) else str(v))
        # a backslash escaped first (`p\|q` would cancel the pipe's escape and split the cell); every line
        # end, \r too, as <br> (Markdown ends a table row at any of them)
        text = text.replace("\\", "\\\\").replace("|", "\\|")
        return text.replace("\r\n", "<br>").replace("\r", "<br>").replace("\n", "<br>")

    lines = ["| " + " | ".join(fmt(str(c)) for c in cols) + " |", "|" + "---|" * len(cols)]  # headers escaped too
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def finite_number(value: Any) -> bool:
    """A real that is a finite float (an int beyond the float range cannot be ranked as a score)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
