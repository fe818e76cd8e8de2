"""Waiting costs nothing and wakes at once: figures of the ``waiting`` scenario.

The scenario runs three phases on one engine: ``idle`` (probe requests of an
unthrottled user reach an otherwise idle engine), ``busy`` (the same kind of
work served back to back, unthrottled) and ``waiting`` (a low-limit user's
streams, nobody else: the engine waits for the user's budget most of the time,
while probes arrive and some of the user's streams are closed).

CPU: the driver reads the EngineCore process's CPU time (all its threads, from
/proc) at each phase's start and end. A model of what the engine must spend,
``cpu = a * wall + b * steps`` (``a``: CPUs an idle engine keeps busy, ``b``:
CPU seconds per engine step), is solved from the idle and busy phases; what
the waiting phase spent beyond it, per second of the phase, is the cost of
waiting. A loop that polls instead of blocking on its input queue spends most
of a core there; a blocked one nothing. Steps are the engine steps that
sampled a token (``steps.step_periods``).

Wake-up: the probes' time to first token in the waiting phase against the same
probes in the idle phase (p50, engine side: first emit event - sent), and the
closed streams' abort latency (the client's close to the engine's abort
finish event, p50): an engine that sleeps instead of blocking on its input
queue adds up to its whole wait to both.

Wherever else the engine waited (:func:`budget_waits`, every phase on a limiter-on
engine with step records, the event file's version 2): the engine **waits for
budget** after a step record that scheduled nothing (``reqs == 0``) while no
request of a user with budget waited (``waiting_ready == 0``) and requests were
held back by their users' budgets (``throttled > 0``: throttled residents, or
``waiting > 0``: queued requests, none of them ready); the wait lasts from that
step's clock to the engine's next step (clipped to the phase's end). Such steps
are **empty steps**. With at least :data:`WAIT_MIN_NS` (1 s) of waiting in the
phase, two figures:

* CPU (information outside the ``waiting`` scenario, whose own phase judges it:
  the model prices the sampling steps, not the empty steps a blocked engine runs
  between users' tokens, and pricing those too would let a loop that polls
  through ``schedule()`` pay for itself; on cpu-tiny's blocked engines the
  figure read +0.1 to +0.5 CPUs in busy phases):
  ``(cpu - a * wall - b * steps) / wait``, CPUs per second of waiting beyond
  what an idle engine (``a``) and the phase's sampling steps (``b``) cost. A blocked
  engine costs ``a * wall + b * steps``; a loop that polls while it waits adds ``p``
  CPUs for each second of waiting, ``cpu = a * wall + b * steps + p * wait``, so
  ``p`` is the figure, the existing ``wait-cpu`` method with only the waiting time
  in the denominator (where the phase is all waiting, the waiting scenario's
  figure). ``a`` and ``b`` come from the ``waiting`` scenario's idle and busy
  phases on the same engine; without them the figure is not measured (a fit over
  busy phases cannot tell a step's cost, which grows with its batch, from the
  idle loop's). An error of ``e`` CPU-seconds in the model's cost of the phase's
  steps moves the figure by ``e / wait``.
* Re-wakes: empty steps that follow two empty steps (the engine woke and found
  nothing to do yet again), per second of waiting. A blocked engine wakes at
  ``min(50 ms, earliest ready - now)`` (the patch) or for a new request or an
  abort: at most 20 timeouts a second, and a wake at a ready time schedules the
  ready request (that step is not empty). A loop that schedules every millisecond
  while it waits makes about 1,000. The empty steps right after a step that ran
  are not re-wakes: one with synchronous scheduling (a token's user just ran out
  of budget), two with asynchronous scheduling (the batch queue holds the empty
  batch scheduled ahead, which the loop finishes before it blocks); with many
  users their ready times come often, each wake then runs a step, and counting
  those would blame the users' rates on the loop (cpu-tiny's async seed phase:
  94 empty steps a second right after another, every one of them the second of
  such a pair). CPU-independent: it needs no
  measurement of the EngineCore process, so it holds on attached engines too; a
  loop that spins inside its wait without scheduling shows only in CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ratebench.analysis.segments import time_order
from ratebench.roles import PHASE_IDLE, PHASE_IDLE_BEFORE, PHASE_STEPS, PHASE_WAITING

# A phase whose engine waited for budget less than this in all is not judged on its waiting.
WAIT_MIN_NS = 1_000_000_000
# manifest.json engines.<name>.loop: "polls" marks an engine whose loop steps at a fixed cadence by
# construction (the test harness, tests/mutants/runfolder.py); its waiting is information only.
LOOP_POLLS = "polls"


@dataclass
class PhaseCost:
    """One phase: its wall time, its engine steps, what the EngineCore spent."""

    phase: str
    wall_s: float
    steps: int
    cpu_s: float | None


@dataclass
class WaitingSummary:
    scenario: str
    engine: str
    idle: PhaseCost
    busy: PhaseCost
    waiting: PhaseCost
    idle_cpus: float | None  # a: CPUs the idle engine keeps busy
    step_cpu_ms: float | None  # b: CPU per engine step
    waiting_excess_cpus: float | None  # what waiting cost beyond a * wall + b * steps, per second
    probe_user: str | None = None
    probe_ttft_idle_p50_ms: float | None = None
    probe_ttft_waiting_p50_ms: float | None = None
    probes: int = 0
    abort_latency_ms: list[float] = field(default_factory=list)  # closed streams of the waiting phase

    @property
    def abort_p50_ms(self) -> float | None:
        return float(np.median(self.abort_latency_ms)) if self.abort_latency_ms else None

    @property
    def wake_added_ms(self) -> float | None:
        if self.probe_ttft_idle_p50_ms is None or self.probe_ttft_waiting_p50_ms is None:
            return None
        return self.probe_ttft_waiting_p50_ms - self.probe_ttft_idle_p50_ms


def _cost(p, steps: dict[int, int]) -> PhaseCost:
    return PhaseCost(p.phase, (p.end_ns - p.start_ns) / 1e9, steps.get(p.index, 0), p.engine_core_cpu_s)


def cpu_model(idle: PhaseCost, busy: PhaseCost) -> tuple[float, float] | None:
    """(a CPUs, b CPU seconds per step) with cpu = a * wall + b * steps through both phases; None when
    they cannot tell a from b (no CPU figures, or the same steps per second)."""
    if idle.cpu_s is None or busy.cpu_s is None:
        return None
    det = idle.wall_s * busy.steps - busy.wall_s * idle.steps
    if abs(det) < 1e-9:
        return None
    a = (idle.cpu_s * busy.steps - busy.cpu_s * idle.steps) / det
    b = (idle.wall_s * busy.cpu_s - busy.wall_s * idle.cpu_s) / det
    return max(a, 0.0), max(b, 0.0)


def waiting_summaries(run, rows: dict, request_checks: dict, steps_per_phase: dict[int, int]) -> list[WaitingSummary]:
    """One summary per (waiting scenario, engine) that ran all three phases."""
    out = []
    for w in (p for p in run.phases if p.kind == "waiting" and p.role == PHASE_WAITING):
        same = [p for p in run.phases if p.scenario == w.scenario and p.engine == w.engine]
        idle = next((p for p in same if p.role in (PHASE_IDLE, PHASE_IDLE_BEFORE)), None)
        busy = next((p for p in same if p.role == PHASE_STEPS), None)
        if idle is None or busy is None:
            continue
        costs = [_cost(p, steps_per_phase) for p in (idle, busy, w)]
        model = cpu_model(costs[0], costs[1])
        excess = None
        if model is not None and costs[2].cpu_s is not None and costs[2].wall_s > 0:
            a, b = model
            excess = (costs[2].cpu_s - b * costs[2].steps) / costs[2].wall_s - a
        s = WaitingSummary(w.scenario, w.engine, *costs, idle_cpus=None if model is None else model[0],
                           step_cpu_ms=None if model is None else model[1] * 1e3, waiting_excess_cpus=excess)
        probe_user = next((u for u in idle.users), None)
        s.probe_user = probe_user
        ri, rw = rows.get((idle.index, probe_user)), rows.get((w.index, probe_user))
        if ri is not None and rw is not None:
            ti = ri.ttft_engine or ri.ttft_client
            tw = rw.ttft_engine if ri.ttft_engine is not None else rw.ttft_client
            if ti is not None and tw is not None:
                s.probe_ttft_idle_p50_ms, s.probe_ttft_waiting_p50_ms = ti.p50_ns / 1e6, tw.p50_ns / 1e6
                s.probes = tw.count
        for user in w.users:
            for c in request_checks.get((w.index, user), []):
                if c.cancelled and c.abort_latency_ns is not None:
                    s.abort_latency_ms.append(c.abort_latency_ns / 1e6)
        out.append(s)
    return out


@dataclass
class BudgetWait:
    """One phase on a limiter-on engine with step records: how long it waited for budget, and at what cost."""

    scenario: str
    phase: str
    engine: str
    phase_index: int
    wall_s: float
    steps: int  # step records in the phase
    empty_steps: int  # of them, steps that scheduled nothing while every request waited for budget
    rewakes: int  # of those, empty steps right after another empty step
    wait_ns: int  # time from each empty step to the engine's next step, in all
    longest_wait_ns: int
    sampling_steps: int  # steps that sampled a token (the CPU model's steps)
    cpu_s: float | None  # the EngineCore's CPU time over the phase
    model: tuple[float, float] | None = None  # (a CPUs, b CPU-s per step), from model_from
    model_from: str | None = None  # "<scenario>'s idle and busy phases"
    loop_polls: bool = False  # the engine's loop steps at a fixed cadence by construction (test harness)
    waiting_scenario: bool = False  # the waiting scenario's own waiting phase (judged by its wait-cpu)

    @property
    def wait_s(self) -> float:
        return self.wait_ns / 1e9

    @property
    def rewakes_per_s(self) -> float:
        return self.rewakes / self.wait_s if self.wait_ns > 0 else 0.0

    @property
    def excess_cpus(self) -> float | None:
        """CPUs per second of waiting beyond a * wall + b * sampling steps (None: not measured)."""
        if self.model is None or self.cpu_s is None or self.wait_ns <= 0:
            return None
        a, b = self.model
        return (self.cpu_s - a * self.wall_s - b * self.sampling_steps) / self.wait_s


def waiting_steps(steps: np.ndarray) -> np.ndarray:
    """Per step record: it scheduled nothing while every request waited for its user's budget."""
    reqs, ready = steps["reqs"].astype(np.int64), steps["waiting_ready"].astype(np.int64)
    held = (steps["throttled"].astype(np.int64) > 0) | (steps["waiting"].astype(np.int64) > 0)
    return (reqs == 0) & (ready == 0) & held


