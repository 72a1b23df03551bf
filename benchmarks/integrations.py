"""Step time of wagma's framework adapters against the same policy in a plain DDP script (CPU ranks, gloo).

    python benchmarks/integrations.py                      # every framework installed, 2 ranks, 80 steps
    python benchmarks/integrations.py --world 2 --steps 120 --reps 3 --frameworks plain lightning

Every run trains the same MLP (``--width`` x 4 layers) on the same data, ``--batch`` examples per rank and step
(64), on ``--world`` CPU ranks (one thread each), and records on rank 0 the time between the starts of consecutive
optimizer steps (the whole step: data, forward, backward, hook, optimizer, averager and the framework's own per-step
work), after ``--warmup`` steps. A run's step time is the median of those intervals; with ``--reps`` the median over
the runs, which are interleaved (every kind once, then again).

The frameworks' own per-step work is mostly passes over the parameters or gradients (the HF Trainer's gradient
norm for its log, every step), so its share of a step falls with the compute per parameter: a batch of 64 through
an MLP is ~400 FLOPs per parameter and step, a ResNet-50 step of batch 128 ~60,000. ``--batch`` sets that regime.

The runs, per framework F (``lightning``, ``accelerate``, ``transformers``):

- ``plain/wagma``: a DDP script in torch alone with the policy, ``PeriodicAverager(period=4)`` and ``local_hook``:
  the reference every adapter is compared with (the target: at most 5 % slower);
- ``plain/plain``: the same script with DDP's own allreduce, no wagma;
- ``F/wagma``: F with wagma's adapter and the same policy;
- ``F/byhand``: F with the same policy wired in by hand (the hook registered on F's DDP model, the averager called
  after F's optimizer step): the adapter's own cost is the difference to ``F/wagma``;
- ``F/plain``: F without wagma (DDP's allreduce).

Every framework's DDP is built as the plain script builds it (``find_unused_parameters=False``): the HF Trainer's
default turns it on for any model without activation checkpointing; and the Trainer is told that its dataset has no
columns to remove (``remove_unused_columns=False``), which spares it filtering every example's keys. ``--hf-defaults``
keeps both of its defaults. ``--pin`` puts each rank, with every thread it starts, on a core of its own (rank r on
core r): one rank's extra work then delays the others only where they wait for it, as on separate devices.

``F/wagma`` against ``plain/wagma`` holds the framework's own per-step cost (its loop, callbacks, logging); where
that dominates, ``F/wagma`` against ``F/byhand`` is what the adapter adds. ``--cpu-time`` measures the adapters' own
code alone (optimizer step plus averager step, in one process's CPU time), which the machine's load barely moves.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
PERIOD = 4


def _net(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, width), torch.nn.ReLU()]
    for _ in range(3):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def _data(n: int) -> torch.utils.data.TensorDataset:
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def _averager(module: torch.nn.Module) -> Any:
    from wagma import PeriodicAverager

    return PeriodicAverager(PERIOD, timeout=60.0)


class _Clock:
    """Rank 0's step start times."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def tick(self) -> None:
        self.starts.append(time.perf_counter())


def _write(out: str, clock: _Clock) -> None:
    if int(os.environ.get("RANK", "0")) == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
        Path(out).write_text(json.dumps(clock.starts))


def _shuffled(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    """The frameworks' loader (they shard it over the ranks themselves): every rank's steps' worth, shuffled."""
    return torch.utils.data.DataLoader(_data(args.batch * args.steps * args.world), batch_size=args.batch, shuffle=True)


# -- the runs (each in its own processes) ----------------------------------------------------------------------------


def run_plain(args: argparse.Namespace, clock: _Clock) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from wagma import AveragingOptimizer, local_hook

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    net = _net(args.width)
    model = DDP(net)
    optimizer: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    averager = None
    if args.variant != "plain":
        model.register_comm_hook(None, local_hook)
        averager = _averager(net)
        optimizer = AveragingOptimizer(optimizer, averager, module=net)
    data = _data(args.batch * args.steps * dist.get_world_size())
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, sampler=sampler)
    for x, y in loader:
        clock.tick()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    clock.tick()
    if averager is not None:
        averager.close()
    _write(args.record, clock)
    dist.destroy_process_group()


