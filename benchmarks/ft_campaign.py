"""The application under faults: live recovery (``ft=torchft``) against restarting everyone, on ``python train.py``.

Per run, one ``python train.py`` job trains a classification task (``--data``/``--model``; default digits and an
MLP) with P replicas (``--replicas``). Faults come from ``--seed``: exponential intervals of mean ``--mtbf-s`` from
the job's first training step (the first at ``--first-fault-s`` when given), each with a uniform draw that picks the
victim, the same draws for every mode of one seed. Each fault SIGKILLs a process from outside. The modes:

- ``none``: ``ft=torchft replicas=P``, no faults: the reference for ``live``;
- ``live``: ``ft=torchft replicas=P``; the victim is a replica process in the quorum; the launcher starts it again
  and it heals from a live peer while the others go on;
- ``restart_none``: ``nproc=P``, no faults: the reference for ``restart``;
- ``restart``: ``nproc=P max_restarts=F+1 checkpoint_every=K``; the victim is a rank; every rank is restarted from
  the newest complete checkpoint.

Per run: wall time (first step to the job's end), faults, goodput (its reference's wall time, same seed and steps,
over this run's; ``restart`` falls back to ``none`` without ``restart_none``), per fault the seconds until the
victim is back in the quorum (live: its next life's first round, ``replicas.json``) or the job trains again
(restart: rank 0's first metrics record after the kill), the steps survivors lost (live: the most rounds one
survivor discarded while the victim was down, ``discarded`` per survivor -- one step a round, ``ft.period=1``;
restart: the steps past the resumed checkpoint, as far as rank 0's flushed metrics show: a lower bound), whether
the job's output named the victim, whether the run hung (over ``--limit-s``: killed by the harness), the final
test accuracy and (restart) the step the last restart resumed from, both from ``summary.json``. Records are
appended to ``--out`` (JSON lines; with ``--resume`` the runs already there are skipped) and summarised in Markdown
beside it (``.md``). A run that failed, hung or lost a survivor more than one round at a fault keeps its
directory (``work``, and ``kept`` says why).

Several ``--mtbf-s`` values share one file: the fault-free references (``none``, ``restart_none``) do not depend on
the faults' rate, so each runs once per seed (recorded with ``mtbf_s`` null) and serves every rate.

    python benchmarks/ft_campaign.py --replicas 4 --mtbf-s 30 60 --steps 2000 --seeds 0 1 2 \\
        --out benchmarks/results/ft_chaos/campaign_p4.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from benchmarks.chaos import alive  # noqa: E402
from benchmarks.ft_campaign_report import FAULT_FREE, cell, markdown, with_goodput  # noqa: E402
from benchmarks.ft_chaos import read_records  # noqa: E402
from wagma.app.procs import descendants  # noqa: E402

MODES = ("none", "live", "restart_none", "restart")
_POLL_S = 0.2


def draw_faults(seed: int, mtbf_s: float, horizon_s: float, first_s: float | None, cap: int) -> list[list[float]]:
    """``[at_s, u]`` per fault: seconds after the first training step and a uniform draw (the victim is
    ``int(u * P)``), exponential intervals of mean ``mtbf_s`` up to ``horizon_s``, at most ``cap``."""
    rng, at, faults = random.Random(seed), 0.0, []
    while len(faults) < cap:
        at += rng.expovariate(1 / mtbf_s)
        u = rng.random()
        if first_s is not None and not faults:
            at = first_s
        if at > horizon_s:
            break
        faults.append([round(at, 3), u])
    return faults


def command(args: argparse.Namespace, mode: str, seed: int, work: Path, faults: int) -> list[str]:
    """``python train.py ...`` for ``mode`` into ``work/run``."""
    p = args.replicas
    out = [sys.executable, str(ROOT / "train.py"), f"data={args.data}", f"model={args.model}", f"steps={args.steps}"]
    out += [f"seed={seed}", "eval_every=0", "progress=false", "log_every=1"]
    out += [f"run_dir={work / 'run'}", f"hydra.run.dir={work / 'hydra'}"]
    if args.step_s > 0:  # every process sleeps this long a step: emulated compute, so a run outlasts restarts
        out += ["imbalance=random_k", f"imbalance.k={p}", f"imbalance.delay_s={args.step_s}"]
    if mode in ("none", "live"):
        return [*out, "ft=torchft", f"replicas={p}", f"ft.max_restarts={faults + 1}", *args.extra]
    return [*out, f"nproc={p}", f"max_restarts={faults + 1}", f"checkpoint_every={args.checkpoint_every}", *args.extra]


def _spawned(parent: int) -> list[int]:
    """The rank processes ``python train.py`` (``parent``) runs: its children that multiprocessing spawned, by pid
    (they start in rank order; the elastic agent sets ``RANK`` inside them, so their environment does not show it)."""
    found = []
    for pid in descendants(parent):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() and alive(pid):
                found.append(pid)
    return sorted(found)


def _lives(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """``replicas.json``'s lives per replica (empty before the launcher wrote it)."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads((run_dir / "replicas.json").read_text())["replicas"]
    return {}


