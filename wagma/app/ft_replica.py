"""One replica group of an ``ft=torchft`` job: the application's data, model and optimizer on torchft's live replicas.

:mod:`wagma.app.ft_launch` starts one process per replica group (``python -m wagma.app.ft_replica RUN_DIR REPLICA
LIGHTHOUSE``), again after it died. The process reads the job's config (``RUN_DIR/ft/config.yaml``), joins its CPU
quota (``rank_cpus``) and its network (``rank_net``: a namespace of its own behind a shaped link,
:class:`wagma.app.network.RankNetwork`; its store, heals and rounds then go over that link; with ``ft.nproc`` > 1
every rank of the group has its own), builds the configured
data, model (the same initial weights on every replica: seeded with ``seed``), optimizer and imbalance, and a
torchft ``Manager`` with wagma's :class:`~wagma.integrations.torchft.ReplicaAverager` (``ft.group_size``,
``ft.sync_period``, ``ft.period``). It joins
the job -- a (re)started replica heals from a live peer there: model, optimizer, averager state, data position --
and trains until the job has committed ``steps / ft.period`` rounds, the last a sync round. With ``ft.nproc`` > 1
the process is one rank of a replica group under torchrun: DDP averages gradients inside the group, the averager
on each rank averages with the same rank of the other groups, torchft's Manager uses a store the group's rank 0
hosts, and the group's rank 0 writes the records.

The data: the training split is one endless sequence of seeded batches (:meth:`wagma.app.data.BatchIterator.batch_at`);
share ``s`` (which the averager hands this replica for a period) is batches ``s * period .. s * period + period - 1``.
No share is handed out twice, so no replica repeats another's batches, and a healed replica continues with the
share its round handed it.

What it writes into ``RUN_DIR``: ``ft/replica<R>.jsonl`` (a ``start`` record per life; a ``round`` record per round:
the :class:`~wagma.integrations.torchft.RoundReport` fields, the rounds committed, the heals, the loss and the
parameters' checksum; a ``final`` record with the test accuracy and the totals), and on replica 0 the metrics
records (``metrics/``, ``metrics.csv``) of :class:`wagma.app.metrics.MetricsWriter`. Its stdout and stderr go to
``ft/replica<R>.out`` (the launcher's).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from wagma.app import launch
from wagma.app.config import build_optimizer, configured_dataset, configured_model, group_options
from wagma.app.data import BatchIterator
from wagma.app.ft_options import ft_rounds
from wagma.app.imbalance import Imbalance, build_imbalance
from wagma.app.metrics import MetricsWriter
from wagma.app.network import RankNetwork, rate_name
from wagma.app.quota import RankQuota, job_name
from wagma.app.report import Totals, window_record
from wagma.app.step import evaluate

__all__ = ["CONFIG_NAME", "FT_DIR", "LIFE_VARIABLE", "main", "replica_log", "train_replica"]

#: The folder of an ft run's own files inside the run directory, and the job's config there.
FT_DIR = "ft"
CONFIG_NAME = "config.yaml"
#: The environment variable in which the launcher tells a replica which of its lives it is (1, 2, ...).
LIFE_VARIABLE = "WAGMA_FT_LIFE"


def replica_log(run_dir: Path, replica: int) -> Path:
    """Where replica ``replica`` appends its records (one JSON object a line)."""
    return run_dir / FT_DIR / f"replica{replica}.jsonl"


@dataclasses.dataclass
class _Replica:
    """One replica's training: the model, the averager and what it records."""

    cfg: DictConfig
    replica: int
    rank: int  # this process's rank in its replica group (ft.nproc ranks, DDP inside the group)
    ranks: int
    net: nn.Module
    model: nn.Module  # net, or with ft.nproc > 1 its DDP wrapper
    optimizer: torch.optim.Optimizer
    averager: Any  # wagma.integrations.torchft.ReplicaAverager (torchft is imported lazily)
    batches: BatchIterator
    test: tuple[torch.Tensor, torch.Tensor]
    imbalance: Imbalance
    log: TextIO | None  # rank 0 of the group records
    writer: MetricsWriter | None
    totals: Totals = dataclasses.field(default_factory=Totals)
    heals: int = 0
    joined: float = 0.0  # when this life joined the job (its first round ended)

    def state_dict(self) -> dict[str, Any]:
        """What a healing peer takes from this replica (torchft's ``state_dict``)."""
        model, optimizer = self.net.state_dict(), self.optimizer.state_dict()
        return {"model": model, "optimizer": optimizer, "wagma": self.averager.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Heal: take a live peer's model, optimizer and averager state (the data position with it)."""
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.averager.load_state_dict(state["wagma"])
        self.heals += 1

    def record(self, event: str, **fields: Any) -> None:
        """Append one record (``event``, this replica, its pid and life, the time, ``fields``) to its log, flushed;
        only on the replica group's rank 0."""
        if self.log is None:
            return
        life = int(os.environ.get(LIFE_VARIABLE, launch.restart_count() + 1))  # the launcher's, or torchrun's
        line = {"event": event, "replica": self.replica, "pid": os.getpid(), "life": life, "time": time.time()}
        line |= fields
        self.log.write(json.dumps(line) + "\n")
        self.log.flush()


def _build(cfg: DictConfig, replica: int, group: tuple[int, int], log: TextIO | None, run_dir: Path) -> _Replica:
    """The data (the whole training split, batched by number), the model (seeded alike on every replica; wrapped in
    DDP over the replica group's ranks when ``group`` = (rank, ranks) has several), the optimizer, the imbalance
    and the averager of replica ``replica``."""
    from wagma.integrations.torchft import ReplicaAverager

    seed = int(cfg.seed)
    dataset = configured_dataset(cfg)
    batches = BatchIterator(dataset.x_train, dataset.y_train, int(cfg.batch_size), seed=seed, rank=0)
    torch.manual_seed(seed)  # the same initial model on every replica (round 0 averages equal models)
    net = configured_model(cfg, dataset)
    optimizer = build_optimizer(group_options(cfg, "optim"), net.parameters())
    torch.manual_seed(seed + replica)  # anything random in training differs between replicas
    index = replica - int(cfg.ft.first_replica)
    imbalance = build_imbalance(group_options(cfg, "imbalance"), index, int(cfg.replicas))
    wrapped = nn.parallel.DistributedDataParallel(net) if group[1] > 1 else net
    ft = cfg.ft
    averager = ReplicaAverager(
        net.parameters(), group_size=int(ft.group_size), sync_period=int(ft.sync_period), period=int(ft.period)
    )
    writer = MetricsWriter(run_dir, 0, with_csv=True) if replica == 0 and group[0] == 0 else None
    test = dataset.x_test, dataset.y_test
    return _Replica(cfg, replica, *group, net, wrapped, optimizer, averager, batches, test, imbalance, log, writer)


def _group_store(run: _Replica, host: str, timeout: datetime.timedelta) -> tuple[dist.TCPStore | None, str, int]:
    """The TCP store of ``run``'s replica group, hosted by its rank 0 on a free port of ``host`` (rank 0's), and
    where it is: the host and the port.

    Rank 0 publishes both in torchrun's store under the restart attempt, so that the other ranks of a group that
    torchrun restarted read the new store's address, not the dead one's (torchft's keys in a store that outlives the
    attempt would be stale), and, each rank in a namespace of its own (``rank_net``), reach it at rank 0's address.
    Returns the store on rank 0 (keep it alive), None elsewhere.
    """
    if run.rank == 0:
        store = dist.TCPStore(host, 0, run.ranks, True, timeout=timeout, wait_for_workers=False)
        if run.ranks == 1:
            return store, host, store.port
    wait = datetime.timedelta(seconds=max(launch.START_S, timeout.total_seconds()))  # ranks start unevenly
    master = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait)
    key = f"wagma/ft_store/{launch.restart_count()}"
    if run.rank == 0:
        master.set(key, f"{host} {store.port}")
        return store, host, store.port
    store_host, port = master.get(key).decode().split()
    return None, store_host, int(port)


