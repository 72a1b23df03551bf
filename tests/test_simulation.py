"""The discrete-event simulator (benchmarks/simulate.py) against closed forms, and its protocol rules.

No process is started: every test runs the SimPy model on a small hand-made or seeded trace.
"""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not an installed package
from benchmarks import scale
from benchmarks.simulate import Network, no_wait_ms, protocol_bound, simulate
from wagma.averaging.gossip import exponential_neighbours, ring_neighbours, sgp_peers
from wagma.engine import WaitAvoidingGroupAllreduce

T = 0.1


def _random_k_trace(p: int, n: int, k: int = 1, d: float = 0.1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    delays = np.zeros((p, n))
    for s in range(n):
        delays[rng.choice(p, size=k, replace=False), s] = d
    return delays


def _blocking_recurrence(c: np.ndarray, blocking: list[bool], flush: bool) -> float:
    """Time to the end when every rank runs freely except at blocking steps (all wait for the slowest)."""
    t = np.zeros(c.shape[0])
    for s in range(c.shape[1]):
        t += c[:, s]
        if blocking[s]:
            t[:] = t.max()
    return float(t.max())  # a final flush or barrier waits for the slowest rank either way


@pytest.mark.parametrize("first_step", [0, 3])
def test_bounds_match_closed_forms(first_step):
    p, n = 8, 40
    delays = _random_k_trace(p, n, k=2, seed=first_step)
    c = T + delays
    steps = range(first_step, first_step + n)
    cases = {
        "allreduce": ({"name": "allreduce"}, [True] * n),
        "local_sgd": ({"name": "local_sgd", "period": 8}, [s % 8 == 0 for s in steps]),
        "hierarchical (global part)": (
            {"name": "hierarchical", "local_group_size": 8, "local_period": 4, "global_period": 16},
            [s % 4 == 0 for s in steps],
        ),
        "wagma": ({"name": "wagma", "group_size": 2, "sync_period": 10}, [s % 11 == 10 for s in steps]),
        "eager_solo": (
            {"name": "eager_solo", "mode": "solo", "sync_period": 32, "warmup_iters": 2},
            [s < 2 or (s - 2) % 33 == 32 for s in steps],
        ),
    }
    for name, (options, blocking) in cases.items():
        got = protocol_bound(options, T, delays, first_step=first_step)
        want = _blocking_recurrence(c, blocking, flush=True)
        assert got.total_s == pytest.approx(want, abs=1e-12), name
    # DDP pays the slowest rank every step: T + E[max delay]; a wait-avoiding bound is never below the ideal.
    ddp = protocol_bound({"name": "allreduce"}, T, delays, first_step=first_step)
    assert ddp.ms_per_step == pytest.approx(1e3 * float((T + delays).max(axis=0).mean()))
    wagma = protocol_bound({"name": "wagma", "group_size": 2, "sync_period": 10}, T, delays, first_step=first_step)
    assert 1e3 * (T + delays.mean()) <= wagma.ms_per_step < ddp.ms_per_step


def test_ddp_pays_the_network_every_step():
    p, n = 4, 10
    delays = _random_k_trace(p, n)
    net = Network(alpha_s=1e-4, bandwidth_Bps=1e8)
    got = simulate({"name": "allreduce"}, T + delays, network=net, nbytes=1e6)
    per_step = net.allreduce_s(p, 1e6)
    assert per_step == pytest.approx(2 * 3 * 1e-4 + 2 * 3 / 4 * 1e6 / 1e8)
    want = float((T + delays).max(axis=0).sum()) + n * per_step + net.allreduce_s(p, 0.0)  # closing barrier
    assert got.total_s == pytest.approx(want)


@pytest.mark.parametrize("n, flushes", [(9, False), (10, True)])
def test_local_sgd_flushes_unless_the_last_step_was_a_global_mean(n, flushes):
    """K = 8: steps 0 and 8 average; after 9 steps (last = 8) finalize has nothing to do, after 10 it averages."""
    p = 4
    net = Network(alpha_s=1e-3, bandwidth_Bps=1e8)
    got = simulate({"name": "local_sgd", "period": 8}, np.full((p, n), T), network=net, nbytes=1e6)
    mean = net.allreduce_s(p, 1e6)
    want = n * T + (2 + flushes) * mean + net.allreduce_s(p, 0.0)
    assert got.total_s == pytest.approx(want)


def _one_late_rank(p: int = 4, n: int = 5, late: int = 3, late_s: float = 10.0) -> np.ndarray:
    c = np.full((p, n), 1.0)
    c[late, 0] += late_s
    return c


def test_wagma_fast_ranks_do_not_wait_for_a_late_rank_in_their_group():
    """Rank 3 is 10 s late at step 0: its progress thread exchanges for it, so ranks 0-2 finish their 5
    steps after about 5 s; only the final flush waits for rank 3."""
    net = Network(alpha_s=1e-3, bandwidth_Bps=1e9, activation_s=1e-3)
    res = simulate({"name": "wagma", "group_size": 2, "sync_period": 10}, _one_late_rank(), network=net, nbytes=1e6)
    assert max(res.finish_s[:3]) < 5.2
    assert res.finish_s[3] == pytest.approx(15.0)  # its rounds were done by its thread: it never waits
    assert res.total_s > 15.0
    # The same trace under DDP: everybody waits at step 0.
    ddp = simulate({"name": "allreduce"}, _one_late_rank(), network=net, nbytes=1e6)
    assert min(ddp.finish_s) > 15.0


def test_wagma_progress_thread_lead_is_bounded():
    """With max_lead=1 the late rank's thread may not run more than one round ahead of its main thread, so a
    fast rank grouped with it from round 2 on (butterfly, P=4, S=2: rounds alternate {0,1},{2,3} and
    {0,2},{1,3}) waits for it."""
    options = {"name": "wagma", "group_size": 2, "sync_period": 10, "max_lead": 1}
    res = simulate(options, _one_late_rank())
    assert res.finish_s[1] >= 10.0  # partner of 3 in rounds 1, 3 (blocked from round 2 on)
    free = simulate(options | {"max_lead": 10}, _one_late_rank())
    assert max(free.finish_s[:3]) == pytest.approx(5.0)


def test_eager_majority_waits_for_the_initiator_and_solo_for_nobody():
    p, n, warmup = 4, 3, 2
    who = WaitAvoidingGroupAllreduce.initiator(type("S", (), {"seed": 7, "world_size": p})(), 0)
    c = np.full((p, warmup + n), 1.0)
    c[who, warmup] += 10.0  # the initiator of round 0 is late in round 0
    base = {"sync_period": 32, "warmup_iters": warmup, "seed": 7}
    majority = simulate(base | {"name": "eager_majority", "mode": "majority"}, c)
    solo = simulate(base | {"name": "eager_solo", "mode": "solo"}, c)
    others = [r for r in range(p) if r != who]
    assert min(majority.finish_s[r] for r in others) >= warmup + 1.0 + 10.0
    assert max(solo.finish_s[r] for r in others) == pytest.approx(warmup + n)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="cannot simulate policy 'gossip'"):
        simulate({"name": "gossip"}, np.ones((2, 2)))
    with pytest.raises(ValueError, match="wagma's sync must be one of .*'lazy'"):
        simulate({"name": "wagma", "sync": "lazy"}, np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"\(P, N\) array"):
        simulate({"name": "allreduce"}, np.ones(3))
    with pytest.raises(ValueError, match="non-negative"):
        simulate({"name": "allreduce"}, -np.ones((2, 2)))
    with pytest.raises(ValueError, match="bandwidth_Bps > 0"):
        Network(bandwidth_Bps=0.0)
    with pytest.raises(ValueError, match=r"cpu_s must have compute_s's shape \(2, 2\), got \(2, 3\)"):
        simulate({"name": "allreduce"}, np.ones((2, 2)), cpu_s=np.ones((2, 3)))
    with pytest.raises(ValueError, match="after_cpu_s must be a finite non-negative"):
        simulate({"name": "allreduce"}, np.ones((2, 2)), after_cpu_s=-np.ones((2, 2)))
    with pytest.raises(ValueError, match="comm_scale must be a finite number >= 0, got nan"):
        simulate({"name": "allreduce"}, np.ones((2, 2)), comm_scale=float("nan"))
    with pytest.raises(ValueError, match=r"cores must be > 0 \(or inf\), got 0"):
        simulate({"name": "allreduce"}, np.ones((2, 2)), cpu_s=np.ones((2, 2)), cores=0)


