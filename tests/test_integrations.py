"""wagma.integrations as a whole: never imported by the library; a missing framework is one line naming the extra."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers", "torchtitan")


def _python(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, timeout=120
    ).stdout


def test_importing_wagma_imports_neither_the_integrations_nor_any_framework_and_the_package_no_framework():
    code = """
import json, sys
import wagma
after_wagma = sorted(sys.modules)
import wagma.integrations
print(json.dumps([after_wagma, sorted(sys.modules)]))
"""
    after_wagma, after_package = (set(m) for m in json.loads(_python(code)))
    assert not [m for m in after_wagma if m.startswith("wagma.integrations")]
    assert not [m for m in after_wagma if m.split(".")[0] in FRAMEWORKS], sorted(
        m for m in after_wagma if m in FRAMEWORKS
    )
    assert "wagma.integrations" not in (ROOT / "wagma" / "__init__.py").read_text()
    assert not [m for m in after_package if m.split(".")[0] in FRAMEWORKS]  # the package imports none either


def test_a_missing_framework_is_one_line_naming_the_extra_to_install():
    # A framework is missing when importing it fails: sys.modules[name] = None makes it fail even where it is installed.
    code = """
import importlib, json, sys
out = {}
for module, missing in [("lightning", "lightning"), ("accelerate", "accelerate"), ("transformers", "transformers")]:
    sys.modules[missing] = None
    try:
        importlib.import_module(f"wagma.integrations.{module}")
        out[module] = None
    except ImportError as exc:
        out[module] = str(exc)
    del sys.modules[missing]
print(json.dumps(out))
"""
    messages = json.loads(_python(code))
    assert messages == {
        "lightning": "wagma.integrations.lightning needs Lightning (lightning is not installed): "
        'pip install "wagma[lightning]"',
        "accelerate": "wagma.integrations.accelerate needs Accelerate (accelerate is not installed): "
        'pip install "wagma[accelerate]"',
        "transformers": "wagma.integrations.transformers needs transformers (transformers is not installed): "
        'pip install "wagma[transformers]"',
    }


def test_an_installed_framework_whose_import_fails_is_named_with_the_cause_not_called_missing(tmp_path, monkeypatch):
    from wagma.integrations._common import require

    (tmp_path / "wagma_fake_framework").mkdir()
    (tmp_path / "wagma_fake_framework" / "__init__.py").write_text("import wagma_fake_dependency_of_it\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        require("wagma_fake_framework", "torchft", "torchft")
    except ModuleNotFoundError as exc:
        raise AssertionError(f"a broken install was reported as missing: {exc}") from exc
    except ImportError as exc:
        message = str(exc)
    else:
        raise AssertionError("require() imported a package whose dependency is missing")
    assert "wagma_fake_framework is installed but importing it failed" in message, message
    assert "wagma_fake_dependency_of_it" in message and 'pip install "wagma[torchft]"' in message, message
    # A package that is not there at all is a ModuleNotFoundError, which pytest.importorskip skips on.
    try:
        require("wagma_no_such_framework", "torchft", "torchft")
    except ModuleNotFoundError as exc:
        assert str(exc) == (
            "wagma.integrations.torchft needs torchft (wagma_no_such_framework is not installed): "
            'pip install "wagma[torchft]"'
        )
    else:
        raise AssertionError("require() imported a package that does not exist")