def wait_figures(steps: np.ndarray, end_ns: int, next_t_ns: int | None = None) -> dict:
    """empty_steps, rewakes, wait_ns and longest_wait_ns of the time-sorted step records of one phase
    (which ends at ``end_ns``); ``next_t_ns``: the clock of the engine's step after them, if any."""
    empty = waiting_steps(steps)
    if not empty.any():
        return dict(empty_steps=0, rewakes=0, wait_ns=0, longest_wait_ns=0)
    t = steps["t_ns"].astype(np.int64)
    after = np.empty_like(t)
    after[:-1] = t[1:]
    after[-1] = end_ns if next_t_ns is None else next_t_ns
    waits = np.clip(np.minimum(after, end_ns) - t, 0, None)[empty]
    rewakes = int((empty[2:] & empty[1:-1] & empty[:-2]).sum())
    return dict(empty_steps=int(empty.sum()), rewakes=rewakes, wait_ns=int(waits.sum()),
                longest_wait_ns=int(waits.max()))


def budget_waits(run, steps_per_phase: dict[int, int], summaries: list[WaitingSummary]) -> list[BudgetWait]:
    """Per phase on each limiter-on engine with step records: its waiting for budget (see the module)."""
    models: dict[str, tuple[tuple[float, float], str]] = {}
    for w in summaries:
        if w.idle_cpus is not None and w.step_cpu_ms is not None and w.engine not in models:
            models[w.engine] = ((w.idle_cpus, w.step_cpu_ms / 1e3), f"{w.scenario}'s idle and busy phases")
    judged = {(w.scenario, w.waiting.phase, w.engine) for w in summaries}
    engines_doc = (run.manifest or {}).get("engines") or {}
    sorted_steps: dict[str, np.ndarray] = {}
    out = []
    for p in run.phases:
        trace, eng = run.traces.get(p.engine), run.engines.get(p.engine)
        if trace is None or eng is None or not eng.feature or not len(trace.events.steps):
            continue
        if p.engine not in sorted_steps:
            st = trace.events.steps
            order = time_order(st["t_ns"])
            sorted_steps[p.engine] = st if order is None else st[order]
        st = sorted_steps[p.engine]
        t = st["t_ns"]
        lo, hi = np.searchsorted(t, p.start_ns, "left"), np.searchsorted(t, p.end_ns, "right")
        next_t = int(t[hi]) if hi < len(t) else None
        model = models.get(p.engine)
        bw = BudgetWait(p.scenario, p.phase, p.engine, p.index, (p.end_ns - p.start_ns) / 1e9, int(hi - lo),
                        sampling_steps=steps_per_phase.get(p.index, 0), cpu_s=p.engine_core_cpu_s,
                        model=None if model is None else model[0], model_from=None if model is None else model[1],
                        loop_polls=(engines_doc.get(p.engine) or {}).get("loop") == LOOP_POLLS,
                        waiting_scenario=p.key in judged,
                        **wait_figures(st[lo:hi], p.end_ns, next_t))
        out.append(bw)
    return out