# -- ranks sharing a machine's cores (processor sharing) ------------------------------------------------------
def test_processor_sharing_closed_forms():
    """On one core, work A = 1 s from t = 0 and B = 1 s from t = 0.5: A runs alone for 0.5 s, then both at half
    speed until A ends at 1.5 (B has done 0.5), then B alone to 2.0. With two cores neither slows the other."""
    import simpy

    from benchmarks.simulate import _Cores

    for cores, want in ((1, (1.5, 2.0)), (2, (1.0, 1.5)), (math.inf, (1.0, 1.5))):
        env = simpy.Environment()
        pool, ends = _Cores(env, cores), {}

        def job(name, start, work, pool=pool, env=env, ends=ends):
            yield env.timeout(start)
            yield pool.run(work)
            ends[name] = env.now

        env.process(job("a", 0.0, 1.0))
        env.process(job("b", 0.5, 1.0))
        env.run()
        assert (ends["a"], ends["b"]) == pytest.approx(want), cores
        assert pool.total_work == (0.0 if math.isinf(cores) else 2.0)


def test_time_slicing_closed_forms():
    """Round robin on one core with slices of 0.5 s: A (1 s) and B (1 s), both from t = 0, alternate: A ends at 1.5,
    B at 2.0 (processor sharing ends both at 2.0). With slices longer than the work, two cores serve four equal
    pieces two at a time: the first pair ends at 1, the second at 2 (processor sharing: all four at 2)."""
    import simpy

    from benchmarks.simulate import _SlicedCores

    def ends(cores, slice_s, works):
        env = simpy.Environment()
        pool, out = _SlicedCores(env, cores, slice_s), {}

        def job(name, work):
            yield pool.run(work)
            out[name] = env.now

        for name, work in enumerate(works):
            env.process(job(name, work))
        env.run()
        assert pool.total_work == pytest.approx(sum(works))
        return [out[k] for k in sorted(out)]

    assert ends(1, 0.5, [1.0, 1.0]) == pytest.approx([1.5, 2.0])
    assert ends(2, 5.0, [1.0] * 4) == pytest.approx([1.0, 1.0, 2.0, 2.0])
    # Three pieces on two cores: the short one ends at 0.1 and frees its core, so the others never queue again.
    assert ends(2, 0.25, [0.1, 1.0, 1.0]) == pytest.approx([0.1, 1.0, 1.1])
    with pytest.raises(ValueError, match="slice_s must be > 0, got 0"):
        _SlicedCores(simpy.Environment(), 2, 0.0)
    with pytest.raises(ValueError, match="a whole number of cores > 0, got 1.5"):
        _SlicedCores(simpy.Environment(), 1.5, 0.1)


