"""Profiles: the built-in ones load; every mistake is refused naming file, key and expectation."""

from __future__ import annotations

import copy
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ratebench.cli import app
from ratebench.scenarios import plan_scenario
from ratebench.profiles import (
    BUILTIN_DIR,
    ProfileError,
    list_profiles,
    load_profile,
    parse_profile,
    scenario_kinds,
)

REPO = Path(__file__).resolve().parent.parent


def _cpu_tiny() -> dict:
    with (BUILTIN_DIR / "cpu-tiny.toml").open("rb") as f:
        return tomllib.load(f)


def _refused(data: dict, key: str, expected: str) -> ProfileError:
    with pytest.raises(ProfileError) as info:
        parse_profile(data, "my.toml")
    err = info.value
    assert err.path == "my.toml"
    assert err.key == key, str(err)
    assert expected in str(err), str(err)
    assert str(err).startswith(f"my.toml: {key}: expected")
    return err


def test_builtin_profiles_are_listed_with_a_description() -> None:
    names = {p.name: p for p in list_profiles()}
    assert {"cpu-tiny", "rtx4090-qwen3-8b"} <= set(names)
    assert all(p.description for p in names.values())


def test_every_builtin_profile_loads() -> None:
    for info in list_profiles():
        prof = load_profile(info.name)
        assert prof.name == info.name
        assert prof.scenarios


def test_cpu_tiny_runs_every_scenario_kind_in_sync_async_and_priority() -> None:
    prof = load_profile("cpu-tiny")
    # every kind but the fleet, which needs HAProxy and engines of its own: cpu-fleet runs it
    assert {s.kind for s in prof.scenarios} == set(scenario_kinds()) - {"fleet"}
    assert {s.kind for s in load_profile("cpu-fleet").scenarios} == {"fleet"}
    seed = next(s for s in prof.scenarios if s.kind == "seed-experiment")
    assert seed.scheduling == ["sync", "async", "priority"]
    # the PRIORITY policy's own code paths (places by priority and turn, victims within a priority, the
    # priority heap as the queue) meet a real engine in the main job
    modes = {s.name: s.scheduling for s in prof.scenarios}
    assert {name for name, m in modes.items() if "priority" in m} == {
        "seed-experiment", "request-options", "anonymous-and-spoofing", "crowd", "kv-pressure", "active-cap-fairness"}
    # async: where a step in flight changes the limiter's path (closing, chunking, preempting, yielding)
    assert {name for name, m in modes.items() if "async" in m} == {
        "seed-experiment", "isolation", "cancellation", "long-prompt", "eos", "parallel-sampling", "request-options",
        "waiting", "crowd", "kv-pressure", "active-cap-fairness"}
    assert prof.device == "cpu" and prof.model.source == "tiny" and prof.model.served_name == "tiny-qwen3"
    assert prof.limits.limit_of(seed.params["user"]) == 20
    assert prof.limits.limit_of(seed.params["neighbour"]) == 100


def test_rtx4090_profile_is_the_seed_set_up() -> None:
    prof = load_profile("rtx4090-qwen3-8b")
    assert prof.device == "cuda"
    assert prof.model.name == "Qwen/Qwen3-8B"
    assert (prof.engine.max_num_seqs, prof.engine.max_num_active_seqs) == (64, 16)
    assert prof.limits.default_tps == 100
    assert prof.limits.user_tps["user-a"] == 100 and prof.limits.user_tps["user-b"] == 500
    seed = prof.scenarios[0]
    assert seed.kind == "seed-experiment" and seed.params["max_tokens"] == 200
    assert seed.params["streams"] == [1, 4] and seed.scheduling == ["sync", "async"]
    assert prof.limits.limit_of(seed.params["user"]) == 20
    assert prof.limits.limit_of(seed.params["neighbour"]) == 100


