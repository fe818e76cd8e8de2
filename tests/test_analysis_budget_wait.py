"""Waiting costs nothing, wherever the engine waited for budget (ratebench/analysis/waiting.py,
budget_waits): the wait-steps and wait-cpu checks of every phase on a limiter-on engine with step
records, not only the waiting scenario's.

Run folders come from the simulated engine; step records are added to its event file as the patched
engine's recorder writes them (one per schedule() call), and the phase is stretched to hold them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from ratebench.analysis.checks import build_checks
from ratebench.analysis.load import load_run
from ratebench.analysis.summary import summarize_run
from ratebench.analysis.verdict import Thresholds
from ratebench.analysis.waiting import wait_figures, waiting_steps
from ratebench.events import STEP_DTYPE, EventFileWriter, read_engine_events
from ratebench.outputs.promises import promise_coverage
from ratebench.verify import verify_run
from synthetic_runs import all_promises_run, edit_manifest, edit_scenarios, one_phase_run

MS = 1_000_000
S = 1_000_000_000
# a step that ran a request; a step that scheduled nothing while the user's requests were throttled
BUSY = dict(reqs=1, tokens=1, resident=2, throttled=1, waiting=0, waiting_ready=0)
EMPTY = dict(reqs=0, tokens=0, resident=2, throttled=2, waiting=0, waiting_ready=0)


def steps(times_ns: list[int], kinds: list[dict]) -> np.ndarray:
    arr = np.zeros(len(times_ns), dtype=STEP_DTYPE)
    for i, (t, k) in enumerate(zip(times_ns, kinds)):
        arr[i] = (t, k["reqs"], k["tokens"], k["resident"], k["throttled"], k["waiting"], k["waiting_ready"],
                  0, 100, 0)
    return arr


def waiting_run(run_dir: Path, *, every_ns: int, wait_ns: int, phase_s: float = 3.0) -> Path:
    """One phase of ``phase_s`` seconds: a busy step, then ``wait_ns`` of empty steps every ``every_ns``
    from 0.5 s into the phase, then a busy step again."""
    run_dir = one_phase_run(run_dir)
    phase = json.loads((run_dir / "scenarios.json").read_text())[0]
    start = phase["start_ns"]
    edit_scenarios(run_dir, lambda ps: ps[0].update(end_ns=start + round(phase_s * S)))
    t0 = start + S // 2
    n = wait_ns // every_ns
    times = [start + 10 * MS] + [t0 + i * every_ns for i in range(n)] + [t0 + n * every_ns]
    add_steps(run_dir, "patched-sync", steps(times, [BUSY] + [EMPTY] * n + [BUSY]))
    return run_dir


def add_steps(run_dir: Path, engine: str, st: np.ndarray) -> None:
    path = run_dir / "engines" / engine / "events.rbev"
    ev = read_engine_events(path)
    with EventFileWriter(path, ev.meta) as w:
        for s in ev.strings:
            w.intern(s)
        w.write_block(ev.records)
        w.write_steps(st)


def wait_checks(run_dir: Path, th: Thresholds | None = None) -> dict[tuple[str, str], object]:
    run = load_run(run_dir)
    checks = build_checks(run, summarize_run(run), th or Thresholds())
    return {(c.name, c.phase): c for c in checks if c.name in ("wait-steps", "wait-cpu")}


# ---- the figures ------------------------------------------------------------------------------


def test_an_empty_step_waits_only_while_every_request_is_held_by_its_budget():
    kinds = [EMPTY, BUSY,
             dict(EMPTY, throttled=0, waiting=2),  # queued requests, none of a user with budget: waits
             dict(EMPTY, waiting=1, waiting_ready=1),  # a ready request left waiting: not a wait for budget
             dict(EMPTY, throttled=0, resident=0)]  # an idle engine: nothing held back
    assert waiting_steps(steps([0] * 5, kinds)).tolist() == [True, False, True, False, False]


def test_waits_run_to_the_next_step_and_stop_at_the_phase_end():
    st = steps([0, 10 * MS, 60 * MS, 70 * MS, 120 * MS], [EMPTY, EMPTY, BUSY, EMPTY, EMPTY])
    f = wait_figures(st, end_ns=150 * MS, next_t_ns=400 * MS)
    # 10 + 50 ms, then 50 ms and 30 ms (the phase ends before the engine's next step); no empty step
    # follows two empty steps (one or two right after a step that ran are not re-wakes)
    assert f == dict(empty_steps=4, rewakes=0, wait_ns=140 * MS, longest_wait_ns=50 * MS)
    st = steps([0, 10 * MS, 60 * MS, 110 * MS, 160 * MS], [BUSY, EMPTY, EMPTY, EMPTY, EMPTY])
    assert wait_figures(st, end_ns=200 * MS)["rewakes"] == 2


# ---- the checks -------------------------------------------------------------------------------


def test_two_seconds_of_waiting_with_an_empty_step_every_50_ms_passes(tmp_path):
    checks = wait_checks(waiting_run(tmp_path / "run", every_ns=50 * MS, wait_ns=2 * S))
    c = checks[("wait-steps", "main")]
    assert c.passed is True and c.threshold == 40.0 and c.unit == "steps/s"
    assert c.figure == 19.0, c.explanation  # 38 re-wakes (empty steps after two empty steps) in 2 s
    assert "2.00 s of 3.00 s waiting for budget after 40 empty steps" in c.explanation
    # the simulated engine's CPU time was not measured: wait-cpu says so, not judged
    cpu = checks[("wait-cpu", "main")]
    assert cpu.passed is None and "not measured" in cpu.explanation


def test_an_empty_step_every_millisecond_fails_wait_steps_under_waiting_costs_nothing(tmp_path):
    run_dir = waiting_run(tmp_path / "run", every_ns=MS, wait_ns=2 * S)
    c = wait_checks(run_dir)[("wait-steps", "main")]
    assert c.passed is False and c.figure > 990, c.explanation
    verdict = verify_run(run_dir, plots=False)
    assert [f.name for f in verdict.failures] == ["wait-steps"], verdict.summary()
    waiting = next(p for p in promise_coverage(verdict) if p.key == "waiting")
    assert waiting.exercised and waiting.checks_failed == 1


def test_short_waiting_is_not_judged(tmp_path):
    run_dir = waiting_run(tmp_path / "run", every_ns=MS, wait_ns=900 * MS)  # polls, but for 0.9 s
    assert wait_checks(run_dir) == {}
    verdict = verify_run(run_dir, plots=False)
    assert verdict.passed, verdict.summary()
    waiting = next(p for p in promise_coverage(verdict) if p.key == "waiting")
    assert not waiting.exercised


def test_an_engine_whose_loop_polls_by_construction_is_information(tmp_path):
    """The test harness steps at a fixed fake cadence; its run folders say so (manifest loop = polls)."""
    run_dir = waiting_run(tmp_path / "run", every_ns=5 * MS, wait_ns=2 * S)
    edit_manifest(run_dir, lambda m: m["engines"]["patched-sync"].update(loop="polls"))
    c = wait_checks(run_dir)[("wait-steps", "main")]
    assert c.passed is None and c.figure > 190 and "fixed cadence by construction" in c.explanation


def test_the_threshold_is_an_option_and_reaches_the_verdict(tmp_path):
    run_dir = waiting_run(tmp_path / "run", every_ns=10 * MS, wait_ns=2 * S)  # 100 re-wakes a second
    runner = CliRunner()
    from ratebench.cli import app

    assert runner.invoke(app, ["verify-bound", str(run_dir), "--no-plots"]).exit_code == 1
    result = runner.invoke(app, ["verify-bound", str(run_dir), "--no-plots", "--wait-steps-max", "120"])
    assert result.exit_code == 0, result.output
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["thresholds"]["wait_steps_max"] == 120
    [c] = [c for c in verdict["checks"] if c["name"] == "wait-steps"]
    assert c["passed"] is True


# ---- wait-cpu outside the waiting scenario ------------------------------------------------------


def cpu_run(run_dir: Path, *, poll_cpus: float, wait_share: float = 0.8,
            scenario: str = "seed-experiment") -> tuple[Path, float]:
    """all_promises_run (the waiting scenario prices the sync engine: an idle loop and a step's cost) with
    its seed phase on that engine waiting ``wait_share`` of its time (empty steps every 50 ms) and its
    EngineCore spending ``poll_cpus`` more for each second of that waiting. Returns the run and the wait."""
    run_dir = all_promises_run(run_dir)
    phases = json.loads((run_dir / "scenarios.json").read_text())
    i, seed = next((i, p) for i, p in enumerate(phases)
                   if p["scenario"] == scenario and p["engine"] == "patched-sync"
                   and p["role"] in ("measure", "waiting"))
    start, end = seed["start_ns"], seed["end_ns"]
    wall = end - start
    n = round(wall * wait_share / (50 * MS))
    t0 = start + (wall - n * 50 * MS) // 2
    add_steps(run_dir, "patched-sync",
              steps([t0 - MS] + [t0 + k * 50 * MS for k in range(n)] + [t0 + n * 50 * MS],
                    [BUSY] + [EMPTY] * n + [BUSY]))
    summary = summarize_run(load_run(run_dir))
    sampling = summary.steps_per_phase[i]
    # the model as the verifier solves it from the idle and busy phases (its steps are those that sampled)
    [w] = [w for w in summary.waiting if w.engine == "patched-sync"]
    a, b = w.idle_cpus, w.step_cpu_ms / 1e3
    wait_s = n * 0.05

    def cpu(entries):
        if scenario == "waiting":
            return  # its CPU time is the waiting scenario's own
        entries[i]["engine_core_cpu_s"] = a * wall / 1e9 + b * sampling + poll_cpus * wait_s

    edit_scenarios(run_dir, cpu)
    return run_dir, wait_s


def test_wait_cpu_outside_the_waiting_scenario_is_measured_for_information(tmp_path):
    """The model prices sampling steps, not the empty steps a blocked engine runs between users' tokens
    (cpu-tiny's blocked engines read +0.1 to +0.5 CPUs in busy phases): outside the waiting scenario
    wait-cpu says its figure and why it is not judged; wait-steps judges the wait there."""
    run_dir, wait_s = cpu_run(tmp_path / "run", poll_cpus=1.0)
    checks = wait_checks(run_dir)
    c = checks[("wait-cpu", "2-streams")]
    assert c.engine == "patched-sync" and c.passed is None and abs(c.figure - 1.0) < 0.01, c.explanation
    assert "information only" in c.explanation and "per second of waiting" in c.explanation
    # the waiting scenario's waiting phase keeps its own wait-cpu, over the phase; one check per phase
    run = load_run(run_dir)
    cpu = [(c.scenario, c.phase, c.engine) for c in build_checks(run, summarize_run(run), Thresholds())
           if c.name == "wait-cpu"]
    assert sorted(cpu) == [("seed-experiment", "2-streams", "patched-sync"), ("waiting", "waiting", "patched-sync")]


def test_a_seed_phase_whose_engine_blocks_reads_its_wait_cpu_for_information(tmp_path):
    run_dir, _ = cpu_run(tmp_path / "run", poll_cpus=0.05)
    c = wait_checks(run_dir)[("wait-cpu", "2-streams")]
    assert c.passed is None and abs(c.figure - 0.05) < 0.01, c.explanation


def test_an_engine_without_idle_and_busy_phases_is_judged_on_its_steps_alone(tmp_path):
    """The user's case: a profile without the waiting scenario, on an engine that polls while every
    request is throttled. wait-steps fails it; wait-cpu cannot price its steps and says so."""
    run_dir = waiting_run(tmp_path / "run", every_ns=MS, wait_ns=2 * S)
    edit_scenarios(run_dir, lambda ps: ps[0].update(engine_core_cpu_s=2.5))
    checks = wait_checks(run_dir)
    assert checks[("wait-steps", "main")].passed is False
    cpu = checks[("wait-cpu", "main")]
    assert cpu.passed is None and "no idle and busy phases on this engine" in cpu.explanation


def test_the_waiting_scenario_s_phase_gets_wait_steps_beside_its_own_wait_cpu(tmp_path):
    run_dir, wait_s = cpu_run(tmp_path / "run", poll_cpus=0.0, scenario="waiting")
    assert wait_s >= 1.0
    run = load_run(run_dir)
    checks = [c for c in build_checks(run, summarize_run(run), Thresholds()) if c.scenario == "waiting"]
    assert [(c.name, c.phase) for c in checks if c.name in ("wait-steps", "wait-cpu")] == [
        ("wait-cpu", "waiting"), ("wait-steps", "waiting")]
    assert all(c.passed for c in checks if c.name in ("wait-steps", "wait-cpu"))