def test_time_slices_let_ranks_that_do_not_wait_for_each_other_drift_apart():
    """16 aligned ranks, 2 cores, no imbalance, free communication: under processor sharing every rank's compute
    ends at the same time, so the ranks stay in step and each step costs T + 16 c / 2 whatever the protocol. With
    slices as long as the work, the ranks finish two at a time and drift apart: WAGMA (no barrier between sync
    rounds) then overlaps one rank's compute with another's sleep and beats the lockstep time, while DDP's
    allreduce puts the ranks back in step every step."""
    p, n, c = 16, 22, 0.006
    compute, cpu = np.full((p, n), T), np.full((p, n), c)
    lockstep = n * (T + p * c / 2)
    wagma = {"name": "wagma", "group_size": 2, "sync_period": 10}
    shared = simulate(wagma, compute, cpu_s=cpu, cores=2)
    assert shared.total_s == pytest.approx(lockstep)
    sliced = simulate(wagma, compute, cpu_s=cpu, cores=2, slice_s=0.004)
    assert sliced.total_s < 0.95 * lockstep
    ddp = simulate({"name": "allreduce"}, compute, cpu_s=cpu, cores=2, slice_s=0.004)
    assert ddp.total_s == pytest.approx(lockstep)


@pytest.mark.parametrize("p, cores", [(4, 2), (8, 2), (16, 2), (3, 4)])
def test_aligned_ranks_pay_their_cpu_divided_by_the_cores(p, cores):
    """No imbalance, DDP: every rank sleeps T, then does c of CPU work, then the allreduce costs each member w of
    CPU work: a step takes T + max(1, P / cores) (c + w) exactly. The floor that ranks sharing cores cannot sleep
    away, and that the model of ranks with cores of their own (T + c + w) misses."""
    n, c, w = 5, 0.004, 0.002
    net = Network(alpha_s=w / (2 * (p - 1)))  # an allreduce of 0 bytes costs w
    shared = simulate({"name": "allreduce"}, np.full((p, n), T), cpu_s=np.full((p, n), c), network=net, cores=cores)
    stretch = max(1.0, p / cores)
    want = n * (T + stretch * (c + w)) + stretch * w  # + the closing barrier
    assert shared.total_s == pytest.approx(want)
    assert shared.cpu_work_s == pytest.approx(p * (n * (c + w) + w))
    own = simulate({"name": "allreduce"}, np.full((p, n), T + c), network=net)
    assert own.total_s == pytest.approx(n * (T + c + w) + w)
    # The collectives of the steps, unscaled, per rank (the closing barrier not counted); a comm_scale multiplies
    # every collective's work, the barrier's too.
    assert shared.comm_s == pytest.approx([n * w] * p)
    scaled = simulate(
        {"name": "allreduce"}, np.full((p, n), T), cpu_s=np.full((p, n), c), network=net, cores=cores, comm_scale=3.0
    )
    assert scaled.total_s == pytest.approx(n * (T + stretch * (c + 3 * w)) + stretch * 3 * w)
    assert scaled.comm_s == shared.comm_s


def test_without_shared_cores_cpu_work_is_a_duration():
    """cores = inf (every rank its own device): CPU work before the exchange is the same as adding it to the
    trace, for every protocol (the extrapolation's model is unchanged)."""
    p, n = 8, 23
    delays = _random_k_trace(p, n)
    cpu = np.random.default_rng(3).uniform(0.001, 0.01, (p, n))
    net = Network(alpha_s=1e-4, bandwidth_Bps=1e9, activation_s=2e-4)
    for options in (
        {"name": "allreduce"},
        {"name": "local_sgd", "period": 4},
        {"name": "wagma", "group_size": 2, "sync_period": 10},
        {"name": "wagma", "group_size": 4, "sync_period": 5, "sync": "wait_avoiding", "overlap": True},
        {"name": "eager_solo", "sync_period": 8, "warmup_iters": 2},
        {"name": "dpsgd", "topology": "exponential"},
        {"name": "sgp"},
        {"name": "osgp"},
        {"name": "adpsgd"},
    ):
        split = simulate(options, T + delays, cpu_s=cpu, network=net, nbytes=1e6)
        joined = simulate(options, T + delays + cpu, network=net, nbytes=1e6)
        assert split.total_s == pytest.approx(joined.total_s, rel=1e-12), options
        assert split.cpu_work_s == 0.0


