"""``python train.py ft=torchft replicas=N``: a lighthouse and N replica groups on this host, supervised.

:func:`launch_replicas` (called by :func:`wagma.app.run.run_job`) writes the job's resolved config to
``RUN_DIR/ft/config.yaml``, starts torchft's lighthouse in this process (its Rust ``LighthouseServer``, on a free
port, ``min_replicas`` from ``ft.min_replicas``; with ``ft.lighthouse=http://...`` a running one is used instead) and
one process per replica group (:mod:`wagma.app.ft_replica`, ids ``ft.first_replica ..``; with ``ft.nproc`` > 1 a
torchrun of that many ranks, in a session of its own so that stopping it stops its ranks), and supervises them:

- a replica that dies before the job's end is started again, at most ``ft.max_restarts`` times each (a warning
  names it, its pid and how it ended); it heals from a live peer when it joins, while the others go on;
- every wait has a deadline: a (re)started replica that has not joined a round within ``ft.rejoin_s`` fails the job
  (named), and so does a job in which no replica committed a round for ``ft.rejoin_s``;
- the job ends when a replica has trained to the end (it committed ``steps / ft.period`` rounds, the last a sync
  round); replicas still running then get ``2 x ft.timeout_s`` to finish too (one started again after its peers
  finished waits for a quorum that never comes: it is stopped, and counted as late).

``RUN_DIR/replicas.json`` holds every replica's lives (pid -- torchrun's for a group of several ranks --, start and
end time, exit status, when it first joined a round, whether it healed; rewritten as each of these happens) while
the job runs, so an operator or a
test can find a replica's pid. At the end the launcher stops the lighthouse and writes ``summary.json`` from the
replicas' ``final`` records (every replica that finished ends with the same model, after the last sync round).
``rank_cpus`` puts each replica process in its own CPU quota, ``rank_net`` in its own network namespace behind a
shaped link (with ``ft.nproc`` > 1 every rank of a group has its own; the lighthouse is reached through the
bridge).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import wagma
from wagma.app.ft_replica import CONFIG_NAME, FT_DIR, LIFE_VARIABLE, replica_log
from wagma.app.ft_report import ft_summary
from wagma.app.metrics import write_summary
from wagma.app.network import network_job, rate_name
from wagma.app.procs import sigterm_exits
from wagma.app.quota import job_name, quota_job

__all__ = ["POLL_S", "REPLICAS_FILE", "ReplicaFailure", "ReplicaJob", "launch_replicas"]

log = logging.getLogger(__name__)

#: The supervisor's poll interval (seconds).
POLL_S = 0.1
#: The file in the run directory that tells every replica's lives.
REPLICAS_FILE = "replicas.json"


class ReplicaFailure(RuntimeError):
    """The job cannot go on: a replica failed beyond its restarts, did not (re)join in time, or no round came."""


@dataclasses.dataclass(frozen=True)
class ReplicaJob:
    """How an ft job ended: exit status, its summary (None on failure), a one-line error."""

    exit_code: int
    summary: dict[str, Any] | None
    error: str | None = None


@dataclasses.dataclass
class _Replica:
    """One replica group's process, its lives, and what its log said so far."""

    replica: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    lives: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    offset: int = 0
    final: dict[str, Any] | None = None
    late: bool = False
    last_round: float = 0.0

    def read(self) -> bool:
        """Take in the records appended since the last read (complete lines only); whether a life first joined."""
        if not self.log.exists():
            return False
        joined = False
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].decode().splitlines():
            record = json.loads(line)
            life = self.lives[-1] if self.lives else None
            if record["event"] == "round" and record.get("life") == len(self.lives) and life is not None:
                joined |= "joined" not in life
                life.setdefault("joined", record["time"])
                life.setdefault("healed", record["heals"] > 0)
                self.last_round = time.monotonic()
            elif record["event"] == "final":
                self.final = record
        return joined