def test_profile_defaults_and_json_round_trip() -> None:
    prof = load_profile("cpu-tiny")
    data = prof.to_json()
    assert data["limits"]["user_tps"]["user-a"] == 20
    iso = next(s for s in prof.scenarios if s.kind == "isolation")
    assert iso.params["lead_s"] == 0.5  # default filled in
    assert iso.scheduling == ["sync", "async"]
    assert next(s for s in prof.scenarios if s.kind == "prefix-cache").scheduling == ["sync"]  # default: the first
    assert prof.stall_timeout_s == 60.0  # default: a stalled stream is closed after a minute, not five


def test_a_path_loads_and_the_name_defaults_to_its_stem(tmp_path: Path) -> None:
    text = (BUILTIN_DIR / "cpu-tiny.toml").read_text().replace('[profile]\n', '[profile]\n', 1)
    path = tmp_path / "mine.toml"
    path.write_text(text)
    assert load_profile(str(path)).name == "mine"


def test_unknown_profile_name_lists_the_builtin_ones() -> None:
    with pytest.raises(ProfileError) as info:
        load_profile("no-such-profile")
    assert "cpu-tiny" in str(info.value)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[profile\n")
    with pytest.raises(ProfileError) as info:
        load_profile(str(path))
    assert str(path) in str(info.value) and "valid TOML" in str(info.value)


def test_unknown_top_level_key_is_refused() -> None:
    data = _cpu_tiny()
    data["enigne"] = {}
    _refused(data, "enigne", "one of the known keys")


def test_unknown_engine_key_is_refused() -> None:
    data = _cpu_tiny()
    data["engine"]["max_num_seq"] = 4
    _refused(data, "engine.max_num_seq", "one of the known keys")


def test_unknown_scenario_key_is_refused() -> None:
    data = _cpu_tiny()
    data["scenarios"][0]["stream"] = 3
    _refused(data, "scenarios[0].stream", "one of the known keys")


def test_missing_required_key_is_refused() -> None:
    data = _cpu_tiny()
    del data["engine"]["max_num_seqs"]
    _refused(data, "engine.max_num_seqs", "it is required")


def test_wrong_types_are_refused() -> None:
    cases = [
        (("engine", "max_num_seqs"), "16", "engine.max_num_seqs", "a positive integer"),
        (("engine", "enable_prefix_caching"), "yes", "engine.enable_prefix_caching", "true or false"),
        (("profile", "device"), "tpu", "profile.device", '"cpu" or "cuda"'),
        (("profile", "scheduling"), ["sync", "turbo"], "profile.scheduling", "distinct modes"),
        (("model", "source"), "hub", "model.source", '"tiny"'),
        (("engine", "extra_args"), "--foo", "engine.extra_args", "a list of strings"),
        (("limits", "default_tps"), True, "limits.default_tps", "a positive integer"),
        (("profile", "stall_timeout_s"), 0, "profile.stall_timeout_s", "a positive number"),
    ]
    for (table, key), value, full, expected in cases:
        data = _cpu_tiny()
        data[table][key] = value
        _refused(data, full, expected)


def test_scenario_parameter_of_the_wrong_type_is_refused() -> None:
    data = _cpu_tiny()
    data["scenarios"][0]["streams"] = [1, 0]
    _refused(data, "scenarios[0].streams", "a non-empty list of positive integers")
    data = _cpu_tiny()
    data["scenarios"][0]["max_tokens"] = 2.5
    _refused(data, "scenarios[0].max_tokens", "a positive integer")


def test_request_options_must_be_known_distinct_and_two_at_least() -> None:
    data = _cpu_tiny()
    i = next(k for k, s in enumerate(data["scenarios"]) if s["kind"] == "request-options")
    data["scenarios"][i]["options"] = ["json-schema", "grammar"]
    err = _refused(data, f"scenarios[{i}].options[1]", 'one of ["json-schema", ')
    assert "'grammar'" in str(err)
    data["scenarios"][i]["options"] = ["regex", "regex"]
    _refused(data, f"scenarios[{i}].options", "each option once")
    data["scenarios"][i]["options"] = ["regex"]
    _refused(data, f"scenarios[{i}].options", "two options at least")
    data["scenarios"][i]["options"] = "regex"
    _refused(data, f"scenarios[{i}].options", "a list of non-empty strings")
    data["scenarios"][i]["options"] = ["regex", "chat"]
    parse_profile(data, "my.toml")


def test_request_options_bad_words_are_words() -> None:
    data = _cpu_tiny()
    i = next(k for k, s in enumerate(data["scenarios"]) if s["kind"] == "request-options")
    data["scenarios"][i]["bad_words"] = ["  "]
    _refused(data, f"scenarios[{i}].bad_words", "one word at least, none empty")
    data["scenarios"][i]["bad_words"] = []
    _refused(data, f"scenarios[{i}].bad_words", "")


def test_rate_zero_or_negative_is_refused() -> None:
    data = _cpu_tiny()
    data["limits"]["default_tps"] = 0
    _refused(data, "limits.default_tps", "a positive integer")
    data = _cpu_tiny()
    data["limits"]["users"]["user-a"] = -5
    _refused(data, "limits.users.user-a", "a positive integer rate")
    data = _cpu_tiny()
    data["limits"]["users"]["user-a"] = 12.5
    _refused(data, "limits.users.user-a", "a positive integer rate")


def test_scenario_naming_an_unknown_user_is_refused() -> None:
    data = _cpu_tiny()
    data["scenarios"][0]["user"] = "user-z"
    err = _refused(data, "scenarios[0].user", "a user declared in [limits.users]")
    assert "user-a" in str(err)


def test_unknown_scenario_kind_is_refused() -> None:
    data = _cpu_tiny()
    data["scenarios"][0]["kind"] = "stress"
    _refused(data, "scenarios[0].kind", "one of")


def test_scenario_scheduling_must_be_built_by_the_profile() -> None:
    data = _cpu_tiny()
    data["profile"]["scheduling"] = ["sync"]
    _refused(data, "scenarios[0].scheduling", "modes listed in profile.scheduling")


def test_duplicate_scenario_names_are_refused() -> None:
    data = _cpu_tiny()
    data["scenarios"].append(copy.deepcopy(data["scenarios"][0]))
    _refused(data, f"scenarios[{len(data['scenarios']) - 1}].name", "not used by another scenario")


def test_isolation_needs_more_throttled_streams_than_active_slots() -> None:
    data = _cpu_tiny()
    iso = next(s for s in data["scenarios"] if s["kind"] == "isolation")
    iso["throttled_streams"] = data["engine"]["max_num_active_seqs"]
    i = data["scenarios"].index(iso)
    _refused(data, f"scenarios[{i}].throttled_streams", "more streams than engine.max_num_active_seqs")


def test_long_prompt_must_need_chunked_prefill() -> None:
    data = _cpu_tiny()
    lp = next(s for s in data["scenarios"] if s["kind"] == "long-prompt")
    lp["prompt_tokens"] = 100
    i = data["scenarios"].index(lp)
    _refused(data, f"scenarios[{i}].prompt_tokens", "twice engine.max_num_batched_tokens")


def test_prompt_and_answer_must_fit_the_model_length() -> None:
    data = _cpu_tiny()
    data["model"]["max_model_len"] = 300
    _refused(data, "scenarios[0].prompt_tokens", "within model.max_model_len")


def test_active_seqs_cannot_exceed_resident_seqs() -> None:
    data = _cpu_tiny()
    data["engine"]["max_num_active_seqs"] = 32
    _refused(data, "engine.max_num_active_seqs", "at most engine.max_num_seqs")


def test_anonymous_user_cannot_be_given_an_override() -> None:
    data = _cpu_tiny()
    data["limits"]["users"]["__anonymous__"] = 5
    _refused(data, "limits.users.__anonymous__", "other than __anonymous__")


def test_invalid_profile_exits_2_and_launches_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text((BUILTIN_DIR / "cpu-tiny.toml").read_text().replace("default_tps = 100", "default_tps = -1"))
    result = CliRunner().invoke(app, ["run", "--profile", str(bad), "--results", str(tmp_path / "results")])
    assert result.exit_code == 2
    assert "limits.default_tps" in result.output and "bad.toml" in result.output
    assert not (tmp_path / "results").exists()


def test_profiles_command_lists_one_line_per_profile() -> None:
    result = CliRunner().invoke(app, ["profiles"])
    assert result.exit_code == 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == len(list_profiles())
    assert any(line.startswith("cpu-tiny") for line in lines)


def test_builtin_profiles_ship_in_the_package_and_the_checkout_points_there() -> None:
    assert BUILTIN_DIR == REPO / "ratebench" / "profiles"
    assert (REPO / "profiles").resolve() == BUILTIN_DIR
    with (REPO / "pyproject.toml").open("rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["ratebench"]
    assert "profiles/*.toml" in package_data
    # The module import is not shadowed by the data folder of the same name.
    out = subprocess.run([sys.executable, "-c", "import ratebench.profiles as p; print(p.__file__)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("profiles.py")


def test_overhead_compares_with_the_engines_it_names() -> None:
    tiny = next(s for s in load_profile("cpu-tiny").scenarios if s.kind == "overhead")
    assert tiny.params["against"] == ["feature-off", "stock"]
    assert {p.engine for p in plan_scenario(tiny)} == {"patched-sync", "feature-off-sync", "stock-sync"}
    full = next(s for s in load_profile("cpu-tiny-overhead").scenarios if s.kind == "overhead")
    assert {p.engine for p in plan_scenario(full)} == {"patched-sync", "patched-noevents-sync", "feature-off-sync",
                                                      "stock-sync"}
    data = _cpu_tiny()
    over = next(s for s in data["scenarios"] if s["kind"] == "overhead")
    i = data["scenarios"].index(over)
    for bad in (["vllm"], [], ["stock", "stock"]):
        over["against"] = bad
        _refused(data, f"scenarios[{i}].against", "distinct engines among")


def test_kv_pressure_and_active_cap_fairness_are_refused_when_they_cannot_show_anything() -> None:
    data = _cpu_tiny()
    kv = next(s for s in data["scenarios"] if s["kind"] == "kv-pressure")
    i = data["scenarios"].index(kv)
    kv["user"] = "user-slow"  # 5 tok/s: below the throttled user's 20
    _refused(data, f"scenarios[{i}].user", "a user whose limit is above user-a's")
    data = _cpu_tiny()
    cap = next(s for s in data["scenarios"] if s["kind"] == "active-cap-fairness")
    i = data["scenarios"].index(cap)
    cap["users"], cap["streams"] = 2, 2  # 4 streams on 4 places: nothing scarce
    _refused(data, f"scenarios[{i}].users", "more streams in all than engine.max_num_active_seqs")
    cap["users"], cap["streams"] = 9, 2  # 18 streams for 16 resident slots
    _refused(data, f"scenarios[{i}].users", "within engine.max_num_seqs")


def test_an_isolated_mix_tier_needs_the_baseline_phase() -> None:
    data = _cpu_tiny()
    mix = next(s for s in data["scenarios"] if s["kind"] == "mix")
    i = data["scenarios"].index(mix)
    mix["baseline"] = False
    team = next(k for k, t in enumerate(mix["tiers"]) if t.get("isolated"))
    _refused(data, f"scenarios[{i}].tiers[{team}].isolated", "baseline = true with it")


@pytest.mark.parametrize(("steps", "key", "expected"), [
    ({"0": 16.4}, "engine.reference_step_ms.0", "a batch size"),
    ({"one": 16.4}, "engine.reference_step_ms.one", "a batch size"),
    ({"1": -3}, "engine.reference_step_ms.1", "a positive number of milliseconds"),
    ({"1": True}, "engine.reference_step_ms.1", "a positive number of milliseconds"),
    ([16.4], "engine.reference_step_ms", "a table of batch size to ms"),
])
def test_a_bad_reference_step_table_is_refused_naming_the_key(steps, key, expected) -> None:
    data = _cpu_tiny()
    data["engine"]["reference_step_ms"] = steps
    _refused(data, key, expected)


def test_the_reference_step_is_linear_between_the_given_batch_sizes_and_flat_outside() -> None:
    data = _cpu_tiny()
    data["engine"]["reference_step_ms"] = {"1": 16.0, "64": 22.3, "128": 26.0}
    flags = parse_profile(data, "my.toml").engine
    assert flags.step_ms_at(1) == 16.0 and flags.step_ms_at(0) == 16.0
    assert flags.step_ms_at(32) == pytest.approx(16.0 + 6.3 * 31 / 63)
    assert flags.step_ms_at(96) == pytest.approx(24.15) and flags.step_ms_at(1000) == 26.0
    assert parse_profile(_cpu_tiny(), "my.toml").engine.step_ms_at(4) is None


def _cpu_fleet() -> dict:
    with (BUILTIN_DIR / "cpu-fleet.toml").open("rb") as f:
        return tomllib.load(f)


def test_a_fleet_scenario_plans_one_phase_per_policy_on_the_fleet_of_its_engines() -> None:
    prof = load_profile("cpu-fleet")
    (spec,) = prof.scenarios
    plans = plan_scenario(spec)
    assert [(p.phase, p.engine) for p in plans] == [("round-robin", "fleet2-sync"), ("user-hash", "fleet2-sync"),
                                                    ("failover", "fleet2-sync"),
                                                    # its baseline: the same requests on a limiter-off fleet
                                                    ("round-robin-baseline", "fleet2-off-sync"),
                                                    ("user-hash-baseline", "fleet2-off-sync")]
    from ratebench.scenarios import fleet_members

    assert fleet_members("fleet2-sync") == ["patched-sync.e0", "patched-sync.e1"]
    assert fleet_members("fleet2-off-sync") == ["feature-off-sync.e0", "feature-off-sync.e1"]
    assert fleet_members("fleet3-async") == ["patched-async.e0", "patched-async.e1", "patched-async.e2"]
    assert fleet_members("patched-sync") is None


@pytest.mark.parametrize("change, key, expected", [
    ({"engines": 1}, "engines", "at least 2 engines"),
    ({"streams": 1}, "streams", "at least as many streams as engines (2)"),
    ({"users": ["user-a", "nobody"]}, "users", "users declared in [limits.users]"),
    ({"policies": ["round-robin", "random"]}, "policies", "distinct routing policies from ['round-robin', 'user-hash']"),
    ({"policies": []}, "policies", "a non-empty list"),
    ({"user_header": "X User"}, "user_header", "an HTTP header name"),
    ({"light_users": ["user-a"]}, "light_users", "users not in `users`"),
    ({"light_max_tokens": 13}, "light_users", "within one burst of the user's limit (0.1 s x 1000 tok/s + 1 = 101"),
    ({"light_users": [], "baseline": True}, "baseline", "light_users to judge against it"),
])
def test_fleet_mistakes_are_refused_naming_the_key(change: dict, key: str, expected: str) -> None:
    data = _cpu_fleet()
    data["scenarios"][0].update(change)
    _refused(data, f"scenarios[0].{key}", expected)


def test_the_gpu_fleet_puts_each_engine_on_its_own_gpu() -> None:
    from ratebench.plan import plan_run

    plan = plan_run(load_profile("rtx4090-qwen3-8b-fleet"))
    # (the limiter-off baseline fleet after it, on the same GPUs: max_engines = 2 stops the first fleet before)
    assert [(e.spec.name, e.env["CUDA_VISIBLE_DEVICES"]) for e in plan.engines] == [
        ("patched-sync.e0", "0"), ("patched-sync.e1", "1"), ("feature-off-sync.e0", "0"), ("feature-off-sync.e1", "1")]
    assert plan.engine_starts == [["fleet2-sync"], ["fleet2-off-sync"]]
    prof = load_profile("rtx4090-qwen3-8b-fleet")
    prof.engine.env["CUDA_VISIBLE_DEVICES"] = "2,3"
    assert [e.env["CUDA_VISIBLE_DEVICES"] for e in plan_run(prof).engines] == ["2", "3", "2", "3"]
    prof.engine.env["CUDA_VISIBLE_DEVICES"] = "2"
    with pytest.raises(ProfileError, match="at least as many GPUs as the fleet's engines"):
        plan_run(prof)


def test_a_fleet_is_refused_twice_beside_too_few_engines_or_with_a_stop_after_its_users_are_done() -> None:
    data = _cpu_fleet()
    data["scenarios"].append({**data["scenarios"][0], "name": "again"})
    _refused(data, "scenarios[1].kind", "at most one fleet scenario in a profile")
    data = _cpu_fleet()
    data["profile"]["max_engines"] = 1
    _refused(data, "profile.max_engines", "at least the fleet's engines (2)")
    data = _cpu_fleet()
    data["scenarios"][0]["failover_after_s"] = 3.0  # 4 streams x 2 x 16 tokens at 30 tok/s: 4.27 s in all
    _refused(data, "scenarios[0].failover_after_s", "at most half the failover phase at the users' limits (2.13 s")


def test_a_fleet_counts_as_its_members_among_the_engines_alive_at_once() -> None:
    from ratebench.plan import engines_wanted

    assert engines_wanted(["fleet2-sync", "fleet2-async", "patched-sync"], 2) == ["fleet2-sync"]
    assert engines_wanted(["fleet2-sync", "patched-sync"], 3) == ["fleet2-sync", "patched-sync"]
    assert engines_wanted(["patched-sync", "fleet2-sync"], 2) == ["patched-sync"]
    assert engines_wanted(["fleet3-sync"], 2) == ["fleet3-sync"]  # the next phase's engines always run


NEW_KIND = '''
"""A scenario kind written for a test: one module, registered when imported."""
from ratebench.profiles import REQUIRED, Kind, ProfileError, register
from ratebench.scenarios.base import ROLE_FEATURE_ON, PhaseEstimate, PhasePlan, engine_name

PARAMS = {"user": ("user", REQUIRED), "answers": ("pos_int", 3), "max_tokens": ("pos_int", 8)}


def plan(spec):
    async def run(ctx, engine):
        raise AssertionError("not run here")

    return [PhasePlan(spec.name, f"answer-{k}", engine_name(ROLE_FEATURE_ON, mode), run,
                      lambda limits: PhaseEstimate(None, "a test"))
            for mode in spec.scheduling for k in range(spec.params["answers"])]


def validate(v, p, where, limits, engine, model):
    if p["answers"] > engine.max_num_seqs:
        raise ProfileError(v.path, f"{where}.answers", "at most engine.max_num_seqs", p["answers"])
    return {"probe-added": 7}


KIND = register(Kind("probe-kind", PARAMS, plan, validate=validate))
'''


def test_a_new_scenario_kind_is_one_module_and_its_profile_entry(tmp_path, monkeypatch) -> None:
    """A module that registers a Kind (its parameters, rules and phases) is all a new kind needs: the
    profile schema takes its parameters, applies its rules and the users it adds, and plans it."""
    import importlib

    from ratebench import profiles

    (tmp_path / "probe_kind.py").write_text(NEW_KIND)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(profiles, "_KINDS", dict(profiles.kinds()))
    importlib.import_module("probe_kind")
    monkeypatch.delitem(sys.modules, "probe_kind")
    data = _cpu_tiny()
    data["scenarios"] = [{"kind": "probe-kind", "user": "user-a", "answers": 2, "scheduling": ["sync", "async"]}]
    prof = parse_profile(data, "my.toml")
    (spec,) = prof.scenarios
    assert spec.params == {"user": "user-a", "answers": 2, "max_tokens": 8, "api": "completions", "prompt_tokens": 32}
    assert prof.limits.user_tps["probe-added"] == 7  # the users a kind adds get their limits
    assert [p.phase for p in plan_scenario(spec)] == ["answer-0", "answer-1"] * 2
    data["scenarios"][0]["answers"] = 99
    _refused(data, "scenarios[0].answers", "at most engine.max_num_seqs")
    data["scenarios"][0]["answer"] = 1
    _refused(data, "scenarios[0].answer", "one of the known keys")
