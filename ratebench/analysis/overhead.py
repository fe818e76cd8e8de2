"""Overhead: output throughput of the overhead scenario's roles, round by round and paired.

Each phase's throughput is its client tokens over its duration, from the first request
sent to the last token received (as serving benchmarks define output throughput; a
first-to-last-token span would leave out the time to first token and reward a stall
followed by a burst). The roles run interleaved, one phase each per round, so two roles'
phases of one round saw nearly the same machine: the ratio of a pair is taken round by
round, and its median over the rounds is what the checks use (a stall of a busy machine
moves one round's ratio, not the median). The pooled ratio (all tokens over all time, per
role) and the spread of the per-round ratios are reported beside it.
"""

from __future__ import annotations

import statistics

import numpy as np

from ratebench.analysis.load import RunData
from ratebench.analysis.verdict import OverheadSummary, PairedRatio
from ratebench.events import KIND_EMIT
from ratebench.runrecords import PhaseRecord
from ratebench.roles import OVERHEAD_NO_EVENTS, OVERHEAD_OFF, OVERHEAD_ON, OVERHEAD_STOCK

# an overhead round's phase role (ratebench/roles.py)
ROLE_ON, ROLE_NO_EVENTS, ROLE_OFF, ROLE_STOCK = OVERHEAD_ON, OVERHEAD_NO_EVENTS, OVERHEAD_OFF, OVERHEAD_STOCK
OVERHEAD_ROLES = (ROLE_ON, ROLE_NO_EVENTS, ROLE_OFF, ROLE_STOCK)
# (a, b): throughput(a) / throughput(b)
PAIRS = ((ROLE_ON, ROLE_OFF), (ROLE_ON, ROLE_STOCK), (ROLE_OFF, ROLE_STOCK), (ROLE_ON, ROLE_NO_EVENTS))
EVENTS_PAIR = f"{ROLE_ON}/{ROLE_NO_EVENTS}"  # what recording engine events costs
# Other processes keeping this many CPUs busy during a phase make its round's ratios say less: warned.
BUSY_MACHINE_CPUS = 0.25

Sample = tuple[int, int]  # (tokens, duration ns) of one phase


def paired_ratio(a: dict[str, Sample], b: dict[str, Sample]) -> PairedRatio | None:
    """Throughput of ``a`` over that of ``b``, round by round (rounds both ran), and pooled.

    ``a`` and ``b`` map a round label to that round's (tokens, duration ns). None when the two
    share no round with a positive throughput.
    """
    per_round = {}
    for rnd, (tokens_a, span_a) in a.items():
        if rnd in b and span_a > 0 and b[rnd][1] > 0 and b[rnd][0] > 0:
            tokens_b, span_b = b[rnd]
            per_round[rnd] = (tokens_a / span_a) / (tokens_b / span_b)
    if not per_round:
        return None
    ratios = list(per_round.values())
    pooled = _pooled_tps(a.values()) / _pooled_tps(b.values())
    return PairedRatio(median=statistics.median(ratios), min=min(ratios), max=max(ratios), rounds=len(ratios),
                       pooled=pooled, per_round=per_round)


def _pooled_tps(samples) -> float:
    samples = list(samples)
    span = sum(s for _, s in samples)
    return sum(t for t, _ in samples) * 1e9 / span if span > 0 else 0.0


