"""Chaos harness: randomized real faults in torchrun training runs, and what the survivors did.

Each run trains ``train.py`` under ``torchrun --standalone`` with a short timeout (every step has a 50 ms
straggler, so training lasts seconds), waits a random time after training has started, and then sends one
chosen rank a real signal from outside:

- ``SIGKILL``: the rank dies at once (a lost node, the OOM killer);
- ``SIGSTOP``: the rank freezes but stays alive, holding its sockets (a hung node): only the survivors'
  own timeouts can end the run, and only their errors can say who is missing;
- ``SIGTERM``: the rank is asked to stop (a scheduler's preemption).

Checkpoints are frequent (``checkpoint_every`` 1 or 5), so some faults land inside a checkpoint.
After the fault the harness records, per run:

- ``struck_at_step``: the newest complete checkpoint when the signal was sent (the fault's place in the run);
- ``hung``: the job did not end within ``2 x timeout + grace`` of the fault (then it is killed);
- ``survivor_s`` / ``max_survivor_s``: seconds from the fault until each other rank's process ended;
- ``named_rank``: whether the job's output names the faulty rank as the cause: torchrun's failure
  report for a rank that died, and for a frozen rank a survivor's error saying it did not arrive;
- ``resumed``: whether the run was then resumed to completion: an elastic restart (``--max-restarts 1``,
  ``restart="elastic"``) or a second launch with ``resume=true`` finished its configured steps;
  ``resumed_from``: the step it continued from (0 when the fault struck before the first complete
  checkpoint: the relaunch then rightly trained from the start);
- ``bitwise``: for synchronous policies (:func:`synchronous`: allreduce, local_sgd, hierarchical,
  hierarchical_momentum, dpsgd, sgp), whether that final model equals, bit for bit, the model of an uninterrupted
  run of the same configuration (``None`` for the others).

The policies are the configs' names (``--policies``): by default every shipped preset and baseline, i.e. every
``configs/averaging/*.yaml`` (a preset added there is in the next campaign), and the published eager-SGD
algorithms of ``configs/averaging/reference/``; any name :func:`benchmarks.presets.averaging_option` finds a config
for is accepted. What the harness needs to know about a policy it reads from that config.

Usage (the campaign behind ``benchmarks/results/chaos/chaos.json``; see benchmarks/README.md)::

    python benchmarks/chaos.py --runs 100 --out benchmarks/results/chaos/chaos.json

Results go to ``--out`` (a JSON list of records) and a Markdown summary beside it (``chaos.md``).
Nothing here is a unit test: tests/test_chaos.py runs two small cases of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout without installing

# No Hydra: chaos only launches train.py, and reads the configs' keys itself.
from benchmarks import presets  # noqa: E402
from benchmarks.presets import averaging_config, averaging_option  # noqa: E402
from wagma.app.network import check_rank_net, rate_name  # noqa: E402 - the standard library only

CONFIGS = REPO / "configs"
#: The published algorithms every campaign has faulted, though they are not shipped (configs/averaging/reference/).
REFERENCES = ("eager_solo", "eager_majority")
#: The averagers (a config's ``name``) whose model does not depend on when ranks arrive, so a resumed run must equal
#: the uninterrupted one bit for bit: DDP's allreduce, the periodic and hierarchical means (blocking collectives at
#: fixed steps; hierarchical_momentum's momentum state is checkpointed), D-PSGD and SGP (fixed peers every step, each
#: exchange waited for). Not: WAGMA and eager-SGD (a round takes whatever has arrived), OSGP (collecting its round in
#: flight at a checkpoint changes what the next rounds split) and AD-PSGD (a progress thread nobody waits for).
BLOCKING_AVERAGERS = frozenset({"allreduce", "local_sgd", "hierarchical", "hierarchical_momentum", "dpsgd", "sgp"})


def default_policies(configs_dir: Path = CONFIGS) -> tuple[str, ...]:
    """The campaign's policies: every shipped preset and baseline (``configs/averaging/*.yaml``), then
    :data:`REFERENCES`."""
    shipped = presets.shipped_policies(configs_dir)
    return shipped + tuple(p for p in REFERENCES if p not in shipped and p in known_policies(configs_dir))


def known_policies(configs_dir: Path = CONFIGS) -> tuple[str, ...]:
    """Every name ``--policies`` accepts: each config of ``configs/averaging/`` and its unshipped folders."""
    return presets.known_policies(configs_dir)


def synchronous(policy: str, configs_dir: Path = CONFIGS) -> bool:
    """Whether ``policy``'s resumed model must equal the uninterrupted one bit for bit: its config builds one of the
    :data:`BLOCKING_AVERAGERS` (its ``name``, after its defaults) and does not overlap rounds with steps."""
    cfg = averaging_config(policy, configs_dir)
    return cfg.get("name") in BLOCKING_AVERAGERS and not cfg.get("overlap")


POLICIES = default_policies()
WORLDS = (2, 4, 8)
FAULTS = ("SIGKILL", "SIGSTOP", "SIGTERM")
RESTARTS = ("elastic", "resume")
_POLL_S = 0.01


@dataclasses.dataclass(frozen=True)
class Spec:
    """One chaos run: which job, which rank gets which signal at which step, and how it comes back."""

    index: int
    policy: str
    world_size: int
    fault: str
    victim: int
    at_s: float
    checkpoint_every: int
    restart: str
    steps: int = 60
    seed: int = 0
    rank_net: str | None = None  # every rank's link rate (wagma.app.network); None: loopback

    def config(self) -> tuple[Any, ...]:
        """What the run depends on (the key of its uninterrupted reference run; its name without ``rank_net`` keeps
        the references of loopback campaigns where they were)."""
        return (
            self.policy,
            self.world_size,
            self.steps,
            self.checkpoint_every,
            self.seed,
            *([self.rank_net] if self.rank_net else []),
        )


def plan(
    runs: int,
    seed: int,
    policies: tuple[str, ...] = POLICIES,
    worlds: tuple[int, ...] = WORLDS,
    faults: tuple[str, ...] = FAULTS,
    steps: int = 60,
    rank_net: str | None = None,
) -> list[Spec]:
    """``runs`` specs drawn from ``seed``; every (policy, world, fault) comes up before any repeats."""
    rng = random.Random(seed)
    combos = [(p, w, f) for p in policies for w in worlds for f in faults]
    specs = []
    for i in range(runs):
        if i % len(combos) == 0:
            rng.shuffle(combos)
        policy, world, fault = combos[i % len(combos)]
        specs.append(
            Spec(
                index=i,
                policy=policy,
                world_size=world,
                fault=fault,
                victim=rng.randrange(world),
                at_s=round(rng.uniform(0.3, 2.5), 3),
                checkpoint_every=rng.choice((1, 5)),
                restart=rng.choice(RESTARTS),
                steps=steps,
                seed=seed,
                rank_net=rank_net,
            )
        )
    return specs


def overrides(spec: Spec, timeout_s: float) -> list[str]:
    """The Hydra overrides of a run: tiny model, short timeouts, frequent checkpoints, a record every step."""
    out = [
        f"averaging={averaging_option(spec.policy, CONFIGS)}",
        f"steps={spec.steps}",
        f"checkpoint_every={spec.checkpoint_every}",
        f"dist_timeout_s={timeout_s}",
        "progress=false",
        "log_every=1",
        f"seed={spec.seed}",
        "batch_size=16",
        # A straggler every step (the papers' imbalance) keeps each step >= 50 ms, so the fault lands mid-run.
        "imbalance=random_k",
        "imbalance.k=1",
        "imbalance.delay_s=0.05",
    ]
    if "timeout_s" in averaging_config(spec.policy, CONFIGS):  # allreduce has none: its only wait is DDP's,
        out.append(f"averaging.timeout_s={timeout_s}")  # bounded by dist_timeout_s
    if spec.rank_net:  # each rank makes its own network namespace; its reaper removes it however the rank ends
        out.append(f"rank_net={spec.rank_net}")
    return out


def torchrun(
    spec: Spec, run_dir: Path, timeout_s: float, *, max_restarts: int, resume: bool, log_name: str
) -> subprocess.Popen:
    """Start torchrun for ``spec`` in its own session (so it can be killed whole), logging per rank."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={spec.world_size}",
        f"--max-restarts={max_restarts}",
        f"--log-dir={run_dir / 'torchrun' / log_name}",
        "--redirects=3",
        str(REPO / "train.py"),
        *overrides(spec, timeout_s),
        f"resume={'true' if resume else 'false'}",
        f"hydra.run.dir={run_dir}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(run_dir / f"{log_name}.log", "wb")  # closed with the process by the caller
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def worker_pids(parent: int) -> dict[int, int]:
    """rank -> pid of the worker processes torchrun ``parent`` started (its children with ``RANK`` set)."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for item in env:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def training_started(run_dir: Path, world_size: int) -> bool:
    """Whether every rank has opened its metrics file (train.py does so as its training loop starts)."""
    return all(
        (run_dir / f"metrics_rank{r}.jsonl").exists() for r in range(world_size)
    )  # wagma.app.metrics.metrics_path


def in_checkpoint(run_dir: Path) -> bool:
    """Whether a checkpoint is being written right now (a temporary file or directory exists)."""
    root = run_dir / "checkpoints"  # wagma.app.checkpoint writes into .partial_step_<n>/, then renames it
    return root.is_dir() and any(p.name.startswith(".partial") or "tmp" in p.name for p in root.rglob("*"))


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def named(text: str, spec: Spec) -> bool:
    """Whether ``text`` (the job's output) names ``spec.victim`` as the cause of the failure.

    A rank that died is named by torchrun's failure report (``rank : V`` with a negative exit code, the
    signal). A frozen rank is alive, so only a survivor can name it: a line saying rank V did not arrive.
    """
    v = spec.victim
    # The roll call's "rank(s) [2] did not arrive at step 12", the engine's "rank(s) [1] of group (0, 1) did
    # not arrive ...; furthest behind: rank(s) [3]": the lists in brackets, never a step or round number.
    for listed in re.findall(r"rank\(s\) \[([\d, ]+)\](?: of group \([\d, ]+\))? did not arrive", text) + re.findall(
        r"furthest behind: rank\(s\) \[([\d, ]+)\]", text
    ):
        if v in {int(x) for x in listed.replace(",", " ").split()}:
            return True
    # The gossip averagers' point-to-point exchanges name their peer: "no model arrived from rank 2 within 5 s".
    if any(int(r) == v for r in re.findall(r"(?:no model arrived from|could not hand its model to) rank (\d+)", text)):
        return True
    if spec.fault != "SIGSTOP":
        # The agent's log line as a worker dies ("failed (exitcode: -9) local_rank: 2") and its final report;
        # with --standalone local ranks are ranks.
        report = re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", text)
        report += [
            (code, r)
            for r, code in re.findall(r"rank\s*:\s*(\d+)\s*\(local_rank[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)", text)
        ]
        return any(int(r) == v and int(code) < 0 for code, r in report)
    return False


def _job_text(run_dir: Path) -> str:
    """torchrun's own output and every rank's stderr of every launch of a run."""
    parts = [p.read_text(errors="replace") for p in sorted(run_dir.glob("*.log"))]
    parts += [p.read_text(errors="replace") for p in sorted((run_dir / "torchrun").rglob("stderr.log"))]
    return "\n".join(parts)


def _final_model(run_dir: Path) -> dict[str, Any] | None:
    import torch

    path = run_dir / "model.pt"
    return torch.load(path, weights_only=True) if path.is_file() else None


def came_back(
    summary: dict[str, Any] | None, written_at: float | None, struck_at: float, steps: int
) -> tuple[bool, int | None]:
    """Whether the run was resumed to completion after the fault, and from which step (``resumed``, ``resumed_from``).

    Resumed to completion: a summary of all ``steps`` was written after the fault (``written_at`` and
    ``struck_at`` are ``time.time()`` values), i.e. by the relaunch or the elastic restart. It resumed from the
    checkpoint its summary names, or from step 0 (``resumed_from`` 0) when the fault struck before the first
    complete checkpoint and the relaunch, correctly, trained from the start.
    """
    if summary is None or written_at is None or written_at < struck_at or int(summary.get("steps", -1)) != steps:
        return False, None
    start = summary.get("resumed_from")
    return True, 0 if start is None else int(start)


def finished_before(written_at: float | None, struck_at: float) -> bool:
    """Whether the run's summary (``written_at``, a ``time.time()`` value or None) predates the fault."""
    return written_at is not None and written_at <= struck_at


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def reference(spec: Spec, root: Path, timeout_s: float, limit_s: float) -> Path:
    """The run directory of an uninterrupted run of ``spec``'s configuration (made once, then reused)."""
    run_dir = root / "reference" / "-".join(str(x) for x in spec.config())
    if not (run_dir / "model.pt").is_file():
        shutil.rmtree(run_dir, ignore_errors=True)
        proc = torchrun(spec, run_dir, timeout_s, max_restarts=0, resume=False, log_name="launch0")
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired as err:
            _kill_session(proc)
            raise RuntimeError(f"the uninterrupted reference run {run_dir} did not finish in {limit_s:.0f} s") from err
        if proc.returncode != 0:
            raise RuntimeError(f"the uninterrupted reference run {run_dir} failed (exit {proc.returncode})")
    return run_dir