def test_shared_cores_slow_wait_avoiding_rounds_but_keep_their_order():
    """Sharing 2 cores among 8 ranks makes every policy slower than with cores of their own, by at most the CPU
    they burn divided by the cores; and WAGMA stays faster than DDP under one straggler per step."""
    p, n = 8, 22
    delays = _random_k_trace(p, n)
    cpu = np.full((p, n), 0.005)
    after = np.full((p, n), 0.001)
    net = Network(alpha_s=2e-5, bandwidth_Bps=1e9, activation_s=2e-4)
    got = {}
    for options in ({"name": "allreduce"}, {"name": "wagma", "group_size": 2, "sync_period": 10}):
        own = simulate(options, T + delays, cpu_s=cpu, after_cpu_s=after, network=net, nbytes=4e6)
        shared = simulate(options, T + delays, cpu_s=cpu, after_cpu_s=after, network=net, nbytes=4e6, cores=2)
        assert own.total_s < shared.total_s <= own.total_s + shared.cpu_work_s / 2 + 1e-9, options["name"]
        got[options["name"]] = shared.ms_per_step
    assert got["wagma"] < got["allreduce"]


def test_paper_extrapolation_and_pending_validation(tmp_path):
    """A small paper-setting run writes records with simulated_ms and no measured_ms, and says the
    validation is pending when there is no regime.json."""
    result = scale.main(
        [
            "--worlds",
            "64",
            "--steps",
            "12",
            "--policies",
            "allreduce",
            "wagma",
            "--regime",
            str(tmp_path / "none.json"),
            "--out",
            str(tmp_path),
        ]
    )
    recs = result["records"]
    assert {r["policy"] for r in recs} == {"allreduce", "wagma"}
    assert all(r["measured_ms"] is None and r["simulated_ms"] > 0 and r["world_size"] == 64 for r in recs)
    assert result["validation"]["status"].startswith("pending")
    wagma = next(r for r in recs if r["policy"] == "wagma" and r["scenario"] == "random_k2")
    assert wagma["x_allreduce"] > 1.0
    assert (tmp_path / "simulation.md").exists() and (tmp_path / "simulation_scale.png").exists()
    # --validate-only keeps those records (no new simulation: a different --steps would change them).
    kept = scale.main(
        ["--validate-only", "--steps", "3", "--regime", str(tmp_path / "none.json"), "--out", str(tmp_path)]
    )
    assert kept["records"] == recs and kept["setting"]["steps"] == 12


# -- wagma with sync="wait_avoiding" -----------------------------------------------------------------------------


def _wait_avoiding_recurrence(c: np.ndarray, groups, tau: int, lead: int) -> float:
    """The zero-cost protocol of sync="wait_avoiding" as a plain max-plus recurrence (no SimPy): rank i
    arrives at call k at A[i, k]; round k is activated by the first arrival; rank m's thread joins round k
    after its round k-1 and once its main thread published call k - lead; a group's exchange ends when its
    last member joins (sync rounds: the group of all ranks); a main thread leaves call k when it has
    arrived and its group's exchange ended."""
    p, n = c.shape
    arrive, joined_prev = np.zeros((p, n)), np.zeros(p)
    leave = np.zeros(p)
    for k in range(n):
        arrive[:, k] = leave + c[:, k]
        act = arrive[:, k].min()
        join = np.maximum.reduce([joined_prev, arrive[:, k - lead] if k >= lead else np.zeros(p), np.full(p, act)])
        partition = [tuple(range(p))] if k % (tau + 1) == tau else groups(k)
        done = np.zeros(p)
        for group in partition:
            done[list(group)] = join[list(group)].max()
        joined_prev = done
        leave = np.maximum(arrive[:, k], done)
    return float(leave.max())  # the final flush and barrier wait for the slowest rank


@pytest.mark.parametrize("p, lead, seed", [(8, 0, 1), (8, 2, 2), (8, 10, 3), (6, 3, 10)])
def test_wait_avoiding_bound_matches_its_recurrence(p, lead, seed):
    from wagma.schedule import GroupSchedule

    n, tau = 40, 10
    delays = _random_k_trace(p, n, k=1, seed=seed)
    schedule = GroupSchedule.create("auto", p, 2)
    options = {"name": "wagma", "group_size": 2, "sync_period": tau, "max_lead": lead, "sync": "wait_avoiding"}
    got = protocol_bound(options, T, delays)
    want = _wait_avoiding_recurrence(T + delays, lambda k: schedule.groups(k), tau, lead)
    assert got.total_s == pytest.approx(want, abs=1e-12)
    if lead > 0:  # on these traces the barrier costs more: the recurrence is not the barrier's by accident
        assert protocol_bound(options | {"sync": "barrier"}, T, delays).total_s > want + 0.05