def run_lightning(args: argparse.Namespace, clock: _Clock) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from wagma.integrations.lightning import WagmaDDPStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net(args.width)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class ByHand(Module):
        """The same policy wired into the LightningModule by hand: the adapter's cost is the difference."""

        def on_fit_start(self) -> None:
            from wagma import local_hook

            self.trainer.strategy.model.register_comm_hook(None, local_hook)
            self.averager = _averager(self)

        def optimizer_step(self, *a: Any, **k: Any) -> None:
            super().optimizer_step(*a, **k)
            self.averager.average_parameters(self.parameters(), self.buffers())

        def on_fit_end(self) -> None:
            self.averager.close()

    class Tick(L.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            clock.tick()

        def on_train_end(self, *a: Any) -> None:
            clock.tick()

    ddp = {"process_group_backend": "gloo", "timeout": datetime.timedelta(seconds=60)}
    strategy = WagmaDDPStrategy(averager=_averager, **ddp) if args.variant == "wagma" else DDPStrategy(**ddp)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.world,
        max_epochs=1,
        callbacks=[Tick()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = _shuffled(args)
    trainer.fit(ByHand() if args.variant == "byhand" else Module(), loader)
    _write(args.record, clock)


def run_accelerate(args: argparse.Namespace, clock: _Clock) -> None:
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from wagma.integrations.accelerate import prepare_wagma

    accelerator = Accelerator(
        cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=datetime.timedelta(seconds=60))]
    )
    net = _net(args.width)
    loader = _shuffled(args)
    model, optimizer, loader = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01), loader)
    run = prepare_wagma(accelerator, model, optimizer, averager=_averager) if args.variant == "wagma" else None
    if args.variant == "byhand":  # the same policy by hand: the hook, and the averager after the prepared step
        from wagma import local_hook

        model.register_comm_hook(None, local_hook)
        averager = _averager(net)
    for x, y in loader:
        clock.tick()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        if args.variant == "byhand":
            averager.average_parameters(net.parameters(), net.buffers())
    clock.tick()
    if run is not None:
        run.close()
    if args.variant == "byhand":
        averager.close()
    _write(args.record, clock)
    accelerator.end_training()


