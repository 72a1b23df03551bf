"""The CUDA kernels' own source, run on the CPU through wagma.kernels' launch path.

These machines have no GPU, so a kernel's arithmetic could rot unseen between GPU runs. Here
``cuda/averaging.cu`` is compiled with g++ as host code: a prelude defines the CUDA keywords and
built-ins, and IEEE-equivalent host versions of the file's PTX primitives (``add_rn``, ``sub_rn``,
``mul_rn`` and the fp16 conversions: one IEEE operation each, round to nearest even, subnormals kept;
compiled with ``-ffp-contract=off`` so nothing is fused). A launch runs every (block, thread) of the
grid in turn, so the grid-stride loops, their bounds and the index arithmetic are the file's own.

A stand-in for CuPy then replaces the GPU under ``wagma.kernels._launch``: ``RawModule(code=...)``
compiles whatever source kernels.py read, ``get_function`` looks the kernel up by its exported name,
and a launch passes the arguments kernels.py built (tensors as pointers, numpy scalars by their C
type). So one test covers the whole chain -- public function, validation, grid size, argument order
and types, kernel source -- against the torch references, bit for bit, including subnormals, signed
zeros and infinities, and checks that nothing outside the buffers is written.

What this cannot show: the PTX instructions themselves, CuPy's DLPack import and streams, and real
GPU timing. The ``gpu``-marked tests in test_kernels.py cover those on a GPU machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import re
import shutil
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from wagma import kernels as K

GXX = shutil.which("g++")

PRELUDE = r"""
// Host emulation of the CUDA execution model for wagma's elementwise kernels (see the test's docstring).
#include <cstdint>
#include <cstring>
#define WAGMA_HOST_EMULATION 1
#define __device__
#define __global__
#define __forceinline__ inline
struct WagmaDim3 { unsigned int x = 0, y = 1, z = 1; };
static WagmaDim3 threadIdx, blockIdx, blockDim, gridDim;
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, sizeof u); return u; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, sizeof f); return f; }
// IEEE-equivalent host versions of averaging.cu's PTX primitives.
static inline float add_rn(float a, float b) { return a + b; }
static inline float sub_rn(float a, float b) { return a - b; }
static inline float mul_rn(float a, float b) { return a * b; }
static inline float f16_to_f32(unsigned short h) { _Float16 x; std::memcpy(&x, &h, 2); return (float)x; }
static inline unsigned short f32_to_f16_rn(float f) {
    _Float16 x = (_Float16)f;  // round to nearest even
    unsigned short h; std::memcpy(&h, &x, 2); return h;
}
#line 1 "averaging.cu"
"""

# One launcher per kernel: run the kernel body for every (block, thread) of the grid, in order.
LAUNCHER = r"""
template <class F> struct WagmaEmulate;
template <class... A> struct WagmaEmulate<void(A...)> {
    template <void (*Kernel)(A...)> static void launch(unsigned int grid, unsigned int block, A... args) {
        gridDim.x = grid; blockDim.x = block;
        for (unsigned int b = 0; b < grid; ++b) {
            blockIdx.x = b;
            for (unsigned int t = 0; t < block; ++t) { threadIdx.x = t; Kernel(args...); }
        }
    }
};
#define WAGMA_EMULATE(name) \
    extern "C" void* wagma_emulated_##name() { return (void*)&WagmaEmulate<decltype(name)>::launch<name>; }
