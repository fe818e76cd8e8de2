"""Overhead: per-round paired throughput ratios, their median and spread, the pooled ratio, and the checks."""

from __future__ import annotations

import itertools
import json

import pytest

from ratebench.analysis import Thresholds, paired_ratio
from synth import SimEngine, overhead_engines, overhead_phases, write_run_folder
from ratebench.verify import analyse_run

S = 1_000_000_000


def test_median_spread_and_pooled_ratio_of_paired_rounds() -> None:
    a = {"sync-1": (1000, 1 * S), "sync-2": (1000, 2 * S), "sync-3": (1000, 1 * S), "sync-4": (500, 1 * S)}
    b = {"sync-1": (1000, 1 * S), "sync-2": (1000, 1 * S), "sync-3": (1100, 1 * S)}
    p = paired_ratio(a, b)
    # rounds both ran: 1000/1000, 500/1000, 1000/1100 (round 4 has no partner)
    assert p.rounds == 3 and p.per_round == pytest.approx({"sync-1": 1.0, "sync-2": 0.5, "sync-3": 1000 / 1100})
    assert p.median == pytest.approx(1000 / 1100)  # not the mean (0.803)
    assert (p.min, p.max) == (pytest.approx(0.5), pytest.approx(1.0))
    # pooled: every phase of each role, all tokens over all time: (3500 / 5 s) / (3100 / 3 s)
    assert p.pooled == pytest.approx((3500 / 5) / (3100 / 3))


def test_median_of_an_even_number_of_rounds_is_the_middle_pair_mean() -> None:
    a = {str(i): (t, S) for i, t in enumerate((900, 1000, 1200, 1300))}
    b = {str(i): (1000, S) for i in range(4)}
    assert paired_ratio(a, b).median == pytest.approx(1.1)


def test_no_shared_round_gives_no_paired_ratio() -> None:
    assert paired_ratio({"1": (10, S)}, {"2": (10, S)}) is None
    assert paired_ratio({"1": (10, S)}, {"1": (0, S)}) is None


def _overhead_run(tmp_path, step_ns: dict[tuple[str, int], int], rounds: int = 3):
    ids = (f"rb-5e1f0001-{n}" for n in itertools.count())
    patched = SimEngine("patched-sync", default_tps=100, user_tps={"bulk": 100000})
    roles = overhead_engines(patched)
    phases = overhead_phases(roles, lambda: next(ids), rounds=rounds, max_tokens=150, step_ns=step_ns)
    return write_run_folder(tmp_path / "run", list(roles.values()), phases)


def test_one_stalled_round_moves_the_pooled_ratio_not_the_median(tmp_path) -> None:
    # feature-on's round 2 runs at half speed (a busy machine); every other phase at the same speed
    run = _overhead_run(tmp_path, {("feature-on", 2): 10_000_000})
    (o,) = analyse_run(run).verdict.overheads
    p = o.paired["feature-on/feature-off"]
    assert p.rounds == 3
    assert p.median == pytest.approx(1.0, abs=0.05)
    assert p.min == pytest.approx(0.5, abs=0.05) and p.max == pytest.approx(1.0, abs=0.05)
    assert p.pooled < 0.8 and o.ratios["feature-on/feature-off"] == pytest.approx(p.pooled)
    assert set(o.round_throughput_tps) == {"sync-1", "sync-2", "sync-3"}
    assert o.round_throughput_tps["sync-2"]["feature-on"] < 0.6 * o.round_throughput_tps["sync-2"]["feature-off"]
    # the check uses the median: within 5 % despite the stalled round
    verdict = analyse_run(run, Thresholds(max_overhead=0.05)).verdict
    checks = {c.phase: c for c in verdict.checks if c.name == "overhead"}
    assert set(checks) == {"feature-on/feature-off", "feature-on/stock"}
    assert checks["feature-on/feature-off"].passed and abs(checks["feature-on/feature-off"].figure) < 0.05
    assert "spread" in checks["feature-on/feature-off"].explanation


def test_event_recording_cost_is_its_own_check_against_the_engine_without_events(tmp_path) -> None:
    # recording slows every feature-on step by 25 % against the same engine without events
    run = _overhead_run(tmp_path, {("feature-on", r): 5_000_000 for r in (1, 2, 3)}
                        | {("feature-on-no-events", r): 4_000_000 for r in (1, 2, 3)})
    verdict = analyse_run(run).verdict
    (check,) = [c for c in verdict.checks if c.name == "event-recording"]
    assert check.phase == "feature-on/feature-on-no-events" and check.passed is None  # report only by default
    assert check.figure == pytest.approx(0.2, abs=0.04)
    assert not any(c.name == "overhead" and "no-events" in c.phase for c in verdict.checks)
    failed = analyse_run(run, Thresholds(max_event_overhead=0.01)).verdict.failures
    assert [c.name for c in failed] == ["event-recording"]
    # the engine without events has no step figure; the others do
    (o,) = verdict.overheads
    assert set(o.step_p50_ns) == {"feature-on", "feature-off"}
    assert o.step_p50_ns["feature-on"] == pytest.approx(5e6, rel=0.1)


