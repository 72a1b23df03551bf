"""Reading and writing the benchmarks' JSON results, plain or xz-compressed.

Results that carry per-step traces (``regime.json.xz``) are stored compressed so that ``benchmarks/results/``
stays small in git; a path ending in ``.xz`` is written and read through :mod:`lzma`, any other as plain text.
:func:`find` returns the compressed file of a result when it exists, else the plain one (older outputs).
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Any

__all__ = ["dump", "find", "load", "save_plot"]


def find(folder: Path, name: str) -> Path:
    """``folder/name.xz`` if it exists, else ``folder/name`` (which may not exist either)."""
    compressed = folder / (name + ".xz")
    return compressed if compressed.exists() else folder / name


def load(path: Path) -> Any:
    """The JSON document at ``path`` (decompressed when the name ends in ``.xz``)."""
    if path.suffix == ".xz":
        with lzma.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text(encoding="utf-8"))


def dump(path: Path, obj: Any, preset: int = 9) -> None:
    """Write ``obj`` as indented JSON to ``path`` (xz-compressed when the name ends in ``.xz``, at ``preset``: 9 is
    the smallest file, 1 several times faster for the saves in between), atomically."""
    text = json.dumps(obj, indent=1) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".xz":
        with lzma.open(tmp, "wt", encoding="utf-8", preset=preset) as f:
            f.write(text)
    else:
        tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def save_plot(fig: Any, path: Path, dpi: int = 110) -> None:
    """Save a matplotlib figure as a PNG of 256 colours: a plot's lines and text lose nothing visible, and the
    file is about half the size of matplotlib's (every committed plot counts against ``benchmarks/results/``'s
    5 MiB in git)."""
    import io

    from PIL import Image  # matplotlib's own dependency

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    image = Image.open(buffer).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, "PNG", optimize=True)
