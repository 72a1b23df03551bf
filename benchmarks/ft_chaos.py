"""Live recovery against restarting everyone: goodput under real kills, on torchft's replica groups.

A job of ``--replicas`` replica groups (``examples/torchft_wagma.py``, one process each, a lighthouse) commits
``--rounds`` rounds. Faults arrive at exponentially distributed intervals of mean ``--mtbf-s`` (seeded): each one
SIGKILLs a random live replica. What happens next is the mode:

- ``live``: only the victim is started again; it heals from a live peer while the others go on (wagma on torchft);
- ``restart``: every replica is killed and all are started again from their newest checkpoint (every
  ``--checkpoint-every`` rounds), as torchrun's ``--max-restarts`` does with the whole job;
- ``none``: no faults, the reference for goodput.

Per run it records the wall time from the first round to the job's last, goodput (the fault-free run's time over
this run's, for the same rounds), per fault the time until the victim (live) or the job (restart) committed a round
again, the rounds the survivors discarded, and the final model's held-out loss. Runs of one invocation share the
machine in turn, so compare within one invocation.

    python benchmarks/ft_chaos.py --replicas 4 --rounds 2000 --mtbf-s 30 --modes none live restart --seeds 0 1 2 \\
        --out benchmarks/results/ft_chaos/p4.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchft_wagma.py"


@dataclasses.dataclass
class Run:
    """What one run of the job did."""

    mode: str
    seed: int
    replicas: int
    rounds: int
    wall_s: float = 0.0
    faults: int = 0
    recovery_s: list[float] = dataclasses.field(default_factory=list)
    discarded: int = 0
    late: int = 0
    test_loss: float | None = None
    goodput: float | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (none when it does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


class Job:
    """A lighthouse and one process per replica group, each of which can be killed and started again."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        port = _free_port()
        binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
        self.lighthouse = subprocess.Popen(
            [binary, "--bind", f"[::]:{port}", "--min_replicas", str(args.min_replicas), "--join_timeout_ms", "500",
             "--heartbeat_timeout_ms", "1000"],
            stdout=(work / "lighthouse.log").open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.address = f"http://127.0.0.1:{port}"
        self.ports = [_free_port() for _ in range(args.replicas)]
        self.logs = [work / f"replica{r}.jsonl" for r in range(args.replicas)]
        self.procs: list[subprocess.Popen] = [self.start(r) for r in range(args.replicas)]

    def start(self, replica: int) -> subprocess.Popen:
        a = self.args
        command = [sys.executable, str(EXAMPLE), "--replica", str(replica), "--store-port", str(self.ports[replica])]
        command += ["--lighthouse", self.address, "--rounds", str(a.rounds), "--log", str(self.logs[replica])]
        command += ["--step-s", str(a.step_s), "--min-replicas", str(a.min_replicas), "--timeout-s", "10"]
        command += ["--checkpoint-dir", str(self.work / "ckpt"), "--checkpoint-every", str(a.checkpoint_every)]
        command += ["--resume"]
        out = (self.work / f"replica{replica}.out").open("ab")
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def committed(self) -> int:
        """The most rounds any replica has committed."""
        return max((x["committed"] for log in self.logs for x in read_records(log) if "committed" in x), default=0)

    def finished(self) -> bool:
        """Every replica has ended, or the job has committed its rounds and a replica that is still running is one
        started again too late: it waits for a quorum no finished peer will join, so it is stopped."""
        running = [proc.poll() is None for proc in self.procs]
        if all(running):
            return False  # nothing has ended: no log to read (it grows all run long, beside the replicas' CPU)
        if not any(running):
            return True
        finals = [r for r, log in enumerate(self.logs) if any(x.get("final") for x in read_records(log))]
        if not finals or any(self.procs[r].poll() is None for r in finals):
            return False
        late = [r for r, proc in enumerate(self.procs) if proc.poll() is None]
        if time.monotonic() - self.finished_at() < 2.0:
            return False
        for replica in late:
            self.kill(replica)
            self.procs[replica].returncode = None  # stopped by the harness, not failed
        return True

    def finished_at(self) -> float:
        """When the last replica that completed the job wrote its final record (on the monotonic clock)."""
        times = [x["time"] for log in self.logs for x in read_records(log) if x.get("final")]
        return time.monotonic() - (time.time() - max(times)) if times else time.monotonic()

    def kill(self, replica: int) -> None:
        self.procs[replica].send_signal(signal.SIGKILL)
        self.procs[replica].wait()

    def close(self) -> None:
        for proc in [*self.procs, self.lighthouse]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run(args: argparse.Namespace, mode: str, seed: int) -> Run:
    """One job in ``mode``; faults from ``seed``."""
    rng = random.Random(seed)
    result = Run(mode, seed, args.replicas, args.rounds)
    tmp = tempfile.mkdtemp(prefix=f"wagma-ft-{mode}-{seed}-")  # kept when the run fails, removed when it does not
    if True:
        job = Job(args, Path(tmp))
        try:
            while job.committed() == 0:  # the clock starts at the job's first round
                time.sleep(0.05)
            start = time.monotonic()
            next_fault = start + (rng.expovariate(1 / args.mtbf_s) if mode != "none" else float("inf"))
            while not job.finished():
                if time.monotonic() >= next_fault and all(p.poll() is None for p in job.procs):
                    _fault(job, mode, rng, result)
                    next_fault = time.monotonic() + rng.expovariate(1 / args.mtbf_s)
                assert time.monotonic() - start < args.limit_s, f"{mode} seed {seed}: over --limit-s"
                time.sleep(0.05)
            result.wall_s = job.finished_at() - start
            finals = {r for r, log in enumerate(job.logs) if any(x.get("final") for x in read_records(log))}
            # A replica without a final record is one that was started again after its peers had finished: it
            # waited for a quorum that never came. Any other failure is the run's.
            result.late = len(job.procs) - len(finals)
            bad = [r for r, p in enumerate(job.procs) if p.returncode not in (0, None) and r in finals]
            assert not bad and len(finals) >= args.min_replicas, f"replicas {bad} failed: see {tmp}"
            lines = [x for log in job.logs for x in read_records(log)]
            result.discarded = sum(x.get("kind") == "discarded" for x in lines)
            losses = [x["test_loss"] for x in lines if x.get("final")]
            result.test_loss = max(losses) if losses else None
        finally:
            job.close()
    shutil.rmtree(tmp)
    return result


def _fault(job: Job, mode: str, rng: random.Random, result: Run) -> None:
    victim = rng.randrange(len(job.procs))
    killed_at = time.monotonic()
    if mode == "live":
        job.kill(victim)
        job.procs[victim] = job.start(victim)
        seen = len(read_records(job.logs[victim]))
        while len(read_records(job.logs[victim])) <= seen and job.procs[victim].poll() is None:
            time.sleep(0.05)  # until the victim reports a round again (its join: healed and back in the quorum)
    else:  # restart everyone from the newest checkpoint
        for replica in range(len(job.procs)):
            job.kill(replica)
        before = job.committed()  # read once every replica is dead: rounds logged while killing count too
        job.procs = [job.start(r) for r in range(len(job.procs))]
        while job.committed() <= before and not all(p.poll() is not None for p in job.procs):
            time.sleep(0.05)  # until the job commits a round it had not before the fault
    result.faults += 1
    result.recovery_s.append(round(time.monotonic() - killed_at, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2000, help="rounds the job commits (a multiple of 4)")
    parser.add_argument("--mtbf-s", type=float, default=30.0, help="mean seconds between faults")
    parser.add_argument("--modes", nargs="+", default=["none", "live", "restart"], choices=["none", "live", "restart"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--step-s", type=float, default=0.02, help="emulated compute per step")
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--limit-s", type=float, default=1800.0, help="a run that takes longer is an error")
    parser.add_argument("--out", type=Path, default=None, help="write the records here (JSON)")
    args = parser.parse_args()
    results: list[Run] = []
    for seed in args.seeds:
        for mode in args.modes:
            result = run(args, mode, seed)
            results.append(result)
            summary = f"{result.faults} faults, recovery {result.recovery_s}, discarded {result.discarded}"
            print(f"{mode:8s} seed {seed}: {result.wall_s:7.1f} s, {summary}, test loss {result.test_loss}", flush=True)
    for result in results:
        reference = [r.wall_s for r in results if r.mode == "none" and r.seed == result.seed]
        result.goodput = round(reference[0] / result.wall_s, 3) if reference and result.wall_s else None
    for result in results:
        print(f"{result.mode:8s} seed {result.seed}: goodput {result.goodput}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1) + "\n")


if __name__ == "__main__":
    main()
