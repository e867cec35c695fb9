"""StepTable and Column: golden output for every format, nan, '?', overflow, legend, headers, conditions."""

import logging
import math
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from instrument.errors import ConfigurationError
from instrument.terminal.table import Column, StepTable, as_column, resolve_columns, unique_headers

NAN = float("nan")

COLUMNS = [
    Column("step", "step", 5, "d", "training step"),
    Column("train/loss", "loss↓", 8, ".4f", "training loss"),
    Column("reward/delta", "Δret↑", 7, "+.2f", "change of return"),
    Column("opt/lr", "lr", 7, ".1e", "learning rate"),
    Column("eval/solved", "solved↑", 7, "frac", "episodes solved / run"),
    Column("eval/mode", "mode", 6, "str", "policy mode"),
]


def test_golden_formats_legend_and_rows():
    table = StepTable(COLUMNS)
    lines = (
        table.legend()
        + table.render(
            {
                "step": 0,
                "train/loss": 0.123456,
                "reward/delta": 1.5,
                "opt/lr": 3e-4,
                "eval/solved": (3, 8),
                "eval/mode": "det",
            }
        )
        + table.render(
            {
                "step": 10,
                "train/loss": 0.0871,
                "reward/delta": -0.25,
                "opt/lr": 3e-4,
                "eval/solved": (8.0, 8.0),
                "eval/mode": "sto",
            }
        )
    )
    assert lines == [
        "columns:",
        "  step     step          training step",
        "  loss↓    train/loss    training loss",
        "  Δret↑    reward/delta  change of return",
        "  lr       opt/lr        learning rate",
        "  solved↑  eval/solved   episodes solved / run",
        "  mode     eval/mode     policy mode",
        "  (↑ higher is better, ↓ lower is better)",
        "  (nan: no value this step; ?: a value of the wrong type (see the log))",
        "  (numbers too wide for a column are shown as 1.2e5)",
        " step     loss↓    Δret↑       lr  solved↑  mode  ",
        "    0    0.1235    +1.50  3.0e-04      3/8  det   ",
        "   10    0.0871    -0.25  3.0e-04      8/8  sto   ",
    ]


@pytest.mark.parametrize("value", [None, NAN, np.float32("nan"), "missing"])
def test_nan_none_and_missing_render_nan_in_every_format(value, caplog):
    table = StepTable(COLUMNS)
    values = {"step": 7}
    if value != "missing":
        values.update({c.key: value for c in COLUMNS[1:]})
    assert table.row(values) == "    7       nan      nan      nan      nan  nan   "
    assert table.row({"step": 7, "eval/solved": (NAN, 8), "eval/mode": None}).split()[-2:] == ["nan", "nan"]
    assert not caplog.records  # a missing value is not an error


def test_wrong_type_errors_once_naming_the_column_then_question_mark(caplog):
    table = StepTable(COLUMNS)
    with caplog.at_level(logging.ERROR, logger="instrument"):
        first = table.row({"step": 1, "reward/delta": "big"})
        second = table.row({"step": 2, "reward/delta": "bigger"})
    assert first.split()[2] == "?" and second.split()[2] == "?"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert errors[0].name == "instrument"
    assert "column 'Δret↑' (key 'reward/delta', format '+.2f') got str 'big'" in errors[0].getMessage()
    assert "expected a number" in errors[0].getMessage()


def test_int_formats_take_whole_floats_and_refuse_fractions(caplog):
    table = StepTable([Column("n", "n", 6, "d"), Column("h", "hex", 4, "x")])
    assert table.row({"n": 12.0, "h": 255.0}) == "    12    ff"
    assert table.row({"n": math.inf, "h": np.int64(16)}) == "   inf    10"
    with caplog.at_level(logging.ERROR, logger="instrument"):
        assert table.row({"n": 2.5}) == "     ?   nan"
    assert "a whole number for format 'd'" in caplog.records[0].getMessage()


def test_frac_takes_pairs_and_refuses_scalars(caplog):
    table = StepTable([Column("solved", "solved", 7, "frac")])
    assert table.cell(table.columns[0], [2, 5]) == "    2/5"
    assert table.cell(table.columns[0], (1.5, 4)) == "  1.5/4"
    with caplog.at_level(logging.ERROR, logger="instrument"):
        assert table.cell(table.columns[0], 0.4) == "      ?"
    assert "expected a (numerator, denominator) pair" in caplog.records[0].getMessage()


