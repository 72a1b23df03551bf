"""The decentralized baselines (D-PSGD, SGP, OSGP, AD-PSGD): graphs, exact invariants on real gloo worlds, resume,
a dead peer, bad input.

The invariants are checked against a sequential simulation of the same rounds (mixing matrices for D-PSGD,
push-sum with messages delivered in the same or the next round for SGP / OSGP), with local "steps" that add a
known per-rank, per-step amount to the model: the averagers must keep Σx and Σw exactly what the protocol says.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import wagma.averaging.gossip as gossip_module
from wagma.averaging import ADPSGDAverager, DPSGDAverager, SGPAverager
from wagma.averaging.adpsgd import adpsgd_peer
from wagma.averaging.gossip import exponential_neighbours, ring_neighbours, sgp_peers
from wagma.testing import rank_device, run_workers, run_workers_outcomes

TIMEOUT_S = 10.0
N = 7  # model size (two tensors: 4 + 3)


def _initial(rank: int) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float64) * (rank + 1) + rank**2


def _delta(rank: int, step: int) -> torch.Tensor:
    """The local step of ``rank`` at ``step`` (what the optimizer would add)."""
    return torch.full((N,), 0.01 * (rank + 1) * (step % 3 - 1), dtype=torch.float64) + 0.001 * step


def _params(rank: int, device: str = "cpu") -> list[torch.Tensor]:
    x = _initial(rank).to(rank_device(device, rank))
    return [x[:4].clone(), x[4:].clone()]


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in params]).cpu()


def _local_step(params: list[torch.Tensor], rank: int, step: int) -> None:
    d = _delta(rank, step).to(params[0].device)
    params[0].add_(d[:4])
    params[1].add_(d[4:])


# -- graphs (no process group) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("graph", [ring_neighbours, exponential_neighbours])
def test_undirected_graphs_are_symmetric_and_regular(graph, world):
    neighbours = [graph(r, world) for r in range(world)]
    assert all(r not in n for r, n in enumerate(neighbours))
    assert all(r in neighbours[j] for r, n in enumerate(neighbours) for j in n)  # undirected
    assert len({len(n) for n in neighbours}) == 1  # regular: uniform weights are doubly stochastic
    if graph is ring_neighbours and world >= 3:
        assert neighbours[0] == [1, world - 1]


def test_exponential_graph_of_eight_ranks():
    assert exponential_neighbours(0, 8) == [1, 2, 4, 6, 7]


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8, 16])
def test_sgp_peers_rotate_through_the_directed_exponential_graph(world):
    n = int(torch.log2(torch.tensor(world - 1.0)).floor()) + 1
    seen = set()
    for round_ in range(2 * n):
        outs = [sgp_peers(r, world, round_)[0] for r in range(world)]
        ins = [sgp_peers(r, world, round_)[1] for r in range(world)]
        for r in range(world):
            for j in range(2):  # the j-th message of r goes to the rank whose j-th in-peer is r
                assert ins[outs[r][j]][j] == r
            assert r not in outs[r]
            seen.update((o - r) % world for o in outs[r])
    assert seen == {2**i for i in range(n)}
    assert sgp_peers(0, 8, 0) == ([1, 2], [7, 6])
    assert sgp_peers(0, 8, 1) == ([4, 1], [4, 7])


@pytest.mark.parametrize("fn", [ring_neighbours, exponential_neighbours, lambda r, p: sgp_peers(r, p, 0)])
def test_a_world_without_peers_is_one_clear_error(fn):
    with pytest.raises(ValueError, match="at least 2 ranks.*found a world of 1"):
        fn(0, 1)


# -- sequential references ------------------------------------------------------------------------------------


def _dpsgd_reference(world: int, topology: str, steps: int) -> torch.Tensor:
    graph = ring_neighbours if topology == "ring" else exponential_neighbours
    x = torch.stack([_initial(r) for r in range(world)])
    for step in range(steps):
        x = x + torch.stack([_delta(r, step) for r in range(world)])
        x = torch.stack(
            [(x[r] + sum(x[j] for j in graph(r, world))) / (len(graph(r, world)) + 1) for r in range(world)]
        )
    return x


def _sgp_reference(world: int, steps: int, overlap: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(z per rank, w per rank, Σx in flight, Σw in flight) after ``steps`` rounds."""
    x = torch.stack([_initial(r) for r in range(world)])
    w = torch.ones(world, dtype=torch.float64)
    flight: list[tuple[int, torch.Tensor, float]] = []
    for step in range(steps):
        x = x + torch.stack([_delta(r, step) for r in range(world)])  # the local step goes into the numerator
        x, w = x / 3, w / 3
        sent = [(out, x[r].clone(), float(w[r])) for r in range(world) for out in sgp_peers(r, world, step)[0]]
        deliver, flight = (flight, sent) if overlap else (sent, [])
        for to, xs, ws in deliver:
            x[to] += xs
            w[to] += ws
    in_flight_x = sum((m[1] for m in flight), torch.zeros(N, dtype=torch.float64))
    return x / w[:, None], w, in_flight_x, sum(m[2] for m in flight)


