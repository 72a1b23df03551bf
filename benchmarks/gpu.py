"""Effective memory bandwidth of wagma's fused kernels on one CUDA GPU (a manual benchmark, not CI).

For each kernel of :mod:`wagma.kernels` and each size it times, with CUDA events (median of
``--reps`` >= 20 repetitions after ``--warmup``):

- ``wagma``: the public function (the CuPy kernel when :func:`wagma.kernels.backend` is "cupy");
- ``eager``: the torch eager sequence the kernel replaces (several passes over memory);
- ``compile``: ``torch.compile`` of that same eager sequence;
- ``copy``: a device-to-device ``dst.copy_(src)`` of the same number of elements, the yardstick.

Effective bandwidth = (bytes the fused kernel must read + write) / time, for every column, so the
columns compare time for the same useful work. Each repetition is timed alone, so small sizes include
the per-call launch overhead (Python + DLPack for ``wagma``) and may sit in L2 cache.

Before the kernels (while this process has not initialised CUDA, so it can fork ranks that use it),
it also measures the wait-avoiding group allreduce engine on CUDA tensors: ``--engine-world`` gloo
ranks forked on this one GPU, ``benchmarks/engine_latency.py --device cuda`` (skip with ``--no-engine``).

Usage::

    python benchmarks/gpu.py --out results/gpu_bench.json [--sizes 1e6,1e7,1e8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Run as a script from a checkout without installing: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import engine_latency
from wagma import kernels

Fn = Callable[[], Any]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description="Bandwidth of wagma's fused CUDA kernels vs copy, eager and torch.compile")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON to this path")
    p.add_argument("--sizes", default="1e6,1e7,1e8", help="comma-separated element counts (default: 1e6,1e7,1e8)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the combine/momentum/residual buffers (pack/unpack are fp32<->bf16)",
    )
    p.add_argument("--reps", type=int, default=50, help="timed repetitions per measurement (>= 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed repetitions first")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--no-engine", action="store_true", help="skip the engine's round time on CUDA tensors")
    p.add_argument("--engine-world", type=int, default=4, help="gloo ranks sharing the GPU (default 4)")
    p.add_argument("--engine-group", type=int, default=2, help="group size S (default 2)")
    p.add_argument("--engine-rounds", type=int, default=200, help="rounds per rank (default 200)")
    p.add_argument("--engine-numel", default="1e6", help="elements of the averaged buffer (default 1e6)")
    p.add_argument(
        "--ilp",
        default=None,
        metavar="LIST",
        help="instead of the comparison: the kernels alone, recompiled with each WAGMA_ILP (loads in flight "
        "per thread) of the comma-separated LIST, interleaved over --ilp-rounds rounds, against copy",
    )
    p.add_argument("--ilp-rounds", type=int, default=3, help="rounds of the --ilp sweep (default 3)")
    args = p.parse_args(argv)
    if args.reps < 20:
        p.error(f"--reps must be >= 20, got {args.reps}")
    try:
        args.size_list = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
        args.engine_numel = int(float(args.engine_numel))
        args.ilp_list = [int(v) for v in args.ilp.split(",")] if args.ilp else []
    except ValueError:
        p.error(f"--sizes and --engine-numel must be numbers, got {args.sizes!r} and {args.engine_numel!r}")
    if any(v < 1 for v in args.ilp_list) or args.ilp_rounds < 1:
        p.error(f"--ilp values and --ilp-rounds must be >= 1, got {args.ilp!r} and {args.ilp_rounds}")
    if args.engine_world < 1 or args.engine_group < 1 or args.engine_world % args.engine_group:
        p.error(f"--engine-group must divide --engine-world, got {args.engine_group} and {args.engine_world}")
    return args


def median_seconds(fn: Fn, reps: int, warmup: int) -> float:
    """Median GPU time of one ``fn()`` call, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3


