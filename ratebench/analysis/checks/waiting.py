"""Waiting costs nothing: while every request is throttled the engine blocks on its input queue and
wakes at once for a new request or an abort (checks wait-*, wake-*)."""

from __future__ import annotations

from ratebench.analysis.checks.base import CheckMeaning, meanings, per_run
from ratebench.analysis.load import RunData
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds
from ratebench.analysis.waiting import WAIT_MIN_NS, BudgetWait, budget_waits

MEANINGS = meanings({
    "wait-cpu": CheckMeaning("waiting", "the engine core used CPU while every request was throttled (it polls "
                             "instead of blocking)", "{events} and engines/{engine}/engine.log around the phase"),
    "wait-steps": CheckMeaning("waiting", "while every request was throttled, the engine kept scheduling empty "
                               "steps (it polls instead of blocking until a request is ready, a new request or an "
                               "abort)", "{events}: the step records of the phase (reqs 0, throttled or waiting, "
                               "their clocks' spacing)"),
    "wake-first-token": CheckMeaning("waiting", "while every request was throttled, a new request waited for the "
                                     "engine's timeout instead of waking it at once", "{events}: the new request's "
                                     "first dispatch against its send time (requests.jsonl)"),
    "wake-abort": CheckMeaning("waiting", "while every request was throttled, an abort waited for the engine's "
                               "timeout instead of waking it at once", "{events}: the aborted request's finish "
                               "event against its cancel time (requests.jsonl)"),
})


@per_run(50)
def waiting_scenario(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _waiting(s, th)


@per_run(60)
def budget_waits_anywhere(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _budget_waits(run, s, th)


def _waiting(s: RunSummary, th: Thresholds) -> list[Check]:
    """The waiting scenario: CPU spent waiting, and how soon the waiting engine takes a new request or an abort."""
    out = []
    for w in s.waiting:
        ids = (w.scenario, w.waiting.phase, w.engine)
        if w.waiting_excess_cpus is None:
            out.append(Check("wait-cpu", *ids, None, None, th.wait_cpu_max, "<=", "CPUs", None,
                             "EngineCore CPU time not measured (attached engine, or no EngineCore process found)"))
        else:
            x = w.waiting_excess_cpus
            out.append(Check("wait-cpu", *ids, None, round(x, 4), th.wait_cpu_max, "<=", "CPUs", x <= th.wait_cpu_max,
                             f"EngineCore spent {w.waiting.cpu_s:.2f} CPU-s over {w.waiting.wall_s:.2f} s of waiting "
                             f"with {w.waiting.steps} steps; an idle engine keeps {w.idle_cpus:.3f} CPUs busy and a step "
                             f"costs {w.step_cpu_ms:.2f} ms (solved from the idle phase: {w.idle.cpu_s:.2f} CPU-s, "
                             f"{w.idle.wall_s:.2f} s, {w.idle.steps} steps; and the busy phase: {w.busy.cpu_s:.2f} "
                             f"CPU-s, {w.busy.wall_s:.2f} s, {w.busy.steps} steps): {x:+.3f} CPUs beyond that"))
        added = w.wake_added_ms
        if added is not None:
            out.append(Check("wake-first-token", *ids, w.probe_user, round(added, 3), th.wake_max_ms, "<=", "ms",
                             added <= th.wake_max_ms,
                             f"p50 time to first token of {w.probes} probes while the engine waits "
                             f"{w.probe_ttft_waiting_p50_ms:.1f} ms vs {w.probe_ttft_idle_p50_ms:.1f} ms on the idle "
                             f"engine: {added:+.1f} ms"))
        if w.abort_latency_ms:
            p50 = w.abort_p50_ms
            out.append(Check("wake-abort", *ids, None, round(p50, 3), th.wake_max_ms, "<=", "ms",
                             p50 <= th.wake_max_ms,
                             f"{len(w.abort_latency_ms)} streams closed while the engine waits: the abort reached "
                             f"the engine in p50 {p50:.1f} ms (max {max(w.abort_latency_ms):.1f} ms)"))
    return out


def _budget_waits(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    """Every phase on a limiter-on engine with step records that waited for budget at least WAIT_MIN_NS in
    all (analysis/waiting.py): wait-steps, the engine's re-wakes per second of waiting (a loop that
    schedules while it waits), and wait-cpu, the EngineCore's CPU beyond an idle engine's and its steps',
    per second of waiting (the waiting scenario's own waiting phase keeps its wait-cpu over the phase)."""
    out = []
    for w in budget_waits(run, s.steps_per_phase, s.waiting):
        if w.wait_ns < WAIT_MIN_NS:
            continue  # not exercised: too little waiting to measure
        ids = (w.scenario, w.phase, w.engine, None)
        waited = (f"{w.wait_s:.2f} s of {w.wall_s:.2f} s waiting for budget after {w.empty_steps} empty steps "
                  f"(of {w.steps}; nothing scheduled, every request held by its user's budget; longest wait "
                  f"{w.longest_wait_ns / 1e6:.1f} ms)")
        polls = ("the engine's loop steps at a fixed cadence by construction (manifest.json engines."
                 f"{w.engine}.loop = polls: the test harness), so its waiting is information only: ")
        rate = w.rewakes_per_s
        text = (f"{waited}: {w.rewakes} of them right after two empty steps, {rate:.1f} per second of "
                f"waiting (a blocked engine wakes every 50 ms at most when nothing comes: 20; a loop that "
                f"schedules every millisecond: about 1,000)")
        out.append(Check("wait-steps", *ids, round(rate, 3), th.wait_steps_max, "<=", "steps/s",
                         None if w.loop_polls else rate <= th.wait_steps_max,
                         polls + text if w.loop_polls else text))
        if w.waiting_scenario:
            continue  # its wait-cpu is the waiting scenario's (over the whole phase)
        out.append(_wait_cpu(w, th, waited, polls))
    return out


def _wait_cpu(w: BudgetWait, th: Thresholds, waited: str, polls: str) -> Check:
    ids = (w.scenario, w.phase, w.engine, None)
    x = w.excess_cpus
    if w.cpu_s is None:
        why = "the EngineCore's CPU time was not measured (attached engine, or no EngineCore process found)"
    elif w.model is None:
        why = ("no idle and busy phases on this engine to price its steps and its idle loop (the waiting "
               "scenario's); wait-steps judges the wait without them")
    else:
        why = (f"the model prices the {w.sampling_steps} sampling steps, not the {w.empty_steps} empty steps a "
               f"blocked engine runs between users' tokens (pricing those would let a loop that polls through "
               f"schedule() pay for itself); judged in the waiting scenario, where every request waits, and by "
               f"wait-steps here ({x:+.3f} CPUs per second of waiting measured)")
    return Check("wait-cpu", *ids, None if x is None else round(x, 4), th.wait_cpu_max, "<=", "CPUs", None,
                 f"{polls if w.loop_polls else ''}{waited}; information only: {why}")