def test_overflow_uses_scientific_notation_and_never_widens(caplog):
    table = StepTable(
        [
            Column("a", "a", 6, "d"),
            Column("b", "b", 6, "+.2f"),
            Column("c", "c", 5, ".1%"),
            Column("f", "f", 7, "frac"),
        ]
    )
    with caplog.at_level(logging.WARNING, logger="instrument"):
        row = table.row({"a": 1234567, "b": 123456.0, "c": 12.5, "f": (123456, 1000000)})
    assert row == "1.23e6  +1.2e5   1e3%  1e5/1e6"
    assert len(row) == table.line_width
    assert not caplog.records  # scientific notation is the documented policy, not a problem


def test_overflow_too_narrow_even_for_scientific_fills_hash_and_warns_once(caplog):
    table = StepTable([Column("x", "x", 3, ".2f"), Column("s", "name", 5, "str")])
    with caplog.at_level(logging.WARNING, logger="instrument"):
        assert table.row({"x": -1.5e-300, "s": "stochastic"}) == "###  stoc…"
        assert table.row({"x": -2.5e-300, "s": "deterministic"}) == "###  dete…"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert any(
        "column 'x' (width 3) is too narrow for -1.5e-300 even in scientific notation" in m for m in messages
    )
    assert any("column 'name' (width 5) cut the text 'stochastic'" in m for m in messages)


@pytest.mark.parametrize("fmt, value", [("x", 0x12345), ("X", 0xABCDEF), ("o", 0o77777), ("b", 0b111111)])
def test_a_whole_number_in_another_base_too_wide_for_its_column_fills_hash_not_decimal_notation(caplog, fmt, value):
    """0x12345 in a 4-wide 'x' column showed "7e4": a hex number to the eye (0x7e4 = 2020), and in 'X', 'o' or 'b'
    a cell that cannot be read in the column's base at all. Such a cell is filled with '#' and said once."""
    table = StepTable([Column("v", "v", 4, fmt)])
    with caplog.at_level(logging.WARNING, logger="instrument"):
        assert table.row({"v": value}) == "####"
        assert table.row({"v": 3}) == format(3, fmt).rjust(4)  # what fits is shown in its base
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and f"too narrow for {value};" in messages[0]


def test_a_long_text_cut_in_a_column_is_named_by_its_start_and_length(caplog):
    """A review found the warning repeating the whole value: a text of a megabyte made a megabyte of log."""
    table = StepTable([Column("s", "note", 6, "str")])
    text = "q" * 1_000_000
    with caplog.at_level(logging.WARNING, logger="instrument"):
        assert table.row({"s": text}) == "qqqqq…"
    (message,) = [r.getMessage() for r in caplog.records]
    assert len(message) < 300, len(message)
    assert "cut the text 'qqqq" in message and "(1000000 characters)" in message


def test_header_repeats_every_n_rows():
    table = StepTable([Column("step", "step", 4, "d")], header_every=2)
    lines = [line for step in range(5) for line in table.render({"step": step})]
    assert lines == ["step", "   0", "   1", "step", "   2", "   3", "step", "   4"]
    once = StepTable([Column("step", "step", 4, "d")], header_every=0)
    assert [line for s in range(3) for line in once.render({"step": s})] == ["step", "   0", "   1", "   2"]


def test_conditional_columns_are_decided_once_and_line_up_across_runs():
    def columns(eval_on: bool):
        return [
            Column("step", "step", 4, "d"),
            Column("eval/{}/return", "{}↑", 6, ".1f", "return, {} policy", each=("det", "sto")),
            Column("train/kl", "kl", 6, ".3f", when=eval_on),
            Column("eval/{}/len", "len_{}", 7, "d", each=("det",), when=eval_on),
        ]

    with_eval = StepTable(columns(True))
    without = StepTable(columns(False))
    assert [c.key for c in with_eval.columns] == [
        "step",
        "eval/det/return",
        "eval/sto/return",
        "train/kl",
        "eval/det/len",
    ]
    assert [c.key for c in without.columns] == ["step", "eval/det/return", "eval/sto/return"]
    assert with_eval.columns[1].description == "return, det policy"
    assert with_eval.header() == "step    det↑    sto↑      kl  len_det"
    # A metric this run does not have stays in its place as nan.
    assert with_eval.row({"step": 3, "eval/sto/return": 9.5}) == "   3     nan     9.5     nan      nan"
    # Templates are checked whether or not the feature is on: a bad header fails in every run.
    with pytest.raises(ConfigurationError, match=r"header 'len_det' is 7 characters, wider than width=6"):
        Column("eval/{}/len", "len_{}", 6, "d", each=("det",), when=False)