def _manager(run: _Replica, lighthouse: str, host: str) -> tuple[Any, Any]:
    """torchft's ``Manager`` for ``run`` and the TCP store it uses (keep it alive; :func:`_group_store`); ``host``:
    the address the other replicas reach this one at."""
    from torchft import Manager

    from wagma.integrations.torchft import ReplicaProcessGroup

    ft = run.cfg.ft
    timeout = datetime.timedelta(seconds=float(ft.timeout_s))
    store, store_host, port = _group_store(run, host, timeout)
    transport = _checkpoint_transport(host, timeout)
    pg = ReplicaProcessGroup(timeout=timeout)
    manager = Manager(
        pg=pg,
        state_dict=run.state_dict,
        load_state_dict=run.load_state_dict,
        min_replica_size=int(ft.min_replicas),
        use_async_quorum=False,
        rank=run.rank,
        world_size=run.ranks,
        store_addr=store_host,
        store_port=port,
        hostname=host,
        checkpoint_transport=transport,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{run.replica}",
        timeout=timeout,
        # A quorum waits for peers still starting, healing or on a starved CPU; a replica whose quorum times out
        # fails (torchft raises), so it gets the longer deadline, and collectives the short one.
        quorum_timeout=datetime.timedelta(seconds=float(ft.quorum_timeout_s)),
        connect_timeout=timeout,
    )
    run.averager.attach(manager, pg)
    return manager, store


