"""The compute-bound regime: policies under stragglers when compute, not communication, fills a step.

Each step of each rank first sleeps the injected delay (``benchmarks.scenarios``, d in units of T),
then sleeps ``--compute-ms`` T (emulated device compute: a sleep, so the 2 cores are not the bottleneck),
then runs the real forward/backward of a synthetic MLP of ``--params`` parameters, the policy's
averaging (the library's own :func:`wagma.app.policies.build_policy`, as the training app builds it) and the
optimizer step. Per (scenario, policy, P, params) and repetition it measures:

- ``ms_per_step``: from a barrier after ``--warmup`` steps to a barrier after the last step and the
  policy's ``finalize`` (final mean or flush), the slowest rank (max end - min start over ranks), / steps;
- ``ideal_ms``: T + the mean over ranks and steps of the delays the ranks actually slept (docs/design.md §4);
- ``no_wait_ms``: T + the largest total delay any one rank slept, / steps: what ranks that never wait for
  each other (nor communicate) take on the same trace, timed like ``ms_per_step``. Every protocol's bound is
  at or above it, so ``ideal / no_wait`` is the most ``x_ideal`` any policy can reach over this many steps
  (it tends to 1 as the steps grow: the slowest rank's share of the delays evens out);
- ``bound_ms``: the policy's protocol bound on that recorded delay trace (:func:`benchmarks.simulate.protocol_bound`:
  zero-cost communication, T of compute per step);
- ``bound_trace_ms``: the same protocol bound on the recorded compute trace instead of T (per rank and
  step: the sleeps plus the real forward/backward and optimizer step, which on 8-16 ranks sharing 2 cores
  is not small); ``x_bound_trace`` = bound_trace / ms: what communication and the implementation cost;
- ``breakdown_ms``: where a step goes, means over ranks and steps: ``sleeps`` (T and the injected delay),
  ``compute`` (the real forward/backward/step), ``averaging`` (the policy on the main thread: DDP's or the
  hook's wait after the last gradient, the averaging before and after the optimizer step, waits included),
  ``finalize`` (the final mean or flush, per timed step); ms/step minus their sum is the slowest rank's excess;
- ``simulated_ms``: :func:`benchmarks.simulate.simulate` with the ranks sharing this machine's ``cores``, which
  run the CPU work round robin in the scheduler's time slice ``slice_s`` (measured once per invocation,
  :func:`benchmarks.machine.scheduler_slice_s`, or ``--slice-ms``): per rank and step it replays the sleeps as
  durations, and as CPU work the main thread's CPU time (``time.thread_time``) of the forward/backward and
  optimizer step before the exchange and of the policy's own work after it; a collective costs each member the
  CPU time (every thread of the process) that an allreduce of 1 float and of the model took in the same world
  before training, through the run's transport (5 samples each: the median of the mean over ranks; a linear fit
  in the bytes), times ``comm_scale`` (:func:`shared_cores`: the run's own CPU beyond its main threads', over
  that calibration's prediction); ``modeled_cpu_ms`` is the CPU per rank and step this replays, beside the
  measured ``cpu_ms``;
- ``bound_cores_ms``: the protocol's best *on this machine*: the shared-cores simulation of the same sleeps and
  compute CPU with free communication and no averaging work; ``x_bound_cores`` = that / ms: what communication
  and the policy's own work cost here, the cores' contention among the ranks' compute counted as the protocol's;
- ``simulated_own_cores_ms``: the simulator as if every rank had its own device: the recorded wall-clock trace
  (sleeps + real forward/backward/step) and the same calibration's wall-clock times (the fastest sample as the
  slowest rank saw it) as durations;

- ``simulated_link_ms`` (with ``--rank-net RATE``: every rank in its own network namespace behind a link shaped
  to RATE, :mod:`wagma.app.network`): the simulator's link model, every rank a device of its own on a link of
  that rate, replaying the recorded wall-clock trace; the bandwidth is the rate's (not fitted), the latency per
  message the calibrated one; ``x_link`` = that / ms: the simulator's error on the emulated cluster (give every
  rank its compute with ``--rank-cpus`` too, or the ranks lend each other idle cores the model does not have);

``--transport shm`` sets ``averaging.transport=shm`` for every policy that has the key (``allreduce``, the
``wagma`` and ``eager`` presets): their collectives go through shared memory instead of gloo's sockets, the
DDP baseline's gradient allreduce included. Records carry ``transport``.

Ratios (medians of the repetitions first): ``x_ddp`` = DDP's ms / the policy's, ``x_ideal`` = ideal / ms,
``x_bound`` = bound / ms (what the implementation keeps of what the protocol permits).

Usage::

    python benchmarks/regime.py --quick                       # smoke test: P=4, random_k1, T=20 ms, 1 rep
    python benchmarks/regime.py --worlds 4 8 16 --reps 3      # the grid (see benchmarks/regime_campaign.sh)

Outputs in ``--out`` (default ``benchmarks/results/regime``): ``regime.json.xz`` (xz-compressed JSON, read with
:func:`benchmarks.results_io.load`; ``records``: one per
(scenario, policy, world_size, params) with medians; ``reps``: every repetition; ``invocations``:
command, machine, settings) and, through :mod:`benchmarks.regime_report`, ``regime.md`` and plots.
``--append`` merges into an existing ``regime.json`` (a record of the same key is replaced).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402  (DDP imports it lazily: once here, not in every forked rank)
import torch.distributed as dist  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from benchmarks import results_io  # noqa: E402
from benchmarks import scenarios as sc  # noqa: E402
from benchmarks.machine import load_average, machine_info, scheduler_slice_s, usable_cores  # noqa: E402
from benchmarks.simulate import ZERO_NETWORK, Network, no_wait_ms, protocol_bound, simulate  # noqa: E402
from wagma.app.config import build_optimizer, group_options  # noqa: E402
from wagma.app.imbalance import build_imbalance  # noqa: E402
from wagma.app.models import MLP  # noqa: E402
from wagma.app.network import check_rank_net, network_job, parse_rate, rate_name, worker_setup  # noqa: E402
from wagma.app.policies import build_policy  # noqa: E402
from wagma.app.quota import RankQuota, check_rank_cpus, quota_job  # noqa: E402
from wagma.shm import SharedMemoryAllreduce  # noqa: E402
from wagma.testing import WorkerError, run_workers  # noqa: E402

__all__ = ["hidden_width", "main", "parse_args", "resimulate", "run_reps", "shared_cores", "summarize"]

IN_DIM, CLASSES = 64, 10  # the synthetic MLP's input and output sizes (digits-like)
SCENARIOS: tuple[str, ...] = ("random_k1", "random_k2", "persistent", "heavy_tail")
POLICIES: tuple[str, ...] = (
    "allreduce",
    "local_sgd",
    "hierarchical",
    "wagma",
    "eager_solo",
    "eager_majority",
    "dpsgd",
    "sgp",
    "osgp",
    "adpsgd",
)
QUICK = {"worlds": [4], "scenarios": ["random_k1"], "steps": 14, "warmup": 3, "reps": 1, "compute_ms": 20.0}
FULL = {"worlds": [4, 8, 16], "scenarios": list(SCENARIOS), "steps": 36, "warmup": 3, "reps": 3, "compute_ms": 100.0}
KEY = ("scenario", "policy", "world_size", "params", "compute_ms")


def hidden_width(params: int) -> int:
    """Width H of the two hidden layers of the synthetic MLP ``IN_DIM -> H -> H -> CLASSES`` closest to ``params``."""
    if params < 1000:
        raise ValueError(f"params must be >= 1000, got {params}")
    b = IN_DIM + CLASSES + 2  # H^2 + b H + CLASSES = params
    return max(1, round((-b + math.sqrt(b * b + 4 * (params - CLASSES))) / 2))


def _allreduce_s(
    n: int, reduce: Callable[[torch.Tensor], Any], repeats: int = 5, device: torch.device | None = None
) -> tuple[list[float], list[float]]:
    """Wall-clock times and CPU times (every thread of this process) of ``repeats`` allreduces of ``n`` floats (on
    ``device``, default CPU) over the default group (all ranks call it) by ``reduce``, after one untimed."""
    buf, times, cpu = torch.zeros(n, device=device), [], []
    reduce(buf)
    for _ in range(repeats):
        dist.barrier()
        t0, c0 = time.perf_counter(), _cpu_s()
        reduce(buf)
        times.append(time.perf_counter() - t0)
        cpu.append(_cpu_s() - c0)
    return times, cpu


def _calibrate(nparams: int, transport: str, device: torch.device) -> dict[str, Any]:
    """Allreduce times (wall-clock and CPU) of 1 float and of the model on ``device``, through the run's transport
    (gloo, or shared memory: what its policies' collectives go through); a shared segment lives only as long as this
    call."""
    reduce = SharedMemoryAllreduce(None, nparams).all_reduce if transport == "shm" else dist.all_reduce
    small, small_cpu = _allreduce_s(1, reduce, device=device)
    large, large_cpu = _allreduce_s(nparams, reduce, device=device)
    return {
        "allreduce_small_s": small,
        "allreduce_model_s": large,
        "allreduce_small_cpu_s": small_cpu,
        "allreduce_model_cpu_s": large_cpu,
        "nparams": nparams,
    }


def _rank(rank: int, world_size: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank of one world (forked by :func:`wagma.testing.run_workers`): every repetition in turn, each
    with a fresh policy, optimizer and delay trace (imbalance seed = repetition); returns their traces. With
    ``rank_cpus`` the rank first joins a CPU cgroup of its own, capped at that many CPUs (every thread: gloo's, the
    progress threads), and leaves it when done."""
    quota = RankQuota(spec["rank_cpus"], job=spec["quota_job"], rank=rank) if spec.get("rank_cpus") else None
    try:
        return _rank_traces(rank, world_size, spec)
    finally:
        if quota is not None:
            quota.leave()


def _rank_traces(rank: int, world_size: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    torch.manual_seed(rank)
    device = torch.device(spec["device"])
    if device.type == "cuda":  # every rank on GPU rank % count: with one GPU, all ranks share it (through gloo)
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    net = MLP((IN_DIM,), CLASSES, hidden=[spec["hidden"]] * 2).to(device)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(spec["batch_size"], IN_DIM, generator=gen).to(device)
    y = torch.randint(0, CLASSES, (spec["batch_size"],), generator=gen).to(device)
    with torch.no_grad():
        for tensor in net.state_dict().values():
            dist.broadcast(tensor, src=0)
    nparams = sum(p.numel() for p in net.parameters())
    network = _calibrate(nparams, str(spec["averaging"].get("transport", "default")), device)
    # When the last gradient of the current backward pass was accumulated, and the main thread's CPU time then
    # (backward runs on the calling thread on CPU; on CUDA autograd's device thread runs it, whose CPU clock is not
    # the main thread's: None then, and the step's CPU split falls back to the main thread's own spans).
    ready: list[float | None] = [0.0, 0.0]
    main_thread = threading.get_ident()

    def mark(_q: torch.Tensor) -> None:
        ready[0] = time.perf_counter()
        ready[1] = time.thread_time() if threading.get_ident() == main_thread else None

    hooks = [q.register_post_accumulate_grad_hook(mark) for q in net.parameters()]
    try:
        return [
            _repetition(rank, world_size, spec, rep, net, (x, y), ready, device) | network
            for rep in range(spec["reps"])
        ]
    finally:
        for hook in hooks:
            hook.remove()


def _cpu_s() -> float:
    """CPU seconds this process (every thread of it: the main thread, the progress threads, gloo's) has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _repetition(
    rank: int,
    world_size: int,
    spec: dict[str, Any],
    rep: int,
    net: torch.nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    ready: list[float | None],
    device: torch.device,
) -> dict[str, Any]:
    """One timed repetition on this rank: warm-up, barrier, timed steps, finalize, barrier.

    On CUDA the step waits for the GPU after the backward pass and after the optimizer step, so that the
    spans measure finished work; the gradient hook's mark is then the time the last gradient was queued."""
    x, y = batch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    policy = build_policy(spec["averaging"], rank=rank, world_size=world_size, device=device)
    try:
        model = policy.wrap(net)
        optimizer = build_optimizer(spec["optim"], net.parameters())
        imbalance_cfg = dict(spec["imbalance"])
        if "seed" in imbalance_cfg:
            imbalance_cfg["seed"] = rep  # a fresh delay trace per repetition, the same for every policy
        imbalance = build_imbalance(imbalance_cfg, rank, world_size)
        compute_s, warmup, steps = spec["compute_ms"] / 1e3, spec["warmup"], spec["steps"]
        slept, pre, real, averaging, compute_cpu, averaging_cpu = [], [], [], [], [], []

        def one_step(step: int, inject: bool) -> None:
            t0 = time.perf_counter()
            delay = imbalance(step) if inject else 0.0
            time.sleep(compute_s)  # the emulated device compute
            t1, c1 = time.perf_counter(), time.thread_time()
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP and the eager hook communicate in here, after the last gradient is ready
            sync()
            policy.before_step(optimizer, step)
            t2, c2 = time.perf_counter(), time.thread_time()
            optimizer.step()
            sync()
            t3, c3 = time.perf_counter(), time.thread_time()
            policy.after_step(optimizer, step)
            sync()
            t4, c4 = time.perf_counter(), time.thread_time()
            if inject:  # the trace the simulator replays: sleeps, and the real compute without any waiting
                ready_cpu = c2 if ready[1] is None else ready[1]
                slept.append(delay)
                pre.append(t1 - t0)
                real.append((ready[0] - t1) + (t3 - t2))
                # The policy's time on the main thread: DDP's or the hook's wait after the last gradient, the
                # averaging before and after the optimizer step (copies, store calls, waiting for results).
                averaging.append((t2 - ready[0]) + (t4 - t3))
                # The same two spans in the main thread's CPU time: the work, without waiting or being descheduled.
                compute_cpu.append((ready_cpu - c1) + (c3 - c2))
                averaging_cpu.append((c2 - ready_cpu) + (c4 - c3))

        for step in range(warmup):
            one_step(step, inject=False)
        dist.barrier()
        start, cpu0 = time.monotonic(), _cpu_s()
        for step in range(warmup, warmup + steps):
            one_step(step, inject=True)
        finished, cpu1 = time.monotonic(), _cpu_s()
        policy.finalize(model, optimizer)
        dist.barrier()
        end = time.monotonic()
        return {
            "rep": rep,
            "start": start,
            "finished": finished,
            "end": end,
            "slept": slept,
            "pre": pre,
            "real": real,
            "averaging": averaging,
            "compute_cpu": compute_cpu,
            "averaging_cpu": averaging_cpu,
            "cpu_s": cpu1 - cpu0,
            "stats": policy.stats(),
        }
    finally:
        policy.close()


def _spec(cfg: Any, args: argparse.Namespace, params: int) -> dict[str, Any]:
    return {
        "averaging": group_options(cfg, "averaging"),
        "imbalance": group_options(cfg, "imbalance"),
        "optim": group_options(cfg, "optim"),
        "compute_ms": args.compute_ms,
        "hidden": hidden_width(params),
        "batch_size": args.batch_size,
        "warmup": args.warmup,
        "steps": args.steps,
        "reps": args.reps,
        "device": args.device,
        "rank_cpus": args.rank_cpus,
        "quota_job": f"regime-{os.getpid()}",
        "rank_net": args.rank_net,
        "net_job": f"regime-net-{os.getpid()}",
    }


def run_reps(cfg: Any, args: argparse.Namespace, world: int, params: int) -> list[dict[str, Any]]:
    """Run ``args.reps`` repetitions in one world of ``world`` forked ranks; per repetition, its measured,
    ideal, bound and simulated ms/step."""
    spec = _spec(cfg, args, params)
    timeout_s = 120.0 + args.reps * (args.warmup + args.steps) * (4 * 5 * args.compute_ms / 1e3 + 2.0)
    rate, job = spec["rank_net"], spec["net_job"]
    # nothing left of the ranks' cgroups and networks; with rank_net each rank enters its network before its group
    with quota_job(spec["quota_job"], enabled=bool(args.rank_cpus)), network_job(job, enabled=rate is not None):
        per_rank = run_workers(
            _rank,
            world,
            spec,
            timeout_s=timeout_s,
            collective_timeout_s=120.0,
            setup=worker_setup(rate, job) if rate is not None else None,
        )
    return [_analyse([reps[i] for reps in per_rank], spec, args, world) for i in range(args.reps)]


def _analyse(ranks: list[dict[str, Any]], spec: dict[str, Any], args: argparse.Namespace, world: int) -> dict[str, Any]:
    """One repetition's numbers from every rank's trace."""
    t = args.compute_ms / 1e3
    delays = np.array([r["slept"] for r in ranks])
    pre = np.array([r["pre"] for r in ranks])
    real = np.array([r["real"] for r in ranks])
    nbytes = 4.0 * ranks[0]["nparams"]
    # Each sample as the slowest rank saw it, then the fastest sample: one slow outlier (another process
    # holding the cores) must not set the network's speed.
    small = min(max(s) for s in zip(*(r["allreduce_small_s"] for r in ranks), strict=True))
    large = min(max(s) for s in zip(*(r["allreduce_model_s"] for r in ranks), strict=True))
    net = _alpha_beta(small, large, world, nbytes, args.activation_ms / 1e3)
    # The CPU a collective costs each member: per sample the mean over ranks, then the median over samples.
    small_cpu, large_cpu = (
        statistics.median(statistics.mean(s) for s in zip(*(r[key] for r in ranks), strict=True))
        for key in ("allreduce_small_cpu_s", "allreduce_model_cpu_s")
    )
    cpu_net = _alpha_beta(small_cpu, large_cpu, world, nbytes, args.activation_ms / 1e3)
    avg = spec["averaging"]
    total = max(r["end"] for r in ranks) - min(r["start"] for r in ranks)
    traces = {
        "sleeps_ms": np.round(1e3 * pre, 3).tolist(),
        "compute_cpu_ms": np.round(1e3 * np.array([r["compute_cpu"] for r in ranks]), 3).tolist(),
        "averaging_cpu_ms": np.round(1e3 * np.array([r["averaging_cpu"] for r in ranks]), 3).tolist(),
        # CPU time per rank and timed step, every thread of the rank's process, mean over ranks. Ranks share the
        # machine's cores: P x cpu_ms / cores is a floor under ms/step that sleeping cannot hide.
        "cpu_ms": 1e3 * statistics.mean(r["cpu_s"] for r in ranks) / args.steps,
        "cores": usable_cores(),
        "slice_s": args.slice_s,
        "nbytes": nbytes,
        "averaging_options": avg,
        "cpu_network": {
            "alpha_s": cpu_net.alpha_s,
            "bandwidth_Bps": cpu_net.bandwidth_Bps,
            "activation_s": cpu_net.activation_s,
            "allreduce_1_float_s": small_cpu,
            "allreduce_model_s": large_cpu,
        },
    }
    return (
        traces
        | shared_cores(avg, traces, args.warmup)
        | {
            "rep": ranks[0]["rep"],
            "ms_per_step": 1e3 * total / args.steps,
            "loop_ms_per_step": 1e3 * (max(r["finished"] for r in ranks) - min(r["start"] for r in ranks)) / args.steps,
            "ideal_ms": 1e3 * (t + float(delays.mean())),
            "no_wait_ms": no_wait_ms(t, delays),
            "bound_ms": protocol_bound(avg, t, delays, first_step=args.warmup).ms_per_step,
            # The same protocol on the compute each rank really did (sleeps + its real forward/backward/step),
            # with free communication: what the implementation loses beyond the cost of computing.
            "bound_trace_ms": simulate(avg, pre + real, network=ZERO_NETWORK, first_step=args.warmup).ms_per_step,
            "simulated_own_cores_ms": simulate(
                avg, pre + real, network=net, nbytes=nbytes, first_step=args.warmup
            ).ms_per_step,
            "real_compute_ms": 1e3 * float(real.mean()),
            **_link(avg, pre + real, spec["rank_net"], net, nbytes, args.warmup),
            # Where a step goes (means over ranks and steps): the sleeps, the real compute, the policy on the main
            # thread; the final mean or flush per timed step; the rest is the slowest rank's excess over the mean.
            "breakdown_ms": {
                "sleeps": 1e3 * float(pre.mean()),
                "compute": 1e3 * float(real.mean()),
                "averaging": 1e3 * float(np.mean([r["averaging"] for r in ranks])),
                "finalize": 1e3 * (max(r["end"] for r in ranks) - max(r["finished"] for r in ranks)) / args.steps,
            },
            "network": {
                "alpha_s": net.alpha_s,
                "bandwidth_Bps": net.bandwidth_Bps,
                "activation_s": net.activation_s,
                "allreduce_1_float_s": small,
                "allreduce_model_s": large,
            },
            "params": ranks[0]["nparams"],
            "policy_stats": ranks[0]["stats"],
            # The recorded traces, [rank][step]: the delays (to recompute bounds) and the simulator's input.
            "delays_ms": np.round(1e3 * delays, 3).tolist(),
            "trace_ms": np.round(1e3 * (pre + real), 3).tolist(),
        }
    )


def _link(
    averaging: dict[str, Any], trace: np.ndarray, rate: str | None, net: Network, nbytes: float, warmup: int
) -> dict[str, Any]:
    """With ``rank_net``: the simulator's link model, every rank a device on a link of ``rate`` (the bandwidth the
    rate's, not a calibration's; the latency per message the calibrated one), on the recorded compute trace:
    ``simulated_link_ms``, what the simulator is validated by against the measured ms/step."""
    if rate is None:
        return {}
    bits = parse_rate(rate)
    assert bits is not None
    link = Network(alpha_s=net.alpha_s, bandwidth_Bps=bits / 8, activation_s=net.activation_s)
    return {
        "rank_net": rate,
        "simulated_link_ms": simulate(averaging, trace, network=link, nbytes=nbytes, first_step=warmup).ms_per_step,
        "link_network": {"alpha_s": link.alpha_s, "bandwidth_Bps": link.bandwidth_Bps},
    }


def shared_cores(averaging: dict[str, Any], rep: dict[str, Any], warmup: int) -> dict[str, Any]:
    """The simulation of one repetition with its ranks sharing the machine's cores, from what the repetition stored:
    ``sleeps_ms``, ``compute_cpu_ms`` and ``averaging_cpu_ms`` ([rank][step]), ``cpu_ms``, ``cores``, ``slice_s``
    (the scheduler's time slice, measured on the machine: the cores run work round robin in slices of it; None:
    processor sharing), ``nbytes`` and the idle world's ``cpu_network`` calibration.

    The collectives' CPU is the calibration's, scaled by one factor per run (``comm_scale``): the CPU the ranks'
    processes used beyond their main threads' measured work (every other thread: gloo's, the progress thread's),
    over what the calibration predicts for the collectives the protocol runs in the timed steps. So the CPU the
    model replays is the CPU the run used, and the calibration (the ring formula through an idle world's allreduce
    of 1 float and of the model) only sets how it splits between collectives (of 2 ranks or all, of the model or of
    a float); a scale above 1 is the collectives' cost under load.
    """
    sleeps, cpu, after = (np.array(rep[k]) / 1e3 for k in ("sleeps_ms", "compute_cpu_ms", "averaging_cpu_ms"))
    cores = {"cores": rep["cores"], "slice_s": rep["slice_s"]}
    world, steps = sleeps.shape
    c = rep["cpu_network"]
    net = Network(c["alpha_s"], c["bandwidth_Bps"], c["activation_s"])
    # The protocol's best on this machine: the same sleeps and compute CPU on the same shared cores, with free
    # communication (the collectives' work scaled to 0, no activation latency) and no averaging work, so what is
    # left is what the protocol and the cores cost. Its comm_s counts the calibration's cost of the collectives
    # the protocol runs, which no timing changes.
    free = Network(net.alpha_s, net.bandwidth_Bps)
    best = simulate(
        averaging, sleeps, network=free, nbytes=rep["nbytes"], first_step=warmup, cpu_s=cpu, **cores, comm_scale=0.0
    )
    predicted = sum(best.comm_s)
    other = max(0.0, rep["cpu_ms"] / 1e3 * world * steps - float(cpu.sum() + after.sum()))
    scale = other / predicted if predicted > 0 else 1.0
    shared = simulate(
        averaging,
        sleeps,
        network=net,
        nbytes=rep["nbytes"],
        first_step=warmup,
        cpu_s=cpu,
        after_cpu_s=after,
        **cores,
        comm_scale=scale,
    )
    return {
        "simulated_ms": shared.ms_per_step,
        "comm_scale": scale,
        "modeled_cpu_ms": 1e3 * shared.cpu_work_s / (world * steps),
        "bound_cores_ms": best.ms_per_step,
    }


def _alpha_beta(small: float, large: float, world: int, nbytes: float, activation_s: float) -> Network:
    """The :class:`Network` through an allreduce's cost over ``world`` ranks of 1 float (``small``) and of ``nbytes``
    (``large``)."""
    if world == 1:  # a world of one rank has nothing to exchange
        return Network(alpha_s=0.0, bandwidth_Bps=float("inf"), activation_s=activation_s)
    spread = large - small
    bandwidth = 2 * (world - 1) / world * nbytes / spread if spread > 0 else float("inf")
    return Network(alpha_s=small / (2 * (world - 1)), bandwidth_Bps=bandwidth, activation_s=activation_s)


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions of one (scenario, policy, world_size, params)."""
    out = {
        k: statistics.median(r[k] for r in reps)
        for k in ("ms_per_step", "ideal_ms", "bound_ms", "simulated_ms", "loop_ms_per_step", "real_compute_ms")
    }
    # Fields older repetitions lack (recorded since): a median only where every repetition has one.
    for key in (
        "simulated_own_cores_ms",
        "modeled_cpu_ms",
        "cores",
        "comm_scale",
        "bound_cores_ms",
        "slice_s",
        "no_wait_ms",
        "cpu_ms",
        "bound_trace_ms",
        "simulated_link_ms",
    ):
        if all(r.get(key) is not None for r in reps):
            out[key] = statistics.median(r[key] for r in reps)
    if "simulated_link_ms" in out:
        out["x_link"] = out["simulated_link_ms"] / out["ms_per_step"]
    for bound in ("bound_cores", "bound_trace"):
        if f"{bound}_ms" in out:
            out[f"x_{bound}"] = out[f"{bound}_ms"] / out["ms_per_step"]
    out["reps"] = len(reps)
    if all("breakdown_ms" in r for r in reps):
        out["breakdown_ms"] = {
            k: statistics.median(r["breakdown_ms"][k] for r in reps) for k in reps[0]["breakdown_ms"]
        }
    out["x_ideal"] = out["ideal_ms"] / out["ms_per_step"]
    out["x_bound"] = out["bound_ms"] / out["ms_per_step"]
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring); ``--quick`` or the full grid fill what is not given."""
    p = argparse.ArgumentParser(description="Policies in the compute-bound regime (emulated compute + stragglers)")
    p.add_argument("--quick", action="store_true", help="smoke test: P=4, random_k1, 14 steps, T=20 ms, 1 rep")
    p.add_argument("--compute-ms", type=float, default=None, help="emulated compute T per step (full: 100)")
    p.add_argument("--params", type=float, nargs="+", default=[0.25e6], help="MLP sizes (default 0.25e6)")
    p.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=None,
        help="world sizes (full: 4 8 16; 1: one rank alone, nothing to wait for or share cores with)",
    )
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=None,
        choices=(*SCENARIOS, "none"),
        help="imbalance scenarios (full: the four with stragglers; 'none' measures the overhead)",
    )
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (full: 36)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (full: 3)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, medians reported (full: 3)")
    p.add_argument("--batch-size", type=int, default=4, help="examples per rank and step (real compute stays small)")
    p.add_argument("--activation-ms", type=float, default=0.2, help="simulator: round activation latency")
    p.add_argument(
        "--slice-ms",
        type=float,
        default=None,
        help="simulator: the time slice of the shared cores (default: measured on this machine, "
        "benchmarks.machine.scheduler_slice_s)",
    )
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="extra Hydra override for every run, e.g. --set averaging.group_size=4 (repeatable)",
    )
    p.add_argument(
        "--transport",
        choices=("default", "shm"),
        default="default",
        help="averaging.transport of every policy that has one (allreduce, wagma, eager): shm moves the "
        "CPU collectives through shared memory instead of gloo's sockets; the others keep gloo",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model, its gradients and the averaged buffers live; cuda: rank r on GPU "
        "r %% device_count() (ranks share one GPU through gloo); records carry the device",
    )
    p.add_argument(
        "--rank-cpus",
        type=float,
        default=0.0,
        help="each rank in its own CPU cgroup capped at this many CPUs, as a device would be (0: none; "
        "root; every world's P x quota must fit the cores); records carry it",
    )
    p.add_argument(
        "--rank-net",
        default=None,
        metavar="RATE",
        help="each rank in its own network namespace behind a link shaped to RATE (e.g. 200mbit; root, tc); "
        "records carry it and the simulator's link model of it (simulated_link_ms, x_link)",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results[/quick])")
    p.add_argument("--append", action="store_true", help="merge into an existing regime.json")
    p.add_argument("--no-report", action="store_true", help="write regime.json only")
    p.add_argument("--report-only", action="store_true", help="only rewrite regime.md and the plots from regime.json")
    p.add_argument(
        "--resimulate",
        action="store_true",
        help="redo the shared-cores simulation of every repetition in regime.json from its stored traces "
        "(no run), then rewrite the records' medians and the report",
    )
    args = p.parse_args(argv)
    mode = QUICK if args.quick else FULL
    for key, value in mode.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = ROOT / ("benchmarks/results/quick" if args.quick else "benchmarks/results/regime")
    if args.compute_ms <= 0 or args.steps < 1 or args.warmup < 2 or args.reps < 1 or min(args.worlds) < 1:
        p.error("need --compute-ms > 0, --steps >= 1, --warmup >= 2 (DDP rebuilds buckets), --reps >= 1, worlds >= 1")
    if args.rank_cpus and not (args.report_only or args.resimulate):
        for world in args.worlds:
            problem = check_rank_cpus(args.rank_cpus, world)
            if problem is not None:
                p.error(f"--rank-cpus: {problem}")
    try:
        args.rank_net = rate_name(args.rank_net)
    except ValueError as err:
        p.error(f"--rank-net: {err}")
    if args.rank_net is not None and not (args.report_only or args.resimulate):
        for world in args.worlds:
            if (problem := check_rank_net(args.rank_net, world, world)) is not None:
                p.error(f"--rank-net: {problem}")
    if args.device == "cuda" and args.transport == "shm":
        p.error("--transport shm moves host memory: it cannot carry CUDA tensors (use --transport default)")
    if args.device == "cuda" and not (args.report_only or args.resimulate):
        # Ask NVML, not the CUDA runtime: this process forks the ranks and must not initialise CUDA itself.
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        if not torch.cuda.is_available():
            p.error("--device cuda needs a CUDA GPU, and torch.cuda.is_available() is False here")
    args.params = [int(v) for v in args.params]
    args.policies = [sc.BASELINE] + [q for q in dict.fromkeys(args.policies) if q != sc.BASELINE]
    return args