@pytest.mark.parametrize("p", [8, 16])
def test_wait_avoiding_sync_reaches_the_issue_target_where_the_barrier_cannot(p):
    """The wait-avoiding sync's target at the protocol level (T = 100 ms, random_k1 with d = T, tau = 10,
    200 steps): the barrier's bound stays below 0.9 of the no-wait ideal T + mean delay, the wait-avoiding
    sync's is >= 0.92, and it never beats the ideal."""
    delays = _random_k_trace(p, 200, k=1, d=T, seed=1)
    ideal_ms = 1e3 * (T + delays.mean())
    base = {"name": "wagma", "group_size": 2, "sync_period": 10}
    barrier = protocol_bound(base, T, delays).ms_per_step
    relaxed = protocol_bound(base | {"sync": "wait_avoiding"}, T, delays).ms_per_step
    assert ideal_ms / barrier < 0.9
    assert 0.92 <= ideal_ms / relaxed <= 1.0 + 1e-9, (ideal_ms, relaxed, barrier)


@pytest.mark.parametrize("p", [8, 16])
def test_the_horizon_caps_every_protocol_at_the_no_wait_time(p):
    """Over N steps no protocol beats T + the largest total delay of one rank / N (the no-wait time, what ranks
    that never communicate take), which sits above the ideal T + mean delay and nears it as N grows. At 22 steps
    (the campaign's default) the ideal is less than 0.93 of the no-wait time on a typical random_k1 draw, so
    x ideal >= 0.92 needs a lucky draw or a longer run; the wait-avoiding sync's bound is the no-wait time itself."""
    relaxed = {"name": "wagma", "group_size": 2, "sync_period": 10, "sync": "wait_avoiding"}
    others = [
        {"name": "allreduce"},
        {"name": "wagma", "group_size": 2, "sync_period": 10},
        {"name": "eager_solo", "mode": "solo", "sync_period": 32, "warmup_iters": 2},
        {"name": "local_sgd", "period": 8},
    ]
    cap = {}
    for n in (22, 200):
        ratios = []
        for seed in range(7):
            delays = _random_k_trace(p, n, k=1, seed=seed)
            no_wait = 1e3 * (T + delays.sum(axis=1).max() / n)
            ideal = 1e3 * (T + delays.mean())
            ratios.append(ideal / no_wait)
            assert protocol_bound(relaxed, T, delays, first_step=3).ms_per_step == pytest.approx(no_wait, rel=1e-9)
            for options in others:
                assert protocol_bound(options, T, delays, first_step=3).ms_per_step >= no_wait - 1e-9, options
        cap[n] = float(np.median(ratios))
    assert cap[22] < 0.93 < 0.95 < cap[200] < 1.0, cap


def test_wagma_overlap_hides_group_exchanges_shorter_than_a_step():
    """No delays, T = 0.1 s per step, a group exchange of 12 ms: without overlap every step pays it; with
    overlap only the blocking sync rounds (and the final round in flight) do."""
    p, n, tau = 4, 22, 10
    compute = np.full((p, n), T)
    net = Network(alpha_s=1e-3, bandwidth_Bps=1e8, activation_s=1e-4)
    options = {"name": "wagma", "group_size": 2, "sync_period": tau}
    plain = simulate(options, compute, network=net, nbytes=1e6)
    overlap = simulate(options | {"overlap": True}, compute, network=net, nbytes=1e6)
    group_s, global_s = net.allreduce_s(2, 1e6), net.allreduce_s(p, 1e6)
    syncs = sum(1 for k in range(n) if k % (tau + 1) == tau)
    assert group_s > 0.01
    # Plain: every group round on the critical path (plus its activation); overlap: none of them but the last.
    assert plain.total_s >= n * T + (n - syncs) * group_s + syncs * global_s
    assert overlap.total_s < n * T + syncs * global_s + group_s + global_s + 0.01
    assert plain.total_s - overlap.total_s > (n - syncs - 2) * group_s
    # eager-SGD solo the same way: each round's allreduce leaves the critical path, sync rounds too.
    eager = {"name": "eager_solo", "sync_period": tau, "warmup_iters": 2}
    eager_plain = simulate(eager, compute, network=net, nbytes=1e6)
    eager_overlap = simulate(eager | {"overlap": True}, compute, network=net, nbytes=1e6)
    assert eager_plain.total_s - eager_overlap.total_s > (n - 2 - 2) * global_s


# -- the decentralized baselines: D-PSGD, SGP, OSGP, AD-PSGD ---------------------------------------------------------


