"""One replica group of a fault-tolerant job: wagma's group averaging across torchft's live replicas (CPU, gloo).

Start a lighthouse, then one process per replica group (each may be killed and started again)::

    torchft_lighthouse --bind "[::]:29510" --min_replicas 2 --join_timeout_ms 500 --heartbeat_timeout_ms 1000 &
    python examples/torchft_wagma.py --replica 0 --store-port 29600 --rounds 60 &
    python examples/torchft_wagma.py --replica 1 --store-port 29601 --rounds 60 &
    python examples/torchft_wagma.py --replica 2 --store-port 29602 --rounds 60 &

Each replica joins the job (``ReplicaAverager.join()``), trains a small regression model on the share of the data
each round hands it, and calls ``ReplicaAverager.step()`` after every optimizer step: a group round of two
replicas, a sync round over the whole quorum every fourth round. Kill one (``kill -9``): the others go on with the
next quorum; start it again with the same arguments: it heals from a live peer (model, optimizer, averager state,
data position) and takes part in that round. ``--log`` appends one JSON line per round (its ``RoundReport``: round,
kind, quorum size, the share trained and whether it was kept; the parameters' checksum, time); the job ends when
the replicas have committed ``--rounds`` rounds, after a last sync round, so that every replica ends with the same
model.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchft import Manager

from wagma.integrations.torchft import ReplicaAverager, ReplicaProcessGroup, RoundReport


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", type=int, required=True, help="this replica group's id (0, 1, ...)")
    parser.add_argument("--store-port", type=int, required=True, help="a free port for this replica's TCP store")
    parser.add_argument("--lighthouse", default="http://127.0.0.1:29510", help="the lighthouse's address")
    parser.add_argument("--rounds", type=int, default=60, help="rounds to commit (the last one a sync round)")
    parser.add_argument("--min-replicas", type=int, default=2, help="the smallest quorum that may run a round")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--sync-period", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.02, help="seconds of emulated compute per step")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="every collective's and quorum's deadline")
    parser.add_argument("--log", default=None, help="append one JSON line per round to this file")
    parser.add_argument(
        "--die-in-round", type=int, default=None, help="fault injection: SIGKILL this process inside round N, mid-round"
    )
    parser.add_argument("--checkpoint-dir", default=None, help="save this replica's state here (for --resume)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="committed rounds between checkpoints")
    parser.add_argument("--resume", action="store_true", help="start from this replica's checkpoint, if it has one")
    args = parser.parse_args()
    if args.rounds % args.sync_period:
        parser.error(f"--rounds: expected a multiple of --sync-period ({args.sync_period}), found {args.rounds}")

    torch.manual_seed(0)  # the same initial model on every replica
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = ReplicaAverager(model.parameters(), group_size=args.group_size, sync_period=args.sync_period)
    teacher = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "wagma": averager.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        averager.load_state_dict(state["wagma"])

    timeout = datetime.timedelta(seconds=args.timeout_s)
    # The replica's own store (torchft's quorum names it to its peers); it must live as long as the manager.
    store = torch.distributed.TCPStore("127.0.0.1", args.store_port, 1, True, wait_for_workers=False)  # noqa: F841
    pg = ReplicaProcessGroup(timeout=timeout)
    manager = Manager(
        pg=pg,
        state_dict=state_dict,
        load_state_dict=load_state_dict,
        min_replica_size=args.min_replicas,
        use_async_quorum=False,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=args.store_port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}",
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    averager.attach(manager, pg)
    checkpoint = Path(args.checkpoint_dir) / f"replica{args.replica}.pt" if args.checkpoint_dir else None
    if args.resume and checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True)
        load_state_dict(saved["user"])
        manager.load_state_dict(saved["torchft"])
    if args.die_in_round is not None:
        _die_in_round(averager, args.die_in_round)
    log = open(args.log, "a") if args.log else None

    def record(report: RoundReport, loss: float) -> None:
        if log is not None and report.kind != "none":
            fields = {"replica": args.replica, "committed": manager.current_step(), **dataclasses.asdict(report)}
            log.write(json.dumps({**fields, "checksum": _checksum(model), "loss": loss, "time": time.time()}) + "\n")
            log.flush()

    try:
        record(averager.join(), float("nan"))  # round 0 with the others, or heal into the job's current round
        while manager.current_step() < args.rounds:
            assert averager.share is not None  # a synchronous quorum: every replica participates
            # The period's share of the job's data: no other replica trains on share s (its batches: s * period + i).
            seed = averager.share * averager.period + averager.local_steps % averager.period
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(seed))
            loss = nn.functional.mse_loss(model(x), torch.tanh(x @ teacher))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(args.step_s)
            report = averager.step()
            record(report, loss.item())
            if checkpoint is not None and report.kind in ("group", "sync") and report.round is not None:
                if (report.round + 1) % args.checkpoint_every == 0:
                    _save(checkpoint, {"user": state_dict(), "torchft": manager.state_dict()})
        if log is not None:  # the final model's loss on held-out data
            x = torch.randn(1024, 8, generator=torch.Generator().manual_seed(-1 % 2**63))
            with torch.no_grad():
                test_loss = nn.functional.mse_loss(model(x), torch.tanh(x @ teacher)).item()
            log.write(json.dumps({"replica": args.replica, "final": True, "test_loss": test_loss, "time": time.time()}))
            log.write("\n")
    finally:
        if log is not None:
            log.close()
        manager.shutdown(wait=False)


def _save(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` whole or not at all (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    torch.save(state, temporary)
    os.replace(temporary, path)


def _checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _die_in_round(averager: ReplicaAverager, round: int) -> None:
    """Kill this process with SIGKILL inside round ``round``: after its quorum formed, before its allreduce."""
    average = averager._average

    def dying(flat: torch.Tensor, k: int, *rest: Any) -> torch.Tensor:
        if k == round:
            os.kill(os.getpid(), signal.SIGKILL)
        return average(flat, k, *rest)

    averager._average = dying  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
