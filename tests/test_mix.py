"""The mix scenario: a seeded synthetic population made as a trace (a pure function of its
parameters), its tiers' users and limits, and every malformed parameter refused at profile load."""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

import pytest

from ratebench.mix import mix_requests, tier_users
from ratebench.plan import plan_run
from ratebench.profiles import ProfileError, parse_profile
from ratebench.scenarios import plan_scenario

_PROFILE = {
    "profile": {"scheduling": ["sync"]},
    "model": {"source": "tiny", "max_model_len": 1024},
    "engine": {"max_num_seqs": 8, "max_num_active_seqs": 2},
    "limits": {"default_tps": 100, "users": {"user-a": 20}},
    "scenarios": [{
        "kind": "mix", "seed": 3, "duration_s": 6, "anonymous_rate": 0.5, "burst_at_s": 2.0,
        "output_tokens": {"dist": "uniform", "low": 8, "high": 40},
        "prompt_tokens": {"dist": "lognormal", "median": 48, "sigma": 0.6, "max": 400},
        "eos_fraction": 0.2, "cancel_fraction": 0.2, "prefix_fraction": 0.3, "prefix_tokens": 128,
        "chat_fraction": 0.3,
        "tiers": [{"name": "t1", "users": 3, "limit_tps": 20, "rate": 0.5},
                  {"name": "t2", "users": 2, "rate": 1.0},
                  {"name": "burst", "users": 4, "limit_tps": 50, "burst": True, "burst_requests": 2}],
    }],
}


def _data(**scenario) -> dict:
    data = copy.deepcopy(_PROFILE)
    data["scenarios"][0].update(scenario)
    return data


def _params(**scenario) -> dict:
    return parse_profile(_data(**scenario), "my.toml").scenarios[0].params


def _refused(data: dict, key: str, expected: str) -> None:
    with pytest.raises(ProfileError) as info:
        parse_profile(data, "my.toml")
    assert info.value.key == key, str(info.value)
    assert expected in str(info.value), str(info.value)


def test_the_same_seed_makes_the_same_requests_and_another_seed_others() -> None:
    a, b = mix_requests(_params()), mix_requests(_params())
    assert a == b and len(a) == _params()["mix_requests"]
    assert mix_requests(_params(seed=4)) != a
    assert [r.at_s for r in a] == sorted(r.at_s for r in a)


def test_tier_users_take_the_tiers_limit_and_the_others_the_default() -> None:
    prof = parse_profile(_data(), "my.toml")
    assert tier_users({"name": "t1", "users": 3}) == ["t1-00", "t1-01", "t1-02"]
    assert len(tier_users({"name": "x", "users": 150})[0]) == len("x-000")
    lim = prof.limits
    assert lim.limit_of("t1-02") == 20 and lim.limit_of("burst-03") == 50 and lim.limit_of("t2-00") == 100
    assert "t2-00" not in lim.user_tps  # no limit_tps: the default rate, no flag
    argv = " ".join(plan_run(prof).engines[0].argv)
    assert '"t1-00":20' in argv and '"burst-03":50' in argv


def test_a_burst_tier_arrives_all_at_once() -> None:
    reqs = mix_requests(_params())
    burst = [r for r in reqs if r.user and r.user.startswith("burst-")]
    assert len(burst) == 4 * 2 and {r.at_s for r in burst} == {2.0}


def test_arrivals_are_poisson_or_evenly_spaced_at_the_rate() -> None:
    tiers = [{"name": "t", "users": 1, "rate": 5.0}]
    constant = mix_requests(_params(tiers=tiers, arrivals="constant", anonymous_rate=0, duration_s=20))
    gaps = [b.at_s - a.at_s for a, b in zip(constant, constant[1:])]
    assert len(constant) in (99, 100) and max(gaps) - min(gaps) < 1e-3 and statistics.mean(gaps) == \
        pytest.approx(0.2, abs=1e-3)
    poisson = mix_requests(_params(tiers=tiers, anonymous_rate=0, duration_s=200))
    gaps = [b.at_s - a.at_s for a, b in zip(poisson, poisson[1:])]
    assert 900 <= len(poisson) <= 1100 and statistics.stdev(gaps) == pytest.approx(0.2, rel=0.15)


def test_fractions_and_lengths_are_as_asked() -> None:
    reqs = mix_requests(_params(duration_s=300, tiers=[{"name": "t", "users": 4, "rate": 2.0}]))
    n = len(reqs)
    assert n > 2000
    for share, pick in ((0.2, lambda r: r.eos), (0.2, lambda r: r.cancel_after_tokens is not None),
                        (0.3, lambda r: r.prefix_group is not None), (0.3, lambda r: r.api == "chat"),
                        (0.5 * 300 / n, lambda r: r.user is None)):
        assert sum(1 for r in reqs if pick(r)) / n == pytest.approx(share, abs=0.04)
    assert min(r.max_tokens for r in reqs) == 8 and max(r.max_tokens for r in reqs) == 40
    assert max(r.prompt for r in reqs) <= 400 and statistics.median(r.prompt for r in reqs) == \
        pytest.approx(48, rel=0.1)
    assert all(r.cancel_after_tokens < r.max_tokens or r.max_tokens < 3 for r in reqs if r.cancel_after_tokens)
    assert {r.prefix_tokens for r in reqs if r.prefix_group} == {128}


