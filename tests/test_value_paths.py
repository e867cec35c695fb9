"""Numbers on every staging path are never lost or falsified, nor merged or rounded without a word: read back
from the JSONL file a user opens."""

import json
import logging
import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

import instrument
from instrument.errors import InvalidValueError
from instrument.logger.blocks import MAX_BLOCKS


def _written(run_dir):
    """The metrics of every step record in ``metrics.jsonl`` (JSONL writes NaN and inf as strings)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: {k: float(v) for k, v in row["metrics"].items()} for row in rows if "step" in row}


def _mean(values):
    """The correctly rounded float64 of the true mean."""
    return float(sum(map(Fraction, values)) / len(values))


# How a value reaches the staged table: each arm is a path of its own (asserted below).
PATHS = {
    "float_block": (lambda v: {"x": v}, {}),
    "numpy_per_key": (lambda v: {"x": np.float64(v)}, {}),
    "cpu_tensor_block": (lambda v: {"x": torch.tensor(v, dtype=torch.float64)}, {}),
    "cpu_tensor_per_key": (lambda v: {"x": torch.tensor(v, dtype=torch.float64), "n": 1}, {}),
    "reduce_op": (lambda v: {"x": v}, {"reduce": "max"}),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("values", [
    [1e308, 1e308],
    [1e308, 1e308, -1e308, 1e308],
    [-1.5e308, -1.7e308, 1e-300],
    [1.7976931348623157e308] * 3 + [1.0],
], ids=["twice", "back_in_range", "negative", "max_and_one"])
def test_the_interval_mean_of_finite_values_is_finite_on_every_path(tmp_path, path, values):
    make, options = PATHS[path]
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("o", tmp_path))
    for step, value in enumerate(values):
        logger.log_metrics(make(value), step=step, **options)
        assert bool(logger._blocks) == path.endswith("block")
    logger.commit(len(values))
    logger.close()
    assert _written(tmp_path / "o")[len(values)]["x"] == _mean(values)



@pytest.mark.parametrize("pairs", [
    [(1e308, 1.0), (1e308, 1.0)],  # the sum leaves float64's range
    [(1e308, 2.0)],  # the product alone does
    [(1e308, 2.0), (3.0, 1.0), (-1e308, 0.5), (1e307, 4.0)],
], ids=["sum", "product", "mixed"])
def test_a_weighted_mean_of_finite_values_is_finite(tmp_path, pairs):
    """sum(value * weight) / sum(weight) taken exactly where float64 would overflow: it read inf."""
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("w", tmp_path))
    for value, weight in pairs:
        logger.log_metrics({"x": value}, step=0, weights=weight)
    logger.commit(0)
    logger.close()
    want = sum(Fraction(v) * Fraction(w) for v, w in pairs) / sum(Fraction(w) for _, w in pairs)
    assert _written(tmp_path / "w")[0]["x"] == float(want)


@pytest.mark.parametrize("own", [False, True], ids=["interval", "commit=True"])
@pytest.mark.parametrize("value, weight", [(1e308, 2.0), (1e-200, 1e-200), (3e-160, 2e-160), (-5e-170, 7e-150)])
def test_one_weighted_value_whose_product_leaves_float64s_normal_range_is_written_as_itself(tmp_path, value,
                                                                                             weight, own):
    """``log_metrics(..., weights=w, commit=True)`` multiplied plainly (1e308 * 2.0 read inf), and both paths read
    0 for a product below float64's smallest normal (1e-200 * 1e-200) or lost digits in a subnormal one."""
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("u", tmp_path))
    if own:
        logger.log_metrics({"x": value}, step=0, weights=weight, commit=True)
    else:
        logger.log_metrics({"x": value}, step=0, weights=weight)
        logger.commit(0)
    logger.close()
    assert _written(tmp_path / "u")[0]["x"] == value


def test_a_weighted_mean_whose_weights_sum_beyond_float64_is_nan_not_a_crash(tmp_path):
    """Both sums left float64's range (weights 1e308 twice): the commit raised OverflowError and the whole step
    was lost; the mean is undefined in float64 there and written as NaN, the other keys as they are."""
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("n", tmp_path))
    for _ in range(2):
        logger.log_metrics({"m": 1.0}, step=0, weights=1e308)
    logger.log_metrics({"other": 2.0}, step=0)
    logger.commit(0)
    logger.close()
    written = _written(tmp_path / "n")[0]
    assert math.isnan(written["m"]) and written["other"] == 2.0

def test_the_mean_of_finite_values_past_max_blocks_is_finite(tmp_path):
    # the blocks are folded into the per-key table on the caller, and the sums go on there
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("f", tmp_path))
    values = [1e308 if i % 3 else -0.5e308 for i in range(MAX_BLOCKS + 5)]
    for step, value in enumerate(values):
        logger.log_metrics({"x": value}, step=step)
        if step == MAX_BLOCKS - 1:
            assert len(logger._blocks) == MAX_BLOCKS
    assert not logger._blocks  # folded
    logger.commit(len(values))
    logger.close()
    assert _written(tmp_path / "f")[len(values)]["x"] == _mean(values)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("values, expected", [
    ([1e308, 1e308, math.inf], math.inf),
    ([1e308, 1e308, -math.inf], -math.inf),
    ([1e308, 1e308, math.nan], math.nan),
    ([math.inf, -math.inf], math.nan),
    ([1e308, 1e308, math.inf, 1e308], math.inf),
], ids=["inf", "minus_inf", "nan", "both_infinities", "inf_then_finite"])
def test_an_infinite_or_nan_value_still_makes_the_mean_inf_or_nan(tmp_path, path, values, expected):
    make, options = PATHS[path]
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("n", tmp_path))
    for step, value in enumerate(values):
        logger.log_metrics(make(value), step=step, **options)
    logger.commit(len(values))
    logger.close()
    got = _written(tmp_path / "n")[len(values)]["x"]
    assert got == expected or (math.isnan(expected) and math.isnan(got))