class Job:
    """One ``python train.py`` of a run, its clock, and its victims."""

    def __init__(self, args: argparse.Namespace, mode: str, seed: int, work: Path, faults: int) -> None:
        self.mode, self.work, self.run_dir, self.p = mode, work, work / "run", args.replicas
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
        self.out_path = work / "train.out"
        with self.out_path.open("wb") as out:
            self.proc = subprocess.Popen(
                command(args, mode, seed, work, faults), cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.live = mode in ("none", "live")
        self.killed: set[int] = set()  # restart modes: the ranks of the newest fault's job
        self.respawned_at = 0.0  # when their replacements were all up (epoch seconds)

    def rank0(self) -> list[dict[str, Any]]:
        """Rank 0's metrics records (restart modes)."""
        return read_records(self.run_dir / "metrics_rank0.jsonl")

    def first_step_time(self) -> float | None:
        """When the job's first training step was recorded (epoch seconds), None before."""
        if self.live:
            times = [r["time"] for q in range(self.p) for r in read_records(self._log(q)) if r["event"] == "round"]
        else:
            times = [r["time"] for r in self.rank0()]
        return min(times) if times else None

    def _log(self, replica: int) -> Path:
        return self.run_dir / "ft" / f"replica{replica}.jsonl"

    def victims(self) -> dict[int, int]:
        """Who may be killed now: replica -> pid of each replica in the quorum (joined, running), or rank -> pid of
        each rank of a job whose ranks are all up and training again since the last kill (a fault then waits, as a
        live one waits for a replica in the quorum)."""
        if self.live:
            return {
                int(r): lives[-1]["pid"] for r, lives in _lives(self.run_dir).items()
                if lives and "joined" in lives[-1] and "exit" not in lives[-1] and alive(lives[-1]["pid"])
            }  # fmt: skip
        ranks = _spawned(self.proc.pid)
        if len(ranks) != self.p or set(ranks) & self.killed:
            return {}  # not while the job is coming back
        training = [r for r in self.rank0() if r["time"] > self.respawned_at]
        return dict(enumerate(ranks)) if training else {}

    def stop(self) -> None:
        """End whatever still runs: SIGTERM the launcher (it stops its replicas), then SIGKILL its session and any
        replica process still alive."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        mine = str(self.run_dir).encode()
        for lives in _lives(self.run_dir).values():
            for life in lives:  # only a replica of this run: a pid may have been reused by another process since
                with contextlib.suppress(OSError):
                    if alive(life["pid"]) and mine in Path(f"/proc/{life['pid']}/cmdline").read_bytes():
                        os.killpg(life["pid"], signal.SIGKILL)


def kill(job: Job, u: float) -> dict[str, Any] | None:
    """SIGKILL the victim ``int(u * P)`` (the next one that may be killed when it may not); None when none may."""
    victims = job.victims()
    if not victims:
        return None
    drawn = int(u * job.p)
    victim = next(v for i in range(job.p) if (v := (drawn + i) % job.p) in victims)
    fault: dict[str, Any] = {"victim": victim, "pid": victims[victim], "at": time.time()}
    if not job.live:
        fault["step"] = max((r["step"] for r in job.rank0()), default=0)
        steps = [
            int(m[1]) for p in (job.run_dir / "checkpoints").glob("step_*") if (m := re.match(r"step_(\d+)$", p.name))
        ]
        fault["checkpoint"] = max(steps, default=0)
        fault["ranks"] = sorted(victims.values())
    os.kill(victims[victim], signal.SIGKILL)
    job.killed = set(victims.values())
    return fault


def _watch(job: Job, faults: list[list[float]], limit_s: float) -> tuple[list[dict[str, Any]], float | None, bool]:
    """Apply ``faults`` to the running job until it ends or ``limit_s`` passes: the faults done, the first step's
    time, whether it hung."""
    deadline, done, start = time.monotonic() + limit_s, [], None
    while job.proc.poll() is None:
        if time.monotonic() > deadline:
            return done, start, True
        time.sleep(_POLL_S)
        start = start or job.first_step_time()
        _respawned(job, done)
        if start is not None and len(done) < len(faults) and time.time() - start >= faults[len(done)][0]:
            fault = kill(job, faults[len(done)][1])
            if fault is not None:
                done.append(fault | {"due_s": faults[len(done)][0], "at_s": round(fault["at"] - start, 3)})
    return done, start, False


def _respawned(job: Job, faults: list[dict[str, Any]]) -> None:
    """Restart modes: note when the ranks killed by a fault have all been replaced by new ones (``respawned``); rank
    0's records after that are the restarted job's (a survivor may still log a step or two after the kill)."""
    waiting = [f for f in faults if "respawned" not in f]
    if job.live or not waiting:
        return
    ranks = set(_spawned(job.proc.pid))
    for fault in waiting:
        if len(ranks) == job.p and not ranks & set(fault["ranks"]):
            fault["respawned"] = job.respawned_at = time.time()


def _recovered(job: Job, fault: dict[str, Any]) -> None:
    """Fill in ``recovery_s``, ``lost`` and ``named`` of one fault from the run's records and output."""
    text = job.out_path.read_text(errors="replace")
    if job.live:
        lives = _lives(job.run_dir).get(str(fault["victim"]), [])
        later = [life for life in lives if life["started"] > fault["at"] and "joined" in life]
        back = later[0]["joined"] if later else None
        until = back if back is not None else float("inf")
        discarded = {  # per survivor: the rounds it discarded while the victim was down
            str(q): sum(
                r["event"] == "round" and r.get("kind") == "discarded" and fault["at"] < r["time"] < until
                for r in read_records(job._log(q))
            )
            for q in range(job.p)
            if q != fault["victim"]
        }
        fault["discarded"] = discarded
        lost = max(discarded.values(), default=0)  # a survivor's loss (a sync round: every survivor loses that one)
        named = f"replica {fault['victim']} (pid {fault['pid']}," in text
    else:
        after = [r for r in job.rank0() if r["time"] > fault.get("respawned", float("inf"))]
        back = after[0]["time"] if after else None
        lost = max(0, fault["step"] - fault["checkpoint"])
        # the launcher's line at the restart: "wagma: rank R (pid N) was killed by SIGKILL; restarting every rank ..."
        named = bool(re.search(rf"rank \d+ \(pid {fault['pid']}\) was killed by SIGKILL", text))
    fault |= {"recovery_s": None if back is None else round(back - fault["at"], 3), "lost": lost, "named": named}


def run(args: argparse.Namespace, mode: str, seed: int, mtbf_s: float | None) -> dict[str, Any]:
    """One job in ``mode`` with the faults of ``seed`` at ``mtbf_s`` (None: a fault-free reference); its record."""
    schedule = [] if mtbf_s is None else draw_faults(seed, mtbf_s, args.limit_s, args.first_fault_s, args.max_faults)
    work = Path(tempfile.mkdtemp(prefix=f"wagma-ftc-{mode}-{seed}-"))
    record: dict[str, Any] = {"replicas": args.replicas, "mtbf_s": mtbf_s, "seed": seed, "mode": mode}
    record |= {"data": args.data, "model": args.model, "steps": args.steps, "work": str(work)}
    job = Job(args, mode, seed, work, len(schedule))
    began = time.time()
    try:
        done, start, hung = _watch(job, schedule, args.limit_s)
    finally:
        job.stop()
    ended = time.time()
    for fault in done:
        _recovered(job, fault)
    if job.live:
        record["survivor_exits"] = survivor_exits(_lives(job.run_dir), done, start)
    path = job.run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    accuracy, resumed_from = summary.get("test_accuracy"), summary.get("resumed_from")
    record |= {"hung": hung, "exit": job.proc.returncode, "total_s": round(ended - began, 3)}
    record |= {"wall_s": None if start is None or hung else round(ended - start, 3), "faults": done}
    record |= {"test_accuracy": accuracy, "resumed_from": resumed_from, "scheduled": len(schedule)}
    record["kept"] = kept_for(record, job.live)
    if record["kept"] is None:
        shutil.rmtree(work, ignore_errors=True)
        record["work"] = None
    return record


def survivor_exits(
    lives: dict[str, list[dict[str, Any]]], faults: list[dict[str, Any]], start: float | None
) -> list[dict[str, Any]]:
    """Live modes: the lives that ended on their own with a nonzero status (a replica the harness did not kill
    that failed, and that the launcher started again): ``replica``, ``life`` (1-based), ``exit`` and ``ended_s``
    (seconds after the first training step)."""
    killed = {f["pid"] for f in faults}
    return [
        {
            "replica": int(replica),
            "life": i + 1,
            "exit": life["exit"],
            "ended_s": None if start is None or "ended" not in life else round(life["ended"] - start, 3),
        }  # fmt: skip
        for replica, replica_lives in sorted(lives.items(), key=lambda kv: int(kv[0]))
        for i, life in enumerate(replica_lives)
        if life["pid"] not in killed and life.get("exit") not in (0, None)
    ]


def kept_for(record: dict[str, Any], live: bool) -> str | None:
    """Why a run's directory (its output, the replicas' logs) is kept to be read; None: it is removed. Kept: a run
    that hung or failed, and a live run where a survivor failed or a fault cost one more rounds than the target's
    one."""
    if record["hung"]:
        return "hung"
    if record["exit"] != 0:
        return f"exit status {record['exit']}"
    failed = record.get("survivor_exits") or []
    if live and failed:
        replica, status = failed[0]["replica"], failed[0]["exit"]
        return f"{len(failed)} survivor life(s) failed, the first replica {replica}'s with status {status}"
    over = [f for f in record["faults"] if live and f.get("lost", 0) > 1]
    if over:
        return f"a survivor lost {over[0]['lost']} rounds at the fault on replica {over[0]['victim']}"
    return None


def main_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4, help="P: replica processes (live) or ranks (restart)")
    parser.add_argument(
        "--mtbf-s", type=float, nargs="+", default=[30.0], help="mean seconds between faults (one cell per value)"
    )
    parser.add_argument(
        "--first-fault-s", type=float, default=None, help="the first fault this long after the first step"
    )
    parser.add_argument("--max-faults", type=int, default=1000, help="at most this many faults a run")
    parser.add_argument("--steps", type=int, default=2000, help="steps per run (a multiple of 4)")
    parser.add_argument("--step-s", type=float, default=0.02, help="emulated compute a step (imbalance random_k)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="restart modes: steps between checkpoints")
    parser.add_argument("--data", default="digits", choices=["digits", "mnist"])
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--limit-s", type=float, default=900.0, help="a run still going after this has hung")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, appended; Markdown beside it (.md)")
    parser.add_argument("--resume", action="store_true", help="skip the runs --out already holds")
    parser.add_argument("--extra", nargs="*", default=[], help="more train.py overrides for every run")
    return parser