def test_mix_is_one_phase_or_two_with_the_limiter_off_baseline() -> None:
    (one,) = plan_scenario(parse_profile(_data(), "my.toml").scenarios[0])
    assert (one.phase, one.engine) == ("mix", "patched-sync")
    both = plan_scenario(parse_profile(_data(baseline=True), "my.toml").scenarios[0])
    assert [(p.phase, p.engine) for p in both] == [("mix", "patched-sync"), ("mix-baseline", "feature-off-sync")]
    assert both[0].estimate(None).at_least_s == max(r.at_s for r in mix_requests(_params()))


_T = "scenarios[0].tiers"


@pytest.mark.parametrize("change, key, expected", [
    ({"tiers": []}, _T, "a non-empty array of tier tables"),
    ({"tiers": "t1"}, _T, "a non-empty array of tier tables"),
    ({"tiers": [{"name": "t", "users": 1, "rate": 1, "colour": 1}]}, f"{_T}[0].colour", "one of the known keys"),
    ({"tiers": [{"users": 1, "rate": 1}]}, f"{_T}[0].name", "it is required"),
    ({"tiers": [{"name": "t", "rate": 1}]}, f"{_T}[0].users", "it is required"),
    ({"tiers": [{"name": "t", "users": 0, "rate": 1}]}, f"{_T}[0].users", "a positive integer"),
    ({"tiers": [{"name": "a b", "users": 1, "rate": 1}]}, f"{_T}[0].name", "a unique name"),
    ({"tiers": [{"name": "t", "users": 1, "rate": 1}, {"name": "t", "users": 1, "rate": 1}]}, f"{_T}[1].name",
     "a unique name"),
    ({"tiers": [{"name": "user", "users": 1, "rate": 1}]}, None, None),  # user-00 is not user-a: fine
    ({"tiers": [{"name": "t", "users": 1}]}, f"{_T}[0].rate", "it is required"),
    ({"tiers": [{"name": "t", "users": 1, "rate": -1}]}, f"{_T}[0].rate", "a number >= 0"),
    ({"tiers": [{"name": "t", "users": 1, "rate": 1, "limit_tps": 0}]}, f"{_T}[0].limit_tps", "a positive integer"),
    ({"tiers": [{"name": "t", "users": 1, "rate": 1, "burst_requests": 2}]}, f"{_T}[0].burst_requests",
     "burst = true"),
    ({"tiers": [{"name": "t", "users": 1, "rate": 0}], "anonymous_rate": 0}, _T, "at least one request"),
    ({"arrivals": "bursty"}, "scenarios[0].arrivals", 'one of ["poisson", "constant"]'),
    ({"eos_fraction": 1.5}, "scenarios[0].eos_fraction", "a fraction from 0 to 1"),
    ({"duration_s": 0}, "scenarios[0].duration_s", "a positive number"),
    ({"output_tokens": 0}, "scenarios[0].output_tokens", "a token count, or a table"),
    ({"output_tokens": {"dist": "zipf"}}, "scenarios[0].output_tokens.dist", "one of ['fixed', 'lognormal', "
                                                                              "'uniform']"),
    ({"output_tokens": {"dist": "uniform", "low": 8}}, "scenarios[0].output_tokens.high", "it is required"),
    ({"output_tokens": {"dist": "uniform", "low": 9, "high": 8}}, "scenarios[0].output_tokens.low", "at most high"),
    ({"output_tokens": {"dist": "fixed", "value": 8, "max": 9}}, "scenarios[0].output_tokens.max",
     "one of the known keys"),
    ({"output_tokens": {"dist": "lognormal", "median": 10, "sigma": -1}}, "scenarios[0].output_tokens.sigma",
     "a positive number"),
    ({"output_tokens": 900}, "scenarios[0].output_tokens", "within model.max_model_len (1024)"),
    ({"api": "chat"}, "scenarios[0].api", "one of the known keys"),
])
def test_every_malformed_mix_parameter_is_refused(change: dict, key: str | None, expected: str | None) -> None:
    if key is None:
        parse_profile(_data(**change), "my.toml")
    else:
        _refused(_data(**change), key, expected)


def test_a_tier_cannot_reuse_a_declared_users_name() -> None:
    data = _data()
    data["limits"]["users"]["t1-01"] = 5
    _refused(data, f"{_T}[0].name", "are not declared in [limits.users] or by another tier")
    data = _data(tiers=[{"name": "a", "users": 2, "rate": 1}, {"name": "a-0", "users": 1, "rate": 1}])
    parse_profile(data, "my.toml")  # a-00, a-01 and a-0-00: distinct


def test_dry_run_prints_the_mix_phases(tmp_path: Path) -> None:
    plan = plan_run(parse_profile(_data(baseline=True), tmp_path / "p.toml"))
    assert [p.phase for p in plan.phases] == ["mix", "mix-baseline"]
    assert plan.phases[0].estimate.at_least_s >= 5 and "t1-0" in plan.phases[0].estimate.basis
