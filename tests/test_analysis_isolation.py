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