def _checkpoint_transport(host: str, timeout: datetime.timedelta) -> Any:
    """torchft's HTTP checkpoint transport (what a healing peer fetches), advertised at ``host``: torchft's own names
    this machine's hostname, which a replica in a network namespace of its own (``rank_net``) cannot reach."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class _AtHost(HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return _AtHost(timeout=timeout, num_chunks=0)


def _cpu_cgroup() -> str | None:
    """This process's cgroup v1 cpu path (``/proc/self/cgroup``), or None where there is none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 2)[2] for line in lines if "cpu" in line.split(":")[1].split(",")), None)


def _checksum(net: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in net.parameters()))


def _round_record(run: _Replica, manager: Any, report: Any, loss: float) -> None:
    """A ``round`` record of ``report`` (a RoundReport), when it ran a round."""
    if report.kind != "none":
        fields = dataclasses.asdict(report) | {"committed": manager.current_step(), "heals": run.heals}
        run.record("round", **fields, loss=loss, checksum=_checksum(run.net))


def _step(run: _Replica, loss_fn: nn.Module, last_compute_s: float) -> tuple[dict[str, float], Any]:
    """One optimizer step on this period's share, then the averager's step (a round every ``period`` steps)."""
    averager = run.averager
    t0 = time.perf_counter()
    imbalance_s = run.imbalance(averager.local_steps, last_compute_s)
    t1 = time.perf_counter()
    batch = averager.share * averager.period + averager.local_steps % averager.period
    x, y = run.batches.batch_at(batch * run.ranks + run.rank)  # the group's ranks: consecutive batches of the share
    loss = loss_fn(run.model(x), y)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    run.optimizer.step()
    loss_value = loss.item()
    t2 = time.perf_counter()
    report = averager.step()
    t3 = time.perf_counter()
    timings = {"loss": loss_value, "samples": len(y), "step_s": t3 - t0, "compute_s": t2 - t1, "wait_s": t3 - t2}
    return timings | {"imbalance_s": imbalance_s}, report


def _train(run: _Replica, manager: Any) -> None:
    """Join the job (heal if it runs already), then train until it has committed its rounds."""
    rounds, log_every, eval_every = ft_rounds(run.cfg), int(run.cfg.log_every), int(run.cfg.eval_every)
    loss_fn = nn.CrossEntropyLoss()
    _round_record(run, manager, run.averager.join(), float("nan"))
    run.joined = time.time()
    window: list[dict[str, float]] = []
    compute_s = 0.0
    while manager.current_step() < rounds:
        timings, report = _step(run, loss_fn, compute_s)
        compute_s = timings["compute_s"]
        run.totals.add(timings)
        window.append(timings)
        _round_record(run, manager, report, timings["loss"])
        done = run.averager.local_steps
        extra: dict[str, Any] = {"round": manager.current_step(), "members": report.members}
        if eval_every and done % eval_every == 0:  # collective over the group's ranks: every replica evaluates
            extra["test_accuracy"], extra["test_loss"] = evaluate(run.net, *run.test, run.rank, run.ranks)
        if run.writer is not None and (done % log_every == 0 or manager.current_step() >= rounds or len(extra) > 2):
            run.writer.write(done, **window_record(window), **extra)
            window = []