def test_column_validation_says_what_to_fix():
    with pytest.raises(
        ConfigurationError, match=r"header 'a long header' is 13 characters, wider than width=6"
    ):
        Column("x", "a long header", 6)
    with pytest.raises(ConfigurationError, match=r"width must be an int >= 3"):
        Column("x", "x", 2)
    with pytest.raises(ConfigurationError, match=r"sets a width or alignment; the table owns those"):
        Column("x", fmt=">10.2f")
    with pytest.raises(ConfigurationError, match=r"fmt 'banana' is not a number format spec"):
        Column("x", fmt="banana")
    with pytest.raises(ConfigurationError, match=r"put '\{\}' in the key"):
        Column("eval/return", each=("a", "b"))
    with pytest.raises(ConfigurationError, match=r"denominator is only meaningful with fmt='frac'"):
        Column("x", fmt=".2f", denominator="y")
    with pytest.raises(ConfigurationError, match=r"at least one column"):
        StepTable([Column("x", when=False)])


def test_column_defaults_and_specs_from_gin_literals():
    col = Column("train/loss")
    assert (col.header, col.width, col.fmt) == ("loss", 8, ".4g")
    assert as_column(("a/b", "b↓", 9, ".3f", "desc")) == Column("a/b", "b↓", 9, ".3f", "desc")
    assert as_column({"key": "a/b", "fmt": "d"}) == Column("a/b", fmt="d")
    assert as_column("a/b") == Column("a/b")
    assert resolve_columns([{"key": "e/{}", "each": ["x", "y"]}])[1].key == "e/y"
    with pytest.raises(ConfigurationError, match=r"cannot make a Column from \{'kye': 'a'\}"):
        as_column({"kye": "a"})
    with pytest.raises(ConfigurationError, match=r"got int"):
        as_column(3)


def test_unique_headers_use_the_fewest_distinguishing_segments():
    keys = ["train/loss", "timing/rollout/mean", "update_norm/l2/mean", "a/l2/mean", "alive", "stats/max/c3"]
    assert unique_headers(keys) == {
        "train/loss": "loss",
        "timing/rollout/mean": "rollout/mean",
        "update_norm/l2/mean": "update_norm/l2/mean",
        "a/l2/mean": "a/l2/mean",
        "alive": "alive",
        "stats/max/c3": "max/c3",
    }


# ------------------------------------------------------------------------------------------------- property
_FORMATS = [".4f", "+.2f", ".1e", ".3g", "d", ",d", ".0%", "frac", "str"]
_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.tuples(st.integers(-(10**12), 10**12), st.integers(0, 10**12)),
    st.tuples(st.floats(allow_nan=True), st.floats(allow_nan=True)),
    st.none(),
)


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(st.tuples(st.sampled_from(_FORMATS), st.integers(3, 14)), min_size=1, max_size=6),
    rows=st.lists(st.lists(_values, min_size=6, max_size=6), min_size=1, max_size=4),
)
def test_any_mix_of_values_renders_rows_of_exactly_the_declared_widths(specs, rows):
    logging.getLogger("instrument").disabled = True  # '?' and '#' are reported; not what this checks
    try:
        table = StepTable([Column(f"k{i}", f"h{i}"[:w], w, fmt) for i, (fmt, w) in enumerate(specs)])
        for raw in rows:
            line = table.row({f"k{i}": v for i, v in enumerate(raw)})
            assert len(line) == table.line_width
            at = 0
            for col in table.columns:
                cell = line[at : at + col.width]
                assert len(cell) == col.width and "\n" not in cell
                _assert_not_cut(cell.strip(), raw[int(col.key[1:])], col.fmt)
                at += col.width
                assert line[at : at + len(table.sep)] in (table.sep, "")
                at += len(table.sep)
    finally:
        logging.getLogger("instrument").disabled = False