def _load(path: Path, append: bool) -> dict[str, Any]:
    if append and path.exists():
        return results_io.load(path)
    return {"invocations": [], "records": [], "reps": []}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the grid; write and return ``regime.json``'s contents."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    found = results_io.find(args.out, "regime.json")  # regime.json.xz, or an older plain regime.json
    path = args.out / "regime.json.xz"

    def save(result: dict[str, Any], final: bool = True) -> None:
        results_io.dump(path, result, preset=9 if final else 1)  # a quick save after every record, the small one last
        if found != path and found.exists():
            found.unlink()  # converted to the compressed file

    command = "python " + shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    if args.report_only or args.resimulate:
        if not found.exists():
            flag = "--resimulate" if args.resimulate else "--report-only"
            raise FileNotFoundError(f"{flag} needs {path}: expected a regime.json from an earlier run, found none")
        result = results_io.load(found)
        if args.resimulate:
            # The slice: as given, else as each invocation measured it, else measured now (the same machine).
            slice_s = args.slice_ms / 1e3 if args.slice_ms is not None else None
            measured = None
            if slice_s is None and any("slice_s" not in i["settings"] for i in result["invocations"]):
                measured = scheduler_slice_s()
            resimulate(result, slice_s, measured)
            result.setdefault("resimulations", []).append(
                {"command": command, "machine": machine_info(ROOT), "slice_s": slice_s, "slice_s_measured": measured}
            )
            save(result)
        _report(args.out, result)
        return result
    result = _load(found, args.append)
    args.slice_s = args.slice_ms / 1e3 if args.slice_ms is not None else scheduler_slice_s()
    invocation = len(result["invocations"])
    settings = {
        k: getattr(args, k)
        for k in (
            "compute_ms",
            "params",
            "worlds",
            "scenarios",
            "policies",
            "steps",
            "warmup",
            "reps",
            "batch_size",
            "activation_ms",
            "extra",
            "transport",
            "slice_s",
            "device",
            "rank_cpus",
            "rank_net",
        )
    }
    result["invocations"].append({"command": command, "machine": machine_info(ROOT), "settings": settings})
    started = time.perf_counter()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        for params in args.params:
            for world in args.worlds:
                for scenario in args.scenarios:
                    ddp_ms = None
                    for policy in args.policies:
                        key = dict(zip(KEY, (scenario, policy, world, params, args.compute_ms)))
                        cfg, reason = _compose(
                            policy, scenario, world, args.compute_ms, args.extra, args.transport, args.device
                        )
                        rec: dict[str, Any] = key | {"status": "ok", "invocation": invocation, "steps": args.steps}
                        reps: list[dict[str, Any]] = []
                        try:
                            if cfg is None:
                                raise ValueError(reason)
                            # A repetition carries its record's key (the requested params; the model's own count as
                            # params_actual) and invocation, so that --append replaces it with its record.
                            reps = [
                                key | r | {"params_actual": r["params"], "params": params, "invocation": invocation}
                                for r in run_reps(cfg, args, world, params)
                            ]
                            rec |= summarize(reps)
                            rec["params_actual"] = reps[0]["params_actual"]
                            rec["transport"] = str(cfg.averaging.get("transport", "default"))
                            rec["device"] = args.device
                            rec["rank_cpus"] = args.rank_cpus
                            rec["rank_net"] = args.rank_net
                        except (WorkerError, ValueError, OSError) as exc:
                            rec |= {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[-3000:]}
                        if policy == sc.BASELINE and rec["status"] == "ok":
                            ddp_ms = rec["ms_per_step"]
                        rec["x_ddp"] = ddp_ms / rec["ms_per_step"] if ddp_ms and rec["status"] == "ok" else None
                        _replace(result, rec, reps)
                        save(result, final=False)
                        print(_line(rec), flush=True)
    result["invocations"][-1]["duration_s"] = time.perf_counter() - started
    result["invocations"][-1]["load_average_end"] = load_average()
    save(result)
    if not args.no_report:
        _report(args.out, result)
    print(f"done in {time.perf_counter() - started:.0f} s -> {path}", flush=True)
    return result


