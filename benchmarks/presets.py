"""Where a benchmark's policy name finds its ``averaging=`` config, without Hydra.

A policy is named by its file in ``configs/averaging/`` (a shipped preset), in ``configs/averaging/reference/``
(a published algorithm that is not a shipped preset, e.g. ``eager_solo``) or in ``configs/averaging/candidate/``
(a variant not yet measured on the accuracy grid a preset needs). :mod:`benchmarks.scenarios` (which composes
configs) and :mod:`benchmarks.chaos` (which only launches ``train.py`` and so keeps Hydra out) both ask here;
chaos also lists the names (:func:`shipped_policies`, :func:`known_policies`) and reads a config's keys without
Hydra (:func:`averaging_config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# One copy of each: train.py names these folders when an option moved there, and lists the shipped ones.
from wagma.app.presets import UNSHIPPED, shipped_options

__all__ = ["UNSHIPPED", "averaging_config", "averaging_option", "config_path", "known_policies", "shipped_policies"]


def averaging_option(policy: str, configs_dir: Path) -> str:
    """The ``averaging=`` option of the benchmark name ``policy``: ``policy`` itself, or ``<folder>/<policy>`` when
    only one of the :data:`UNSHIPPED` folders of ``configs/averaging/`` has it.

    Args:
        policy: a file stem, e.g. ``wagma`` or ``eager_solo``.
        configs_dir: the repository's ``configs/``.

    Raises:
        ValueError: two unshipped folders both hold ``policy`` (the name would be ambiguous).
    """
    averaging = configs_dir / "averaging"
    if (averaging / f"{policy}.yaml").exists():
        return policy
    found = [folder for folder in UNSHIPPED if (averaging / folder / f"{policy}.yaml").exists()]
    if len(found) > 1:
        raise ValueError(
            f"policy {policy!r} is ambiguous: expected it in one of configs/averaging/{{{','.join(UNSHIPPED)}}}/, "
            f"found it in {', '.join(found)}"
        )
    return f"{found[0]}/{policy}" if found else policy


def shipped_policies(configs_dir: Path) -> tuple[str, ...]:
    """Every shipped preset and baseline: the stems of ``configs/averaging/*.yaml``, sorted."""
    return tuple(shipped_options("averaging", configs_dir))


def known_policies(configs_dir: Path) -> tuple[str, ...]:
    """Every name :func:`averaging_option` resolves to a config: the shipped ones, then each :data:`UNSHIPPED`
    folder's (sorted; a name two of them hold is ambiguous and left out)."""
    names = list(shipped_policies(configs_dir))
    for folder in UNSHIPPED:
        names += sorted(path.stem for path in (configs_dir / "averaging" / folder).glob("*.yaml"))
    return tuple(name for name in dict.fromkeys(names) if _resolves(name, configs_dir))


def _resolves(policy: str, configs_dir: Path) -> bool:
    try:
        return config_path(policy, configs_dir) is not None
    except ValueError:
        return False


def config_path(policy: str, configs_dir: Path) -> Path | None:
    """The file of the benchmark name ``policy`` (:func:`averaging_option`), or None when there is none.

    Raises:
        ValueError: the name is ambiguous (see :func:`averaging_option`).
    """
    path = configs_dir / "averaging" / f"{averaging_option(policy, configs_dir)}.yaml"
    return path if path.is_file() else None


def averaging_config(policy: str, configs_dir: Path) -> dict[str, Any]:
    """The keys of ``policy``'s config with its ``defaults`` merged in, as Hydra composes the ``averaging`` group
    (flat keys; interpolations such as ``${seed}`` stay strings): what a harness that keeps Hydra out needs to
    know about a policy, e.g. which averager its ``name`` builds.

    A defaults entry is a config of the ``averaging`` group (``wagma``, ``reference/eager_solo@_here_``) or an
    absolute one (``/averaging/wagma@_here_``); entries before ``_self_`` are overridden by the file's own keys,
    entries after it override them (no ``_self_``: the file's keys come last, as in Hydra).

    Raises:
        FileNotFoundError: ``policy`` (or a config it names in its defaults) has no file.
        ValueError: the name is ambiguous (see :func:`averaging_option`).
    """
    path = config_path(policy, configs_dir)
    if path is None:
        raise FileNotFoundError(
            f"no config for policy {policy!r} in {configs_dir / 'averaging'} or its {', '.join(UNSHIPPED)} folders"
        )
    return _load(path, configs_dir, ())


def _load(path: Path, configs_dir: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if path in seen:
        raise ValueError(f"the defaults of {seen[0]} include themselves: {' -> '.join(map(str, (*seen, path)))}")
    own = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    defaults = own.pop("defaults", None) or []
    if "_self_" not in defaults:
        defaults = [*defaults, "_self_"]
    merged: dict[str, Any] = {}
    for entry in defaults:
        if entry == "_self_":
            merged.update(own)
            continue
        if not isinstance(entry, str):
            raise ValueError(f"{path}: cannot read the defaults entry {entry!r} without Hydra")
        name = entry.split("@", 1)[0]
        base = configs_dir / f"{name[1:]}.yaml" if name.startswith("/") else configs_dir / "averaging" / f"{name}.yaml"
        if not base.is_file():
            raise FileNotFoundError(f"{path}: its defaults entry {entry!r} has no file ({base})")
        merged.update(_load(base, configs_dir, (*seen, path)))
    return merged
