"""The parameters of a data task the application makes itself (``data=sequences``, ``data=torch_source``).

Each task keeps its parameters in a frozen dataclass derived from :class:`TaskSpec`, with a ``check()`` method
(:class:`wagma.app.sequences.SequenceSpec`, :class:`wagma.app.source_text.SourceSpec`); :meth:`TaskSpec.from_options`
(:func:`spec_from_options`) reads one from a data config's options the same way for both, and :func:`check_lengths`
checks the length bounds both have. This module imports nothing from the tasks, so both can import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from wagma.checks import check_int, check_number, fail, is_number

__all__ = ["LOADER_KEYS", "TaskSpec", "check_lengths", "spec_from_options"]

LOADER_KEYS = frozenset({"name", "test_fraction", "batching", "tokens"})
"""A data config's keys that are the loader's (:func:`wagma.app.data.load_dataset`), not a task's parameters."""


class TaskSpec:
    """Base of a task's parameters: a frozen dataclass whose field defaults give each parameter's type (``int`` or
    ``float``), its ``data=`` name in :attr:`task`, and a :meth:`check` of the ranges."""

    task: ClassVar[str]

    def check(self) -> None:
        """Raise ``ValueError`` naming the first parameter out of range."""
        raise NotImplementedError

    @classmethod
    def from_options(cls: type[S], options: Mapping[str, Any]) -> S:
        """The spec from a data config's options (``name``, ``test_fraction``, ``batching`` and ``tokens`` are the
        loader's, not the task's), checked (:func:`spec_from_options`).

        Raises:
            ValueError: naming an unknown key, or a value of another type or out of range.
        """
        return spec_from_options(cls, options, cls.task)


S = TypeVar("S", bound=TaskSpec)


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
