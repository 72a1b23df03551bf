"""wagma.checks: one message form, bool never a number, the value returned as checked."""

from __future__ import annotations

import math

import pytest

from wagma.checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_optional_int,
    check_optional_number,
    fail,
    is_int,
    is_number,
)


def test_check_int_returns_the_value_within_its_bounds() -> None:
    assert check_int("n", 3, minimum=1) == 3
    assert check_int("n", 0, minimum=0, maximum=0) == 0
    assert check_int("n", -5) == -5


@pytest.mark.parametrize(
    ("value", "minimum", "maximum", "message"),
    [
        (True, None, None, "n: expected an integer, found True"),
        (1.0, 0, None, "n: expected an integer >= 0, found 1.0"),
        (0, 1, None, "n: expected an integer >= 1, found 0"),
        (20, 0, 19, "n: expected an integer >= 0 and <= 19, found 20"),
        ("3", None, 5, "n: expected an integer <= 5, found '3'"),
    ],
)
def test_check_int_names_what_was_expected_and_found(value: object, minimum: int, maximum: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        check_int("n", value, minimum, maximum)
    assert str(info.value) == message


def test_check_number_bounds_inclusive_and_exclusive() -> None:
    assert check_number("lr", 1, minimum=0, above=True) == 1.0
    assert isinstance(check_number("lr", 1, minimum=0), float)
    assert check_number("m", 0.0, minimum=0.0, maximum=1.0, below=True) == 0.0
    with pytest.raises(ValueError, match=r"^lr: expected a finite number > 0, found 0$"):
        check_number("lr", 0, minimum=0, above=True)
    with pytest.raises(ValueError, match=r"^m: expected a finite number >= 0.0 and < 1.0, found 1.0$"):
        check_number("m", 1.0, minimum=0.0, maximum=1.0, below=True)
    for bad in (True, math.nan, math.inf, "1", None):
        with pytest.raises(ValueError, match="^x: expected a finite number, found "):
            check_number("x", bad)


def test_check_bool_and_check_choice() -> None:
    assert check_bool("flag", False) is False
    with pytest.raises(ValueError, match=r"^flag: expected True or False, found 1$"):
        check_bool("flag", 1)
    assert check_choice("mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"^mode: expected one of 'a', 'b', found 'c'$"):
        check_choice("mode", "c", ("a", "b"))
    with pytest.raises(ValueError, match=r"^mode: expected one of 'a', found \[\]$"):
        check_choice("mode", [], {"a"})


def test_predicates_refuse_bool() -> None:
    assert is_int(2) and not is_int(True) and not is_int(2.0)
    assert is_number(2.5) and is_number(2) and not is_number(False) and not is_number("2")


def test_fail_appends_advice() -> None:
    assert str(fail("n", "an integer", 1.5)) == "n: expected an integer, found 1.5"
    assert str(fail("n", "an integer", 1.5, "round it first")) == "n: expected an integer, found 1.5; round it first"


def test_optional_checks_take_none_and_say_so() -> None:
    assert check_optional_int("lead", None) is None
    assert check_optional_int("lead", 3, minimum=0) == 3
    assert check_optional_number("s", None, minimum=0) is None
    assert check_optional_number("s", 2, minimum=0) == 2.0
    with pytest.raises(ValueError, match=r"^lead: expected None or an integer >= 0 and <= 4, found 5$"):
        check_optional_int("lead", 5, minimum=0, maximum=4)
    with pytest.raises(ValueError, match=r"^s: expected None or a finite number > 0, found False$"):
        check_optional_number("s", False, minimum=0, above=True)