def check(args: argparse.Namespace) -> None:
    """Refuse bad arguments in one line each."""
    for name, value, ok, expected in (
        ("--replicas", args.replicas, args.replicas >= 2, "an integer >= 2"),
        ("--mtbf-s", args.mtbf_s, all(m > 0 for m in args.mtbf_s), "numbers > 0"),
        ("--steps", args.steps, args.steps > 0 and args.steps % 4 == 0, "a positive multiple of 4"),
        ("--step-s", args.step_s, args.step_s >= 0, "a number >= 0"),
        ("--limit-s", args.limit_s, args.limit_s > 0, "a number > 0"),
        ("--max-faults", args.max_faults, args.max_faults >= 0, "an integer >= 0"),
        ("--checkpoint-every", args.checkpoint_every, args.checkpoint_every >= 1, "an integer >= 1"),
    ):
        if not ok:
            raise SystemExit(f"{name}: expected {expected}, found {value}")
    if args.out.exists() and not args.resume:
        raise SystemExit(f"--out: expected a new file (or --resume to continue it), found {args.out}")


def planned(args: argparse.Namespace, records: list[dict[str, Any]]) -> list[tuple[int, str, float | None]]:
    """``(seed, mode, mtbf_s)`` of every run still to do, in order: per seed, each mode; a fault-free mode once
    (``mtbf_s`` None), a faulted one at each ``--mtbf-s``; the runs ``records`` already hold are left out."""
    done = {cell(r) for r in records}
    todo = []
    for seed in args.seeds:
        for mode in args.modes:
            for mtbf in [None] if mode in FAULT_FREE else dict.fromkeys(args.mtbf_s):
                key = {"replicas": args.replicas, "mtbf_s": mtbf, "seed": seed, "mode": mode, "steps": args.steps}
                if cell(key) not in done:
                    todo.append((seed, mode, mtbf))
    return todo


def main(argv: list[str] | None = None) -> int:
    """Run the campaign; append each record as it ends; rewrite the Markdown summary."""
    args = main_parser().parse_args(argv)
    check(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for seed, mode, mtbf in planned(args, read_records(args.out)):
        record = run(args, mode, seed, mtbf)
        with args.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        recov = [f["recovery_s"] for f in record["faults"]]
        said = f"wall {record['wall_s']} s, recovery {recov}, accuracy {record['test_accuracy']}"
        if "survivor_exits" in record:
            said += f", survivors failed {len(record['survivor_exits'])}"
        rate = "" if mtbf is None else f" MTBF {mtbf:g} s"
        kept = "" if record["kept"] is None else f"; kept {record['work']} ({record['kept']})"
        print(f"P={args.replicas}{rate} {mode:12s} seed {seed}: {said}, hung {record['hung']}{kept}", flush=True)
    records = with_goodput(read_records(args.out))
    shown = " ".join(a if " " not in a else repr(a) for a in sys.argv)
    args.out.with_suffix(".md").write_text(markdown(records, f"python {shown}", ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