def test_overheads_in_verdict_json_keep_the_earlier_fields(tmp_path) -> None:
    from ratebench.verify import verify_run

    run = _overhead_run(tmp_path, {}, rounds=2)
    verify_run(run, plots=False)
    (o,) = json.loads((run / "verdict.json").read_text())["overheads"]
    assert {"scenario", "throughput_tps", "tokens", "ratios"} <= set(o)  # readers of earlier versions
    assert set(o["throughput_tps"]) == {"feature-on", "feature-on-no-events", "feature-off", "stock"}
    pair = o["paired"]["feature-on/feature-off"]
    assert {"median", "min", "max", "rounds", "pooled", "per_round"} <= set(pair) and pair["rounds"] == 2
    report = (run / "report.md").read_text()
    assert "feature-on/feature-on-no-events" in report and "engine step p50" in report


def test_runs_without_round_numbers_pair_phases_in_order(tmp_path) -> None:
    from synthetic_runs import edit_scenarios

    run = _overhead_run(tmp_path, {}, rounds=2)

    def drop_rounds(phases):
        for p in phases:
            p["params"].pop("round", None)
            p["params"].pop("scheduling", None)

    edit_scenarios(run, drop_rounds)
    (o,) = analyse_run(run).verdict.overheads
    assert o.paired["feature-on/stock"].rounds == 2 and set(o.round_throughput_tps) == {"1", "2"}


def test_a_phase_beside_busy_processes_is_warned_with_its_round(tmp_path) -> None:
    run_dir = tmp_path / "run"
    ids = (f"rb-5e1f0001-{n}" for n in itertools.count())
    roles = overhead_engines(SimEngine("patched-sync", default_tps=100, user_tps={"bulk": 100000}))
    phases = overhead_phases(roles, lambda: next(ids), rounds=2, max_tokens=50)
    for p in phases:
        busy = p.role == "stock" and p.params["round"] == 2
        p.machine_cpu = {"busy": 2.0, "run": 1.1 if busy else 1.9, "other": 0.9 if busy else 0.1}
    verdict = analyse_run(write_run_folder(run_dir, list(roles.values()), phases)).verdict
    (o,) = verdict.overheads
    assert o.round_other_cpu["sync-2"]["stock"] == 0.9 and o.round_other_cpu["sync-1"]["stock"] == 0.1
    (warning,) = [w for w in verdict.warnings if "outside the run" in w]
    assert "1 of 8 phases" in warning and "stock sync-2 0.90" in warning and "round(s) sync-2" in warning


def test_the_profiles_max_overhead_judges_a_limiter_that_slows_every_step(tmp_path) -> None:
    """The overhead scenario's own threshold (`max_overhead`, cpu-tiny's 0.35) makes the check a verdict:
    a limiter whose steps take twice as long (every feature-on round at half the speed) fails it, the
    same run at the same speed passes, and --max-overhead given on the command line wins."""
    def run(folder, slow: bool):
        ids = (f"rb-5e1f0002-{n}" for n in itertools.count())
        patched = SimEngine("patched-sync", default_tps=100, user_tps={"bulk": 100000})
        roles = overhead_engines(patched)
        step = {("feature-on", r): 10_000_000 for r in (1, 2, 3)} if slow else {}
        phases = overhead_phases(roles, lambda: next(ids), rounds=3, max_tokens=150, step_ns=step)
        for ph in phases:
            ph.params["max_overhead"] = 0.35
        return write_run_folder(tmp_path / folder, list(roles.values()), phases)

    def check(folder, th=None):
        (c,) = [c for c in analyse_run(folder, th or Thresholds()).verdict.checks
                if c.name == "overhead" and c.phase == "feature-on/feature-off"]
        return c

    slow = check(run("slow", True))
    assert slow.passed is False and slow.threshold == 0.35 and slow.figure > 0.4, slow.explanation
    assert "at most 0.35 (the profile's max_overhead)" in slow.explanation
    fine = check(run("fine", False))
    assert fine.passed and fine.figure < 0.05, fine.explanation
    wins = check(tmp_path / "slow", Thresholds(max_overhead=0.6))
    assert wins.passed and wins.threshold == 0.6 and "(--max-overhead)" in wins.explanation