def _assert_not_cut(text, value, fmt):
    """A shown number is the value rounded, never a truncated prefix of it (1234567 never shows as 12345)."""
    if (
        fmt in ("str", "frac")
        or isinstance(value, tuple)
        or value is None
        or text in ("nan", "?", "inf", "-inf")
    ):
        return
    if set(text) == {"#"} or not math.isfinite(value):
        return
    # Decimal, not float: 1.5e308 rounded to '2e308' is right but would parse as inf.
    shown = Decimal(text.replace(",", "").rstrip("%")) / (100 if text.endswith("%") else 1)
    exact = Decimal(value)
    assert abs(shown - exact) <= max(abs(exact) / 2, Decimal(1)), (text, value, fmt)


def test_overflow_is_exact_for_huge_numbers_python_formats_as_inf(caplog):
    # format(1.8e306, '.1%') is 'inf%' and float(10**400) raises; the table shows both rounded, not inf.
    table = StepTable([Column("p", "p", 9, ".1%"), Column("n", "n", 6, "d")])
    assert table.row({"p": 1.797693134862316e306, "n": 10**400}) == "1.80e308%   1e400"
    assert table.row({"p": math.inf, "n": -(10**400)}) == "     inf%  -1e400"
    assert not caplog.records


def test_a_step_too_wide_for_its_column_widens_it_instead_of_rounding():
    """A frame-counted run passes 10M: the automatic step column (7 wide) showed 1.001e7 for successive rows."""
    import io

    from instrument.backends.base import StepRecord
    from instrument.backends.console import ConsoleBackend

    out = io.StringIO()
    console = ConsoleBackend(stream=out, legend=False)
    steps = (9_999_000, 10_002_048, 10_006_144, 123_456_789_012)
    for step in steps:
        console.write(StepRecord(step=step, scalars={"reward": 1.0}))
    rows = [line.split() for line in out.getvalue().splitlines() if line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == list(steps)
    headers = [line for line in out.getvalue().splitlines() if line.split()[0] == "step"]
    assert len(headers) == 3  # the first, and one each time the column widened


def test_a_match_column_with_an_invalid_pattern_is_refused_when_built():
    with pytest.raises(ConfigurationError, match=r"regular expression.*not valid.*fix it"):
        Column("iteration_stats/max/c(3", match=True)
    assert Column("iteration_stats/max/c0*3", match=True).header == "c0*3"


def test_wide_characters_take_two_cells_and_the_columns_stay_aligned():
    # Headers were padded by code points: a wide character (CJK, most emoji) takes two terminal cells, so the
    # header line was wider on screen than its rows and every column to its right moved.
    import unicodedata

    def display_width(text):  # what a terminal gives it: 2 cells for wide, 0 for a combining mark
        return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
                   for c in text)

    table = StepTable([Column("train/loss", "损失↓", 8, ".4f"), Column("eval/acc", "✅acc", 7, ".1%"),
                       Column("mode", "mode", 6, "str"), Column("note", "e\u0301t\u00e9", 5, "str")])
    lines = table.render({"step": 10, "train/loss": 0.1234, "eval/acc": 0.5, "mode": "贪心搜索算法", "note": "x"})
    assert [display_width(line) for line in lines] == [table.line_width] * 2, lines
    assert lines[0].endswith("  mode    e\u0301t\u00e9  ")  # a combining accent takes no cell
    assert "贪心…" in lines[1]  # cut by cells: two wide characters and the mark fill 5 of the 6
    legend = table.legend()
    assert len({line.index("train/loss") for line in legend if "train/loss" in line}) == 1
    assert display_width(legend[1].split("train/loss")[0]) == display_width(legend[2].split("eval/acc")[0])
    with pytest.raises(ConfigurationError, match=r"is 6 characters wide on a terminal, wider than width=5"):
        Column("x", "损失↓↓", 5)
    # the legend's key column too: a wide key pushed its description right (a read-through found it)
    legend = StepTable([Column("损失/总", "loss", 6, ".3f", description="total"),
                        Column("acc", "acc", 6, ".3f", description="accuracy")]).legend()
    assert display_width(legend[1].split("total")[0]) == display_width(legend[2].split("accuracy")[0]), legend
