"""Fused elementwise kernels for the averaging hot paths, with torch reference implementations.

Each public function works in place on flat contiguous buffers and makes one pass over memory:

- :func:`wagma_combine_` -- the WAGMA combine ``w = (w + group_sum) / divisor``;
- :func:`reduction_momentum_` -- reduction (block) momentum at a global or local reduction;
- :func:`residual_take_` / :func:`residual_accumulate_` -- eager-SGD's residual buffer: take the
  pending contribution and zero it in the same pass, or add a fresh gradient to it;
- :func:`pack_bf16` / :func:`unpack_bf16` -- fp32 <-> bf16 for a low-precision exchange.

Dispatch. CUDA tensors of dtype float32, float16 or bfloat16 run a CUDA kernel from
``cuda/averaging.cu`` through CuPy, when CuPy is installed and sees a GPU; everything else (CPU
tensors, other dtypes, no CuPy, ``WAGMA_DISABLE_CUPY=1``) runs the ``*_ref`` torch implementation.
The references are also the test oracle: they compute in fp32 (fp64 for fp64 tensors) and round once
to the storage type, in the same operation order as the kernels, which avoid FMA contraction -- so
kernel and reference agree bit for bit. CuPy is imported once, lazily, on the first CUDA call or
:func:`backend` call, never at ``import wagma``. Kernels are compiled with ``cupy.RawModule`` on first
use and cached per (kernel, dtype, device); a compile failure (e.g. no NVRTC on the host) warns once
and falls back to torch. Kernels launch on torch's current CUDA stream (wrapped for CuPy with
``cupy.cuda.Stream.from_external``, or ``ExternalStream`` on CuPy < 14) and get the tensors' device
addresses (no copies, no DLPack views), so they are ordered with surrounding torch work like any torch op.

Shipping the ``.cu`` sources. They live once, in the repository's top-level ``cuda/`` folder;
``pyproject.toml`` maps the package ``wagma._cuda`` onto that folder, so the wheel carries them as
``wagma/_cuda/*.cu`` without a copy in the source tree. :func:`cuda_source_dir` finds ``<repo>/cuda`` in
a source checkout (or an editable install) and ``wagma/_cuda`` in an installed wheel.
"""

from __future__ import annotations

import os
import struct
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from wagma.checks import check_number, fail

__all__ = [
    "backend",
    "cuda_source_dir",
    "wagma_combine_",
    "reduction_momentum_",
    "residual_take_",
    "residual_accumulate_",
    "pack_bf16",
    "unpack_bf16",
    "wagma_combine_ref",
    "reduction_momentum_ref",
    "residual_take_ref",
    "residual_accumulate_ref",
    "pack_bf16_ref",
    "unpack_bf16_ref",
]

SOURCE_FILE = "averaging.cu"
# dtype -> kernel name suffix (16-bit values are raw `unsigned short` in the kernels: CuPy has no bfloat16).
KERNEL_DTYPES: dict[torch.dtype, str] = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_BLOCK = 256
_BLOCKS_PER_SM = 8  # 8 x 256 threads fill an SM on sm_80/sm_90; the grid-stride loop covers the rest

_lock = threading.Lock()
_cupy_probed = False
_cupy_mod: Any = None
_cupy_reason = "not probed yet"
_kernels: dict[tuple[str, int], Any] = {}
_modules: dict[int, Any] = {}


# ----------------------------------------------------------------------------------------------
# Sources and backend selection
# ----------------------------------------------------------------------------------------------
def cuda_source_dir() -> Path:
    """The folder holding the ``.cu`` sources: ``<repo>/cuda`` in a checkout, else ``wagma/_cuda``."""
    package_dir = Path(__file__).resolve().parent
    repo_dir = package_dir.parent
    # pyproject.toml beside the package tells a checkout from site-packages, where an unrelated
    # top-level ``cuda`` package (cuda-python) may sit next to ``wagma``.
    if (repo_dir / "pyproject.toml").is_file() and (repo_dir / "cuda" / SOURCE_FILE).is_file():
        return repo_dir / "cuda"
    return package_dir / "_cuda"


def _cupy_disabled_by_env() -> bool:
    return os.environ.get("WAGMA_DISABLE_CUPY", "").strip() not in ("", "0")


def _cupy() -> Any:
    """The ``cupy`` module if it imports and sees a GPU, else None. Probed once per process."""
    global _cupy_probed, _cupy_mod, _cupy_reason
    if _cupy_probed:
        return _cupy_mod
    with _lock:
        if not _cupy_probed:
            try:
                import cupy  # optional dependency, imported on first use only

                if cupy.cuda.is_available():
                    _cupy_mod, _cupy_reason = cupy, "ok"
                else:
                    _cupy_reason = "cupy sees no CUDA device"
            except Exception as exc:  # noqa: BLE001 - ImportError, or CuPy failing to load CUDA libs
                _cupy_reason = f"cupy unavailable: {type(exc).__name__}: {exc}"
            _cupy_probed = True
    return _cupy_mod