class _Supervisor:
    """Starts the replica processes, starts a dead one again, and watches every deadline."""

    def __init__(self, cfg: DictConfig, run_dir: Path, lighthouse: str) -> None:
        self.cfg, self.run_dir, self.lighthouse = cfg, run_dir, lighthouse
        first = int(cfg.ft.first_replica)
        ids = range(first, first + int(cfg.replicas))
        self.replicas = [_Replica(r, replica_log(run_dir, r)) for r in ids]
        self.rejoin_s, self.grace_s = float(cfg.ft.rejoin_s), 2 * float(cfg.ft.timeout_s)
        self.env = dict(os.environ)
        package_root = str(Path(wagma.__file__).resolve().parents[1])
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, self.env.get("PYTHONPATH")) if p)
        self.env.setdefault("OMP_NUM_THREADS", "1")

    def start(self, rep: _Replica) -> None:
        """Start (again) replica ``rep``'s process; its output is appended to ``ft/replica<R>.out``."""
        out = (self.run_dir / FT_DIR / f"replica{rep.replica}.out").open("ab")
        command = [sys.executable, "-m", "wagma.app.ft_replica", str(self.run_dir), str(rep.replica), self.lighthouse]
        nproc = int(self.cfg.ft.nproc)
        if nproc > 1:  # torchrun per replica group: a rank that dies takes its group down, and it is started again
            torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"]
            command[1:2] = [*torchrun, "--monitor-interval=0.1", "-m"]
        env = self.env | {LIFE_VARIABLE: str(len(rep.lives) + 1)}
        with out:  # a session of its own: the launcher stops the replica's whole process group (torchrun's ranks)
            rep.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        rep.lives.append({"pid": rep.proc.pid, "started": time.time()})
        rep.last_round = time.monotonic()
        self.write_file()

    def write_file(self) -> None:
        """``replicas.json``: the lighthouse and every replica's lives (written whole: a temporary file, a rename)."""
        state = {"lighthouse": self.lighthouse, "replicas": {str(r.replica): r.lives for r in self.replicas}}
        path = self.run_dir / REPLICAS_FILE
        path.with_suffix(".tmp").write_text(json.dumps(state, indent=1) + "\n")
        os.replace(path.with_suffix(".tmp"), path)

    def run(self) -> None:
        """Start every replica and supervise them until the job has ended.

        Raises:
            ReplicaFailure: naming the replica and why (restarts spent, no (re)join in time) or the stall.
        """
        for rep in self.replicas:
            self.start(rep)
        finished_at: float | None = None
        while True:
            time.sleep(POLL_S)
            if [rep for rep in self.replicas if rep.read()]:
                self.write_file()  # who is in the quorum since when, for an operator or a chaos harness
            if finished_at is None and any(r.final for r in self.replicas):
                finished_at = time.monotonic()
            if not [r for r in self.replicas if self._running(r, finished_at)]:
                return
            self._check_progress(finished_at)

    def _running(self, rep: _Replica, finished_at: float | None) -> bool:
        """Whether ``rep`` still runs; a dead one is recorded, and started again while the job has not ended."""
        assert rep.proc is not None
        code = rep.proc.poll()
        if code is None and finished_at is not None and time.monotonic() - finished_at > self.grace_s:
            self._stop(rep)  # started again too late: its peers are done, no quorum will come
            rep.late = True
            code = rep.proc.returncode
        if code is None:
            return True
        life = rep.lives[-1]
        if "exit" not in life:
            life |= {"exit": code, "ended": time.time()}
            self.write_file()
        if rep.final is not None or rep.late:
            return False
        if finished_at is not None:  # it failed while the job was ending: late, not a failure of the job
            rep.late = True
            return False
        restarts = len(rep.lives) - 1
        if restarts >= int(self.cfg.ft.max_restarts):
            raise ReplicaFailure(
                f"replica {rep.replica} {_how(code)} and has used its ft.max_restarts={self.cfg.ft.max_restarts} "
                f"restart(s); see {FT_DIR}/replica{rep.replica}.out"
            )
        log.warning(
            "replica %d (pid %d, life %d) %s; starting it again (restart %d of ft.max_restarts=%s)",
            rep.replica, life["pid"], len(rep.lives), _how(code), restarts + 1, self.cfg.ft.max_restarts,
        )  # fmt: skip
        self.start(rep)
        return True

    def _check_progress(self, finished_at: float | None) -> None:
        """Raise when a running replica has not joined within ``rejoin_s`` of its start, or the job stalls."""
        now = time.monotonic()
        for rep in self.replicas:
            life = rep.lives[-1]
            if "exit" not in life and "joined" not in life and time.time() - life["started"] > self.rejoin_s:
                raise ReplicaFailure(
                    f"replica {rep.replica} (pid {life['pid']}, life {len(rep.lives)}) did not join a round within "
                    f"ft.rejoin_s={self.rejoin_s:g} s of its start; see {FT_DIR}/replica{rep.replica}.out"
                )
        if finished_at is None and now - max(r.last_round for r in self.replicas) > self.rejoin_s:
            raise ReplicaFailure(f"no replica committed a round for ft.rejoin_s={self.rejoin_s:g} s")

    @staticmethod
    def _stop(rep: _Replica) -> None:
        if rep.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already (its group is empty)
            os.killpg(rep.proc.pid, signal.SIGKILL)  # the replica and whatever it started (torchrun's ranks)
        with contextlib.suppress(subprocess.TimeoutExpired):
            rep.proc.wait(timeout=10)

    def stop(self) -> None:
        """Stop every replica process still running (SIGKILL) and record how each life ended."""
        for rep in self.replicas:
            self._stop(rep)
            if rep.lives and "exit" not in rep.lives[-1] and rep.proc is not None:
                rep.lives[-1] |= {"exit": rep.proc.returncode, "ended": time.time()}
        self.write_file()


