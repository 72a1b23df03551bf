"""The parameters of a data task the application makes itself (``data=sequences``, ``data=torch_source``).

Each task keeps its parameters in a frozen dataclass with a ``check()`` method
(:class:`wagma.app.sequences.SequenceSpec`, :class:`wagma.app.source_text.SourceSpec`); :func:`spec_from_options`
reads one from a data config's options the same way for both, and :func:`check_lengths` checks the length bounds
both have. This module imports nothing from the tasks, so both can import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from wagma.checks import check_int, check_number, fail, is_number

__all__ = ["LOADER_KEYS", "check_lengths", "spec_from_options"]

LOADER_KEYS = frozenset({"name", "test_fraction", "batching", "tokens"})
"""A data config's keys that are the loader's (:func:`wagma.app.data.load_dataset`), not a task's parameters."""


class _Spec(Protocol):
    def check(self) -> None: ...


S = TypeVar("S", bound=_Spec)


def spec_from_options(cls: type[S], options: Mapping[str, Any], task: str) -> S:
    """The spec ``cls`` (a dataclass whose field defaults give each parameter's type, ``int`` or ``float``) of
    ``data={task}`` from a data config's options, checked (``cls.check``); the loader's keys are passed over.

    An integer parameter takes an integral float (``1024.0``) as that integer.

    Raises:
        ValueError: naming an unknown key, or a value that is not a number of its parameter's type or out of range.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(fields) - LOADER_KEYS)
    if unknown:
        raise ValueError(f"data={task} has no option(s) {unknown}; known: {sorted(fields)}")
    values: dict[str, Any] = {}
    for name, field in fields.items():
        if name not in options:
            continue
        raw = options[name]
        if type(field.default) is int:
            integral = is_number(raw) and float(raw).is_integer()
            values[name] = check_int(f"data.{name}", int(raw) if integral else raw)
        else:
            values[name] = check_number(f"data.{name}", raw)
    spec = cls(**values)
    spec.check()
    return spec


def check_lengths(min_len: int, max_len: int, shortest: int) -> None:
    """``shortest <= data.min_len <= data.max_len``; raise ``ValueError`` naming the one out of range otherwise."""
    check_int("data.min_len", min_len, shortest)
    if max_len < min_len:
        raise fail("data.max_len", f"an integer >= data.min_len = {min_len}", max_len)
