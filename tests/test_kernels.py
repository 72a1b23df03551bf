"""wagma.kernels: CUDA sources compile, references match closed forms, dispatch and packaging work.

GPU tests (marked ``gpu``) compare the CuPy kernels with the torch references bit for bit; they are
skipped without CUDA (and the kernel comparisons without CuPy).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import wagma
from wagma import kernels as K

REPO = Path(__file__).resolve().parents[1]
CU_FILES = sorted((REPO / "cuda").glob("*.cu"))
LOW = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------
# CUDA sources: they compile, export what kernels.py launches, and ship in the package
# ----------------------------------------------------------------------------------------------
def _expected_kernel_names() -> set[str]:
    ops = ["combine", "momentum", "residual_take", "residual_take_add", "residual_accumulate"]
    names = {f"wagma_{op}_{sfx}" for op in ops for sfx in K.KERNEL_DTYPES.values()}
    return names | {"wagma_pack_bf16", "wagma_unpack_bf16"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_sources_compile_with_nvcc(arch, tmp_path):
    assert CU_FILES, "no cuda/*.cu found"
    for cu in CU_FILES:
        cmd = ["nvcc", f"-arch={arch}", "--cubin", "-Werror", "all-warnings", "-o", str(tmp_path / f"{cu.stem}.cubin")]
        proc = subprocess.run([*cmd, str(cu)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{' '.join(cmd)} {cu} failed:\n{proc.stdout}{proc.stderr}"
        assert (tmp_path / f"{cu.stem}.cubin").stat().st_size > 0


def _check_ptx(text: str) -> None:
    """Every launched kernel is exported; no FMA contraction and no flushed subnormals anywhere."""
    entries = {line.split()[2].rstrip("(") for line in text.splitlines() if line.startswith(".visible .entry")}
    assert _expected_kernel_names() <= entries
    assert "fma." not in text  # no contraction: kernels stay bit-identical to the references
    assert ".ftz" not in text  # subnormals kept, although CuPy compiles with -ftz=true


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_every_launched_kernel_is_exported(tmp_path):
    # The harshest flags: FTZ (which CuPy always passes) and fast math must change nothing.
    ptx = tmp_path / "averaging.ptx"
    cmd = [
        "nvcc",
        "-arch=sm_80",
        "--ptx",
        "-ftz=true",
        "-use_fast_math",
        "-o",
        str(ptx),
        str(REPO / "cuda" / K.SOURCE_FILE),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    _check_ptx(ptx.read_text())


def _cupy_compiler():
    """CuPy's compiler module, when CuPy and an NVRTC library load (no GPU needed); else skip.

    ``.ci/run`` installs both (the ``nvrtc`` extra) and sets ``WAGMA_REQUIRE_NVRTC=1``, which turns
    the skip into a failure, so CI always runs these tests.
    """
    try:
        from cupy.cuda import compiler, nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - ImportError, or no libnvrtc
        if os.environ.get("WAGMA_REQUIRE_NVRTC", "") not in ("", "0"):
            pytest.fail(f"WAGMA_REQUIRE_NVRTC is set but CuPy's NVRTC is unavailable: {exc}")
        pytest.skip(f"CuPy with NVRTC is not installed (pip install -e '.[nvrtc]'): {exc}")
    return compiler


@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("method", ["ptx", "cubin"])
def test_cupy_compiles_the_sources_with_nvrtc(monkeypatch, arch, method):
    # What RawModule(code=source).get_function(...) does on a GPU host, through CuPy's own compile
    # function with its own options (-ftz=true among them), with NVRTC and no GPU: only the device
    # query and the driver's module load are replaced. method "cubin" is what CuPy uses on an A100 or
    # H100 (-arch=sm_XX); "ptx" gives text to inspect.
    compiler = _cupy_compiler()
    loaded = []

    class Module:  # cupy.cuda.function.Module, whose load() needs a driver
        def _set_mapping(self, mapping):
            pass

        def load(self, payload):
            loaded.append(payload)

    flag = f"-arch=compute_{arch}" if method == "ptx" else f"-arch=sm_{arch}"
    monkeypatch.setattr(compiler, "function", types.SimpleNamespace(Module=Module))
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (flag, method))
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")  # nothing written to ~/.cupy
    source = (K.cuda_source_dir() / K.SOURCE_FILE).read_text()
    compiler._compile_module_with_cache(source, (), arch=arch)
    (payload,) = loaded
    if method == "ptx":
        text = payload.decode() if isinstance(payload, bytes) else payload
        assert f".target sm_{arch}" in text
        _check_ptx(text)
    else:
        assert bytes(payload[:4]) == b"\x7fELF"  # a cubin for sm_XX, ready for cuModuleLoadData


def test_cuda_sources_include_no_headers():
    # NVRTC at run time does not reliably find CUDA headers (see the .cu file's comment).
    for cu in CU_FILES:
        assert "#include" not in cu.read_text(), f"{cu.name} includes a header"


def test_the_wheel_ships_every_module_and_the_cuda_sources_from_their_one_place(tmp_path):
    # pyproject.toml lists the packages and maps wagma._cuda onto cuda/: a package left off the list, or
    # sources that no longer reach the wheel, fail here. Built from a copy (setuptools leaves build/ behind,
    # which a later build would reuse) without isolation (setuptools from this venv).
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".*", "__pycache__", "build", "*.egg-info", "outputs", "multirun", "runs", "benchmarks", "tests"
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=150,
    )
    (wheel,) = tmp_path.glob("wagma-*.whl")
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "wagma").rglob("*.py")}
    expected |= {f"wagma/_cuda/{cu.name}" for cu in CU_FILES}
    assert expected - names == set(), f"missing from the wheel: {sorted(expected - names)}"
    assert not (REPO / "wagma" / "_cuda").exists(), "the CUDA sources live once, in cuda/"


def test_installed_layout_finds_the_shipped_sources(tmp_path, monkeypatch):
    # A wheel's layout: wagma/_cuda/ beside the package and no pyproject.toml above it.
    pkg = tmp_path / "site" / "wagma"
    (pkg / "_cuda").mkdir(parents=True)
    shutil.copy(CU_FILES[0], pkg / "_cuda" / CU_FILES[0].name)
    monkeypatch.setattr(K, "__file__", str(pkg / "kernels.py"))
    assert K.cuda_source_dir() == pkg / "_cuda"


def test_source_dir_in_a_checkout_is_the_canonical_one():
    assert K.cuda_source_dir() == REPO / "cuda"
    assert (K.cuda_source_dir() / K.SOURCE_FILE).is_file()


# ----------------------------------------------------------------------------------------------
# References against hand-computed closed forms
# ----------------------------------------------------------------------------------------------
def _t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW])
def test_combine_closed_form(dtype):
    # S = 7 group members plus self: divisor 8 keeps everything exact in every dtype.
    w = _t([1.0, -2.0, 0.5, 0.0], dtype)
    out = K.wagma_combine_ref(w, _t([7.0, 10.0, 3.5, -4.0], dtype), 8)
    assert out is w
    assert torch.equal(w, _t([1.0, 1.0, 0.5, -0.5], dtype))


def test_combine_rounds_once_in_fp32_like_the_kernel():
    import numpy as np

    g = torch.Generator().manual_seed(0)
    w, s = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    expected = (w.numpy() + s.numpy()) * np.float32(1.0 / 3.0)
    K.wagma_combine_ref(w, s, 3.0)
    assert np.array_equal(w.numpy(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW])
@pytest.mark.parametrize(
    "lr, nesterov, anchor, velocity",
    [
        # a=1, v=0.5, x=3, mu=0.5: d=2, v=0.5*0.5+2=2.25
        (1.0, False, 3.25, 2.25),  # a = 1 + 2.25
        (0.5, False, 2.125, 2.25),  # a = 1 + 0.5*2.25
        (1.0, True, 4.125, 2.25),  # a = 1 + (0.5*2.25 + 2)
        (0.5, True, 2.5625, 2.25),  # a = 1 + 0.5*3.125
    ],
)
def test_momentum_closed_form(dtype, lr, nesterov, anchor, velocity):
    a, v, x = _t([1.0], dtype), _t([0.5], dtype), _t([3.0], dtype)
    K.reduction_momentum_ref(a, v, x, momentum=0.5, lr=lr, nesterov=nesterov)
    assert a.item() == anchor and v.item() == velocity and x.item() == 3.0


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_zero_is_plain_averaging(nesterov):
    a, x = torch.randn(50), torch.randn(50)
    a0 = a.clone()
    v = torch.zeros(50)
    K.reduction_momentum_ref(a, v, x, momentum=0.0, lr=1.0, nesterov=nesterov)
    assert torch.equal(a, x) or torch.allclose(a, x, rtol=0, atol=1e-6)
    assert torch.equal(v, x - a0)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_over_rounds_matches_scalar_recurrence(nesterov):
    mu, lr = 0.9, 0.7
    xs = [3.0, -1.0, 2.5, 0.25, 4.0]
    a, v = _t([0.5], torch.float64), _t([0.0], torch.float64)
    ea, ev = 0.5, 0.0
    for x in xs:
        K.reduction_momentum_ref(a, v, _t([x], torch.float64), mu, lr, nesterov)
        d = x - ea
        ev = mu * ev + d
        ea += lr * (mu * ev + d if nesterov else ev)
        assert math.isclose(a.item(), ea, rel_tol=1e-12) and math.isclose(v.item(), ev, rel_tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_residual_take_and_accumulate_closed_form(dtype):
    r = _t([1.0, 2.0, -3.0], dtype)
    K.residual_accumulate_ref(r, _t([0.5, 0.5, 1.0], dtype))
    assert torch.equal(r, _t([1.5, 2.5, -2.0], dtype))
    out = torch.empty(3, dtype=dtype)
    assert K.residual_take_ref(r, out, _t([10.0, 20.0, 30.0], dtype)) is out
    assert torch.equal(out, _t([11.5, 22.5, 28.0], dtype)) and torch.equal(r, torch.zeros(3, dtype=dtype))
    K.residual_accumulate_ref(r, _t([4.0, 5.0, 6.0], dtype))
    K.residual_take_ref(r, out)
    assert torch.equal(out, _t([4.0, 5.0, 6.0], dtype)) and not r.any()


def test_residual_conserves_every_gradient():
    # Integer-valued gradients keep fp32 sums exact: taken + still pending == everything accumulated.
    g = torch.Generator().manual_seed(1)
    r, taken, total = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    out = torch.empty(64)
    for step in range(30):
        grad = torch.randint(-50, 50, (64,), generator=g).float()
        total += grad
        if step % 3 == 0:
            taken += K.residual_take_(r, out, grad)  # a fresh gradient folded into this round
        else:
            K.residual_accumulate_(r, grad)
            if step % 4 == 0:
                taken += K.residual_take_(r, out)
    assert torch.equal(taken + r, total)


def _bf16_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_pack_rounds_to_nearest_even_closed_form():
    # bf16 keeps 7 fraction bits: 1+2^-8 is halfway between 1 and 1+2^-7 (odd) -> 1;
    # 1+3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even) -> 1+2^-6; just above half rounds up.
    # bf16's largest finite value is (2 - 2^-7) * 2^127 ~ 3.3895e38; 3.4e38 lies past the halfway point
    # to 2^128 and rounds to inf, 3.39e38 rounds down to that maximum.
    src = _t([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.4e38, 3.39e38])
    out = K.pack_bf16_ref(src, torch.empty(6, dtype=torch.bfloat16))
    bf16_max = (2 - 2**-7) * 2.0**127
    assert out.float().tolist() == [1.0, 1 + 2**-6, 1 + 2**-7, -1.0, math.inf, bf16_max]


def test_pack_matches_torch_conversion_on_every_kind_of_value():
    g = torch.Generator().manual_seed(2)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    specials = _t([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 3.4028235e38, 1e-45, -1e-45, 1.1754942e-38])
    src = torch.cat([bits.view(torch.float32), specials, torch.randn(10_000, generator=g) * 1e3])
    out = K.pack_bf16_ref(src, torch.empty(src.shape, dtype=torch.bfloat16))
    expected = src.to(torch.bfloat16)
    nan = torch.isnan(src)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(_bf16_bits(out)[~nan], _bf16_bits(expected)[~nan])


def test_unpack_closed_form_and_round_trip():
    src = _t([1.5, -2.0, 0.25, 0.0], torch.bfloat16)
    out = K.unpack_bf16_ref(src, torch.empty(4), scale=0.5)
    assert out.tolist() == [0.75, -1.0, 0.125, 0.0]
    x = torch.randn(1000)
    assert torch.equal(K.unpack_bf16(K.pack_bf16(x)), x.to(torch.bfloat16).float())


# ----------------------------------------------------------------------------------------------
# Public functions on CPU equal the references; argument validation
# ----------------------------------------------------------------------------------------------
def _inputs(n: int, dtype: torch.dtype, k: int, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 3).to(dtype).to(device) for _ in range(k)]


def _run_both(name: str, n: int, dtype: torch.dtype, device: str = "cpu"):
    """Run public ``name`` on ``device`` and its reference on CPU copies; return both results."""
    pub, ref = getattr(K, name), getattr(K, name + "_ref" if not name.endswith("_") else name[:-1] + "_ref")
    if name == "pack_bf16":
        (src,) = _inputs(n, torch.float32, 1, device=device)
        return [pub(src)], [ref(src.cpu(), torch.empty(n, dtype=torch.bfloat16))]
    if name == "unpack_bf16":
        (src,) = _inputs(n, torch.bfloat16, 1, device=device)
        return [pub(src, scale=0.125)], [ref(src.cpu(), torch.empty(n), 0.125)]
    k = {"wagma_combine_": 2, "reduction_momentum_": 3, "residual_take_": 3, "residual_accumulate_": 2}[name]
    a, b = _inputs(n, dtype, k, device=device), [t.cpu().clone() for t in _inputs(n, dtype, k, device=device)]
    args = {"wagma_combine_": (9.0,), "reduction_momentum_": (0.9, 0.7, True)}.get(name, ())
    pub(*a, *args)
    ref(*b, *args)
    return a, b


PUBLIC = ["wagma_combine_", "reduction_momentum_", "residual_take_", "residual_accumulate_", "pack_bf16", "unpack_bf16"]


@pytest.mark.parametrize("name", PUBLIC)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW])
def test_public_functions_on_cpu_equal_references(name, dtype):
    got, want = _run_both(name, 1001, dtype)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_public_functions_work_on_parameters_that_require_grad():
    p = torch.nn.Parameter(torch.ones(4))
    K.wagma_combine_(p, torch.full((4,), 3.0), 2.0)
    assert torch.equal(p.detach(), torch.full((4,), 2.0)) and p.requires_grad


def test_empty_buffers_are_fine():
    e = torch.empty(0)
    assert K.wagma_combine_(e, torch.empty(0), 2.0).numel() == 0
    assert K.pack_bf16(e).dtype == torch.bfloat16


def test_allowed_aliasing():
    w = torch.tensor([2.0, 4.0])
    K.wagma_combine_(w, w, 2.0)  # (w + w) / 2 == w
    assert w.tolist() == [2.0, 4.0]
    r, g = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    K.residual_take_(r, g, grad=g)  # out may be the fresh gradient's buffer
    assert g.tolist() == [11.0, 22.0] and not r.any()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: K.wagma_combine_(torch.zeros(3), torch.zeros(4), 2.0), "shape"),
        (lambda: K.wagma_combine_(torch.zeros(3), torch.zeros(3, dtype=torch.float64), 2.0), "dtype"),
        (lambda: K.wagma_combine_(torch.zeros(4, 2).t(), torch.zeros(2, 4), 2.0), "contiguous"),
        (lambda: K.wagma_combine_(torch.zeros(3), torch.zeros(3, device="meta"), 2.0), "meta"),
        (
            lambda: K.wagma_combine_(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 2),
            "^wagma_combine_: w: expected a floating-point tensor, found torch.int32$",
        ),
        (
            lambda: K.wagma_combine_(torch.zeros(3), [0.0, 0.0, 0.0], 2.0),
            "^wagma_combine_: group_sum: expected a torch.Tensor, found <class 'list'>$",
        ),
        (
            lambda: K.wagma_combine_(torch.zeros(3), torch.zeros(3), 0.0),
            "^wagma_combine_: divisor: expected a finite number > 0, found 0.0$",
        ),
        (lambda: K.wagma_combine_(torch.zeros(3), torch.zeros(3), math.nan), "divisor"),
        (lambda: K.reduction_momentum_(*torch.zeros(3, 2).unbind(1), torch.zeros(3), 0.9), "contiguous"),
        (lambda: K.reduction_momentum_(torch.zeros(3), torch.zeros(3), torch.zeros(3), -0.1), "momentum"),
        (lambda: K.reduction_momentum_(torch.zeros(3), torch.zeros(3), torch.zeros(3), 0.9, lr=0.0), "lr"),
        (lambda: K.pack_bf16(torch.zeros(3, dtype=torch.float64)), "src has dtype"),
        (lambda: K.pack_bf16(torch.zeros(3), torch.zeros(3)), "out has dtype"),
        (lambda: K.unpack_bf16(torch.zeros(3), torch.zeros(3)), "src has dtype"),
        (lambda: K.unpack_bf16(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4)), "shape"),
        (lambda: K.unpack_bf16(torch.zeros(3, dtype=torch.bfloat16), scale=math.inf), "scale"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_overlapping_buffers_are_rejected():
    buf = torch.zeros(10)
    r = torch.zeros(4)
    with pytest.raises(ValueError, match="residual and out share memory"):
        K.residual_take_(r, r)
    with pytest.raises(ValueError, match="anchor and velocity share memory"):
        K.reduction_momentum_(buf[:5], buf[:5], torch.zeros(5), 0.9)
    with pytest.raises(ValueError, match="share memory"):  # partial overlap is never allowed
        K.wagma_combine_(buf[0:5], buf[2:7], 2.0)
    src = torch.zeros(4)
    with pytest.raises(ValueError, match="src and out share memory"):
        K.pack_bf16(src, src.view(torch.bfloat16)[:4])


def _kernel_params() -> dict[str, list[str]]:
    """Parameter names of every extern "C" kernel in averaging.cu, macro-instantiated names expanded."""
    text = (REPO / "cuda" / K.SOURCE_FILE).read_text().replace("\\\n", " ")
    params = {}
    for name, plist in re.findall(r'extern "C" __global__ void ([\w#]+)\(([^)]*)\)', text):
        names = [re.findall(r"\w+", p)[-1] for p in plist.split(",")]
        for sfx in K.KERNEL_DTYPES.values() if "##SUFFIX" in name else [""]:
            params[name.replace("##SUFFIX", sfx)] = names
    return params


def test_launch_arguments_match_kernel_signatures(monkeypatch):
    # No GPU here: intercept the launch and check that every public function passes its tensors and
    # scalars in the order, and with the types, that the kernel's signature in averaging.cu declares.
    params = _kernel_params()
    assert set(params) == _expected_kernel_names()
    calls = []
    monkeypatch.setattr(K, "_use_kernel", lambda t: True)
    monkeypatch.setattr(K, "_launch", lambda name, args, n: calls.append((name, args, n)) or True)
    scalar_types = {
        "inv_divisor": np.float32,
        "mu": np.float32,
        "lr": np.float32,
        "scale": np.float32,
        "nesterov": np.int32,
    }
    for dtype, sfx in K.KERNEL_DTYPES.items():
        t = {
            k: torch.zeros(5, dtype=dtype)
            for k in ["w", "sum", "anchor", "velocity", "average", "residual", "grad", "out"]
        }
        cases = [
            (f"wagma_combine_{sfx}", lambda t=t: K.wagma_combine_(t["w"], t["sum"], 3.0)),
            (f"wagma_momentum_{sfx}", lambda t=t: K.reduction_momentum_(t["anchor"], t["velocity"], t["average"], 0.5)),
            (f"wagma_residual_take_{sfx}", lambda t=t: K.residual_take_(t["residual"], t["out"])),
            (f"wagma_residual_take_add_{sfx}", lambda t=t: K.residual_take_(t["residual"], t["out"], t["grad"])),
            (f"wagma_residual_accumulate_{sfx}", lambda t=t: K.residual_accumulate_(t["residual"], t["grad"])),
        ]
        if dtype == torch.float32:
            t["src"], t["dst"] = torch.zeros(5), torch.zeros(5, dtype=torch.bfloat16)
            cases.append(("wagma_pack_bf16", lambda t=t: K.pack_bf16(t["src"], t["dst"])))
            cases.append(("wagma_unpack_bf16", lambda t=t: K.unpack_bf16(t["dst"], t["src"], 0.5)))
        for expected_name, call in cases:
            calls.clear()
            call()
            ((name, args, n),) = calls
            assert name == expected_name and n == 5
            *arg_names, last = params[name]
            assert last == "n" and len(args) == len(arg_names), name
            for pname, arg in zip(arg_names, args):
                if isinstance(arg, torch.Tensor):
                    want = t["dst"] if name == "wagma_unpack_bf16" and pname == "src" else t[pname]
                    want = t["src"] if name == "wagma_unpack_bf16" and pname == "dst" else want
                    assert arg is want, f"{name}: parameter {pname} got the wrong tensor"
                else:
                    assert type(arg) is scalar_types[pname], f"{name}: {pname} must be {scalar_types[pname]}"


# ----------------------------------------------------------------------------------------------
# Backend selection: CuPy probed lazily, never required
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_kernels(monkeypatch):
    """Import a fresh ``wagma.kernels`` (fresh probe state); the original is restored afterwards."""
    monkeypatch.setattr(wagma, "kernels", K)

    def load():
        monkeypatch.delitem(sys.modules, "wagma.kernels", raising=False)
        return importlib.import_module("wagma.kernels")

    return load


def _fake_cupy(available: bool = True) -> types.ModuleType:
    fake = types.ModuleType("cupy")
    fake.probes = 0

    def is_available() -> bool:
        fake.probes += 1
        return available

    fake.cuda = types.SimpleNamespace(is_available=is_available)  # anything else would raise
    return fake


def test_without_cupy_import_works_and_backend_is_torch(monkeypatch, fresh_kernels):
    monkeypatch.setitem(sys.modules, "cupy", None)  # ``import cupy`` raises ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU host without CuPy
    mod = fresh_kernels()
    assert mod.backend() == "torch"
    assert mod._cupy_reason.startswith("cupy unavailable")
    x = torch.randn(8)
    assert torch.equal(mod.pack_bf16(x), x.to(torch.bfloat16))


def test_cupy_is_probed_lazily_once_and_cpu_tensors_never_use_it(monkeypatch, fresh_kernels):
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    mod = fresh_kernels()
    assert fake.probes == 0  # importing wagma.kernels does not touch CuPy
    w = torch.ones(4)
    mod.wagma_combine_(w, torch.ones(4), 2.0)  # CPU tensors: torch path, the fake is never used
    assert w.tolist() == [1.0] * 4 and fake.probes == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert mod.backend() == "cupy" and mod.backend() == "cupy"
    assert fake.probes == 1
    monkeypatch.setenv("WAGMA_DISABLE_CUPY", "1")
    assert mod.backend() == "torch"


def test_backend_is_torch_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert K.backend() == "torch"


# ----------------------------------------------------------------------------------------------
# The benchmark script at least parses its arguments and refuses to run without a GPU
# ----------------------------------------------------------------------------------------------
def _load_benchmark():
    spec = importlib.util.spec_from_file_location("wagma_bench_gpu", REPO / "benchmarks" / "gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_help_and_no_gpu_exit(capsys, tmp_path):
    bench = _load_benchmark()
    with pytest.raises(SystemExit) as info:
        bench.main(["--help"])
    assert info.value.code == 0 and "--out" in capsys.readouterr().out
    args = bench.parse_args(["--out", str(tmp_path / "r.json"), "--sizes", "1e6,2.5e7", "--reps", "20"])
    assert args.size_list == [1_000_000, 25_000_000]
    assert (args.engine_world, args.engine_group, args.engine_numel, args.no_engine) == (4, 2, 1_000_000, False)
    with pytest.raises(SystemExit):
        bench.parse_args(["--reps", "5"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--engine-world", "3", "--engine-group", "2"])  # S must divide P
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main(["--out", str(tmp_path / "r.json")])
        assert not (tmp_path / "r.json").exists()


# ----------------------------------------------------------------------------------------------
# GPU: kernels against references, bit for bit
# ----------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _needs_cupy_backend() -> None:
    if K.backend() != "cupy":
        pytest.skip("CuPy is not installed or disabled: no kernel to compare")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", PUBLIC)
@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("n", [1, 255, 257, 1000, 1_048_577, 3_000_017])  # incl. non-multiples of 256
def test_kernels_equal_references_on_gpu(name, dtype, n):
    _needs_cupy_backend()
    if name in ("pack_bf16", "unpack_bf16") and dtype != torch.float32:
        pytest.skip("pack/unpack are fp32 <-> bf16 only")
    got, want = _run_both(name, n, dtype, device="cuda")
    for g, w in zip(got, want):
        assert g.is_cuda
        assert torch.equal(g.cpu(), w), f"{name} {dtype} n={n}: kernel differs from reference"


@pytest.mark.gpu
@needs_cuda
def test_kernels_run_on_the_current_torch_stream():
    _needs_cupy_backend()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Produced, combined and read on the side stream with no synchronisation in between: only
        # correct if the kernel is ordered on torch's current stream.
        w = torch.full((1 << 22,), 1.0, device="cuda")
        s = torch.full((1 << 22,), 7.0, device="cuda")
        K.wagma_combine_(w, s, 8.0)
        total = w.sum()
    side.synchronize()
    assert total.item() == float(1 << 22)


@pytest.mark.gpu
@needs_cuda
def test_kernels_keep_subnormals_on_gpu():
    # CuPy compiles with -ftz=true; the kernels' PTX primitives carry no .ftz, so nothing is flushed.
    _needs_cupy_backend()
    tiny = torch.finfo(torch.float32).smallest_normal
    w = torch.tensor([tiny / 4, -tiny / 1024, tiny], device="cuda")
    K.wagma_combine_(w, torch.tensor([tiny / 4, 0.0, -tiny / 2], device="cuda"), 1.0)
    assert w.cpu().tolist() == [tiny / 2, -tiny / 1024, tiny / 2]
    packed = K.pack_bf16(torch.tensor([tiny / 8], device="cuda"))
    assert K.unpack_bf16(packed).cpu().tolist() == [tiny / 8]


@pytest.mark.gpu
@needs_cuda
def test_float64_cuda_tensors_take_the_torch_path():
    w = torch.ones(1000, dtype=torch.float64, device="cuda")
    K.wagma_combine_(w, torch.full_like(w, 2.0), 3.0)
    assert torch.equal(w.cpu(), torch.ones(1000, dtype=torch.float64))