def overhead_summaries(run: RunData, phase_of: dict) -> list[OverheadSummary]:
    """One summary per scenario that has overhead roles."""
    out = []
    for scen in sorted({p.scenario for p in run.phases if p.role in OVERHEAD_ROLES}):
        phases = [p for p in run.phases if p.scenario == scen and p.role in OVERHEAD_ROLES]
        samples: dict[str, dict[str, Sample]] = {}  # role -> round -> (tokens, ns)
        steps: dict[str, list[float]] = {}  # role -> each phase's p50 engine step
        other_cpu: dict[str, dict[str, float]] = {}
        for p, rnd in zip(phases, _round_labels(phases)):
            if p.machine_cpu is not None and "other" in p.machine_cpu:
                other_cpu.setdefault(rnd, {})[p.role] = float(p.machine_cpu["other"])
            sample = _phase_sample(run, p, phase_of)
            if sample is not None:
                samples.setdefault(p.role, {})[rnd] = sample
            step = _phase_step_p50_ns(run, p)
            if step is not None:
                steps.setdefault(p.role, []).append(step)
        roles = [r for r in OVERHEAD_ROLES if r in samples and _pooled_tps(samples[r].values()) > 0]
        tput = {r: _pooled_tps(samples[r].values()) for r in roles}
        summary = OverheadSummary(scen, tput, {r: sum(t for t, _ in samples[r].values()) for r in roles}, {})
        for a, b in PAIRS:
            if a in tput and b in tput:
                pair = f"{a}/{b}"
                summary.ratios[pair] = tput[a] / tput[b]
                paired = paired_ratio(samples[a], samples[b])
                if paired is not None:
                    summary.paired[pair] = paired
        for role in roles:
            for rnd, (tokens, span) in samples[role].items():
                if span > 0:
                    summary.round_throughput_tps.setdefault(rnd, {})[role] = tokens * 1e9 / span
        summary.step_p50_ns = {r: statistics.median(v) for r, v in steps.items()}
        summary.round_other_cpu = other_cpu
        out.append(summary)
    return out


def busy_machine_warnings(summaries: list[OverheadSummary]) -> list[str]:
    """One warning per scenario whose phases shared the machine with busy processes outside the run."""
    out = []
    for o in summaries:
        busy = [(rnd, role, cpus) for rnd, roles in o.round_other_cpu.items() for role, cpus in roles.items()
                if cpus >= BUSY_MACHINE_CPUS]
        if busy:
            listed = ", ".join(f"{role} {rnd} {cpus:.2f}" for rnd, role, cpus in busy)
            rounds = sorted({rnd for rnd, _, _ in busy})
            out.append(f"{o.scenario}: processes outside the run kept {BUSY_MACHINE_CPUS:g} CPUs or more busy during "
                       f"{len(busy)} of {sum(len(r) for r in o.round_other_cpu.values())} phases ({listed}); the "
                       f"throughput ratios of round(s) {', '.join(rounds)} compare phases that may not have seen "
                       f"the same machine")
    return out


def _round_labels(phases: list[PhaseRecord]) -> list[str]:
    """Each phase's round: ``<scheduling>-<round>`` from its params, else its place among its
    role's phases (runs written before rounds were recorded)."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for p in phases:
        mode = p.facts.scheduling or ""
        seen[(p.role, mode)] = seen.get((p.role, mode), 0) + 1
        rnd = p.facts.round or seen[(p.role, mode)]
        out.append(f"{mode}-{rnd}" if mode else str(rnd))
    return out


def _phase_sample(run: RunData, p: PhaseRecord, phase_of: dict) -> Sample | None:
    recs = [r for r in run.records if phase_of.get((r.scenario, r.phase, r.engine)) == p.index and r.chunk_ns]
    if not recs:
        return None
    first_ns = min(r.sent_ns if r.sent_ns is not None else r.chunk_ns[0] for r in recs)
    return sum(r.streamed_tokens for r in recs), max(r.chunk_ns[-1] for r in recs) - first_ns


def _phase_step_p50_ns(run: RunData, p: PhaseRecord) -> float | None:
    """The median time from one engine step's emit to the next while the phase ran (the engine
    stamps every emit of a step with one time); None without engine events."""
    trace = run.traces.get(p.engine)
    if trace is None:
        return None
    recs = trace.records
    mine = (recs["kind"] == KIND_EMIT) & (trace.req_phase[recs["req"]] == p.index)
    t = np.unique(recs["t_ns"][mine])
    return float(np.median(np.diff(t))) if len(t) > 1 else None