def _gossip_recurrence(
    c: np.ndarray, peers, alpha: float, overlap: bool, warmup: int = 0, first_step: int = 0
) -> tuple[np.ndarray, float]:
    """D-PSGD / SGP / OSGP as a plain max-plus recurrence (no SimPy), with messages of ``alpha`` seconds (no
    bandwidth term) that travel once both ends are there: rank r arrives at step k at A[r, k]; its round's messages
    with ``peers(r, round)`` are done at max(A[r, k], A[q, k] for q in peers) + alpha; blocking (D-PSGD, SGP), it
    leaves then; with ``overlap`` (OSGP) it leaves at max(A[r, k], its previous round's done). Warm-up steps are
    allreduces (2 (P - 1) alpha after the last arrival). Returns the leave times after the last step and the total
    (OSGP's round in flight, then the global mean and the closing barrier, 2 (P - 1) alpha each)."""
    p, n = c.shape
    collective = 2 * (p - 1) * alpha
    leave, in_flight = np.zeros(p), None
    for i in range(n):
        step = first_step + i
        arrive = leave + c[:, i]
        if step < warmup:
            leave = np.full(p, arrive.max() + collective)
            continue
        done = np.array([max(arrive[q] for q in [r, *peers(r, step - warmup)]) + alpha for r in range(p)])
        if overlap:
            leave = arrive if in_flight is None else np.maximum(arrive, in_flight)
            in_flight = done
        else:
            leave = done
    end = leave if in_flight is None else np.maximum(leave, in_flight)
    return leave, float(end.max()) + 2 * collective


def _sgp_both(r: int, p: int, k: int) -> list[int]:
    out, into = sgp_peers(r, p, k)
    return out + into  # a rank waits for its sends (the receiver must post) as well as for its receives