"""

# np.uint64: a tensor's device address (wagma.kernels passes data_ptr(), CuPy packs it as the 64-bit pointer).
_C_TYPES = {np.float32: ctypes.c_float, np.int32: ctypes.c_int, np.int64: ctypes.c_longlong, np.uint64: ctypes.c_void_p}


class _EmulatedModule:
    """``cupy.RawModule(code=...)``: the source compiled with g++ into a shared library."""

    _built: dict[str, tuple[ctypes.CDLL, set[str]]] = {}

    def __init__(self, code: str, build_dir: Path):
        digest = hashlib.sha256(code.encode()).hexdigest()[:16]
        if digest not in self._built:
            self._built[digest] = _build(code, build_dir / digest)
        self.lib, self.names = self._built[digest]
        self.launches: list[tuple[str, int, int, object]] = []
        self.stream_of_launch = lambda: None

    def get_function(self, name: str) -> _EmulatedKernel:
        if name not in self.names:
            raise AttributeError(f"no kernel named {name} in the module")  # as CuPy raises on a missing name
        return _EmulatedKernel(self, name)


class _EmulatedKernel:
    def __init__(self, module: _EmulatedModule, name: str):
        self.module, self.name = module, name
        getter = getattr(module.lib, f"wagma_emulated_{name}")
        getter.restype = ctypes.c_void_p
        self.address = getter()

    def __call__(self, grid: tuple[int], block: tuple[int], args: tuple) -> None:
        (g,), (b,) = grid, block
        ctypes_args, argtypes = [], []
        for a in args:
            if type(a) in _C_TYPES:  # numpy scalars carry their C type, as CuPy requires
                argtypes.append(_C_TYPES[type(a)])
                ctypes_args.append(a.item())
            else:
                raise TypeError(f"{self.name}: argument {a!r} of type {type(a).__name__} has no C type")
        fn = ctypes.CFUNCTYPE(None, ctypes.c_uint, ctypes.c_uint, *argtypes)(self.address)
        fn(g, b, *ctypes_args)
        self.module.launches.append((self.name, g, b, self.module.stream_of_launch()))


def _build(code: str, out_dir: Path) -> tuple[ctypes.CDLL, set[str]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "averaging_host.cpp"
    src.write_text(PRELUDE + code)
    common = [GXX, "-std=c++17", "-x", "c++"]
    pre = subprocess.run([*common, "-E", str(src)], capture_output=True, text=True, timeout=120)
    assert pre.returncode == 0, pre.stderr
    names = set(re.findall(r'extern "C" void (wagma_\w+)\s*\(', pre.stdout))
    assert names, 'no extern "C" kernels found in the source'
    src.write_text(PRELUDE + code + LAUNCHER + "".join(f"WAGMA_EMULATE({n})\n" for n in sorted(names)))
    lib = out_dir / "averaging_host.so"
    cmd = [
        *common,
        "-O2",
        "-ffp-contract=off",
        "-fno-fast-math",
        "-Wall",
        "-Werror",
        "-shared",
        "-fPIC",
        "-o",
        str(lib),
        str(src),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"
    return ctypes.CDLL(str(lib)), names


class _TorchStream:
    """Stands in for ``torch.cuda.current_stream()``: speaks the CUDA stream protocol."""

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, id(self))


def _emulated_cupy(build_dir: Path) -> types.ModuleType:
    fake = types.ModuleType("cupy")
    fake.modules = []
    fake.stream = None  # the stream a launch would go to: set inside ``with Stream.from_external(s)``

    def raw_module(code: str) -> _EmulatedModule:
        module = _EmulatedModule(code, build_dir)
        module.stream_of_launch = lambda: fake.stream
        fake.modules.append(module)
        return module

    @contextlib.contextmanager
    def from_external(stream):
        assert stream.__cuda_stream__()[0] == 0
        fake.stream = stream
        try:
            yield
        finally:
            fake.stream = None

    fake.RawModule = raw_module
    fake.cuda = types.SimpleNamespace(
        is_available=lambda: True,
        Device=lambda index: contextlib.nullcontext(),
        Stream=types.SimpleNamespace(from_external=from_external),
    )
    return fake


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    if GXX is None:
        pytest.skip("g++ is not on PATH")
    return tmp_path_factory.mktemp("emulated_kernels")


@pytest.fixture
def emulated(monkeypatch, build_dir):
    """Route wagma.kernels' kernel dtypes through the emulated kernels; ``sms`` sets the grid cap."""
    fake = _emulated_cupy(build_dir)
    state = types.SimpleNamespace(cupy=fake, sms=132, stream=_TorchStream())
    monkeypatch.setattr(K, "_kernels", {})
    monkeypatch.setattr(K, "_modules", {})
    monkeypatch.setattr(K, "_cupy", lambda: fake)
    monkeypatch.setattr(K, "_use_kernel", lambda t: t.dtype in K.KERNEL_DTYPES)  # CPU tensors stand in
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: state.stream)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(multi_processor_count=state.sms)
    )
    return state


def _launches(state) -> list[tuple[str, int, int]]:
    """(kernel, grid, block) of every launch so far; each one must have gone to torch's stream."""
    launches = [launch for module in state.cupy.modules for launch in module.launches]
    for name, _, _, stream in launches:
        assert stream is state.stream, f"{name} was not launched on torch's current stream"
    return [launch[:3] for launch in launches]