def backend() -> str:
    """``"cupy"`` when CUDA tensors of a kernel dtype run the CUDA kernels, else ``"torch"``.

    CPU tensors always take the torch path whatever this says.
    """
    if _cupy_disabled_by_env() or not torch.cuda.is_available():
        return "torch"
    return "cupy" if _cupy() is not None else "torch"


def _use_kernel(t: Tensor) -> bool:
    return t.is_cuda and t.dtype in KERNEL_DTYPES and not _cupy_disabled_by_env() and _cupy() is not None


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def _check(op: str, tensors: dict[str, Tensor], dtypes: dict[str, torch.dtype] | None = None) -> None:
    """Same device, same shape, contiguous, floating point; the ``dtypes`` given, else all alike."""
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise fail(f"{op}: {name}", "a torch.Tensor", type(t))
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (a flat buffer); call .contiguous() first")
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}")
        if t.shape != first.shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, {first_name} {tuple(first.shape)}")
        if not t.is_floating_point():
            raise fail(f"{op}: {name}", "a floating-point tensor", t.dtype)
        expected = dtypes[name] if dtypes is not None else first.dtype
        if t.dtype != expected:
            raise ValueError(f"{op}: {name} has dtype {t.dtype}, expected {expected}")


def _check_overlap(op: str, tensors: dict[str, Tensor], may_alias: tuple[tuple[str, str], ...] = ()) -> None:
    """Reject partial overlaps always, and full aliasing except for the pairs in ``may_alias``."""
    items = [(n, t) for n, t in tensors.items() if t is not None and t.numel() > 0]
    for i, (na, a) in enumerate(items):
        a0 = a.data_ptr()
        a1 = a0 + a.numel() * a.element_size()
        for nb, b in items[i + 1 :]:
            b0 = b.data_ptr()
            b1 = b0 + b.numel() * b.element_size()
            if a1 <= b0 or b1 <= a0:
                continue
            if (a0, a1) == (b0, b1) and ((na, nb) in may_alias or (nb, na) in may_alias):
                continue
            raise ValueError(f"{op}: {na} and {nb} share memory; pass separate buffers")


def _check_scalar(op: str, name: str, value: float, *, positive: bool = False, nonneg: bool = False) -> None:
    """A finite number, ``> 0`` when ``positive``, ``>= 0`` when ``nonneg``; the message names ``op`` too."""
    check_number(f"{op}: {name}", value, minimum=0 if positive or nonneg else None, above=positive)