def run_transformers(args: argparse.Namespace, clock: _Clock) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from wagma.integrations.transformers import WagmaCallback

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net(args.width)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    class Pairs(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.data = _data(args.batch * args.steps * args.world)

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            x, y = self.data[i]
            return {"x": x, "labels": y}

    class Tick(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            clock.tick()

        def on_train_end(self, *a: Any, **k: Any) -> None:
            clock.tick()

    class ByHand(TrainerCallback):
        """The same policy by hand: the hook at on_train_begin, the averager after each optimizer step."""

        def __init__(self, trainer: Any) -> None:
            self.trainer = trainer

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            from wagma import local_hook

            self.trainer.model_wrapped.register_comm_hook(None, local_hook)
            self.averager = _averager(self.trainer.model)

        def on_optimizer_step(self, *a: Any, **k: Any) -> None:
            model = self.trainer.model
            self.averager.average_parameters(model.parameters(), model.buffers())

        def on_train_end(self, *a: Any, **k: Any) -> None:
            self.averager.close()

    with tempfile.TemporaryDirectory() as tmp:
        training = TrainingArguments(
            output_dir=tmp,
            num_train_epochs=1,
            per_device_train_batch_size=args.batch,
            learning_rate=0.01,
            lr_scheduler_type="constant",
            optim="sgd",
            max_grad_norm=0.0,
            save_strategy="no",
            logging_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
            ddp_backend="gloo",
            ddp_timeout=60,
            # DDP as the plain script builds it: the Trainer's default (None) turns find_unused_parameters on for
            # every model without activation checkpointing, an extra pass over the autograd graph each backward.
            ddp_find_unused_parameters=None if args.hf_defaults else False,
            # The default wraps the collator in one that filters every example's keys against the forward's
            # signature (for a datasets.Dataset's columns): 2.8 ms a step here, for a dataset that has no others.
            remove_unused_columns=args.hf_defaults,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = Trainer(model=Model(), args=training, train_dataset=Pairs(), callbacks=[Tick()])
        if args.variant == "wagma":
            trainer.add_callback(WagmaCallback(trainer, averager=_averager))
        elif args.variant == "byhand":
            trainer.add_callback(ByHand(trainer))
        trainer.train()
    _write(args.record, clock)
    dist.destroy_process_group()


VARIANTS = ("wagma", "byhand", "plain")
RUNS = {"plain": run_plain, "lightning": run_lightning, "accelerate": run_accelerate, "transformers": run_transformers}


# -- the adapters' own code, in CPU time ------------------------------------------------------------------------


def adapter_cpu_time(width: int, reps: int = 3, n: int = 400) -> dict[str, float]:
    """Median thread CPU time (µs) of one optimizer step plus averager step: through each adapter's code and by hand.

    One process, a world of one rank (a gloo group over a file store), the benchmark's MLP with zero gradients and
    ``PeriodicAverager(period=4)``. CPU time, unlike wall time, barely moves with the load of other processes on
    the machine, so it shows the adapters' own per-step cost where the step-time comparison drowns in that noise.
    """
    from wagma.integrations._common import AveragingStep
    from wagma.integrations.accelerate import _CountingAveragingOptimizer

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    torch.set_num_threads(1)
    net = _net(width)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    wrapped = _CountingAveragingOptimizer(optimizer, _averager(net), net, None)  # Accelerate and the HF Trainer
    stepper = AveragingStep(_averager(net), net)  # Lightning's strategy
    by_hand = _averager(net)

    def lightning() -> None:
        groups = optimizer.param_groups
        optimizer.step(stepper.wrap_closure(lambda: None, groups))
        stepper.after_step(groups)

    def hand() -> None:
        optimizer.step()
        by_hand.average_parameters(net.parameters(), net.buffers())

    def median_us(fn: Any) -> float:
        times = []
        for _ in range(n):
            start = time.thread_time()
            fn()
            times.append(time.thread_time() - start)
        return 1e6 * statistics.median(times)

    out: dict[str, list[float]] = {"accelerate/transformers": [], "lightning": [], "by hand": []}
    for _ in range(reps):  # interleaved
        out["accelerate/transformers"].append(median_us(wrapped.step))
        out["lightning"].append(median_us(lightning))
        out["by hand"].append(median_us(hand))
    for averager in (wrapped.averager, stepper.averager, by_hand):
        averager.close()
    dist.destroy_process_group()
    return {k: statistics.median(v) for k, v in out.items()}


# -- the driver ------------------------------------------------------------------------------------------------------


def _launch(framework: str, variant: str, args: argparse.Namespace) -> float:
    """One run in fresh processes; its median step time in ms (rank 0, after the warm-up)."""
    with tempfile.TemporaryDirectory() as tmp:
        record = str(Path(tmp) / "starts.json")
        inner = [
            str(Path(__file__).resolve()),
            "--launch-run",
            framework,
            "--record",
            record,
            "--world",
            str(args.world),
            "--steps",
            str(args.steps),
            "--width",
            str(args.width),
            "--batch",
            str(args.batch),
            "--variant",
            variant,
        ]
        if args.hf_defaults:
            inner.append("--hf-defaults")
        if args.pin:
            inner.append("--pin")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        if framework == "lightning":  # Lightning starts its other ranks itself
            cmd = [sys.executable, *inner]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}"]
            cmd += inner
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
        complete = Path(record).is_file() and len(json.loads(Path(record).read_text())) == args.steps + 1
        if proc.returncode != 0 and not complete:
            raise RuntimeError(f"{framework} ({variant}) failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        if proc.returncode != 0:  # every step was timed; the processes failed while shutting down
            last = (proc.stderr.strip().splitlines() or ["?"])[0]
            print(f"note: {framework}/{variant} exited with {proc.returncode} after its last step ({last})", flush=True)
        starts = json.loads(Path(record).read_text())
    steps = [b - a for a, b in zip(starts, starts[1:])][args.warmup :]
    return 1000 * statistics.median(steps)


def _paired_ratios(samples: dict[str, list[float]], frameworks: list[str]) -> dict[str, float]:
    """Per framework, the median over the repetitions of F/wagma / plain/wagma and of F/wagma / F/byhand, each
    ratio of two runs of one repetition (adjacent in time, so a slow drift of the machine's load cancels)."""
    out: dict[str, float] = {}
    for framework in frameworks:
        mine = samples[f"{framework}/wagma"]
        for other in ("plain/wagma", f"{framework}/byhand"):
            out[f"{framework}/wagma : {other}"] = statistics.median(a / b for a, b in zip(mine, samples[other]))
    return out


def _table(results: dict[str, float], paired: dict[str, float], frameworks: list[str]) -> None:
    reference = results["plain/wagma"]
    alone = f", {results['plain/plain']:.2f} ms with DDP's allreduce" if "plain/plain" in results else ""
    print(f"\nplain DDP script: {reference:.2f} ms with the policy{alone}")
    print(
        "\n| framework | with wagma's adapter | vs plain script, same policy (paired) | same policy by hand in the "
        "framework | adapter vs by hand (paired) | framework alone (allreduce) |"
    )
    print("|---|---|---|---|---|---|")
    for framework in frameworks:
        mine, hand = results[f"{framework}/wagma"], results[f"{framework}/byhand"]
        alone_ms = results.get(f"{framework}/plain")
        vs_plain = 100 * (paired[f"{framework}/wagma : plain/wagma"] - 1)
        vs_hand = 100 * (paired[f"{framework}/wagma : {framework}/byhand"] - 1)
        print(
            f"| {framework} | {mine:.2f} ms | {100 * (mine / reference - 1):+.1f} % ({vs_plain:+.1f} %) | "
            f"{hand:.2f} ms | {100 * (mine / hand - 1):+.1f} % ({vs_hand:+.1f} %) "
            f"| {'–' if alone_ms is None else f'{alone_ms:.2f} ms'} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    parser.add_argument("--width", type=int, default=512, help="hidden width of the 4-layer MLP")
    parser.add_argument(
        "--batch", type=int, default=64, help="examples per rank and step (more: more compute per parameter)"
    )
    parser.add_argument("--reps", type=int, default=1, help="runs of each kind (the median is reported)")
    parser.add_argument("--frameworks", nargs="+", default=["plain", "lightning", "accelerate", "transformers"])
    parser.add_argument(
        "--without-allreduce", action="store_true", help="skip the runs with DDP's allreduce (plain/plain, F/plain)"
    )
    parser.add_argument(
        "--hf-defaults",
        action="store_true",
        help="leave the HF Trainer at its defaults: find_unused_parameters on, remove_unused_columns on",
    )
    parser.add_argument(
        "--pin", action="store_true", help="each rank (with its threads) on a core of its own: ranks as devices"
    )
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument("--cpu-time", action="store_true", help="only the adapters' own code, in CPU time, one process")
    parser.add_argument("--launch-run", dest="run", choices=sorted(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, default="wagma", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        torch.set_num_threads(1)
        if args.pin:  # this rank and every thread it starts (gloo's, wagma's) on one core of its own
            os.sched_setaffinity(0, {int(os.environ.get("LOCAL_RANK", "0")) % (os.cpu_count() or 1)})
        RUNS[args.run](args, _Clock())
        return
    if args.cpu_time:
        for name, us in adapter_cpu_time(args.width, max(args.reps, 3)).items():
            print(f"{name:24s} {us:8.1f} µs of CPU per optimizer + averager step (median)")
        return

    import importlib.util

    load_before = os.getloadavg()[0]
    frameworks = [f for f in args.frameworks if f == "plain" or importlib.util.find_spec(f) is not None]
    if "plain" not in frameworks:
        frameworks.insert(0, "plain")
    # Repetitions are interleaved (every kind once, then every kind again, ...), so a change of the machine's load
    # during the benchmark spreads over all kinds instead of biasing the ones that ran last.
    variants = [v for v in VARIANTS if not (args.without_allreduce and v == "plain")]
    kinds = [("plain", v) for v in ("wagma", "plain") if v in variants]
    kinds += [(f, v) for f in frameworks[1:] for v in variants]
    samples: dict[str, list[float]] = {f"{f}/{v}": [] for f, v in kinds}
    for rep in range(args.reps):
        for framework, variant in kinds:
            key = f"{framework}/{variant}"
            samples[key].append(_launch(framework, variant, args))
            print(f"rep {rep + 1}: {key:24s} {samples[key][-1]:8.2f} ms/step", flush=True)
    results = {key: statistics.median(values) for key, values in samples.items()}
    paired = _paired_ratios(samples, frameworks[1:])
    print()
    for key, value in results.items():
        print(f"{key:24s} {value:8.2f} ms/step (median of {', '.join(f'{v:.2f}' for v in samples[key])})")
    print(
        f"\nworld {args.world}, MLP width {args.width} ({sum(p.numel() for p in _net(args.width).parameters()):,} "
        f"parameters), batch {args.batch}, {args.steps} steps, median after {args.warmup}, {args.reps} run(s) each, "
        f"load average at the start: {load_before:.2f}, at the end: {os.getloadavg()[0]:.2f}"
    )
    _table(results, paired, frameworks[1:])
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"args": vars(args), "ms_per_step": results, "paired_ratios": paired, "samples": samples}, indent=1
            )
        )


if __name__ == "__main__":
    main()