# -- D-PSGD on real worlds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world,topology",
    [
        (2, "ring"),
        pytest.param(5, "ring", marks=pytest.mark.slow),
        pytest.param(8, "exponential", marks=pytest.mark.slow),
    ],
)
def test_dpsgd_is_its_mixing_matrix_and_keeps_the_mean(world, topology):
    check_dpsgd_mixing(world, topology)


def test_exchanges_staged_through_host_buffers_give_the_same_rounds():
    # gloo sends and receives CPU tensors only, so CUDA tensors on a gloo group travel through host copies. Here
    # every CPU tensor is treated so: each receive lands in a host buffer that wait() copies into its tensor.
    check_dpsgd_mixing(4, "ring", staged=True)


def test_an_exchange_refuses_a_receive_posted_after_a_send():
    # gloo starts a send once its peer's receive is posted: exchanges whose sends come first serialize (1.5x the
    # wire time of a ring exchange on emulated links). Every averager posts its receives first; this is the guard.
    def worker(rank, world_size):
        import datetime

        exchange = gossip_module._Exchange("D", 3, dist.group.WORLD, datetime.timedelta(seconds=TIMEOUT_S))
        peer = 1 - rank
        inbox, data = torch.empty(4), torch.full((4,), float(rank))
        exchange.recv(inbox, peer, tag=0)
        exchange.send(data, peer, tag=0)
        with pytest.raises(RuntimeError, match=r"^D: round 3: a receive posted after a send; post every receive"):
            exchange.recv(torch.empty(4), peer, tag=1)
        exchange.wait()
        return inbox

    got = run_workers(worker, 2, timeout_s=60, collective_timeout_s=TIMEOUT_S)
    assert [g.tolist() for g in got] == [[1.0] * 4, [0.0] * 4]


def check_dpsgd_mixing(world: int, topology: str, device: str = "cpu", staged: bool = False) -> None:
    """D-PSGD's rounds are its mixing matrix, exactly, and keep the mean (``device="cuda"``: tests/gpu_worlds.py)."""
    steps = 5

    def worker(rank, world_size):
        if staged:  # in the forked worker only
            gossip_module._Exchange._staged = lambda self, tensor: True
        params = _params(rank, device)
        averager = DPSGDAverager(topology, timeout=TIMEOUT_S)
        for step in range(steps):
            _local_step(params, rank, step)
            if rank == world_size - 1 and step == 2:
                time.sleep(0.3)  # a straggler: the round waits for it, the result does not change
            assert averager.average_parameters(params) == "local"
        stats = averager.stats
        averager.close()
        return _flat(params), stats.local_reductions, stats.bytes_sent

    results = run_workers(worker, world, timeout_s=60, collective_timeout_s=TIMEOUT_S)
    got = torch.stack([r[0] for r in results])
    expected = _dpsgd_reference(world, topology, steps)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    total = sum(_initial(r) for r in range(world)) + sum(_delta(r, s) for r in range(world) for s in range(steps))
    torch.testing.assert_close(got.sum(0), total, rtol=0, atol=1e-11)  # the mean is kept
    degree = len((ring_neighbours if topology == "ring" else exponential_neighbours)(0, world))
    assert all(r[1] == steps and r[2] == steps * degree * N * 8 for r in results)