@pytest.mark.parametrize(
    "p, seed, warmup, first_step", [(2, 0, 0, 0), (6, 1, 0, 0), (8, 2, 2, 1), (8, 3, 0, 4), (16, 4, 0, 0)]
)
@pytest.mark.parametrize("alpha", [0.0, 2e-3])
def test_gossip_matches_its_recurrence(p, seed, warmup, first_step, alpha):
    """On random straggler traces with jitter, D-PSGD (ring and exponential), SGP and OSGP end exactly where their
    recurrences say, per rank, with a zero network and with messages of alpha seconds."""
    n = 30
    rng = np.random.default_rng(seed)
    c = T + _random_k_trace(p, n, k=max(1, p // 4), d=0.15, seed=seed) + rng.uniform(0, 0.02, (p, n))
    net = Network(alpha_s=alpha)
    cases = {
        "dpsgd ring": ({"name": "dpsgd", "topology": "ring"}, lambda r, k: ring_neighbours(r, p), False),
        "dpsgd exponential": (
            {"name": "dpsgd", "topology": "exponential"},
            lambda r, k: exponential_neighbours(r, p),
            False,
        ),
        "sgp": ({"name": "sgp"}, lambda r, k: _sgp_both(r, p, k), False),
        "osgp": ({"name": "osgp"}, lambda r, k: _sgp_both(r, p, k), True),
    }
    for what, (options, peers, overlap) in cases.items():
        got = simulate(options | {"warmup_steps": warmup}, c, network=net, nbytes=1e6, first_step=first_step)
        finish, total = _gossip_recurrence(c, peers, alpha, overlap, warmup, first_step)
        assert got.finish_s == pytest.approx(finish.tolist(), abs=1e-12), what
        assert got.total_s == pytest.approx(total, abs=1e-12), what


@pytest.mark.parametrize("s, reached", [(7, {2, 4}), (6, {1, 2, 4, 5})])
def test_dpsgd_ring_delay_spreads_one_hop_a_step(s, reached):
    """Ring of 8, every step T, rank 3 late by d at step s of 8: its neighbours 2 and 4 wait d at step s, ranks 2 hops
    away (1, 5) only at step s + 1, so with s = 7 (the last step) they finish on time and with s = 6 they finish d
    late; the others never wait. Nobody waits for anybody else: no global barrier."""
    p, n, d = 8, 8, 0.05
    c = np.full((p, n), T)
    c[3, s] += d
    got = protocol_bound({"name": "dpsgd", "topology": "ring"}, T, c - T)
    for r in range(p):
        late = r == 3 or r in reached
        assert got.finish_s[r] == pytest.approx(n * T + (d if late else 0.0)), r
        assert got.wait_s[r] == pytest.approx(d if r in reached else 0.0), r
    assert got.total_s == pytest.approx(n * T + d)


@pytest.mark.parametrize("d", [0.5 * T, T])
def test_osgp_tolerates_a_one_step_delay_that_sgp_does_not(d):
    """P = 8, rank 3 late by d <= T at step 2 of 10, zero network: under SGP the delay reaches every rank (the
    time-varying exponential graph spans 8 ranks in two rounds) and everybody ends d late; under OSGP a round's
    messages are only waited for one step later, so nobody waits and only rank 3 ends late."""
    p, n = 8, 10
    delays = np.zeros((p, n))
    delays[3, 2] = d
    sgp = protocol_bound({"name": "sgp"}, T, delays)
    assert sgp.finish_s == pytest.approx([n * T + d] * p)
    osgp = protocol_bound({"name": "osgp"}, T, delays)
    assert osgp.finish_s == pytest.approx([n * T + (d if r == 3 else 0.0) for r in range(p)])
    assert osgp.wait_s == pytest.approx([0.0] * p)
    assert osgp.total_s == pytest.approx(n * T + d)
    # Two steps' delay is not absorbed: rank 3's round-2 peers (two out-peers, two in-peers) wait d - T at step 3.
    delays[3, 2] = 2 * T
    late = protocol_bound({"name": "osgp"}, T, delays)
    out, into = sgp_peers(3, p, 2)
    assert {r for r in range(p) if late.wait_s[r] > 1e-9} >= set(out + into)


def test_adpsgd_main_threads_never_wait():
    """AD-PSGD with a zero network on random straggler traces: every main thread ends its steps after exactly its
    own compute (it only publishes), and the run ends with the slowest rank: the no-wait time."""
    for p, seed in ((2, 0), (8, 1), (16, 2)):
        delays = _random_k_trace(p, 25, k=2 if p > 2 else 1, seed=seed)
        got = protocol_bound({"name": "adpsgd"}, T, delays)
        assert got.finish_s == pytest.approx((T * 25 + delays.sum(axis=1)).tolist())
        assert got.wait_s == [0.0] * p
        assert got.ms_per_step == pytest.approx(no_wait_ms(T, delays))


def test_adpsgd_flush_finishes_the_agreed_exchanges():
    """P = 2 (rank 0 always meets rank 1), steps of 1 s, rank 1 late 2.5 s at step 0, messages of alpha = 0.1 s.
    Rank 1's thread runs exchange k from its publish at k + 3.5; rank 0's thread begins exchange 0 at 1, exchange 1
    at 3.6 and 2 at 4.6 (each once the previous one ended, with a newer copy), then its main thread ends at 5 and
    freezes it. Rank 1 begins exchange 3 at 6.5 and is stuck in it; its main thread ends at 7.5. The agreement
    (an allreduce of 2 alpha) ends at 7.7 with the target 4, so rank 0's thread runs exchange 3 then: 7.8; the global
    mean and the barrier (2 alpha each) end the run at 8.2. Exchanges begun before a rank's flush count in comm_s."""
    c = np.full((2, 5), 1.0)
    c[1, 0] += 2.5
    got = simulate({"name": "adpsgd"}, c, network=Network(alpha_s=0.1))
    assert got.finish_s == pytest.approx([5.0, 7.5])
    assert got.total_s == pytest.approx(8.2)
    assert got.comm_s == pytest.approx([0.3, 0.4])
    # A balanced run: the last exchange (begun at the last publish) outlasts the agreement; the flush waits for it.
    p, n = 4, 6
    net = Network(alpha_s=1e-3, bandwidth_Bps=1e8)
    got = simulate({"name": "adpsgd"}, np.full((p, n), T), network=net, nbytes=1e6)
    exchange = net.p2p_s(1e6)
    assert exchange > net.allreduce_s(p, 8.0)
    assert got.total_s == pytest.approx(n * T + exchange + net.allreduce_s(p, 1e6) + net.allreduce_s(p, 0.0))
    assert got.comm_s == pytest.approx([n * exchange] * p)


def test_gossip_messages_share_their_senders_link():
    """Aligned ranks, alpha = 1 ms, 10 ms per model message alone: a rank sending the model to d peers at once needs
    d times 10 ms (its injection bandwidth is shared), so a step costs T + alpha + d n / bw: d = 2 on a ring and for
    SGP's two out-peers, 5 on the exponential graph of 8 (±1, ±2, 4). OSGP hides it behind the next step (all but
    the round in flight at the end). Ring of 4, rank 1 late by 50 ms: rank 3's exchanges start at once and end
    alpha + 2 n / bw later; rank 1's two messages share its link when it arrives, so it and its neighbours, who
    receive them, end alpha + 2 n / bw after it."""
    n, nbytes = 6, 1e6
    net = Network(alpha_s=1e-3, bandwidth_Bps=1e8)
    one = nbytes / net.bandwidth_Bps
    for options, p, d in (
        ({"name": "dpsgd"}, 4, 2),
        ({"name": "dpsgd", "topology": "exponential"}, 8, 5),
        ({"name": "sgp"}, 8, 2),
        ({"name": "sgp"}, 2, 2),
    ):
        got = simulate(options, np.full((p, n), T), network=net, nbytes=nbytes)
        assert got.finish_s == pytest.approx([n * (T + net.alpha_s + d * one)] * p), (options, p)
        assert got.comm_s == pytest.approx([n * d * net.p2p_s(nbytes)] * p), (options, p)
    flush = net.allreduce_s(8, nbytes) + net.allreduce_s(8, 0.0)
    osgp = simulate({"name": "osgp"}, np.full((8, n), T), network=net, nbytes=nbytes)
    assert osgp.total_s == pytest.approx(n * T + net.alpha_s + 2 * one + flush)
    c = np.full((4, 1), T)
    c[1, 0] += 0.05
    got = simulate({"name": "dpsgd"}, c, network=net, nbytes=nbytes)
    assert got.finish_s == pytest.approx([T + 0.05 + net.alpha_s + 2 * one] * 3 + [T + net.alpha_s + 2 * one])


@pytest.mark.parametrize("p, cores", [(4, 2), (8, 2)])
def test_gossip_on_shared_cores(p, cores):
    """Aligned ranks sharing cores (no imbalance): D-PSGD's exchanges are CPU work in the step, alpha for each of the
    two pairwise exchanges of every rank, so a step takes T + (P / cores) (c + 2 alpha) (the global mean and the
    barrier after); AD-PSGD's exchanges run on its threads during the next sleep, so its main threads pay only
    their own CPU."""
    n, c, alpha = 5, 0.004, 0.001
    net = Network(alpha_s=alpha)
    stretch = p / cores
    compute, cpu = np.full((p, n), T), np.full((p, n), c)
    dpsgd = simulate({"name": "dpsgd"}, compute, cpu_s=cpu, network=net, cores=cores)
    collective = 2 * (p - 1) * alpha
    assert dpsgd.total_s == pytest.approx(n * (T + stretch * (c + 2 * alpha)) + 2 * stretch * collective)
    assert dpsgd.comm_s == pytest.approx([n * 2 * alpha] * p)
    assert dpsgd.cpu_work_s == pytest.approx(p * n * (c + 2 * alpha) + 2 * p * collective)
    adpsgd = simulate({"name": "adpsgd"}, compute, cpu_s=cpu, network=net, cores=cores)
    assert adpsgd.finish_s == pytest.approx([n * (T + stretch * c)] * p)
    assert adpsgd.wait_s == [0.0] * p


@pytest.mark.parametrize("p", [4, 8, 16])
def test_gossip_bounds_lie_between_the_no_wait_time_and_allreduce(p):
    """On random straggler traces no gossip protocol's bound is above DDP's (each waits for a subset of the ranks
    DDP waits for) nor below the no-wait time; OSGP's is never above SGP's; AD-PSGD's is the no-wait time."""
    for seed in range(4):
        delays = _random_k_trace(p, 24, k=max(1, p // 8), seed=seed) * (1 + np.random.default_rng(seed).random())
        ddp = protocol_bound({"name": "allreduce"}, T, delays).ms_per_step
        floor = no_wait_ms(T, delays)
        got = {
            name: protocol_bound(options, T, delays).ms_per_step
            for name, options in (
                ("dpsgd", {"name": "dpsgd"}),
                ("dpsgd exponential", {"name": "dpsgd", "topology": "exponential"}),
                ("sgp", {"name": "sgp"}),
                ("osgp", {"name": "osgp"}),
                ("adpsgd", {"name": "adpsgd"}),
            )
        }
        for name, ms in got.items():
            assert floor - 1e-9 <= ms <= ddp + 1e-9, (name, seed)
        assert got["osgp"] <= got["sgp"] + 1e-9
        assert got["adpsgd"] == pytest.approx(floor)
        assert got["dpsgd"] < ddp  # on these traces waiting for neighbours only is strictly better


def test_gossip_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="dpsgd's topology must be one of"):
        simulate({"name": "dpsgd", "topology": "torus"}, np.ones((4, 2)))
    with pytest.raises(ValueError, match="world must be even"):
        simulate({"name": "adpsgd"}, np.ones((3, 2)))
    for name in ("dpsgd", "sgp", "osgp", "adpsgd"):
        with pytest.raises(ValueError, match="at least 2 ranks"):
            simulate({"name": name}, np.ones((1, 2)))


def test_paper_setting_simulates_the_gossip_presets():
    """scale.py's paper setting takes the gossip baselines from configs/averaging/ and simulates them at P = 64
    (AD-PSGD needs an even P); the report sets WAGMA beside the fastest of them."""
    from benchmarks.scale_report import _versus

    policies = scale.paper_policies()
    assert {"dpsgd", "sgp", "osgp", "adpsgd"} <= set(scale.POLICIES) <= set(policies)
    assert policies["dpsgd"]["topology"] == "ring"
    delays = scale._delays(64, 2, 6, 0.32, 0)
    net = Network(3e-6, 1e10)
    records = []
    for name in ("wagma", "dpsgd", "sgp", "osgp", "adpsgd"):
        ms = simulate(policies[name], 0.35 + delays, network=net, nbytes=1.024e8).ms_per_step
        assert ms >= no_wait_ms(0.35, delays) - 1e-9, name
        records.append({"policy": name, "world_size": 64, "scenario": "random_k2", "simulated_ms": ms})
    best = min(records[1:], key=lambda r: r["simulated_ms"])
    want = f"{best['simulated_ms'] / records[0]['simulated_ms']:.2f} ({best['policy']})"
    assert _versus(records, records[:1], list(scale.DECENTRALIZED)) == want
