"""The compute-bound regime benchmark (benchmarks/regime.py): model sizing, the medians and ratios, and a
tiny real run end to end on forked gloo ranks (the CI smoke test: a few seconds)."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not an installed package
from benchmarks import regime, results_io
from benchmarks.simulate import Network, simulate
from wagma.app.models import MLP

REQUIRED = (
    "scenario",
    "policy",
    "world_size",
    "params",
    "compute_ms",
    "ms_per_step",
    "ideal_ms",
    "bound_ms",
    "x_ddp",
    "x_ideal",
    "x_bound",
    "simulated_ms",
)


@pytest.mark.parametrize("params", [250_000, 2_500_000, 25_000_000])
def test_hidden_width_sizes_the_mlp(params):
    h = regime.hidden_width(params)
    count = h * h + (regime.IN_DIM + regime.CLASSES + 2) * h + regime.CLASSES
    assert abs(count - params) / params < 0.01
    if params <= 2_500_000:  # build the real model where it is cheap
        net = MLP((regime.IN_DIM,), regime.CLASSES, hidden=[h, h])
        assert sum(p.numel() for p in net.parameters()) == count
    with pytest.raises(ValueError, match="params must be >= 1000"):
        regime.hidden_width(10)


def test_summarize_takes_medians_then_ratios():
    reps = [
        {
            "ms_per_step": m,
            "ideal_ms": 100.0,
            "bound_ms": b,
            "simulated_ms": m,
            "loop_ms_per_step": m,
            "real_compute_ms": 1.0,
        }
        for m, b in ((150.0, 120.0), (200.0, 110.0), (160.0, 130.0))
    ]
    out = regime.summarize(reps)
    assert out["ms_per_step"] == 160.0 and out["bound_ms"] == 120.0 and out["reps"] == 3
    assert out["x_ideal"] == pytest.approx(100.0 / 160.0)
    assert out["x_bound"] == pytest.approx(120.0 / 160.0)


@pytest.mark.slow  # 6.5 s: a whole campaign point
def test_tiny_run_end_to_end(tmp_path):
    """P=2, T=10 ms, 6 timed steps, three policies: every record is complete and consistent, the report is
    written, and --append replaces a record of the same key instead of duplicating it."""
    argv = [
        "--worlds",
        "2",
        "--scenarios",
        "random_k1",
        "--policies",
        "allreduce",
        "wagma",
        "eager_solo",
        "--compute-ms",
        "10",
        "--steps",
        "6",
        "--warmup",
        "2",
        "--reps",
        "1",
        "--out",
        str(tmp_path),
    ]
    result = regime.main(argv)
    recs = result["records"]
    assert [r["policy"] for r in recs] == ["allreduce", "wagma", "eager_solo"]
    for r in recs:
        assert r["status"] == "ok", r.get("reason")
        assert all(r.get(k) is not None for k in REQUIRED), r
        # The ideal is below the trace's no-wait time, that below every protocol's bound, and the bound below
        # what was measured.
        assert r["ideal_ms"] <= r["no_wait_ms"] + 1e-6 <= r["bound_ms"] + 2e-6 <= r["ms_per_step"] + 3e-6
        assert r["steps"] == 6
        # The bound on the recorded compute adds the real forward/backward/step to T: above the T-only bound. So
        # does the bound on the compute's CPU shared by the machine's cores.
        assert r["bound_ms"] < r["bound_trace_ms"] <= r["ms_per_step"] + 1e-9
        assert r["bound_ms"] < r["bound_cores_ms"] and r["x_bound_cores"] == r["bound_cores_ms"] / r["ms_per_step"]
        # The breakdown: the sleeps are at least T, and its parts add up to no more than a step.
        parts = r["breakdown_ms"]
        assert parts["sleeps"] >= 10.0 and min(parts.values()) >= 0.0
        assert sum(parts.values()) <= r["ms_per_step"] + 1e-6
        assert r["ms_per_step"] >= 10.0
    assert recs[0]["x_ddp"] == 1.0
    # The ideal and the bounds are closed forms of each run's recorded delay trace (T = 10 ms, 6 steps):
    # DDP pays the slowest rank every step; WAGMA (no sync round in steps 2..7) only the final mean.
    assert not (tmp_path / "regime.json").exists()  # stored compressed: benchmarks/results/ stays small
    saved = results_io.load(tmp_path / "regime.json.xz")
    for rep in saved["reps"]:
        delays = np.array(rep["delays_ms"])
        assert delays.shape == (2, 6) and (delays.max(axis=0) >= 10.0).all()  # random_k1: one rank sleeps d = T
        assert rep["ideal_ms"] == pytest.approx(10.0 + delays.mean(), abs=1e-2)
        assert rep["no_wait_ms"] == pytest.approx(10.0 + delays.sum(axis=1).max() / 6, abs=1e-2)
        want = {"allreduce": 10.0 + delays.max(axis=0).mean(), "wagma": 10.0 + delays.sum(axis=1).max() / 6}
        if rep["policy"] in want:
            assert rep["bound_ms"] == pytest.approx(want[rep["policy"]], abs=1e-2), rep["policy"]
        if rep["policy"] == "allreduce":  # the stored traces and networks re-simulate to the stored values
            net, cpu_net = rep["network"], rep["cpu_network"]
            own = simulate(
                {"name": "allreduce"},
                np.array(rep["trace_ms"]) / 1e3,
                first_step=2,
                nbytes=4.0 * rep["params"],
                network=Network(net["alpha_s"], net["bandwidth_Bps"], net["activation_s"]),
            )
            assert own.ms_per_step == pytest.approx(rep["simulated_own_cores_ms"], rel=1e-3)
            shared = simulate(
                {"name": "allreduce"},
                np.array(rep["sleeps_ms"]) / 1e3,
                first_step=2,
                nbytes=4.0 * rep["params"],
                cores=rep["cores"],
                slice_s=rep["slice_s"],
                cpu_s=np.array(rep["compute_cpu_ms"]) / 1e3,
                after_cpu_s=np.array(rep["averaging_cpu_ms"]) / 1e3,
                network=Network(cpu_net["alpha_s"], cpu_net["bandwidth_Bps"], cpu_net["activation_s"]),
                comm_scale=rep["comm_scale"],
            )
            assert shared.ms_per_step == pytest.approx(rep["simulated_ms"], rel=1e-3)
            assert regime.shared_cores(rep["averaging_options"], rep, 2)["simulated_ms"] == rep["simulated_ms"]
            # The CPU the model replays is the CPU the run used in its timed steps (every thread of each rank's
            # process), plus the final flush's and barrier's: the collectives' calibration is scaled to it.
            main_thread = np.mean(np.array(rep["compute_cpu_ms"]) + np.array(rep["averaging_cpu_ms"]))
            assert rep["comm_scale"] > 0 and main_thread < rep["cpu_ms"]
            assert rep["cpu_ms"] - 1e-6 <= rep["modeled_cpu_ms"] <= rep["cpu_ms"] * 1.5
    assert len(saved["records"]) == 3 and len(saved["reps"]) == 3 and saved["invocations"][0]["machine"]
    # The scheduler's slice was measured for the invocation, and every repetition was simulated with it.
    slice_s = saved["invocations"][0]["settings"]["slice_s"]
    assert 0 < slice_s < 1.0 and all(r["slice_s"] == slice_s for r in saved["reps"])
    # --resimulate redoes the shared-cores simulation from the stored traces alone: the same numbers, also for a
    # repetition whose averaging options must be composed again from its invocation's settings.
    stripped = json.loads(json.dumps(saved))
    del stripped["reps"][1]["averaging_options"]
    stripped["reps"][0]["simulated_ms"] = stripped["records"][0]["simulated_ms"] = -1.0
    regime.resimulate(stripped)
    assert [r["simulated_ms"] for r in stripped["reps"]] == [r["simulated_ms"] for r in saved["reps"]]
    assert stripped["records"][0]["simulated_ms"] == saved["records"][0]["simulated_ms"]
    assert stripped["reps"][1]["averaging_options"] == saved["reps"][1]["averaging_options"]
    # A record from before no_wait_ms was stored: the report recomputes it from its repetitions' delay traces.
    from benchmarks import regime_report

    old = {k: v for k, v in saved["records"][1].items() if k != "no_wait_ms"}
    assert regime_report._no_wait(old, saved) == pytest.approx(saved["records"][1]["no_wait_ms"], abs=1e-2)
    assert regime_report._no_wait(old, {"reps": []}) is None
    assert (tmp_path / "regime.md").exists() and (tmp_path / "regime_ms_per_step.png").exists()
    assert "| 6 | wagma |" in (tmp_path / "regime.md").read_text()  # the steps column
    again = regime.main(
        [
            *argv[:5],
            "allreduce",
            "--compute-ms",
            "10",
            "--steps",
            "4",
            "--warmup",
            "2",
            "--reps",
            "1",
            "--out",
            str(tmp_path),
            "--append",
            "--no-report",
            "--slice-ms",
            "4",
        ]
    )
    assert again["reps"][-1]["slice_s"] == 0.004 and again["invocations"][1]["settings"]["slice_s"] == 0.004
    assert len(again["records"]) == 3 and len(again["invocations"]) == 2
    # The replaced record's repetitions went with it: one per record, the new one from invocation 1.
    assert len(again["reps"]) == 3
    assert [(r["policy"], r["invocation"]) for r in again["reps"]] == [
        ("wagma", 0),
        ("eager_solo", 0),
        ("allreduce", 1),
    ]
    assert all(r["params"] == 250_000 and r["params_actual"] > 1000 for r in again["reps"])
    assert next(r for r in again["records"] if r["policy"] == "allreduce")["invocation"] == 1
    (tmp_path / "regime.md").unlink()
    assert regime.main(["--out", str(tmp_path), "--report-only"]) == again
    assert (tmp_path / "regime.md").exists()
    with pytest.raises(FileNotFoundError, match="expected a regime.json"):
        regime.main(["--out", str(tmp_path / "empty"), "--report-only"])


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_transport_shm_reaches_the_policies_that_have_it(tmp_path):
    argv = [
        "--worlds",
        "2",
        "--scenarios",
        "none",
        "--policies",
        "allreduce",
        "eager_solo",
        "local_sgd",
        "--compute-ms",
        "5",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--reps",
        "1",
        "--out",
        str(tmp_path),
        "--transport",
        "shm",
        "--no-report",
        "--slice-ms",
        "4",
    ]
    result = regime.main(argv)
    assert [(r["policy"], r["status"], r.get("transport")) for r in result["records"]] == [
        ("allreduce", "ok", "shm"),
        ("eager_solo", "ok", "shm"),
        ("local_sgd", "ok", "default"),
    ]
    assert result["invocations"][0]["settings"]["transport"] == "shm"
    assert {r["device"] for r in result["records"]} == {"cpu"}
    assert result["invocations"][0]["settings"]["device"] == "cpu"


def test_device_cuda_is_refused_clearly_without_a_gpu_or_with_shm(capsys):
    with pytest.raises(SystemExit):
        regime.parse_args(["--device", "cuda", "--transport", "shm"])
    assert "--transport shm moves host memory: it cannot carry CUDA tensors" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            regime.parse_args(["--device", "cuda"])
        assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err


def test_an_override_a_policy_lacks_fails_that_policy_only():
    """``--set averaging.progress_nice=10`` composes with wagma's config, not with DDP's: DDP is refused with a
    reason naming the override, wagma gets the value."""
    from hydra import compose, initialize_config_dir

    from benchmarks import scenarios as sc

    base = ["device=cpu", "imbalance=none", "averaging.progress_nice=10"]
    with initialize_config_dir(config_dir=str(regime.ROOT / "configs"), version_base=None):

        def compose_fn(overrides):
            return compose("config", overrides=overrides)

        cfg, reason = sc.resolve_policy("allreduce", compose_fn, regime.ROOT / "configs", 4, base)
        assert cfg is None and "averaging.progress_nice=10" in reason and "averaging=allreduce" in reason, reason
        cfg, reason = sc.resolve_policy("wagma", compose_fn, regime.ROOT / "configs", 4, base)
        assert reason is None and cfg.averaging.progress_nice == 10


def test_a_world_of_one_rank_measures_the_step_alone(tmp_path):
    """P = 1: nothing to exchange and no rank to share the cores with, so a step is T plus the real
    forward/backward/step alone; the record is complete, and the bound with T alone is below what was measured
    by about that compute. A policy that cannot run on one rank is refused with its reason, not run."""
    argv = [
        "--worlds",
        "1",
        "--scenarios",
        "none",
        "--policies",
        "allreduce",
        "wagma",
        "--compute-ms",
        "5",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--reps",
        "1",
        "--out",
        str(tmp_path),
        "--no-report",
        "--slice-ms",
        "4",
    ]
    recs = regime.main(argv)["records"]
    ddp, wagma = recs
    assert ddp["status"] == "ok" and all(ddp.get(k) is not None for k in REQUIRED), ddp
    assert ddp["world_size"] == 1 and ddp["x_ddp"] == 1.0 and ddp["bound_ms"] == pytest.approx(5.0, abs=1e-6)
    assert ddp["ms_per_step"] >= 5.0 + ddp["breakdown_ms"]["compute"] * 0.9 and ddp["breakdown_ms"]["compute"] > 0
    assert wagma["status"] != "ok" and "group_size" in wagma["reason"], wagma


def test_results_io_round_trips_plain_and_compressed_json_and_finds_the_compressed_first(tmp_path):
    from benchmarks import results_io

    doc = {"records": [{"ms": 1.5, "trace": list(range(50))}], "name": "é"}
    results_io.dump(tmp_path / "a.json", doc)
    results_io.dump(tmp_path / "a.json.xz", doc)
    assert results_io.load(tmp_path / "a.json") == doc == results_io.load(tmp_path / "a.json.xz")
    assert (tmp_path / "a.json.xz").read_bytes()[:6] == b"\xfd7zXZ\x00"  # really xz, not plain text
    assert results_io.find(tmp_path, "a.json") == tmp_path / "a.json.xz"
    assert results_io.find(tmp_path, "b.json") == tmp_path / "b.json"
    assert not list(tmp_path.glob("*.tmp"))


def test_every_committed_regime_result_loads_and_has_records():
    """The curated results: each compressed campaign under benchmarks/results/ is readable and not empty."""
    from benchmarks import results_io

    root = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    found = sorted(root.rglob("regime.json.xz"))
    assert found, "no regime.json.xz under benchmarks/results/"
    assert not list(root.rglob("regime.json")), "a plain regime.json: store it compressed (results_io.dump)"
    for path in found:
        result = results_io.load(path)
        assert result["records"] and result["invocations"], path


def test_rank_cpus_puts_every_rank_in_its_own_cgroup_and_leaves_nothing(tmp_path, monkeypatch):
    from wagma.app.quota import cgroup_root, check_rank_cpus

    why = check_rank_cpus(0.5, 2)
    if why is not None:
        pytest.skip(f"no writable cgroup v1 cpu hierarchy: {why}")
    traces = regime._rank_traces

    def noting(rank, world_size, spec):  # runs in the forked rank, after it joined its cgroup
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        cpu = next(line for line in lines if "cpu" in line.split(":")[1].split(","))  # not cpuset, not cpuacct
        (tmp_path / f"rank{rank}.cgroup").write_text(cpu.split(":", 2)[2])
        return traces(rank, world_size, spec)

    monkeypatch.setattr(regime, "_rank_traces", noting)
    argv = [
        "--worlds",
        "2",
        "--scenarios",
        "none",
        "--policies",
        "allreduce",
        "--compute-ms",
        "5",
        "--steps",
        "3",
        "--warmup",
        "2",
        "--reps",
        "1",
        "--out",
        str(tmp_path),
        "--no-report",
        "--slice-ms",
        "4",
        "--rank-cpus",
        "0.5",
    ]
    result = regime.main(argv)
    (rec,) = result["records"]
    assert rec["status"] == "ok" and rec["rank_cpus"] == 0.5
    assert result["invocations"][0]["settings"]["rank_cpus"] == 0.5
    job = f"regime-{os.getpid()}"
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.cgroup").read_text().endswith(f"/wagma/{job}/rank{rank}")
    assert not (cgroup_root() / "wagma" / job).exists()  # every rank left and removed its cgroup
    with pytest.raises(SystemExit):
        regime.parse_args(["--worlds", "8", "--rank-cpus", "64"])  # 8 x 64 CPUs fit no machine here
