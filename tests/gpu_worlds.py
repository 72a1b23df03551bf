"""Multi-rank checks on CUDA tensors: gloo ranks sharing one GPU stand in for a multi-GPU world.

The engine (its progress thread on a CUDA side stream, ordered by events), WagmaAverager, the
eager-SGD partial hook under DDP, the gossip averagers (their sends and receives staged through the host, as
gloo needs), two averagers on disjoint worlds, the compressed wire and HSDP x WAGMA (FSDP2 sharding inside a
replica) run the same checks as their CPU tests, with every rank's tensors on
the GPU (``wagma.testing.rank_device``). Ranks are forked, and a forked child can use CUDA only if its
parent never initialised it, so this runs as a script in a fresh interpreter:

    python tests/gpu_worlds.py --device cuda            # every check
    python tests/gpu_worlds.py --device cpu engine_exact  # one check, on the CPU

``tests/test_gpu_worlds.py`` runs it: every check on CUDA where there is a GPU (marked ``gpu``), and
one on the CPU everywhere, so the script itself cannot rot unseen.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Ask NVML, not the CUDA runtime, whether there is a GPU: this process must leave CUDA uninitialised.
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the test modules (their check_* functions), and wagma

import test_engine  # noqa: E402
import test_gossip  # noqa: E402
import test_hsdp  # noqa: E402
import test_partial_hook  # noqa: E402
import test_wagma_averager  # noqa: E402
import test_wire  # noqa: E402
import test_worlds  # noqa: E402
import torch  # noqa: E402

CHECKS: dict[str, Callable[[str], None]] = {
    "engine_exact": lambda d: test_engine.check_sums_without_delays(4, 2, d),
    "engine_random_delays": lambda d: test_engine.check_random_delays(4, 200, d),
    "engine_accumulate_any": lambda d: test_engine.check_accumulate(4, 2, "any", d),
    "engine_accumulate_initiator": lambda d: test_engine.check_accumulate(4, 2, "initiator", d),
    "wagma_sync_period_zero": test_wagma_averager.check_sync_period_zero,
    "wagma_flattened_in_place": test_wagma_averager.check_flattened_bits,
    "wagma_late_rank": test_wagma_averager.check_late_rank_not_waited_for,
    "wagma_conserve_sum": lambda d: test_wagma_averager.check_conserve_sum(True, d),
    # Not in the H200 runs of 2026-11-27 (torch 2.11): publishing after the step (the shipped
    # wagma_ahead_conserve: publish_after_step with conserve mixing), blocking-round conserve, SGP without overlap
    # and AD-PSGD's communication thread on CUDA tensors.
    "wagma_conserve_sum_blocking": lambda d: test_wagma_averager.check_conserve_sum(False, d),
    "wagma_publish_after_step": lambda d: test_wagma_averager.check_publish_after_step(True, d),
    "wagma_ahead_conserve_sum": lambda d: test_wagma_averager.check_conserve_sum(False, d, publish=True),
    "partial_equals_allreduce": test_partial_hook.check_equals_plain_allreduce,
    "partial_carries_late_solo": lambda d: test_partial_hook.check_late_gradients_carried("solo", d),
    "partial_carries_late_majority": lambda d: test_partial_hook.check_late_gradients_carried("majority", d),
    "dpsgd_mixing": lambda d: test_gossip.check_dpsgd_mixing(4, "ring", d),
    "osgp_push_sum": lambda d: test_gossip.check_push_sum(4, True, d),
    "sgp_push_sum": lambda d: test_gossip.check_push_sum(4, False, d),
    "adpsgd_mean_untorn": lambda d: test_gossip.check_adpsgd_mean_untorn_unwaited(4, d),
    "two_worlds": test_worlds.check_two_worlds,
    "wire_error_feedback": lambda d: test_wire.check_error_feedback(True, d),
    "wire_deltas": test_wire.check_deltas,
    # HSDP x WAGMA: FSDP2 on CUDA tensors over gloo, one GPU standing in for 2 replicas x 2 shards (NCCL would need
    # four GPUs): round 0's closed form, a synchronized model that trains, and the eager hook's conservation through
    # FSDP2's all-reduce hook (fp32 and bf16 on the wire). First passed on an H200 on 2026-11-27 (run 7 in
    # benchmarks/results/gpu/README.md).
    "hsdp_round0": test_hsdp.check_round0_on,
    "hsdp_sync_trains_wagma": lambda d: test_hsdp.check_sync_trains_on(d, "wagma"),
    "hsdp_eager_conserves_solo": lambda d: test_hsdp.check_eager_conserves_on(d, "solo"),
    "hsdp_eager_conserves_bf16": lambda d: test_hsdp.check_eager_conserves_on(d, "solo", "bf16"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("checks", nargs="*", help=f"which checks (default: all of {', '.join(CHECKS)})")
    args = parser.parse_args(argv)
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {unknown}; expected some of {list(CHECKS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and torch.cuda.is_available() is False here")
    failed = []
    for name in args.checks or list(CHECKS):
        t0 = time.perf_counter()
        try:
            CHECKS[name](args.device)
        except Exception as exc:  # noqa: BLE001 - report every check, then fail
            failed.append(name)
            print(
                f"FAIL {name} on {args.device} ({time.perf_counter() - t0:.1f} s): {type(exc).__name__}: {exc}",
                flush=True,
            )
        else:
            print(f"ok   {name} on {args.device} ({time.perf_counter() - t0:.1f} s)", flush=True)
    ran = len(args.checks or CHECKS)
    print(f"{ran - len(failed)} of {ran} checks passed on {args.device}" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