def test_dpsgd_without_local_steps_contracts_the_consensus_distance_as_its_matrix_predicts():
    world, rounds = 6, 4

    def worker(rank, world_size):
        params = _params(rank)
        averager = DPSGDAverager("ring", timeout=TIMEOUT_S)
        distances = []
        for _ in range(rounds):
            averager.average_parameters(params)
            flat = _flat(params)
            everyone = [torch.empty_like(flat) for _ in range(world_size)]
            dist.all_gather(everyone, flat)
            stacked = torch.stack(everyone)
            distances.append(float((stacked - stacked.mean(0)).norm()))
        averager.close()
        return distances

    got = run_workers(worker, world, timeout_s=60, collective_timeout_s=TIMEOUT_S)[0]
    w = torch.zeros(world, world, dtype=torch.float64)
    for r in range(world):
        for j in [r, *ring_neighbours(r, world)]:
            w[r, j] = 1 / 3
    x = torch.stack([_initial(r) for r in range(world)])
    predicted = []
    for _ in range(rounds):
        x = w @ x
        predicted.append(float((x - x.mean(0)).norm()))
    assert got == pytest.approx(predicted, rel=1e-9)
    assert all(b < a for a, b in zip(got, got[1:]))  # it contracts, round after round


# -- SGP / OSGP on real worlds -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world,overlap",
    [  # the quick suite keeps two; the slow phase runs every one
        pytest.param(2, True, marks=pytest.mark.slow),
        (3, False),
        pytest.param(4, False, marks=pytest.mark.slow),
        (4, True),
        pytest.param(8, True, marks=pytest.mark.slow),
    ],
)
def test_push_sum_matches_the_protocol_and_conserves_numerators_and_weights(world, overlap):
    check_push_sum(world, overlap)


def check_push_sum(world: int, overlap: bool, device: str = "cpu") -> None:
    """SGP / OSGP follow the push-sum protocol exactly and conserve Σx and Σw (``device="cuda"``: gpu_worlds.py)."""
    steps = 6

    def worker(rank, world_size):
        params = _params(rank, device)
        averager = SGPAverager(overlap=overlap, timeout=TIMEOUT_S)
        for step in range(steps):
            _local_step(params, rank, step)
            if rank == 1 and step == 3:
                time.sleep(0.3)
            averager.average_parameters(params)
        z, w = _flat(params), averager.weight
        # What is in flight now (OSGP) is still owed: synchronize collects it, then the global push-sum mean.
        averager.synchronize(params)
        averager.close()
        return z, w, _flat(params), averager.weight

    results = run_workers(worker, world, timeout_s=60, collective_timeout_s=TIMEOUT_S)
    z_ref, w_ref, flight_x, flight_w = _sgp_reference(world, steps, overlap)
    torch.testing.assert_close(torch.stack([r[0] for r in results]), z_ref, rtol=1e-12, atol=1e-12)
    assert [r[1] for r in results] == pytest.approx(w_ref.tolist(), rel=1e-12)
    if not overlap:
        assert all(r[1] == pytest.approx(1.0, rel=1e-15) for r in results)  # regular graph, no delay: w = 1
    # Σw = P and Σx = Σ initial + Σ local steps, messages in flight included.
    assert sum(r[1] for r in results) + flight_w == pytest.approx(world, rel=1e-12)
    total = sum(_initial(r) for r in range(world)) + sum(_delta(r, s) for r in range(world) for s in range(steps))
    x_held = sum(r[0] * r[1] for r in results)
    torch.testing.assert_close(x_held + flight_x, total, rtol=0, atol=1e-10)
    for r in results:  # after synchronize: every rank holds Σx / Σw, w = 1
        torch.testing.assert_close(r[2], total / world, rtol=0, atol=1e-12)
        assert r[3] == 1.0


def test_osgp_weights_settle_at_three_fifths():
    def worker(rank, world_size):
        params = _params(rank)
        averager = SGPAverager(overlap=True, timeout=TIMEOUT_S)
        for _ in range(30):
            averager.average_parameters(params)
        weight = averager.weight
        averager.synchronize(params)  # as documented: collect the round in flight before close()
        averager.close()
        return weight

    weights = run_workers(worker, 4, timeout_s=60, collective_timeout_s=TIMEOUT_S)
    assert weights == pytest.approx([0.6] * 4, rel=1e-4)  # w_t - 3/5 shrinks by 2/3 per round


@pytest.mark.parametrize("kind", [pytest.param("dpsgd", marks=pytest.mark.slow), "sgp"])
def test_resume_from_state_dict_is_bitwise(kind):
    steps, cut = 8, 5

    def make():
        return DPSGDAverager("ring", timeout=TIMEOUT_S) if kind == "dpsgd" else SGPAverager(timeout=TIMEOUT_S)

    def worker(rank, world_size):
        params = _params(rank)
        averager = make()
        saved = None
        for step in range(steps):
            if step == cut:
                saved = ([p.clone() for p in params], averager.state_dict())
            _local_step(params, rank, step)
            averager.average_parameters(params)
        straight = _flat(params)
        averager.close()
        assert saved is not None
        params = saved[0]
        resumed = make()
        resumed.load_state_dict(saved[1])
        for step in range(cut, steps):
            _local_step(params, rank, step)
            resumed.average_parameters(params)
        resumed.close()
        return torch.equal(straight, _flat(params))

    assert run_workers(worker, 4, timeout_s=60, collective_timeout_s=TIMEOUT_S) == [True] * 4