# ---------------------------------------------------------------------------------------------- one name, two keys
@pytest.mark.parametrize("options", [{}, {"reduce": "max"}, {"commit": True}], ids=["plain", "reduce", "commit"])
@pytest.mark.parametrize("first, second", [(1, "1"), ("1", 1), (np.float32(0.1), 0.1), (None, "None")])
def test_two_keys_that_name_one_metric_are_refused_and_stage_nothing(tmp_path, options, first, second):
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("k", tmp_path))
    logger.log_metrics({"before": 1.0}, step=0)
    with pytest.raises(InvalidValueError) as refused:
        logger.log_metrics({first: 2.0, second: 4.0, "other": 5.0}, step=1, prefix="p", **options)
    message = str(refused.value)
    assert repr(first) in message and repr(second) in message and repr(f"p/{second}") in message
    assert "its own string key" in message
    logger.log_metrics({first: 2.0, "other": 5.0}, step=1, prefix="p")  # one of them alone is fine
    logger.commit()
    logger.close()
    assert _written(tmp_path / "k") == {1: {"before": 1.0, f"p/{str(first)}": 2.0, "p/other": 5.0}}


def test_keys_of_one_call_that_name_distinct_metrics_are_kept():
    logger = instrument.Logger([])
    logger.log_metrics({1: 2.0, "2": 4.0, (3,): 1.0}, step=0, prefix="p")
    assert logger.commit().scalars == {"p/1": 2.0, "p/2": 4.0, "p/(3,)": 1.0}
    logger.close()


# ------------------------------------------------------------------------------ numbers float64 cannot hold exactly
LONG = np.longdouble(1) + np.longdouble(2) ** -60  # 1 + 2**-60: 1.0 in float64 (where longdouble is wider)


@pytest.mark.parametrize("value", [
    LONG, np.array(LONG), Fraction(1, 3), Fraction(2**60 + 1, 2**60), Decimal("0.1"), Decimal("1.000000000000000001"),
    Decimal(2**60 + 1),
], ids=["longdouble", "longdouble_0d", "fraction", "fraction_near_1", "decimal", "decimal_near_1", "decimal_int"])
@pytest.mark.parametrize("commit", [False, True])
def test_a_number_float64_rounds_is_written_rounded_and_said_once_per_key(tmp_path, caplog, value, commit):
    if value is LONG and np.finfo(np.longdouble).nmant <= 52:
        pytest.skip("np.longdouble is float64 on this platform")
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("r", tmp_path))
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            logger.log_metrics({"r": value}, step=step, commit=commit)
        logger.commit(1)
        logger.close()
    rounded = float(np.asarray(value).item())
    assert rounded != np.asarray(value).item()  # really rounded
    assert all(row["r"] == rounded for row in _written(tmp_path / "r").values())
    said = [r.getMessage() for r in caplog.records if "cannot hold exactly" in r.getMessage()]
    assert len(said) == 1 and "'r'" in said[0] and f"logged as {rounded!r}" in said[0]


@pytest.mark.parametrize("value, written", [
    (np.longdouble(0.5), 0.5), (np.array(np.longdouble(-3)), -3.0), (Fraction(1, 2), 0.5), (Decimal("0.25"), 0.25),
    (Decimal("-0"), -0.0), (Decimal("-Infinity"), -math.inf), (Decimal("NaN"), math.nan),
    (np.longdouble("nan"), math.nan), (np.longdouble("inf"), math.inf), (Decimal(2**60), float(2**60)),
])
def test_a_number_float64_holds_is_written_as_it_is_and_not_said(tmp_path, caplog, value, written):
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("e", tmp_path))
    with caplog.at_level(logging.WARNING, logger="instrument"):
        logger.log_metrics({"e": value}, step=0)
        logger.commit()
        logger.close()
    got = _written(tmp_path / "e")[0]["e"]
    assert got == written or (math.isnan(written) and math.isnan(got))
    assert math.copysign(1, got) == math.copysign(1, written)
    said = [r.getMessage() for r in caplog.records if "'e'" in r.getMessage()]
    assert said == []


@pytest.mark.parametrize("value, pattern", [
    (np.longdouble("1e4000"), r"metric 'k' is np.longdouble\('1e\+4000'\), beyond the float range"),
    (Fraction(10**400), r"metric 'k' is Fraction\(1000.*\.\.\., beyond the float range"),
    (Decimal("-1e400"), r"metric 'k' is Decimal\('-1E\+400'\), beyond the float range.*log10"),
    (Decimal("sNaN"), r"metric 'k' is a signalling NaN Decimal.*Decimal\('NaN'\)"),
    (object(), r"metric 'k' has type object; expected a Python or NumPy real number.*float\(value\)"),
])
def test_a_number_no_float_can_hold_is_refused_with_the_fix(value, pattern):
    if isinstance(value, np.longdouble) and np.finfo(np.longdouble).maxexp <= 1024:
        pytest.skip("np.longdouble is float64 on this platform")
    logger = instrument.Logger([])
    for commit in (False, True):
        with pytest.raises(InvalidValueError, match=pattern):
            logger.log_metrics({"k": value, "ok": 1.0}, step=0, commit=commit)
    assert logger.commit() is None  # nothing of the refused calls was staged
    logger.close()