def cases(n: int, dtype: torch.dtype, device: str = "cuda") -> list[tuple[str, int, dict[str, Fn]]]:
    """(name, bytes moved by the fused kernel, {"wagma": fn, "eager": fn}) for every kernel."""
    dev = torch.device(device)
    es = torch.tensor([], dtype=dtype).element_size()

    def r(dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(n, device=dev, dtype=dt)

    w, s = r(), r()
    a, v, x = r(), torch.zeros(n, device=dev, dtype=dtype), r()
    res, g, out = r(), r(), r()
    f32, b16, f32_out = r(torch.float32), r(torch.bfloat16), r(torch.float32)
    mu, lr, inv = 0.9, 1.0, 1.0 / 9.0

    def momentum_eager(nesterov: bool) -> Fn:
        def fn() -> None:
            d = x - a
            v.mul_(mu).add_(d)
            a.add_(torch.add(d, v, alpha=mu) if nesterov else v, alpha=lr)

        return fn

    def take_add_eager() -> None:
        torch.add(res, g, out=out)
        res.zero_()

    def take_eager() -> None:
        out.copy_(res)
        res.zero_()

    def unpack_eager() -> None:
        f32_out.copy_(b16).mul_(0.125)

    return [
        ("combine", 3 * es, {"wagma": lambda: kernels.wagma_combine_(w, s, 9.0), "eager": lambda: w.add_(s).mul_(inv)}),
        (
            "momentum",
            5 * es,
            {"wagma": lambda: kernels.reduction_momentum_(a, v, x, mu, lr), "eager": momentum_eager(False)},
        ),
        (
            "momentum_nesterov",
            5 * es,
            {
                "wagma": lambda: kernels.reduction_momentum_(a, v, x, mu, lr, nesterov=True),
                "eager": momentum_eager(True),
            },
        ),
        ("residual_take", 3 * es, {"wagma": lambda: kernels.residual_take_(res, out), "eager": take_eager}),
        ("residual_take_add", 4 * es, {"wagma": lambda: kernels.residual_take_(res, out, g), "eager": take_add_eager}),
        (
            "residual_accumulate",
            3 * es,
            {"wagma": lambda: kernels.residual_accumulate_(res, g), "eager": lambda: res.add_(g)},
        ),
        ("pack_bf16", 6, {"wagma": lambda: kernels.pack_bf16(f32, b16), "eager": lambda: b16.copy_(f32)}),
        ("unpack_bf16", 6, {"wagma": lambda: kernels.unpack_bf16(b16, f32_out, 0.125), "eager": unpack_eager}),
    ]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Measure every case at every size; returns one row per (kernel, size)."""
    dtype = getattr(torch, args.dtype)
    rows = []
    for n in args.size_list:
        src, dst = torch.randn(n, device="cuda", dtype=dtype), torch.empty(n, device="cuda", dtype=dtype)
        copy_s = median_seconds(lambda: dst.copy_(src), args.reps, args.warmup)  # noqa: B023 - called here
        copy_gbs = 2 * src.element_size() * n / copy_s / 1e9
        src = dst = None  # freed before the next size (not del: the lambda above reads them)
        for name, bytes_per_elem, fns in cases(n, dtype):
            if not args.no_compile:
                torch._dynamo.reset()  # fresh compile per case: never hit the recompile limit and fall back
                fns["compile"] = torch.compile(fns["eager"], dynamic=False)
            row: dict[str, Any] = {
                "kernel": name,
                "n": n,
                "dtype": args.dtype,
                "bytes": bytes_per_elem * n,
                "copy_gbs": copy_gbs,
            }
            for label, fn in fns.items():
                try:
                    t = median_seconds(fn, args.reps, args.warmup)
                except Exception as exc:  # a torch.compile failure should not end the run
                    if label != "compile":
                        raise
                    row["compile_error"] = f"{type(exc).__name__}: {exc}"[:500]
                    continue
                row[f"{label}_s"] = t
                row[f"{label}_gbs"] = bytes_per_elem * n / t / 1e9
            rows.append(row)
            print(f"  {name:20s} n={n:>11,d} wagma {row['wagma_gbs']:8.1f} GB/s", file=sys.stderr)
        torch.cuda.empty_cache()
    return rows


def ilp_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each kernel's bandwidth with the source recompiled at every WAGMA_ILP of ``args.ilp_list``, the variants
    interleaved round by round (so drift of the clock or the machine hits them alike), beside a copy; one row per
    (round, ilp, kernel, size)."""
    import tempfile

    source = (kernels.cuda_source_dir() / kernels.SOURCE_FILE).read_text()
    if "#ifdef WAGMA_ILP" not in source:
        raise SystemExit(f"--ilp: {kernels.SOURCE_FILE} no longer reads WAGMA_ILP; update benchmarks/gpu.py")
    dtype, rows = getattr(torch, args.dtype), []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for ilp in args.ilp_list:
            dirs[ilp] = Path(tmp) / f"ilp{ilp}"
            dirs[ilp].mkdir()
            (dirs[ilp] / kernels.SOURCE_FILE).write_text(f"#define WAGMA_ILP {ilp}\n" + source)
        real_dir = kernels.cuda_source_dir
        try:
            for n in args.size_list:
                work = cases(n, dtype)
                src, dst = torch.randn(n, device="cuda", dtype=dtype), torch.empty(n, device="cuda", dtype=dtype)
                for round_ in range(args.ilp_rounds):
                    copy_s = median_seconds(lambda: dst.copy_(src), args.reps, args.warmup)  # noqa: B023 - called here
                    for ilp in args.ilp_list:
                        kernels.cuda_source_dir = lambda d=dirs[ilp]: d  # type: ignore[assignment]
                        kernels._modules.clear()
                        kernels._kernels.clear()
                        for name, bytes_per_elem, fns in work:
                            t = median_seconds(fns["wagma"], args.reps, args.warmup)
                            rows.append(
                                {
                                    "round": round_,
                                    "ilp": ilp,
                                    "kernel": name,
                                    "n": n,
                                    "wagma_gbs": bytes_per_elem * n / t / 1e9,
                                    "copy_gbs": 2 * src.element_size() * n / copy_s / 1e9,
                                }
                            )
                work = src = dst = None  # freed before the next size
                torch.cuda.empty_cache()
        finally:
            kernels.cuda_source_dir = real_dir  # type: ignore[assignment]
            kernels._modules.clear()
            kernels._kernels.clear()
    return rows


def ilp_markdown(rows: list[dict[str, Any]]) -> str:
    """Median over rounds of each kernel's share of copy bandwidth, one column per WAGMA_ILP."""
    ilps = sorted({r["ilp"] for r in rows})
    lines = ["| kernel | n | " + " | ".join(f"ILP {v}: / copy" for v in ilps) + " |", "|" + "---|" * (len(ilps) + 2)]
    for kernel, n in dict.fromkeys((r["kernel"], r["n"]) for r in rows):
        cells = []
        for v in ilps:
            ratios = [r["wagma_gbs"] / r["copy_gbs"] for r in rows if (r["kernel"], r["n"], r["ilp"]) == (kernel, n, v)]
            cells.append(f"{statistics.median(ratios):.0%} ({min(ratios):.0%}-{max(ratios):.0%})")
        lines.append(f"| {kernel} | {n:.0e} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table (GB/s, and wagma's share of copy bandwidth)."""
    cols = ["wagma", "eager", "compile"]
    present = [c for c in cols if any(f"{c}_gbs" in r for r in rows)]
    head = ["kernel", "n", "dtype"] + [f"{c} GB/s" for c in present] + ["copy GB/s", "wagma / copy", "wagma vs eager"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["kernel"], f"{r['n']:.0e}", r["dtype"]]
        cells += [f"{r[f'{c}_gbs']:.1f}" if f"{c}_gbs" in r else "n/a" for c in present]
        cells += [f"{r['copy_gbs']:.1f}", f"{r['wagma_gbs'] / r['copy_gbs']:.0%}"]
        cells.append(f"{r['eager_s'] / r['wagma_s']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, refuse clearly without a GPU, measure, print a table and write JSON."""
    args = parse_args(argv)
    # Ask NVML, not the CUDA runtime: this process must not initialise CUDA before forking the engine's ranks.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU, and torch.cuda.is_available() is False here")
    engine = None
    if not args.no_engine and not args.ilp_list:
        print(
            f"engine: {args.engine_world} ranks, S={args.engine_group}, {args.engine_numel:,d} elements, "
            f"{args.engine_rounds} rounds on CUDA tensors",
            file=sys.stderr,
        )
        engine = engine_latency.measure(
            args.engine_world, args.engine_group, args.engine_rounds, args.engine_numel, device="cuda"
        )
        print(json.dumps(engine, indent=2))
    try:
        import cupy

        cupy_version: str | None = cupy.__version__
    except ImportError:
        cupy_version = None
    if kernels.backend() != "cupy":
        print(
            "warning: wagma.kernels.backend() is 'torch' (CuPy missing or disabled): the 'wagma' column "
            "measures the torch fallback, not the CUDA kernels",
            file=sys.stderr,
        )
    if args.ilp_list:
        rows = ilp_sweep(args)
        table = ilp_markdown(rows)
    else:
        rows = run(args)
        table = markdown(rows)
    print(table)
    if args.out is not None:
        report = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cupy": cupy_version,
            "backend": kernels.backend(),
            "command": " ".join([sys.executable, *sys.argv]) if argv is None else " ".join(["gpu.py", *argv]),
            "reps": args.reps,
            "warmup": args.warmup,
            "results": rows,
            "markdown": table,
            "engine": engine,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
