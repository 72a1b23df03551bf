"""Where a benchmark's policy name finds its ``averaging=`` config, without importing the application.

A policy is named by its file in ``configs/averaging/`` (a shipped preset), in ``configs/averaging/reference/``
(a published algorithm that is not a shipped preset, e.g. ``eager_solo``) or in ``configs/averaging/candidate/``
(a variant not yet measured on the accuracy grid a preset needs). :mod:`benchmarks.scenarios` (which composes
configs) and :mod:`benchmarks.chaos` (which only launches ``train.py`` and so keeps Hydra out) both ask here.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["UNSHIPPED", "averaging_option"]

#: Folders of ``configs/averaging/`` whose configs are not shipped presets: the published algorithms that lost
#: accuracy (``reference``) and variants not yet through the accuracy grid (``candidate``).
UNSHIPPED = ("reference", "candidate")


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
