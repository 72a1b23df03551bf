"""MkDocs hook: publish the committed plots of ``benchmarks/results/`` under ``results/`` in the site.

The plots live once, beside the data and the commands that made them; the pages link them as
``results/<path under benchmarks/results>`` and this hook hands them to MkDocs as files of the site.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def on_files(files: Files, config) -> Files:
    for path in sorted(RESULTS.rglob("*.png")):
        uri = "results/" + path.relative_to(RESULTS).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