def run_one(spec: Spec, root: Path, timeout_s: float, grace_s: float = 30.0) -> dict[str, Any]:
    """Run ``spec``: start the job, strike, watch the survivors, bring the run back, compare."""
    run_dir = root / f"{spec.index:03d}-{spec.policy}-p{spec.world_size}-{spec.fault.lower()}"
    shutil.rmtree(run_dir, ignore_errors=True)
    record: dict[str, Any] = dataclasses.asdict(spec) | {"timeout_s": timeout_s, "run_dir": str(run_dir)}
    elastic = spec.restart == "elastic"
    proc = torchrun(spec, run_dir, timeout_s, max_restarts=1 if elastic else 0, resume=False, log_name="launch0")
    start_limit = time.monotonic() + 120.0
    while not training_started(run_dir, spec.world_size):
        if proc.poll() is not None or time.monotonic() > start_limit:
            _kill_session(proc)
            return record | {"error": f"the job ended or stalled before training started (exit {proc.returncode})"}
        time.sleep(_POLL_S)
    time.sleep(spec.at_s)
    pids = worker_pids(proc.pid)
    if spec.victim not in pids:
        _kill_session(proc)
        return record | {"error": f"rank {spec.victim}'s process was not found among {pids}"}
    record["during_checkpoint"] = in_checkpoint(run_dir)
    steps = [int(p.parent.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*/meta.json")]
    record["struck_at_step"] = max(steps, default=0)
    struck, struck_wall = time.monotonic(), time.time()
    os.kill(pids[spec.victim], getattr(signal, spec.fault))

    # The survivors: when did each end (raised, or was ended by torchrun once another rank failed)?
    survivors = {r: p for r, p in pids.items() if r != spec.victim}
    ended: dict[int, float] = {}
    hard = struck + 2 * timeout_s + grace_s
    while len(ended) < len(survivors) and time.monotonic() < hard:
        for r, p in survivors.items():
            if r not in ended and not alive(p):
                ended[r] = time.monotonic() - struck
        time.sleep(_POLL_S)
    if spec.fault == "SIGSTOP":
        # The frozen rank cannot act on torchrun's SIGTERM; end it as an operator would, once the survivors
        # have had their say (and at the latest at the hang limit), so that the job can be torn down.
        try:
            os.kill(pids[spec.victim], signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=max(1.0, hard - time.monotonic()) + (300.0 if elastic else 0.0))
        hung = len(ended) < len(survivors)
    except subprocess.TimeoutExpired:
        hung = True
        _kill_session(proc)
    record.update(
        hung=hung,
        survivor_s={str(r): round(s, 3) for r, s in sorted(ended.items())},
        max_survivor_s=round(max(ended.values()), 3) if ended else None,
        exit_first=proc.returncode,
    )

    if finished_before(_mtime(run_dir / "summary.json"), struck_wall) or (proc.returncode == 0 and not elastic):
        # The run's work was done (rank 0 wrote its summary) before the signal: the fault struck a rank in its
        # teardown, or not at all. Not a fault run; the launcher's failure report would blame the signal.
        return record | {"error": "the job finished before the fault took effect"}
    # Bring the run back: the elastic restart has already happened inside the first launch, if asked for.
    if not (elastic and proc.returncode == 0):
        again = torchrun(spec, run_dir, timeout_s, max_restarts=0, resume=True, log_name="launch1")
        try:
            again.wait(timeout=300.0)
        except subprocess.TimeoutExpired:
            _kill_session(again)
        record["restart"] = "resume" if not elastic else "elastic, then resume"
        record["exit_resume"] = again.returncode
    record["resumed"], record["resumed_from"] = came_back(
        _summary(run_dir), _mtime(run_dir / "summary.json"), struck_wall, spec.steps
    )
    record["named_rank"] = named(_job_text(run_dir), spec)
    record["bitwise"] = None
    if synchronous(spec.policy) and record["resumed"]:
        ref = _final_model(reference(spec, root, timeout_s, 300.0))
        got = _final_model(run_dir)
        record["bitwise"] = bool(
            ref is not None and got is not None and ref.keys() == got.keys() and all(ref[k].equal(got[k]) for k in ref)
        )
    return record


def markdown(records: list[dict[str, Any]], command: str) -> str:
    """A short report: the targets, then one line per (fault) and the runs that missed a target."""
    ok = [r for r in records if "error" not in r]
    stop = [r for r in ok if r["fault"] == "SIGSTOP"]
    dead = [r for r in ok if r["fault"] != "SIGSTOP"]
    sync = [r for r in ok if r["bitwise"] is not None]
    within = [r for r in ok if r["max_survivor_s"] is not None and r["max_survivor_s"] <= 2 * r["timeout_s"]]
    ratios = [r["max_survivor_s"] / r["timeout_s"] for r in ok if r["max_survivor_s"] is not None]
    lines = [
        "# Chaos campaign",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.node()} ({os.cpu_count()} cores, {platform.platform()}), "
        f"Python {platform.python_version()}.",
        "",
        *(
            [f"Ranks' links (`rank_net`): {', '.join(nets)}.", ""]
            if (nets := sorted({str(r.get("rank_net") or "loopback") for r in records})) != ["loopback"]
            else []
        ),
        "| target | result |",
        "|---|---|",
        f"| runs (harness errors) | {len(records)} ({len(records) - len(ok)}) |",
        f"| 0 hangs | {sum(r['hung'] for r in ok)} hung |",
        f"| every survivor ends within 2 x timeout | {len(within)} of {len(ok)} runs |",
        f"| survivors' end / timeout: median, max | {statistics.median(ratios):.2f}, {max(ratios):.2f} |"
        if ratios
        else "| survivors' end / timeout | - |",
        f"| faulty rank named, SIGSTOP runs | {sum(r['named_rank'] for r in stop)} of {len(stop)} |",
        f"| faulty rank named, SIGKILL/SIGTERM runs | {sum(r['named_rank'] for r in dead)} of {len(dead)} |",
        f"| run resumed to completion after the fault | {sum(r['resumed'] for r in ok)} of {len(ok)} "
        f"({sum(r['resumed'] and r.get('resumed_from') == 0 for r in ok)} from step 0: struck before a checkpoint) |",
        "| synchronous policies: resumed model bitwise equal | "
        f"{sum(bool(r['bitwise']) for r in sync)} of {len(sync)} |",
        f"| faults that landed inside a checkpoint | {sum(bool(r.get('during_checkpoint')) for r in ok)} |",
        "",
    ]
    missed = [
        r
        for r in records
        if "error" in r
        or r["hung"]
        or not r["resumed"]
        or (r["fault"] == "SIGSTOP" and not r["named_rank"])
        or r["bitwise"] is False
        or r["max_survivor_s"] is None
        or r["max_survivor_s"] > 2 * r["timeout_s"]
    ]
    if missed:
        lines += ["Runs that missed a target:", ""]
        lines += [
            f"- {r['index']}: {r['policy']} P={r['world_size']} {r['fault']} rank {r['victim']} "
            f"{r['at_s']} s into training: "
            + ", ".join(
                f"{k}={r.get(k)}" for k in ("error", "hung", "max_survivor_s", "named_rank", "resumed", "bitwise")
            )
            for r in missed
        ]
    return "\n".join(lines) + "\n"


def main_parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="number of fault runs (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the run plan")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="collective timeout of every run (default 5)")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated config names (default: every configs/averaging/*.yaml, and {', '.join(REFERENCES)})",
    )
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--rank-net",
        default=None,
        metavar="RATE",
        help="every rank on its own link of this rate, e.g. 200mbit (the app's rank_net; default: "
        "loopback); the records carry it",
    )
    parser.add_argument("--workdir", default="/tmp/wagma-chaos", help="where the runs' directories go")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "chaos" / "chaos.json"))
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="instead of running: combine the records of campaigns run side by side (other seeds "
        "and workdirs) into --out and its Markdown summary",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = main_parser()
    args = parser.parse_args(argv)
    if args.merge:
        records = [dict(r, campaign=str(path)) for path in args.merge for r in json.loads(Path(path).read_text())]
        out = Path(args.out)
        out.write_text(json.dumps(records, indent=1) + "\n")
        sources = "; ".join(f"{path}: {sum(r['campaign'] == str(path) for r in records)} runs" for path in args.merge)
        (out.parent / (out.stem + ".md")).write_text(
            markdown(records, f"python benchmarks/chaos.py --merge ... ({sources})")
        )
        print(markdown(records, sources))
        return 0
    if args.runs < 1 or args.timeout_s <= 0 or args.steps < 10:
        parser.error(
            f"need --runs >= 1, --timeout-s > 0 and --steps >= 10, got {args.runs}, {args.timeout_s}, {args.steps}"
        )
    policies = tuple(p for p in args.policies.split(",") if p)
    known = known_policies()
    unknown = set(policies) - set(known)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; known: {', '.join(known)}")
    worlds = tuple(int(w) for w in args.worlds.split(","))
    try:
        rank_net = rate_name(args.rank_net)
    except ValueError as exc:
        parser.error(f"--rank-net: {exc}")
    if rank_net is not None and (problem := check_rank_net(rank_net, max(worlds), max(worlds))) is not None:
        parser.error(problem)
    specs = plan(args.runs, args.seed, policies, worlds, tuple(args.faults.split(",")), args.steps, rank_net)
    root = Path(args.workdir)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/chaos.py " + " ".join(argv if argv is not None else sys.argv[1:])
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    for spec in specs:
        t0 = time.monotonic()
        record = run_one(spec, root, args.timeout_s)
        record["run_s"] = round(time.monotonic() - t0, 1)
        records.append(record)
        print(
            f"[{len(records)}/{len(specs)} {time.monotonic() - started:6.0f}s] {spec.policy:15s} "
            f"P={spec.world_size} {spec.fault:7s} rank {spec.victim} at {spec.at_s:.2f}s: "
            + (
                record["error"]
                if "error" in record
                else f"hung={record['hung']} max_survivor_s={record['max_survivor_s']} named={record['named_rank']} "
                f"resumed={record['resumed']} bitwise={record['bitwise']}"
            ),
            flush=True,
        )
        out.write_text(json.dumps(records, indent=1) + "\n")  # after every run: a partial campaign is kept
    (out.parent / (out.stem + ".md")).write_text(markdown(records, command))
    print(markdown(records, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
