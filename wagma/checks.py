"""Argument checks: the one place where wagma tells a caller that a value is not what it takes.

Every check names the argument, says what was expected and what was found, in one form::

    group_size: expected an integer >= 2, found 1

and returns the value (as the type it checked for) so a constructor can check and assign in one line.
``bool`` is never taken for a number: ``True`` is an ``int`` to Python, never to these checks. The library
and the application both call these instead of writing ``isinstance`` tests of their own; this module
imports nothing from wagma.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import TypeGuard, TypeVar

__all__ = [
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "check_optional_int",
    "check_optional_number",
    "fail",
    "is_int",
    "is_number",
]

T = TypeVar("T")


def fail(name: str, expected: str, found: object, advice: str = "") -> ValueError:
    """The error every check raises: ``"{name}: expected {expected}, found {found!r}"`` (return it, then raise it).

    ``advice``, when given, follows after ``"; "``: what the caller can do instead, or why the value is refused.
    """
    message = f"{name}: expected {expected}, found {found!r}"
    return ValueError(f"{message}; {advice}" if advice else message)


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an integer and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an ``int`` or a ``float`` and not a ``bool`` (NaN and infinities included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _described(
    kind: str, minimum: float | None, maximum: float | None, above: bool = False, below: bool = False
) -> str:
    """``kind`` and its bounds, as a message says what was expected: ``"an integer >= 0 and <= 19"``."""
    parts = [] if minimum is None else [f"{'>' if above else '>='} {minimum}"]
    parts += [] if maximum is None else [f"{'<' if below else '<='} {maximum}"]
    return " ".join([kind, " and ".join(parts)]).rstrip()


def _int_fits(value: object, minimum: int | None, maximum: int | None) -> bool:
    return is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def _number_fits(value: object, minimum: float | None, maximum: float | None, above: bool, below: bool) -> bool:
    if not is_number(value) or not math.isfinite(value):
        return False
    if minimum is not None and not (value > minimum if above else value >= minimum):
        return False
    return maximum is None or (value < maximum if below else value <= maximum)


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` if it is an integer (not a ``bool``) in ``[minimum, maximum]``; raise ``ValueError`` otherwise.

    Either bound may be ``None`` (unbounded on that side).
    """
    if not _int_fits(value, minimum, maximum):
        raise fail(name, _described("an integer", minimum, maximum), value)
    return value  # type: ignore[return-value]


def check_optional_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int | None:
    """``None``, or what :func:`check_int` takes; the message then says ``expected None or an integer ...``."""
    if value is not None and not _int_fits(value, minimum, maximum):
        raise fail(name, "None or " + _described("an integer", minimum, maximum), value)
    return value  # type: ignore[return-value]


def check_number(
    name: str,
    value: object,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    above: bool = False,
    below: bool = False,
) -> float:
    """Return ``value`` as a ``float`` if it is a finite number (not a ``bool``) within the bounds; raise otherwise.

    ``minimum`` and ``maximum`` are inclusive unless ``above`` (the value must be greater than ``minimum``) or
    ``below`` (less than ``maximum``) says otherwise; either bound may be ``None``.
    """
    if not _number_fits(value, minimum, maximum, above, below):
        raise fail(name, _described("a finite number", minimum, maximum, above, below), value)
    return float(value)  # type: ignore[arg-type]


def check_optional_number(
    name: str,
    value: object,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    above: bool = False,
    below: bool = False,
) -> float | None:
    """``None``, or what :func:`check_number` takes (as a ``float``); the message then says ``expected None or ...``."""
    if value is None:
        return None
    if not _number_fits(value, minimum, maximum, above, below):
        raise fail(name, "None or " + _described("a finite number", minimum, maximum, above, below), value)
    return float(value)  # type: ignore[arg-type]


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is ``True`` or ``False``; raise ``ValueError`` otherwise (``0`` and ``1`` included)."""
    if not isinstance(value, bool):
        raise fail(name, "True or False", value)
    return value


def check_choice(name: str, value: T, choices: Collection[object]) -> T:
    """Return ``value`` if it is one of ``choices``; raise ``ValueError`` naming them otherwise.

    The value keeps its static type (a ``Literal`` parameter stays one) whatever the type of ``choices``.
    """
    try:
        ok = value in choices
    except TypeError:  # an unhashable value against a set
        ok = False
    if not ok:
        raise fail(name, "one of " + ", ".join(repr(c) for c in choices), value)
    return value