def resimulate(result: dict[str, Any], slice_s: float | None = None, measured_slice_s: float | None = None) -> None:
    """Redo :func:`shared_cores` for every repetition of ``result`` (a ``regime.json``) that stored its CPU traces,
    in place, and the medians of their records. A repetition without its averaging options (stored since this
    function exists) gets them composed again from its invocation's settings, and keeps them.

    Args:
        result: the contents of a ``regime.json``.
        slice_s: the scheduler's time slice for every repetition; None: the one its invocation measured, else
            ``measured_slice_s``.
        measured_slice_s: the slice measured now, for invocations from before the slice was measured; None
            there: processor sharing.
    """
    records = {tuple(r[k] for k in KEY): r for r in result["records"] if r.get("status") == "ok"}
    redone: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        for rep in result["reps"]:
            if "compute_cpu_ms" not in rep:
                continue  # from before CPU traces were recorded: its simulated_ms stays the own-cores model's
            invocation = result["invocations"][rep["invocation"]]
            settings = invocation["settings"]
            if "averaging_options" not in rep:
                rep["averaging_options"] = _averaging_options(rep, settings)
            rep.setdefault("nbytes", 4.0 * rep["params_actual"])
            rep.setdefault("cores", invocation["machine"]["cpus_usable"])
            rep["slice_s"] = slice_s if slice_s is not None else settings.get("slice_s", measured_slice_s)
            rep |= shared_cores(rep["averaging_options"], rep, settings["warmup"])
            redone.setdefault(tuple(rep[k] for k in KEY), []).append(rep)
    for key, reps in redone.items():
        if key in records:
            records[key] |= summarize(reps)


