"""The plan of a run: `ratebench run --dry-run` prints what the runner would launch and send,
built by the same code, and launches, generates and writes nothing; --scenario and the other
options that narrow a run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from ratebench import engine, plan, tinymodel
from ratebench.cli import app
from ratebench.profiles import ProfileError, list_profiles, load_profile, with_run_options
from ratebench.runner import Run, RunOptions
from ratebench.scenarios import fleet_members, plan_scenario


@pytest.fixture
def nothing_launches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working folder and models folder; launching an engine, starting a process or
    generating the tiny model fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run launched or generated something")

    monkeypatch.setattr(engine, "launch_engine", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(tinymodel, "ensure_tiny_model", refuse)
    monkeypatch.setenv(tinymodel.MODELS_DIR_ENV, str(tmp_path / "models"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def _dry_run(*args: str):
    return CliRunner().invoke(app, ["run", "--dry-run", *args])


@pytest.mark.parametrize("name", [p.name for p in list_profiles()])
def test_dry_run_of_every_builtin_profile_names_every_engine_and_phase_and_writes_nothing(
        name: str, nothing_launches: Path, tmp_path: Path) -> None:
    result = _dry_run("--profile", name)
    assert result.exit_code == 0, result.output
    out = result.output
    phases = [p for spec in load_profile(name).scenarios for p in plan_scenario(spec)]
    for number, phase in enumerate(phases, 1):
        assert f"{number:>3}. {phase.scenario}/{phase.phase} on {phase.engine}: " in out
    engines = {m for p in phases for m in fleet_members(p.engine) or [p.engine]}  # a fleet: its members
    for engine_name in engines:
        assert f"  {engine_name} (" in out
    assert out.count("argv: ") == len(engines)
    for fleet in {p.engine for p in phases if fleet_members(p.engine)}:
        assert f"fleet {fleet}: HAProxy (" in out
    assert "model (" in out and "expected: at least" in out
    assert list(nothing_launches.iterdir()) == []  # no results/ (nor anything else) written
    assert not (tmp_path / "models").exists()  # the tiny model was not generated


def test_dry_run_says_whether_the_tiny_model_is_generated(nothing_launches: Path, monkeypatch) -> None:
    out = _dry_run("--profile", "cpu-tiny").output
    assert "not generated yet" in out and "not present" in out
    monkeypatch.setattr(tinymodel, "tiny_model_is_generated", lambda dest=None: True)
    out = _dry_run("--profile", "cpu-tiny").output
    assert "already generated at" in out and ": present:" in out


def test_dry_run_of_an_invalid_profile_exits_2(nothing_launches: Path) -> None:
    bad = nothing_launches.parent / "bad.toml"
    bad.write_text("[profile\n")
    result = _dry_run("--profile", str(bad))
    assert result.exit_code == 2
    assert "valid TOML" in result.output


def test_the_planned_argv_and_environment_are_what_the_runner_launches(tmp_path: Path, monkeypatch) -> None:
    profile = load_profile("cpu-tiny")
    planned = plan.plan_run(profile, model="/models/m")
    engines = Run(profile, RunOptions(results_dir=tmp_path / "results", model="/models/m"),
                  Console(stderr=True)).engine_set
    engines.model_path = "/models/m"
    monkeypatch.setattr(engines, "pristine_files", lambda: {})
    launched: dict[str, tuple[list[str], dict[str, str]]] = {}

    def fake_popen(argv, *, env, **kwargs):
        launched[run_engine_name] = (argv, env)
        return type("P", (), {"pid": 0})()

    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    monkeypatch.setattr(engine, "RunningEngine", lambda *args: None)
    monkeypatch.setattr(engine, "write_stock_overlay", lambda *args: None)
    monkeypatch.setattr(engine.tempfile, "mkdtemp", lambda prefix: str(tmp_path / prefix))
    for p in planned.engines:
        run_engine_name = p.spec.name
        spec = engines.engine_spec(p.spec.name)
        engine.launch_engine(spec, tmp_path / "engines" / p.spec.name)
        argv, env = launched[p.spec.name]
        port = argv[argv.index("--port") + 1]
        assert [port if a == plan.PORT_PLACEHOLDER else a for a in p.argv] == argv
        for key, value in p.env.items():
            assert key in env, key
            if plan.RUN_DIR_PLACEHOLDER in value:
                assert env[key].endswith(value.split(plan.RUN_DIR_PLACEHOLDER, 1)[1])
            elif plan.OVERLAY_PLACEHOLDER not in value:
                assert env[key] == value, key
        assert (engine.EVENTS_ENV_VAR in env) == (engine.EVENTS_ENV_VAR in p.env)


@pytest.mark.parametrize("cap", [1, 2, 3, 4, 5])
def test_planned_engine_starts_are_the_runner_s(cap: int, tmp_path: Path, monkeypatch) -> None:
    profile = load_profile("cpu-tiny")
    profile.max_engines = cap
    phases = [p for spec in profile.scenarios for p in plan_scenario(spec)]
    engines = Run(profile, RunOptions(results_dir=tmp_path), Console(stderr=True)).engine_set
    waves: list[list[str]] = []

    def fake_ensure(names):
        if names:
            waves.append(list(names))
        for n in names:
            engines.running[n] = object()

    monkeypatch.setattr(engines, "ensure_engines", fake_ensure)
    monkeypatch.setattr(engines, "stop", lambda name, **kw: engines.running.pop(name, None))
    for k in range(len(phases)):  # what Run.execute does around each phase
        engines.arrange_engines([p.engine for p in phases[k:]])
        engines.stop_unneeded({p.engine for p in phases[k + 1:]})
    assert plan.engine_starts([p.engine for p in phases], cap) == waves


def test_scenario_option_keeps_only_those_scenarios_in_profile_order(nothing_launches: Path) -> None:
    profile = with_run_options(load_profile("rtx4090-qwen3-8b"), scenarios=["overhead", "seed-experiment"],
                               overhead_rounds=3)
    assert [s.name for s in profile.scenarios] == ["seed-experiment", "overhead"]
    assert profile.scenarios[1].params["rounds"] == 3
    assert load_profile("rtx4090-qwen3-8b").scenarios[-1].params["rounds"] == 2  # the profile itself unchanged
    out = _dry_run("--profile", "rtx4090-qwen3-8b", "--scenario", "seed-experiment", "--scenario", "overhead",
                   "--overhead-rounds", "3").output
    assert "seed-users-a-b" not in out and "isolation/" not in out
    assert "overhead/feature-on-sync-3 on patched-sync" in out and "-sync-4" not in out
    assert "1-stream on patched-async" in out


def test_max_engines_and_engine_args_reach_every_engine(nothing_launches: Path) -> None:
    profile = with_run_options(load_profile("rtx4090-qwen3-8b"), max_engines=4,
                               engine_args=["--gpu-memory-utilization=0.2"])
    planned = plan.plan_run(profile, model="/models/m")
    for e in planned.engines:  # after the profile's own value: vLLM's argparse takes the last one
        assert e.argv.index("--gpu-memory-utilization=0.2") > e.argv.index("--gpu-memory-utilization")
    assert len(planned.engine_starts[0]) == 4


@pytest.mark.parametrize("args, key, expected", [
    (["--scenario", "nope"], "--scenario", "a scenario of this profile (seed-experiment, "),
    (["--scenario", "eos", "--overhead-rounds", "3"], "--overhead-rounds", "an overhead scenario among those"),
    (["--overhead-rounds", "0"], "--overhead-rounds", "a positive integer"),
    (["--max-engines", "0"], "--max-engines", "a positive integer"),
    (["--engine-arg", ""], "--engine-arg", "non-empty strings"),
])
def test_invalid_run_options_are_refused_with_exit_2_naming_the_option(
        args: list[str], key: str, expected: str, nothing_launches: Path) -> None:
    result = _dry_run("--profile", "rtx4090-qwen3-8b", *args)
    assert result.exit_code == 2, result.output
    assert f": {key}: expected {expected}" in " ".join(result.output.split())
    with pytest.raises(ProfileError):
        with_run_options(load_profile("rtx4090-qwen3-8b"), scenarios=["nope"])


def test_the_dry_run_says_whether_each_users_limit_is_reachable_with_its_streams(nothing_launches: Path,
                                                                                tmp_path: Path) -> None:
    """A stream gets at most one token a step: on an RTX 4090 (a 16.4 ms step at least) one stream tops
    out near 60 tok/s, so the seed's 100 tok/s neighbour needs two; every backlogged user of the GPU
    profile can reach its limit, and a profile that gives a 100 tok/s user one stream is told."""
    out = _dry_run("--profile", "rtx4090-qwen3-8b").output
    assert "reachable limits at the reference decode step" in out
    assert "seed-experiment/1-stream on patched-sync: user-a 100 tok/s with 2 stream(s)" in out
    assert "NOT reachable" not in out
    text = (Path(__file__).resolve().parent.parent / "profiles" / "rtx4090-qwen3-8b.toml").read_text()
    one_stream = tmp_path / "one-stream.toml"
    one_stream.write_text(text.replace("neighbour_streams = 2 ", "neighbour_streams = 1 "))
    out = _dry_run("--profile", str(one_stream)).output
    assert "user-a 100 tok/s with 1 stream(s): at most 61 tok/s at a batch of 2 (16.5 ms a step): NOT reachable" in out
    assert "limit(s) the engine, not the budget, would set" in out
    assert "reachable limits" not in _dry_run("--profile", "cpu-tiny").output  # no reference step: nothing said


def test_attached_to_a_server_a_mix_skips_its_limiter_off_baseline_and_says_so(nothing_launches: Path) -> None:
    """--endpoint stands in for the limiter-on engine only: a mix with baseline = true would plan a
    phase on a limiter-off engine nobody launched (the run failed looking it up)."""
    p = plan.plan_run(load_profile("cpu-tiny"), endpoint="http://127.0.0.1:9")
    assert all(not ph.engine.startswith("feature-off") for ph in p.phases)
    assert {s["scenario"] for s in p.skipped} >= {"mix/mix-baseline", "crowd/mix-baseline", "overhead"}
    assert any(ph.scenario == "crowd" and ph.phase == "mix" for ph in p.phases)


def test_the_priority_mode_is_a_sync_engine_under_the_priority_policy() -> None:
    profile = load_profile("cpu-tiny")
    spec = plan.engine_spec(profile, "patched-priority", "/m", use_patch=True, pristine_files=dict)
    assert not spec.async_scheduling and spec.feature and spec.scheduling_policy == "priority"
    flags = spec.all_flags()
    assert flags[flags.index("--scheduling-policy") + 1] == "priority"
    assert "--async-scheduling" not in flags
    sync = plan.engine_spec(profile, "patched-sync", "/m", use_patch=True, pristine_files=dict)
    assert sync.scheduling_policy == "fcfs" and "--scheduling-policy" not in sync.all_flags()
    # a profile's own flag (or --engine-arg) sets the policy of its sync and async engines: asked as run
    profile.engine.extra_args = [*profile.engine.extra_args, "--scheduling-policy=priority"]
    assert plan.engine_spec(profile, "patched-async", "/m", use_patch=True,
                            pristine_files=dict).scheduling_policy == "priority"


def test_every_kind_runs_on_every_scheduling_mode_its_scenario_names() -> None:
    """A mode listed in a scenario's ``scheduling`` is never left out: each kind's phases run on the
    limiter-on engine of each mode, mode after mode."""
    profile = load_profile("cpu-tiny")
    for spec in profile.scenarios:
        phases = plan_scenario(spec)
        on = [p.engine for p in phases if p.engine.startswith("patched-")]
        assert [f"patched-{m}" for m in spec.scheduling] == list(dict.fromkeys(on)), spec.name
        per_mode = {e: [p.phase for p in phases if p.engine == e] for e in set(on)}
        # the priority mode adds phases of its own (active-cap-fairness's cap-priority), after the others
        extra = per_mode.pop("patched-priority", None)
        if per_mode and extra is not None:
            (common,) = {tuple(v) for v in per_mode.values()}
            assert tuple(extra[:len(common)]) == common, (spec.name, extra)
            assert extra[len(common):] == (["cap-priority"] if spec.kind == "active-cap-fairness" else []), spec.name
        assert len({tuple(v) for v in per_mode.values()}) <= 1, (spec.name, per_mode)
