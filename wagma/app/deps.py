"""Optional dependencies: a missing one is one line naming the extra that installs it, not a traceback.

The library needs torch alone; the application (``train.py``, :mod:`wagma.app`) needs the ``app`` extra,
the GPU telemetry and kernels the ``gpu`` extra, the SLURM launcher the ``slurm`` extra.
:func:`missing_dependency` turns a ``ModuleNotFoundError`` for one of them (anywhere in an exception's
chain) into that line; :func:`reported_missing_dependencies` prints it and exits.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator

__all__ = [
    "MISSING_DEPENDENCY_EXIT_CODE",
    "OPTIONAL",
    "missing_dependency",
    "reported_missing_dependencies",
    "require",
]

#: Exit status of a run stopped by a missing optional dependency.
MISSING_DEPENDENCY_EXIT_CODE = 1

#: Top-level module -> (the PyPI package that provides it, the wagma extra that installs it).
OPTIONAL: dict[str, tuple[str, str]] = {
    "hydra": ("hydra-core", "app"),
    "omegaconf": ("omegaconf", "app"),
    "tqdm": ("tqdm", "app"),
    "sklearn": ("scikit-learn", "app"),
    "mlxtend": ("mlxtend", "app"),
    "tensorboard": ("tensorboard", "app"),
    "matplotlib": ("matplotlib", "app"),
    "submitit": ("submitit", "slurm"),
    "hydra_plugins.hydra_submitit_launcher": ("hydra-submitit-launcher", "slurm"),
    "cupy": ("cupy-cuda12x", "gpu"),
    "pynvml": ("nvidia-ml-py", "gpu"),
    "torchft": ("torchft", "torchft"),
}


def _known(name: str) -> tuple[str, str] | None:
    """The ``OPTIONAL`` entry for module ``name`` (its longest dotted prefix that has one)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        entry = OPTIONAL.get(".".join(parts[:end]))
        if entry is not None:
            return entry
    return None


def missing_dependency(exc: BaseException, what: str = "wagma's training application") -> str | None:
    """``"<what> needs <package>: pip install 'wagma[<extra>]'"`` if ``exc`` (or its cause) is a missing optional
    module.

    Returns None for any other exception, including a missing module that no extra provides (a bug).
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ModuleNotFoundError) and current.name:
            entry = _known(current.name)
            if entry is not None:
                package, extra = entry
                return f"{what} needs {package} (module {current.name!r} is missing): pip install 'wagma[{extra}]'"
        current = current.__cause__ or current.__context__
    return None


def require(*modules: str) -> None:
    """Check that ``modules`` can be imported, without importing them (cheap: done before starting ranks).

    Raises:
        ModuleNotFoundError: naming the first missing one (turn it into a line with :func:`missing_dependency`).
    """
    for name in modules:
        if name in sys.modules:
            found = sys.modules[name] is not None  # None: import blocked, as Python's docs say to simulate absence
        else:
            try:
                found = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):
                found = False
        if not found:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


@contextlib.contextmanager
def reported_missing_dependencies(what: str = "wagma's training application") -> Iterator[None]:
    """Around an entry point: a missing optional module ends the process with one line on stderr.

    Exits with :data:`MISSING_DEPENDENCY_EXIT_CODE`; any other exception passes through unchanged.
    """
    try:
        yield
    except ImportError as exc:
        message = missing_dependency(exc, what)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(MISSING_DEPENDENCY_EXIT_CODE) from None