def test_a_state_of_another_model_is_named_at_the_next_round():
    def worker(rank, world_size):
        params = _params(rank)
        averager = SGPAverager(timeout=TIMEOUT_S)
        averager.average_parameters(params)
        state = averager.state_dict()
        averager.close()
        other = SGPAverager(timeout=TIMEOUT_S)
        other.load_state_dict(state)
        try:
            other.average_parameters([torch.zeros(3, dtype=torch.float64)])
        except ValueError as err:
            return str(err)
        finally:
            other.close()
        return "no error"

    messages = run_workers(worker, 2, timeout_s=60, collective_timeout_s=TIMEOUT_S)
    assert all("the saved numerator has buffers" in m and "another model" in m for m in messages)


@pytest.mark.parametrize("kind", ["dpsgd", "sgp"])
def test_a_dead_peer_is_named_by_its_neighbours_with_the_round(kind):
    def worker(rank, world_size):
        params = _params(rank)
        averager = DPSGDAverager("ring", timeout=3.0) if kind == "dpsgd" else SGPAverager(timeout=3.0)
        for step in range(6):
            if rank == 2 and step == 3:
                os._exit(17)  # killed for real: no goodbye to anyone
            averager.average_parameters(params)
        return "finished"

    outcomes = run_workers_outcomes(worker, 4, timeout_s=60, collective_timeout_s=10.0)
    assert outcomes[2].ok is False
    # Rank 2's receivers at round 3: its ring neighbours (D-PSGD), the ranks it pushes to (SGP).
    named = ring_neighbours(2, 4) if kind == "dpsgd" else sgp_peers(2, 4, 3)[0]
    for r in named:
        assert not outcomes[r].ok
        assert "rank 2" in outcomes[r].error and "round 3" in outcomes[r].error, outcomes[r].error


def test_bad_arguments_are_one_clear_error():
    def worker(rank, world_size):
        errors = []
        for build in (
            lambda: DPSGDAverager("torus"),
            lambda: SGPAverager(overlap="yes"),
            lambda: DPSGDAverager(warmup_steps=-1),
        ):
            try:
                build()
            except ValueError as err:
                errors.append(str(err))
        return errors

    errors = run_workers(worker, 2, timeout_s=60, collective_timeout_s=TIMEOUT_S)[0]
    assert "topology: expected one of 'ring', 'exponential', found 'torus'" in errors[0]
    assert "overlap: expected True or False, found 'yes'" in errors[1]
    assert "warmup_steps: expected an integer >= 0, found -1" in errors[2]


def test_a_single_rank_world_is_one_clear_error():
    def worker(rank, world_size):
        try:
            SGPAverager(timeout=TIMEOUT_S)
        except ValueError as err:
            return str(err)
        return "no error"

    assert "gossip needs at least 2 ranks to have a peer, found a world of 1" in run_workers(worker, 1)[0]


# -- AD-PSGD ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4, 6, 8, 16])
def test_adpsgd_pairs_every_active_rank_with_a_passive_one_each_exchange(world):
    for k in range(6):
        partners = [adpsgd_peer(r, world, k) for r in range(world)]
        assert all(partners[partners[r]] == r and partners[r] % 2 != r % 2 for r in range(world))  # a perfect matching


def test_adpsgd_refuses_an_odd_world():
    with pytest.raises(ValueError, match="the world must be even; found 5 ranks"):
        adpsgd_peer(0, 5, 0)


def _constant_params(rank: int) -> list[torch.Tensor]:
    return [
        torch.full((4,), float(rank + 1), dtype=torch.float64),
        torch.full((3,), float(rank + 1), dtype=torch.float64),
    ]


@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.slow) for w in (2, 4, 8)])  # 2 ranks take 6 s
def test_adpsgd_keeps_the_mean_never_tears_a_model_and_the_loop_never_waits_for_a_straggler(world):
    check_adpsgd_mean_untorn_unwaited(world)


