"""Isolation: an unthrottled user's rate beside a throttled neighbour, against alone."""

from __future__ import annotations

from ratebench.synth import SimEngine, SimPhase, SimRequest, write_run_folder
from ratebench.verify import analyse_run


def isolation_run(tmp_path, shared_step_ns=None):
    eng = SimEngine("patched-sync", default_tps=20, user_tps={"fast": 5000})
    fast = {"limit_tps": 5000, "streams": 2, "backlogged": False}
    phases = [
        SimPhase("isolation", "isolation", "baseline", "patched-sync", "baseline", {"fast": fast},
                 [SimRequest(f"rb-1-{i}", "fast", i, 80) for i in range(2)]),
        SimPhase("isolation", "isolation", "shared", "patched-sync", "shared",
                 {"fast": fast, "slow": {"limit_tps": 20, "streams": 2, "backlogged": True}},
                 [SimRequest(f"rb-1-{i + 2}", "fast", i, 80) for i in range(2)]
                 + [SimRequest(f"rb-1-{i + 4}", "slow", i, 10) for i in range(2)], step_ns=shared_step_ns),
    ]
    return write_run_folder(tmp_path, [eng], phases)


def isolation_checks(run_dir):
    return {c.name: c for c in analyse_run(run_dir).verdict.checks if c.name.startswith("isolation")}


def test_unthrottled_user_unaffected_by_throttled_neighbour(tmp_path):
    checks = isolation_checks(isolation_run(tmp_path))
    assert checks["isolation-rate"].passed and checks["isolation-rate"].figure > 0.9
    assert checks["isolation-gap-p99"].passed is None  # reported only, no threshold given


def test_neighbour_that_slows_everyone_fails_isolation(tmp_path):
    checks = isolation_checks(isolation_run(tmp_path, shared_step_ns=10_000_000))
    assert checks["isolation-rate"].passed is False
    assert checks["isolation-rate"].figure < 0.6


def test_unthrottled_users_first_token_is_checked_against_its_baseline(tmp_path):
    checks = isolation_checks(isolation_run(tmp_path))
    ttft = checks["isolation-ttft"]
    assert ttft.passed and ttft.unit == "ms"
    assert "engine side" in ttft.explanation


def test_a_neighbour_that_delays_the_first_token_fails_isolation_ttft(tmp_path):
    from synthetic_runs import edit_client_records

    run = isolation_run(tmp_path)

    def sent_earlier(recs):  # as if the shared phase's requests waited 0.5 s before their first token
        for r in recs:
            if r.phase == "shared" and r.user == "fast":
                r.sent_ns -= 500_000_000

    edit_client_records(run, sent_earlier)
    checks = isolation_checks(run)
    assert checks["isolation-ttft"].passed is False
    assert checks["isolation-ttft"].figure > 500
    assert checks["isolation-rate"].passed  # the rate from the first token on does not see it