def _compose(
    policy: str, scenario: str, world: int, compute_ms: float, extra: Sequence[str], transport: str, device: str = "cpu"
) -> tuple[Any, str | None]:
    """``policy``'s config for one world of the grid (inside ``initialize_config_dir``), with the scenario's
    imbalance, the ``--set`` overrides and the transport for policies that have the key; or None and the reason
    the policy cannot run there."""
    base = [f"device={device}", *sc.SCENARIO_TABLE[scenario].overrides(compute_ms / 1e3, world), *extra]
    cfg, reason = sc.resolve_policy(policy, lambda o: compose("config", overrides=o), ROOT / "configs", world, base)
    if cfg is not None and "transport" in cfg.averaging:
        cfg.averaging.transport = transport
    return cfg, reason


def _averaging_options(rep: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The averaging options ``rep``'s run had, composed as :func:`main` composed them."""
    cfg, reason = _compose(
        rep["policy"],
        rep["scenario"],
        rep["world_size"],
        settings["compute_ms"],
        settings["extra"],
        settings.get("transport", "default"),
        settings.get("device", "cpu"),
    )
    if cfg is None:
        raise ValueError(f"cannot compose the options of {rep['policy']!r} again: {reason}")
    return group_options(cfg, "averaging")


def _report(out: Path, result: dict[str, Any]) -> None:
    from benchmarks import regime_report  # matplotlib only when reporting

    regime_report.write_all(out, result)


def _replace(result: dict[str, Any], rec: dict[str, Any], reps: list[dict[str, Any]]) -> None:
    same = lambda r: all(r.get(k) == rec[k] for k in KEY)  # noqa: E731
    result["records"] = [r for r in result["records"] if not same(r)] + [rec]
    result["reps"] = [r for r in result["reps"] if not same(r)] + reps


def _line(rec: dict[str, Any]) -> str:
    head = f"{rec['scenario']:<10} {rec['policy']:<15} P={rec['world_size']:<3} params={rec['params']:.3g}"
    if rec["status"] != "ok":
        return f"{head}  FAILED {rec['reason'].strip().splitlines()[-1][:200]}"
    x_ddp = "-" if rec["x_ddp"] is None else f"{rec['x_ddp']:.2f}"
    return (
        f"{head}  {rec['ms_per_step']:7.1f} ms/step  ideal {rec['ideal_ms']:6.1f}  bound {rec['bound_ms']:6.1f}  "
        f"sim {rec['simulated_ms']:6.1f}  x DDP {x_ddp}  x ideal {rec['x_ideal']:.2f}  "
        f"x bound {rec['x_bound']:.2f}"
        + (f" (on the trace {rec['x_bound_trace']:.2f})" if "x_bound_trace" in rec else "")
        + (f"  link model {rec['simulated_link_ms']:6.1f} (x {rec['x_link']:.2f})" if "x_link" in rec else "")
    )


if __name__ == "__main__":
    main()
