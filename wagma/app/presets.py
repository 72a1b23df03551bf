"""Where the options of ``configs/`` live, and what ``python train.py GROUP=NAME`` says when NAME is not one.

A config group's shipped presets are the files ``configs/<group>/<name>.yaml``. The files in its
:data:`UNSHIPPED` folders are options too (``averaging=reference/eager_solo``), but not presets: the
published algorithms kept for comparison (``reference/``) and variants not yet through the accuracy grid
(``candidate/``). :func:`override_problems` checks the ``GROUP=NAME`` overrides of a command line before Hydra
composes anything, so a preset that moved to one of those folders, or a typo, is one line naming the option
to use instead of Hydra's list of options.

This module imports nothing heavy (no torch, Hydra only inside :func:`override_problems`):
``benchmarks/presets.py`` takes :data:`UNSHIPPED` from here.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CONFIGS_DIR", "UNSHIPPED", "UNSHIPPED_MEANING", "option_problem", "override_problems", "shipped_options"]

#: The repository's ``configs/`` (``train.py``'s Hydra config directory).
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"

#: Folders of a config group (``configs/averaging/``, ``configs/experiment/``) whose configs are options but not
#: shipped presets: the published algorithms that lost accuracy (``reference``) and variants not yet through the
#: accuracy grid (``candidate``).
UNSHIPPED: tuple[str, ...] = ("reference", "candidate")

#: What each :data:`UNSHIPPED` folder holds, for the message that sends a user there.
UNSHIPPED_MEANING: dict[str, str] = {
    "reference": "a published algorithm kept for comparison; see docs/staleness.md",
    "candidate": "a variant not yet through the accuracy grid a preset needs; see docs/application.md",
}


_SEARCH_PATH_ARGS = ("--config-dir", "-cd", "--config-path", "-cp", "hydra.searchpath")


def shipped_options(group: str, configs_dir: Path = CONFIGS_DIR) -> list[str]:
    """The shipped presets of ``group``: the stems of ``configs/<group>/*.yaml``, sorted."""
    return sorted(path.stem for path in (configs_dir / group).glob("*.yaml"))


def _unshipped_options(group: str, configs_dir: Path) -> list[str]:
    return [
        f"{folder}/{path.stem}"
        for folder in UNSHIPPED
        for path in sorted((configs_dir / group / folder).glob("*.yaml"))
    ]


def option_problem(group: str, name: str, configs_dir: Path = CONFIGS_DIR) -> str | None:
    """Why ``group=name`` names no config of ``configs/<group>/``, in one line; None when it names one.

    A name that is the stem of a config in an :data:`UNSHIPPED` folder is sent there
    (``averaging=eager_solo is not a shipped preset: it is averaging=reference/eager_solo (...)``); any other
    unknown name gets the closest options and the shipped presets.
    """
    if (configs_dir / group / f"{name}.yaml").is_file():
        return None
    moved = [folder for folder in UNSHIPPED if (configs_dir / group / folder / f"{name}.yaml").is_file()]
    if moved:
        where = " or ".join(f"{group}={folder}/{name} ({UNSHIPPED_MEANING[folder]})" for folder in moved)
        return f"{group}={name} is not a shipped preset: it is {where}"
    shipped, unshipped = shipped_options(group, configs_dir), _unshipped_options(group, configs_dir)
    close = difflib.get_close_matches(name, shipped + unshipped, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(f'{group}={c}' for c in close)}? " if close else ""
    line = f"{group}={name}: no such option in configs/{group}/; {hint}shipped presets: {', '.join(shipped)}"
    if unshipped:
        line += f"; not shipped: {', '.join(unshipped)}"
    return line


def override_problems(overrides: Sequence[str], configs_dir: Path = CONFIGS_DIR) -> list[str]:
    """One line (:func:`option_problem`) for every ``GROUP=NAME`` of ``overrides`` that names no config.

    ``overrides`` is a command line (flags and their values are skipped); every value of a sweep
    (``averaging=wagma,eager_solo``) is checked. An override Hydra's grammar rejects, a group that is not a
    folder of ``configs_dir`` (``hydra/...``), a deletion or a ``null`` is left to Hydra, and so is the whole
    command line when it adds config directories (``--config-dir``, ``hydra.searchpath``), which may hold
    the option.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    if any(arg.split("=", 1)[0].lstrip("+~") in _SEARCH_PATH_ARGS for arg in overrides):
        return []
    if not configs_dir.is_dir():
        return []
    groups = {p.name for p in configs_dir.iterdir() if p.is_dir() and p.name != "hydra"}
    parser = OverridesParser.create()
    problems: list[str] = []
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:  # noqa: BLE001 - a bad override: Hydra reports it
            continue
        group = override.key_or_group
        if group not in groups or override.type == OverrideType.DEL or override.package is not None:
            continue
        try:
            names = (
                list(override.sweep_string_iterator())
                if override.is_sweep_override()
                else [override.get_value_element_as_str()]
            )
        except Exception:  # noqa: BLE001 - a sweep Hydra expands itself (glob, range)
            continue
        for name in names:
            if name and name != "null" and (problem := option_problem(group, name, configs_dir)) is not None:
                problems.append(problem)
    return problems