def _how(code: int) -> str:
    """``exited with status 1`` or ``was killed by SIGKILL``."""
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


@contextlib.contextmanager
def _lighthouse(cfg: DictConfig) -> Iterator[str]:
    """The lighthouse's address: ``ft.lighthouse``, or one started here for the job (stopped at its end)."""
    if cfg.ft.lighthouse is not None:
        yield str(cfg.ft.lighthouse)
        return
    # torchft's Rust logger prints every quorum at INFO; RUST_LOG=info (set before the launch) shows them again.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=int(cfg.ft.min_replicas),
        join_timeout_ms=int(cfg.ft.join_timeout_ms),
        heartbeat_timeout_ms=int(cfg.ft.heartbeat_timeout_ms),
    )
    try:
        port = server.address().rsplit(":", 1)[1]
        yield f"http://{cfg.ft.host}:{port}"
    finally:
        server.shutdown()


def launch_replicas(cfg: DictConfig, run_dir: Path) -> ReplicaJob:
    """Run ``cfg`` (``ft=torchft``) as a lighthouse and ``cfg.replicas`` supervised replica groups into ``run_dir``."""
    ft_dir = run_dir / FT_DIR
    if (run_dir / REPLICAS_FILE).exists():
        return ReplicaJob(2, None, f"{run_dir} holds an earlier ft run ({REPLICAS_FILE}); use a fresh run_dir")
    ft_dir.mkdir(parents=True, exist_ok=True)
    job = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    assert isinstance(job, DictConfig)
    job.run_dir = str(run_dir)
    OmegaConf.save(job, ft_dir / CONFIG_NAME)
    started = time.time()
    # quota_job, network_job: no cgroup, namespace, veth or bridge of the replicas left behind, however they end
    with (
        quota_job(job_name(run_dir), enabled=bool(cfg.get("rank_cpus"))),
        network_job(job_name(run_dir), enabled=rate_name(cfg.get("rank_net")) is not None),
        sigterm_exits(),
        _lighthouse(job) as address,
    ):
        supervisor = _Supervisor(job, run_dir, address)
        try:
            supervisor.run()
        except ReplicaFailure as exc:
            return ReplicaJob(1, None, str(exc))
        finally:
            supervisor.stop()
    finals = {r.replica: r.final for r in supervisor.replicas if r.final is not None}
    if not finals:
        return ReplicaJob(1, None, "no replica trained to the end of the job; see the logs in " + str(ft_dir))
    lives = {r.replica: len(r.lives) for r in supervisor.replicas}
    late = [r.replica for r in supervisor.replicas if r.late]
    first_round = min((life["joined"] for r in supervisor.replicas for life in r.lives if "joined" in life))
    summary = ft_summary(job, finals, lives, late, (first_round - started, time.time() - first_round))
    write_summary(run_dir, summary)
    return ReplicaJob(0, summary)