# ----------------------------------------------------------------------------------------------
# Torch references: the CPU / no-CuPy path and the test oracle (no validation here)
# ----------------------------------------------------------------------------------------------
def _f32(x: float) -> float:
    """``x`` rounded to the nearest fp32, which is what a kernel's ``float`` argument receives."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scalar(x: float, dtype: torch.dtype) -> float:
    return x if dtype == torch.float64 else _f32(x)


@torch.no_grad()
def wagma_combine_ref(w: Tensor, group_sum: Tensor, divisor: float) -> Tensor:
    """Reference for :func:`wagma_combine_`: ``w = (w + group_sum) * (1 / divisor)``, one rounding."""
    acc = _acc(w.dtype)
    scale = _scalar(1.0 / divisor, w.dtype)
    if w.dtype == acc and group_sum.dtype == acc:
        # Already the accumulation type: in place, the same two roundings, no temporaries (a fresh 4 MB buffer
        # per call costs page faults and zeroing that, on CPU, outweigh the arithmetic).
        return w.add_(group_sum).mul_(scale)
    w.copy_((w.to(acc) + group_sum.to(acc)) * scale)
    return w


@torch.no_grad()
def reduction_momentum_ref(
    anchor: Tensor, velocity: Tensor, average: Tensor, momentum: float, lr: float = 1.0, nesterov: bool = False
) -> None:
    """Reference for :func:`reduction_momentum_` (same operation order as the kernel)."""
    acc = _acc(anchor.dtype)
    mu, lr = _scalar(momentum, anchor.dtype), _scalar(lr, anchor.dtype)
    a = anchor.to(acc)
    d = average.to(acc) - a
    v = velocity.to(acc) * mu + d
    step = v * mu + d if nesterov else v
    new_anchor = a + step * lr
    velocity.copy_(v)
    anchor.copy_(new_anchor)


@torch.no_grad()
def residual_take_ref(residual: Tensor, out: Tensor, grad: Tensor | None = None) -> Tensor:
    """Reference for :func:`residual_take_`: ``out = residual (+ grad)``, then ``residual = 0``."""
    if grad is None:
        out.copy_(residual)
    else:
        acc = _acc(residual.dtype)
        out.copy_(residual.to(acc) + grad.to(acc))
    residual.zero_()
    return out


@torch.no_grad()
def residual_accumulate_ref(residual: Tensor, grad: Tensor) -> None:
    """Reference for :func:`residual_accumulate_`: ``residual += grad``, one rounding."""
    acc = _acc(residual.dtype)
    residual.copy_(residual.to(acc) + grad.to(acc))


@torch.no_grad()
def pack_bf16_ref(src: Tensor, out: Tensor) -> Tensor:
    """Reference for :func:`pack_bf16`: fp32 -> bf16 by the kernel's integer round-to-nearest-even.

    Deliberately not ``src.to(torch.bfloat16)``: the tests check this bit arithmetic (which the
    kernel uses too) against torch's own conversion.
    """
    u = src.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the fp32 bits as unsigned
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    rounded = torch.where(torch.isnan(src), torch.full_like(rounded, 0x7FC0), rounded)
    signed = rounded - (rounded >= 0x8000).to(torch.int64) * 0x10000  # two's complement int16 bits
    out.view(torch.int16).copy_(signed)
    return out


@torch.no_grad()
def unpack_bf16_ref(src: Tensor, out: Tensor, scale: float = 1.0) -> Tensor:
    """Reference for :func:`unpack_bf16`: ``out = float32(src) * scale`` (widening is exact)."""
    out.copy_(src.to(torch.float32) * _f32(scale))
    return out


# ----------------------------------------------------------------------------------------------
# CuPy launch
# ----------------------------------------------------------------------------------------------
def _get_kernel(cp: Any, name: str, device_index: int) -> Any:
    """The compiled kernel ``name`` on ``device_index``, or None when compiling failed."""
    global _cupy_mod, _cupy_reason
    key = (name, device_index)
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        if key not in _kernels:
            try:
                with cp.cuda.Device(device_index):
                    module = _modules.get(device_index)
                    if module is None:
                        source = (cuda_source_dir() / SOURCE_FILE).read_text()
                        module = _modules[device_index] = cp.RawModule(code=source)
                    _kernels[key] = module.get_function(name)  # compiles on first call per device
            except Exception as exc:  # noqa: BLE001 - e.g. no NVRTC on this host
                warnings.warn(
                    f"wagma.kernels: compiling {name} failed ({type(exc).__name__}: {exc}); "
                    "using the torch implementation from now on",
                    RuntimeWarning,
                    stacklevel=3,
                )
                _cupy_mod, _cupy_reason = None, f"kernel compilation failed: {exc}"
                return None
        return _kernels[key]


def _launch(name: str, args: tuple[Any, ...], n: int) -> bool:
    """Run kernel ``name`` over ``n`` elements; False when the kernel is unavailable (use torch)."""
    cp = _cupy()
    if cp is None:
        return False
    device = next(a.device for a in args if isinstance(a, Tensor))
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel = _get_kernel(cp, name, index)
    if kernel is None:
        return False
    if n == 0:
        return True
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    grid = max(1, min((n + _BLOCK - 1) // _BLOCK, sms * _BLOCKS_PER_SM))
    with cp.cuda.Device(index):
        # torch's current stream: the kernel is ordered after the torch ops that produced its inputs,
        # and the caching allocator's stream bookkeeping stays valid for the tensors it touches.
        with _cupy_stream(cp, torch.cuda.current_stream(index), index):
            # A tensor crosses as its device address (a 64-bit value, what the kernel's pointer parameter holds):
            # DLPack views would cost several microseconds per tensor and call, which small buffers notice.
            kernel_args = tuple(np.uint64(a.data_ptr()) if isinstance(a, Tensor) else a for a in args)
            kernel((grid,), (_BLOCK,), kernel_args + (np.int64(n),))
    return True


def _cupy_stream(cp: Any, stream: torch.cuda.Stream, index: int) -> Any:
    """A CuPy view of a torch stream: ``Stream.from_external`` (CuPy >= 14, CUDA stream protocol)
    where available, else the older (since deprecated) ``ExternalStream``."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cp.cuda.ExternalStream(stream.cuda_stream, index)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def wagma_combine_(w: Tensor, group_sum: Tensor, divisor: float) -> Tensor:
    """WAGMA combine in place: ``w = (w + group_sum) / divisor``; returns ``w``.

    ``group_sum`` is the finished group sum of the round (Σ ŵ_j over the group) and ``divisor``
    is ``S + 1`` for an async round. ``group_sum`` may be ``w`` itself.
    """
    _check("wagma_combine_", {"w": w, "group_sum": group_sum})
    _check_scalar("wagma_combine_", "divisor", divisor, positive=True)
    _check_overlap("wagma_combine_", {"w": w, "group_sum": group_sum}, (("w", "group_sum"),))
    if _use_kernel(w):
        inv = np.float32(1.0 / divisor)
        if _launch(f"wagma_combine_{KERNEL_DTYPES[w.dtype]}", (w, group_sum, inv), w.numel()):
            return w
    return wagma_combine_ref(w, group_sum, divisor)


