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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ROLE_IDLE, ROLE_STEPS, ROLE_WAITING = "baseline", "steps", "waiting"


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
    for w in (p for p in run.phases if p.kind == "waiting" and p.role == ROLE_WAITING):
        same = [p for p in run.phases if p.scenario == w.scenario and p.engine == w.engine]
        idle = next((p for p in same if p.role == ROLE_IDLE), None)
        busy = next((p for p in same if p.role == ROLE_STEPS), None)
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