def _adpsgd_straggler_worker(rank: int, world_size: int, steps: int, device: str) -> tuple:
    params = [p.to(rank_device(device, rank)) for p in _constant_params(rank)]
    averager = ADPSGDAverager(timeout=TIMEOUT_S)
    torn, longest, first = False, 0.0, True
    for step in range(steps):
        for p in params:
            p.add_(0.01 * (rank + 1))  # the local step: a constant, so every model stays a constant vector
        if rank == 1 and step in (4, 12):
            time.sleep(1.5)  # a straggler: its partners' threads wait for it, nobody's training loop does
        start = time.perf_counter()
        kind = averager.average_parameters(params)
        if rank != 1 and not (first and kind):  # the first reduction runs the one-time DDP guard rail (a gc scan)
            longest = max(longest, time.perf_counter() - start)
        first = first and not kind
        values = torch.cat(params)
        torn |= bool((values != values[0]).any())  # half of an exchange would leave two values
        time.sleep(0.01)
    before = float(sum(p.sum() for p in params))
    averager.synchronize(params)
    after = _flat(params).cpu()
    exchanges = averager.exchanges
    stats = averager.stats
    averager.close()
    return torn, longest, before, after, exchanges, stats.local_reductions, stats.global_reductions


def check_adpsgd_mean_untorn_unwaited(world: int, device: str = "cpu") -> None:
    steps = 24
    results = run_workers(_adpsgd_straggler_worker, world, steps, device, timeout_s=90, collective_timeout_s=TIMEOUT_S)
    assert not any(r[0] for r in results)
    assert max(r[1] for r in results) < 1.0  # the straggler sleeps 1.5 s twice; the others' calls never wait for it
    total = sum(7 * (r + 1) * (1 + 0.01 * steps) for r in range(world))  # Σ initial + Σ local steps
    for r in results:  # synchronize: the agreed exchanges are finished and added, then the global mean
        torch.testing.assert_close(r[3], torch.full((7,), total / (7 * world), dtype=torch.float64), rtol=1e-12, atol=0)
    assert len({r[4] for r in results}) == 1 and results[0][4] > 0  # every rank finished the agreed exchanges
    assert all(r[5] == r[4] and r[6] == 1 for r in results)  # every exchange added exactly once


def test_adpsgd_state_dict_finishes_what_is_in_flight_and_resume_continues_the_exchanges():
    def worker(rank, world_size):
        params = _constant_params(rank)
        averager = ADPSGDAverager(timeout=TIMEOUT_S)
        for _ in range(10):
            averager.average_parameters(params)
            time.sleep(0.01)
        state = averager.state_dict()  # collective: nothing in flight is lost
        mine = torch.cat(params).clone()
        averager.close()
        resumed = ADPSGDAverager(timeout=TIMEOUT_S)
        resumed.load_state_dict(state)
        for _ in range(5):
            resumed.average_parameters(params)
            time.sleep(0.01)
        resumed.synchronize(params)
        done = resumed.exchanges
        resumed.close()
        return mine, state["exchanges"], done, _flat(params)

    results = run_workers(worker, 4, timeout_s=90, collective_timeout_s=TIMEOUT_S)
    held = sum(float(r[0].sum()) for r in results)
    assert held == pytest.approx(7 * (1 + 2 + 3 + 4), rel=1e-12)  # the mean after state_dict: nothing lost
    assert len({r[1] for r in results}) == 1 and all(r[2] >= r[1] for r in results)
    for r in results:
        torch.testing.assert_close(r[3], torch.full((7,), 2.5, dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.slow  # 6 s (test_close covers a dead AD-PSGD partner in the quick suite)
def test_adpsgd_a_dead_peer_is_named_by_the_training_loop_of_its_partner():
    def worker(rank, world_size):
        params = _constant_params(rank)
        averager = ADPSGDAverager(timeout=2.0)
        for step in range(80):
            if rank == 1 and step == 3:
                os._exit(17)
            averager.average_parameters(params)
            time.sleep(0.05)
        return "finished"

    outcomes = run_workers_outcomes(worker, 4, timeout_s=60, collective_timeout_s=10.0)
    assert outcomes[1].ok is False
    partners = {adpsgd_peer(1, 4, k) for k in range(4)}  # 0 and 2
    named = [
        r for r in partners if not outcomes[r].ok and "rank 1" in outcomes[r].error and "exchange" in outcomes[r].error
    ]
    assert named, [o.error[-400:] for o in outcomes if o.error]