def reduction_momentum_(
    anchor: Tensor, velocity: Tensor, average: Tensor, momentum: float, lr: float = 1.0, nesterov: bool = False
) -> None:
    """Reduction momentum in place on ``anchor`` (a) and ``velocity`` (v), given the new average x̄.

    ``d = x̄ - a; v = momentum*v + d; a += lr*v``, or with ``nesterov`` ``a += lr*(momentum*v + d)``
    (v is updated first in both). ``momentum=0, lr=1`` makes ``a`` the plain average.
    """
    op = "reduction_momentum_"
    named = {"anchor": anchor, "velocity": velocity, "average": average}
    _check(op, named)
    _check_scalar(op, "momentum", momentum, nonneg=True)
    _check_scalar(op, "lr", lr, positive=True)
    _check_overlap(op, named, (("anchor", "average"), ("velocity", "average")))
    if _use_kernel(anchor):
        suffix = KERNEL_DTYPES[anchor.dtype]
        args = (anchor, velocity, average, np.float32(momentum), np.float32(lr), np.int32(bool(nesterov)))
        if _launch(f"wagma_momentum_{suffix}", args, anchor.numel()):
            return
    reduction_momentum_ref(anchor, velocity, average, momentum, lr, nesterov)


def residual_take_(residual: Tensor, out: Tensor, grad: Tensor | None = None) -> Tensor:
    """Take eager-SGD's pending contribution and zero it: ``out = residual (+ grad); residual = 0``.

    One pass, so each value is counted in exactly one round as long as accumulate and take are
    ordered on a stream (on the GPU: the same stream, or one ordered by an event). Returns ``out``.
    ``grad`` (a fresh gradient folded into this round) may be ``out`` itself; ``out`` may not share
    memory with ``residual``.
    """
    op = "residual_take_"
    named = {"residual": residual, "out": out}
    if grad is not None:
        named["grad"] = grad
    _check(op, named)
    _check_overlap(op, named, (("out", "grad"), ("residual", "grad")))
    if _use_kernel(residual):
        suffix = KERNEL_DTYPES[residual.dtype]
        if grad is None:
            launched = _launch(f"wagma_residual_take_{suffix}", (residual, out), residual.numel())
        else:
            launched = _launch(f"wagma_residual_take_add_{suffix}", (residual, grad, out), residual.numel())
        if launched:
            return out
    return residual_take_ref(residual, out, grad)


def residual_accumulate_(residual: Tensor, grad: Tensor) -> None:
    """Add a fresh gradient to eager-SGD's residual buffer in place: ``residual += grad``."""
    _check("residual_accumulate_", {"residual": residual, "grad": grad})
    _check_overlap("residual_accumulate_", {"residual": residual, "grad": grad}, (("residual", "grad"),))
    if _use_kernel(residual):
        name = f"wagma_residual_accumulate_{KERNEL_DTYPES[residual.dtype]}"
        if _launch(name, (residual, grad), residual.numel()):
            return
    residual_accumulate_ref(residual, grad)


def pack_bf16(src: Tensor, out: Tensor | None = None) -> Tensor:
    """fp32 -> bf16 with round-to-nearest-even (NaN stays NaN); writes ``out`` or a new tensor."""
    if isinstance(src, Tensor) and out is None:
        out = torch.empty(src.shape, dtype=torch.bfloat16, device=src.device)
    _check("pack_bf16", {"src": src, "out": out}, {"src": torch.float32, "out": torch.bfloat16})
    _check_overlap("pack_bf16", {"src": src, "out": out})
    if _use_kernel(src) and _launch("wagma_pack_bf16", (src, out), src.numel()):
        return out
    return pack_bf16_ref(src, out)


def unpack_bf16(src: Tensor, out: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """bf16 -> fp32, times ``scale`` (e.g. 1/P after a bf16 sum); writes ``out`` or a new tensor."""
    if isinstance(src, Tensor) and out is None:
        out = torch.empty(src.shape, dtype=torch.float32, device=src.device)
    _check("unpack_bf16", {"src": src, "out": out}, {"src": torch.bfloat16, "out": torch.float32})
    _check_scalar("unpack_bf16", "scale", scale)
    _check_overlap("unpack_bf16", {"src": src, "out": out})
    if _use_kernel(src) and _launch("wagma_unpack_bf16", (src, out, np.float32(scale)), src.numel()):
        return out
    return unpack_bf16_ref(src, out, scale)