# ----------------------------------------------------------------------------------------------
# Inputs: random values plus every special kind of value the storage type has
# ----------------------------------------------------------------------------------------------
GUARD = 37  # elements past the end of every buffer, which no kernel may touch


def _special_values(dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    sub = info.smallest_normal
    return [
        0.0,
        -0.0,
        float("inf"),
        float("-inf"),
        float("nan"),
        sub,
        -sub,
        sub / 2,
        sub / 8,
        -sub / 4,
        info.tiny / 1024,
        info.max,
        -info.max,
        info.eps,
        1.0 + info.eps,
        1.0 / 3.0,
    ]


def _buffer(n: int, dtype: torch.dtype, seed: int, special: bool = True) -> torch.Tensor:
    """``n + GUARD`` values: random normals times 3, and (if ``special``) specials spread through."""
    g = torch.Generator().manual_seed(seed)
    buf = (torch.randn(n + GUARD, generator=g) * 3).to(dtype)
    if special and n > 1:
        values = torch.tensor(_special_values(dtype), dtype=torch.float64).to(dtype)
        idx = torch.randint(0, n, (min(n, 4 * len(values)),), generator=g)
        buf[idx] = values.repeat(len(idx) // len(values) + 1)[: len(idx)]
    return buf


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit, except that NaN payloads are unspecified (only where NaNs are must agree)."""
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want), f"{what}: NaNs in different places"
    differ = (_bits(got) != _bits(want)) & ~nan_want
    if differ.any():
        i = int(differ.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())} elements differ, first at {i}: "
            f"kernel {got[i].item()!r}, reference {want[i].item()!r}"
        )


# name -> (dtypes of the buffers, extra arguments, the reference)
CASES = {
    "wagma_combine_": (["x", "x"], (9.0,), K.wagma_combine_ref),
    "reduction_momentum_": (["x", "x", "x"], (0.9, 0.7, False), K.reduction_momentum_ref),
    "reduction_momentum_nesterov": (["x", "x", "x"], (0.9, 0.7, True), K.reduction_momentum_ref),
    "residual_take_": (["x", "x"], (), K.residual_take_ref),
    "residual_take_add": (["x", "x", "x"], (), K.residual_take_ref),
    "residual_accumulate_": (["x", "x"], (), K.residual_accumulate_ref),
    "pack_bf16": ([torch.float32, torch.bfloat16], (), K.pack_bf16_ref),
    "unpack_bf16": ([torch.bfloat16, torch.float32], (0.125,), K.unpack_bf16_ref),
}
PUBLIC = {"reduction_momentum_nesterov": "reduction_momentum_", "residual_take_add": "residual_take_"}


# pack/unpack are fp32 <-> bf16 only; every other case runs in each kernel dtype.
CASE_DTYPES = [
    (case, dtype)
    for case, (kinds, _, _) in CASES.items()
    for dtype in ([torch.float32] if "x" not in kinds else list(K.KERNEL_DTYPES))
]


@pytest.mark.parametrize("case,dtype", CASE_DTYPES, ids=[f"{c}-{str(d)[6:]}" for c, d in CASE_DTYPES])
@pytest.mark.parametrize("n,sms", [(1, 132), (255, 132), (257, 1), (100_003, 132), (100_003, 1)])
def test_emulated_kernels_equal_references_bit_for_bit(emulated, case, dtype, n, sms):
    emulated.sms = sms
    _compare_with_reference(case, dtype, n, "cpu")
    ((name, grid, block),) = _launches(emulated)
    assert name.startswith("wagma_") and block == K._BLOCK
    assert grid == max(1, min(-(-n // K._BLOCK), sms * K._BLOCKS_PER_SM))


def _compare_with_reference(case: str, dtype: torch.dtype, n: int, device: str) -> None:
    """Run public ``case`` on ``device`` and its reference on CPU copies; compare, check the guards."""
    kinds, extra, ref = CASES[case]
    dtypes = [dtype if k == "x" else k for k in kinds]
    bufs = [_buffer(n, dt, seed=i).to(device) for i, dt in enumerate(dtypes)]
    before = [b.cpu() for b in bufs]
    got = [b[:n] for b in bufs]
    want = [b[:n].clone() for b in before]
    public = getattr(K, PUBLIC.get(case, case))
    public(*got, *extra)
    ref(*want, *extra)
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_same(g.cpu(), w, f"{case} {dtype} n={n} buffer {i}")
    for i, (b, old) in enumerate(zip(bufs, before)):
        assert torch.equal(_bits(b[n:].cpu()), _bits(old[n:])), f"{case} wrote past the end of buffer {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case,dtype", CASE_DTYPES, ids=[f"{c}-{str(d)[6:]}" for c, d in CASE_DTYPES])
def test_gpu_kernels_equal_references_on_special_values(case, dtype):
    # The same comparison on a real GPU: subnormals, signed zeros, infinities and NaNs included.
    if K.backend() != "cupy":
        pytest.skip("CuPy is not installed or disabled: no kernel to compare")
    _compare_with_reference(case, dtype, 100_003, "cuda")


def test_every_exported_kernel_is_launched_by_some_public_function(emulated):
    n = 64
    for dtype in K.KERNEL_DTYPES:
        x = [_buffer(n, dtype, seed=i, special=False)[:n] for i in range(3)]
        K.wagma_combine_(x[0], x[1], 3.0)
        K.reduction_momentum_(x[0], x[1], x[2], 0.5)
        K.residual_take_(x[0], x[1])
        K.residual_take_(x[0], x[1], x[2])
        K.residual_accumulate_(x[0], x[1])
    K.unpack_bf16(K.pack_bf16(torch.randn(n)))
    launched = {name for name, _, _ in _launches(emulated)}
    exported = set().union(*(m.names for m in emulated.cupy.modules))
    assert launched == exported, f"exported but never launched: {exported - launched}"
    assert len(emulated.cupy.modules) == 1  # one module per device, compiled once


def test_subnormals_are_kept_not_flushed(emulated):
    # CuPy compiles with -ftz=true; the kernels' PTX primitives carry no .ftz, so subnormals survive.
    # (test_kernels.py checks the PTX; here the arithmetic, on the smallest fp32 values.)
    tiny = torch.finfo(torch.float32).smallest_normal
    w = torch.tensor([tiny / 4, -tiny / 1024, tiny])
    K.wagma_combine_(w, torch.tensor([tiny / 4, 0.0, -tiny / 2]), 1.0)
    assert w.tolist() == [tiny / 2, -tiny / 1024, tiny / 2]
    assert torch.equal(K.unpack_bf16(K.pack_bf16(torch.tensor([tiny / 8]))), torch.tensor([tiny / 8]))


def test_a_kernel_that_breaks_is_caught(emulated, monkeypatch, tmp_path):
    # The emulation runs the source kernels.py reads: a wrong divisor in the kernel must fail the
    # comparison with the reference (mutation check of the test itself).
    source = (K.cuda_source_dir() / K.SOURCE_FILE).read_text()
    broken = source.replace("mul_rn(add_rn(a[k], b[k]), inv_divisor)", "add_rn(a[k], b[k])")
    assert broken != source, "the mutated expression is no longer in averaging.cu: update this test"
    (tmp_path / K.SOURCE_FILE).write_text(broken)
    monkeypatch.setattr(K, "cuda_source_dir", lambda: tmp_path)
    w, s = torch.ones(300), torch.full((300,), 3.0)
    K.wagma_combine_(w, s, 4.0)
    assert torch.equal(w, torch.full((300,), 4.0))  # (1 + 3) without the division: the mutant ran
    assert not torch.equal(w, K.wagma_combine_ref(torch.ones(300), s, 4.0))


@pytest.mark.parametrize("ilp", [1, 2, 3, 8])
def test_every_loads_in_flight_setting_equals_the_reference(emulated, monkeypatch, tmp_path, ilp):
    # benchmarks/gpu.py --ilp recompiles the source with another WAGMA_ILP: each must stay exact, including the
    # trips that end past n and a grid small enough to wrap (257 elements, one SM: 8 blocks of 256 threads).
    source = (K.cuda_source_dir() / K.SOURCE_FILE).read_text()
    assert "#ifdef WAGMA_ILP" in source, "benchmarks/gpu.py --ilp defines WAGMA_ILP before the source: update both"
    (tmp_path / K.SOURCE_FILE).write_text(f"#define WAGMA_ILP {ilp}\n" + source)
    monkeypatch.setattr(K, "cuda_source_dir", lambda: tmp_path)
    for sms, n in [(1, 257), (1, 5_000), (132, 100_003)]:
        emulated.sms = sms
        for case, dtype in CASE_DTYPES:
            _compare_with_reference(case, dtype, n, "cpu")
