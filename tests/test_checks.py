"""instrument.checks: the int and number checks every layer's constructors share, and their messages."""

import ast
import math
import re

import numpy as np
import pytest

import instrument.checks
from instrument.checks import check_int, check_number, is_int
from instrument.errors import ConfigurationError

FIX = "bind e.g. Thing.count = 8"


def test_is_int_refuses_bool_and_takes_numpy_ints_only_when_asked():
    assert is_int(3) and is_int(-1) and not is_int(True) and not is_int(False)
    assert not is_int(3.0) and not is_int("3") and not is_int(None)
    assert not is_int(np.int64(3)) and is_int(np.int64(3), integral=True)
    assert not is_int(np.bool_(True), integral=True)


@pytest.mark.parametrize("value", [True, False])
def test_bool_is_never_an_int_or_a_number(value):
    with pytest.raises(ConfigurationError, match=rf"got {value} \(bool\)"):
        check_int("Thing.count", value, fix=FIX)
    with pytest.raises(ConfigurationError, match=rf"got {value} \(bool\)"):
        check_int("Thing.count", value, integral=True, fix=FIX)
    with pytest.raises(ConfigurationError, match=rf"got {value} \(bool\)"):
        check_number("Thing.rate", value, fix=FIX)


def test_check_int_returns_a_plain_int():
    assert check_int("Thing.count", 5, least=1, fix=FIX) == 5
    got = check_int("Thing.count", np.int32(7), least=1, most=7, integral=True, fix=FIX)
    assert got == 7 and type(got) is int


def test_numpy_ints_are_refused_unless_integral():
    with pytest.raises(ConfigurationError, match=r"Thing.count must be an int, got .*7.* \(int64\)"):
        check_int("Thing.count", np.int64(7), fix=FIX)


@pytest.mark.parametrize(
    "kwargs, value, expected",
    [
        ({"least": 1}, 0, "an int >= 1"),
        ({"least": 0, "most": 5}, 6, "an int from 0 to 5"),
        ({"least": 0, "most": 5}, -1, "an int from 0 to 5"),
        ({"most": 5}, 6, "an int <= 5"),
        ({}, 2.0, "an int"),
        ({}, "3", "an int"),
        ({"least": 1, "none": True}, 0, "an int >= 1 or None"),
        ({"least": 1, "expected": "a positive int"}, 0, "a positive int"),
    ],
)
def test_check_int_bounds_and_what_is_expected(kwargs, value, expected):
    with pytest.raises(ConfigurationError) as info:
        check_int("Thing.count", value, fix=FIX, **kwargs)
    assert str(info.value) == f"Thing.count must be {expected}, got {value!r} ({type(value).__name__}); {FIX}."


def test_bounds_are_inclusive_and_none_passes_only_when_allowed():
    assert check_int("Thing.count", 0, least=0, most=0, fix=FIX) == 0
    assert check_int("Thing.count", None, least=1, none=True, fix=FIX) is None
    with pytest.raises(ConfigurationError, match=r"got None \(NoneType\)"):
        check_int("Thing.count", None, least=1, fix=FIX)
    assert check_number("Thing.rate", None, above=0, none=True, fix=FIX) is None
    assert check_number("Thing.rate", 0, least=0, most=0, fix=FIX) == 0.0


def test_the_message_says_received_expected_why_and_fix():
    with pytest.raises(ConfigurationError) as info:
        check_int("MlflowBackend.timeout", 2.5, least=1, why="whole seconds",
                  fix="bind e.g. MlflowBackend.timeout = 10.")
    assert str(info.value) == (
        "MlflowBackend.timeout must be an int >= 1 (whole seconds), got 2.5 (float); "
        "bind e.g. MlflowBackend.timeout = 10."  # the fix's own full stop is not doubled
    )


def test_check_number_returns_a_float_and_takes_ints():
    got = check_number("Thing.rate", 3, above=0, fix=FIX)
    assert got == 3.0 and type(got) is float
    assert check_number("Thing.rate", np.float64(0.5), least=0, most=1, fix=FIX) == 0.5  # a float subclass
    assert check_number("Thing.rate", math.inf, least=0, fix=FIX) == math.inf  # a lower bound lets inf through
    assert math.isnan(check_number("Thing.rate", math.nan, fix=FIX))  # no bound: nothing to refuse NaN with


@pytest.mark.parametrize(
    "kwargs, value, expected",
    [
        ({"least": 0}, -1, "a number >= 0"),
        ({"above": 0}, 0, "a number > 0"),
        ({"least": 0, "most": 1}, 1.5, "a number in [0, 1]"),
        ({"above": 0, "most": 1}, 0.0, "a number in (0, 1]"),
        ({"most": 1}, 2, "a number <= 1"),
        ({}, "1", "a number"),
        ({"least": 0, "noun": "a number of seconds"}, -1, "a number of seconds >= 0"),
        ({"above": 0, "none": True}, 0, "a number > 0 or None"),
        ({"above": 0, "expected": "a positive number of seconds"}, 0, "a positive number of seconds"),
    ],
)
def test_check_number_bounds_and_what_is_expected(kwargs, value, expected):
    with pytest.raises(ConfigurationError) as info:
        check_number("Thing.rate", value, fix=FIX, **kwargs)
    assert str(info.value) == f"Thing.rate must be {expected}, got {value!r} ({type(value).__name__}); {FIX}."


@pytest.mark.parametrize("bounds", [{"least": 0}, {"above": 0}, {"most": 1}, {"least": 0, "most": 1}])
def test_nan_fails_every_bound(bounds):
    with pytest.raises(ConfigurationError, match=r"got nan \(float\)"):
        check_number("Thing.rate", math.nan, fix=FIX, **bounds)


def test_numbers_other_than_int_and_float_are_refused():
    with pytest.raises(ConfigurationError, match=re.escape("got (1+0j) (complex)")):
        check_number("Thing.rate", 1 + 0j, fix=FIX)
    with pytest.raises(ConfigurationError, match=r"must be a number, got .*0\.5.* \(float32\)"):
        check_number("Thing.rate", np.float32(0.5), fix=FIX)


def test_the_error_is_a_configuration_error_and_a_value_error():
    with pytest.raises(ValueError):
        check_int("Thing.count", -1, least=0, fix=FIX)


def test_the_module_imports_neither_torch_nor_gin():
    """Every layer imports it, the lightest included: only the standard library and instrument.errors."""
    tree = ast.parse(open(instrument.checks.__file__, encoding="utf-8").read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names == {"numbers", "typing", "instrument.errors"}, names
