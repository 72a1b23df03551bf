"""The front door: README, the documentation site's sources, the curated results, the version and the wheel's
metadata. (CI also runs `mkdocs build --strict` and installs the wheel into a fresh venv: .ci/run.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import wagma

ROOT = Path(__file__).resolve().parents[1]


def test_the_api_reference_documents_every_public_name():
    page = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: wagma\.(\w+)$", page, flags=re.M))
    public = set(wagma.__all__) - {"__version__"}
    assert public - documented == set(), f"public names without an API entry: {sorted(public - documented)}"
    assert documented - public == set(), f"API entries that are not public: {sorted(documented - public)}"


def test_every_page_in_docs_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    missing = {p for p in pages if p not in nav}
    assert not missing, f"pages missing from mkdocs.yml's nav: {sorted(missing)}"


def test_readme_is_a_front_door_of_at_most_200_lines_and_its_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_committed_results_stay_under_5_mb():
    out = subprocess.run(["git", "ls-files", "-z", "benchmarks/results"], cwd=ROOT, capture_output=True, check=True)
    files = [ROOT / f for f in out.stdout.decode().split("\0") if f]
    if not files:
        pytest.skip("not a git checkout")  # e.g. an sdist: the limit is about the repository
    total = sum(f.stat().st_size for f in files if f.exists())
    assert total <= 5 * 2**20, f"benchmarks/results/ holds {total / 2**20:.2f} MiB in git; the limit is 5 MiB"


def test_the_version_has_one_source():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dynamic = ["version"]' in pyproject and 'version = { attr = "wagma.__version__" }' in pyproject
    assert not re.search(r"^version\s*=\s*\"", pyproject, flags=re.M), "a literal version in pyproject.toml"
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", wagma.__version__)
    assert f"## [{wagma.__version__}]" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def test_the_wheel_metadata_is_complete(tmp_path):
    """Build the metadata the wheel would carry (no compilation) and check what a package index shows."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import setuptools.build_meta as b, sys; print(b.prepare_metadata_for_build_wheel(sys.argv[1]))",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = (tmp_path / proc.stdout.strip().splitlines()[-1] / "METADATA").read_text(encoding="utf-8")
    assert f"Version: {wagma.__version__}" in meta
    assert "License-Expression: BSD-3-Clause" in meta and "License-File: LICENSE" in meta
    assert "Description-Content-Type: text/markdown" in meta and "# wagma" in meta
    for extra in ("app", "gpu", "docs", "dev"):
        assert f"Provides-Extra: {extra}" in meta
    assert "Classifier: Typing :: Typed" in meta and "Requires-Python: >=3.10" in meta
    assert (ROOT / "wagma" / "py.typed").exists()


def test_nothing_in_the_repository_points_outside_it():
    # The design is docs/design.md; a clone from anywhere must be complete. No file refers to a folder beside the
    # clone (its shared folder) or to the design notes the project started from by their old name.
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    files = [
        f
        for f in out.stdout.decode().split("\0")
        if f and Path(f).suffix in {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cu", ".txt"}
    ]
    if not files:
        pytest.skip("not a git checkout")
    outside = re.compile("\\.\\./" + "shared/|DESIGN" + "\\.md|DESIGN" + " §")
    found = [
        f"{f}:{n}"
        for f in files
        if (ROOT / f).is_file()
        for n, line in enumerate((ROOT / f).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if outside.search(line)
    ]
    assert not found, f"references outside the repository (use docs/design.md): {found}"
