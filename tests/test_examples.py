"""The library's public API and the recipes in examples/ (docs/library.md), run as a user runs them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import wagma
from wagma.testing import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
APPLICATION = ("wagma.app", "hydra", "omegaconf")  # wagma.app and what only it may import


def _library_files() -> list[Path]:
    """Every module of the package outside wagma/app: the library."""
    return sorted(p for p in (ROOT / "wagma").rglob("*.py") if "app" not in p.relative_to(ROOT / "wagma").parts[:1])


def test_the_public_api_is_importable_from_the_top_level_package():
    for name in (
        "WagmaAverager",
        "PeriodicAverager",
        "HierarchicalAverager",
        "ReductionMomentum",
        "AveragingOptimizer",
        "PartialAllreduceState",
        "partial_allreduce_hook",
        "post_local_hook",
        "PostLocalState",
        "GroupSchedule",
        "WaitAvoidingGroupAllreduce",
        "AccumulatingGroupAllreduce",
        "RoundOptions",
        "DPSGDAverager",
        "SGPAverager",
        "ADPSGDAverager",
    ):
        assert name in wagma.__all__ and getattr(wagma, name) is not None, name
    assert all(hasattr(wagma, name) for name in wagma.__all__)


def test_importing_the_library_loads_no_part_of_the_application():
    code = "import sys, wagma; print('\\n'.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout.split()
    )
    assert not {m for m in loaded if m.split(".")[0] in ("hydra", "omegaconf")}
    assert not [m for m in loaded if m.startswith(APPLICATION)], sorted(m for m in loaded if m.startswith(APPLICATION))


def test_no_library_module_imports_the_application():
    offenders = []
    assert len(_library_files()) > 10
    for file in _library_files():
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            offenders += [
                f"{file.relative_to(ROOT)} imports {n}"
                for n in names
                if n.startswith(APPLICATION)
                or (n == "wagma" and any(a.name == "app" for a in getattr(node, "names", [])))
            ]
    assert not offenders, offenders


# The library's layers, bottom up: a module may import only from its own layer or the ones below.
LAYERS = [
    {"wagma.schedule", "wagma.shm", "wagma.kernels", "wagma.telemetry", "wagma.wire"},
    {"wagma.groups", "wagma.engine_store", "wagma.world"},
    {"wagma.engine_options", "wagma.engine_comms"},
    {"wagma.engine_core"},
    {"wagma.engine_modes", "wagma.engine_base"},
    {"wagma.engine"},
    {"wagma.averaging", "wagma.hooks"},
    {"wagma.integrations"},
]


def test_library_imports_go_one_way_down_the_layers():
    def layer(module: str) -> int | None:
        return next(
            (i for i, names in enumerate(LAYERS) if any(module == n or module.startswith(n + ".") for n in names)), None
        )

    offenders = []
    for file in _library_files():
        module = ".".join(file.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mine = layer(module)
        if mine is None:
            continue
        for node in ast.walk(ast.parse(file.read_text(), str(file))):  # every import, also inside functions
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("wagma."):
                theirs = layer(node.module)
                if theirs is not None and theirs > mine:
                    offenders.append(f"{module} imports {node.module}")
    assert not offenders, offenders


def _torchrun(script: str, nproc: int, *args: str) -> str:
    proc = run_torchrun(ROOT / "examples" / script, nproc, *args, cwd=ROOT)
    assert "UserWarning" not in proc.stderr, proc.stderr[-3000:]  # a recipe trips none of the guard rails
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_recipe_eager_sgd_as_a_ddp_comm_hook_keeps_replicas_identical():
    assert "replicas identical" in _torchrun("eager_sgd_hook.py", 3)


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("args", [(), ("--no-ddp",)], ids=["ddp", "no-ddp"])
def test_recipe_wagma_averaging_ends_with_identical_replicas(args):
    out = _torchrun("wagma_averaging.py", 4, *args)
    assert "replicas identical" in out and ("no DDP" in out) == bool(args)


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_recipe_periodic_averaging_agrees_with_torchs_post_local_sgd_optimizer():
    assert "agree after 24 steps on 2 ranks" in _torchrun("post_local_sgd.py", 2)


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("method", ["dpsgd", "sgp", "osgp", "adpsgd"])
def test_recipe_gossip_baselines_end_with_identical_replicas(method):
    out = _torchrun("gossip_baselines.py", 4, "--method", method)
    assert f"{method}: 30 steps on 4 ranks" in out and "replicas identical after synchronize" in out


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_recipe_fsdp2_wagma_shards_inside_replicas_and_ends_with_identical_replicas():
    out = _torchrun("fsdp2_wagma.py", 4)
    assert "40 steps on 2 replicas x 2 shards" in out and "replicas identical after the final average" in out
    held, total = (int(v) for v in out.split("each rank holds ")[1].split(" parameters")[0].split(" of "))
    assert held < 0.6 * total  # rank 0 holds its shards, about half the model, not all of it
