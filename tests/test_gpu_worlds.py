"""Runs tests/gpu_worlds.py in a fresh interpreter: multi-rank checks on CUDA tensors (see its docstring)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent / "gpu_worlds.py"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # 8 s: three fresh interpreters
def test_the_script_runs_a_check_on_the_cpu_and_rejects_bad_input():
    proc = _run("--device", "cpu", "engine_exact", timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok   engine_exact on cpu" in proc.stdout
    proc = _run("--device", "cpu", "no_such_check", timeout=60)
    assert proc.returncode == 2 and "unknown check(s) ['no_such_check']" in proc.stderr
    if not torch.cuda.is_available():
        proc = _run("--device", "cuda", timeout=60)
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_averager_and_partial_hook_on_cuda_tensors():
    proc = _run("--device", "cuda", timeout=570)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout and " checks passed on cuda" in proc.stdout, proc.stdout