def train_replica(cfg: DictConfig, run_dir: Path, replica: int, lighthouse: str) -> dict[str, Any]:
    """Replica ``replica`` of the job: train it, heal it when it (re)joins, and return its ``final`` record."""
    rank, ranks = launch.env_rank(), launch.env_world_size()  # torchrun's, for ft.nproc > 1; else 0 of 1
    quota = network = None
    if cfg.get("rank_cpus"):
        quota = RankQuota(float(cfg.rank_cpus), job=job_name(run_dir), rank=replica * ranks + rank)
    host = str(cfg.ft.host)
    rate = rate_name(cfg.get("rank_net"))
    if rate is not None:  # before any socket; a restarted life waits for its last one's reaper
        index = (replica - int(cfg.ft.first_replica)) * ranks + rank  # every rank of every group: a link of its own
        network = RankNetwork(rate, job=job_name(run_dir), rank=index, wait_s=float(cfg.ft.rejoin_s))
        host = str(network.address.ip)  # where the other replicas (and this group's ranks) reach this one
        lighthouse = _via_bridge(lighthouse, str(network.gateway.ip))
    launch.init_distributed("cpu", float(cfg.dist_timeout_s))  # the replica group's ranks (DDP, evaluate)
    netns = network.namespace if network is not None else None
    spread: dict[str, list[Any]] = {}
    if ranks > 1:  # what rank 0 records: every rank's namespace and address
        where: list[Any] = [None] * ranks
        dist.all_gather_object(where, (netns, host))
        spread = {"group_netns": [w[0] for w in where], "group_hosts": [w[1] for w in where]}
    manager = None
    with open(replica_log(run_dir, replica), "a", encoding="utf-8") if rank == 0 else nullcontext() as log:
        run = _build(cfg, replica, (rank, ranks), log, run_dir)
        try:
            run.record("start", cpu_cgroup=_cpu_cgroup(), netns=netns, host=host, **spread)  # its quota and network
            manager, _store = _manager(run, lighthouse, host)
            _train(run, manager)
            accuracy, test_loss = evaluate(run.net, *run.test, rank, ranks)
            final: dict[str, Any] = {"test_accuracy": accuracy, "test_loss": test_loss, "checksum": _checksum(run.net)}
            final |= {"committed": manager.current_step(), "heals": run.heals, "totals": dataclasses.asdict(run.totals)}
            final["joined"] = run.joined
            if run.writer is not None:
                run.writer.write(run.averager.local_steps, test_accuracy=accuracy, test_loss=test_loss)
            run.record("final", **final)
            return final
        finally:
            if run.writer is not None:
                run.writer.close()
            if manager is not None:
                manager.shutdown(wait=False)
            if quota is not None:
                quota.leave()
            if network is not None:
                network.leave()


def _via_bridge(lighthouse: str, gateway: str) -> str:
    """``lighthouse`` (``http://host:port``, the launcher's, listening on every address of the root namespace) as a
    replica in a namespace of its own reaches it: through the bridge's address."""
    scheme, _, rest = lighthouse.partition("://")
    port = rest.rsplit(":", 1)[1] if ":" in rest else ""
    return f"{scheme}://{gateway}:{port}" if port else f"{scheme}://{gateway}"


def main(argv: list[str] | None = None) -> None:
    """``python -m wagma.app.ft_replica RUN_DIR REPLICA LIGHTHOUSE``: one replica's life; exit status 0 when it
    trained to the job's end (it then exits at once, without the interpreter's teardown of torchft's threads)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("replica", type=int)
    parser.add_argument("lighthouse")
    args = parser.parse_args(argv)
    cfg = OmegaConf.load(args.run_dir / FT_DIR / CONFIG_NAME)
    assert isinstance(cfg, DictConfig)
    train_replica(cfg, args.run_dir, args.replica, args.lighthouse)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
