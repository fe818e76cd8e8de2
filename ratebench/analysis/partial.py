"""Partial runs: which scenario phases of an unfinished run completed, and why the others did not.

``verify-bound --partial`` checks the completed phases of a run whose manifest state is not
``complete`` (interrupted, a phase that failed, a driver killed outright) and names the others.
A phase counts as completed when the files show all of this (docs/run-folder.md, "Partial runs"):

1. scenarios.json gives it an end time after its start (the runner writes a phase's entry when
   it ends, also when it is cut short, so this alone proves little);
2. requests.jsonl holds its client records, and none was cut short: each has an end time
   (``done_ns``) and none carries the error ``interrupted`` (the driver marks every stream still
   open when the run is interrupted);
3. where the engine records events, every request of the phase that reached it (sent, HTTP 200,
   no client error) has its finish event in the engine's file (an engine stopped hard loses its
   last unflushed events, and a truncated last block is dropped).

Every engine event stays in its engine's whole-file bound, whatever phase it belongs to.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ratebench.analysis.load import EngineTrace, RunData
from ratebench.analysis.verdict import MissingPhase
from ratebench.events import KIND_FINISH
from ratebench.runrecords import ERROR_INTERRUPTED, ClientRecord, PhaseRecord


def keep_completed_phases(run: RunData) -> tuple[RunData, list[MissingPhase]]:
    """The run restricted to its completed phases and their client records, and the phases left out.

    The phases left out, in run order: those scenarios.json lists that did not complete; those
    with client records but no entry in scenarios.json; then those the manifest's
    ``planned_phases`` names that never started (with no plan, the profile's scenarios that never
    started, without phase names)."""
    records_of: dict[tuple[str, str, str], list[int]] = {}
    for i, r in enumerate(run.records):
        records_of.setdefault((r.scenario, r.phase, r.engine), []).append(i)
    finished = _records_with_finish_event(run) | _cut_by_failover_indices(run)
    missing: list[MissingPhase] = []
    kept: list[PhaseRecord] = []
    # a fleet's phase (one record per member, tied by params.fleet) is kept or left out as a whole: its
    # fleet checks merge the members; a member that served nobody is complete
    fleets: dict[tuple[str, str, str], list[PhaseRecord]] = {}
    for p in run.phases:
        name = _fleet_of(p)
        if name is not None:
            fleets.setdefault((p.scenario, p.phase, name), []).append(p)
    fleet_why: dict[tuple[str, str, str], str | None] = {}
    for key, members in fleets.items():
        anyone = any(records_of.get(m.key) for m in members) or bool(records_of.get(key))
        whys = [_why_incomplete(run, m, records_of.get(m.key, []), finished)
                for m in members if records_of.get(m.key) or not anyone]
        why = next((w for w in whys if w is not None), None)
        fleet_why[key] = None if why is None else f"a member of fleet {key[2]}: {why}"
    for p in run.phases:
        name = _fleet_of(p)
        why = fleet_why[(p.scenario, p.phase, name)] if name is not None else \
            _why_incomplete(run, p, records_of.get(p.key, []), finished)
        if why is None:
            kept.append(p)
        else:
            missing.append(MissingPhase(p.scenario, p.phase, p.engine, why))
    listed = {p.key for p in run.phases} | set(fleets)  # records the balancer refused carry the fleet's name
    for key, idx in records_of.items():
        if key not in listed:
            missing.append(MissingPhase(*key, f"{len(idx)} client records but no entry in scenarios.json "
                                                 "(the run stopped before the phase was recorded)"))
    missing.extend(_never_started(run.manifest, listed | set(records_of)))
    return _restrict(run, kept), missing


def _fleet_of(p: PhaseRecord) -> str | None:
    return p.facts.fleet.name if p.facts.fleet is not None else None


def _cut_by_failover_indices(run: RunData) -> set[int]:
    """Client records a fleet's failover cut on the stopped engine: complete as they are (their engine was
    stopped; fleet-failover-lost judges them)."""
    from ratebench.analysis.fleet import cut_by_failover

    cut = cut_by_failover(run)
    # an answer of a request of n > 1 answers is cut with its request (``ClientRecord.answers``)
    return {i for i, r in enumerate(run.records) if r.client_id.partition("/")[0] in cut} if cut else set()


def _records_with_finish_event(run: RunData) -> set[int]:
    """Client record indices whose engine request has a finish event."""
    out: set[int] = set()
    for trace in run.traces.values():
        codes = np.unique(trace.records["req"][trace.records["kind"] == KIND_FINISH])
        rec = trace.req_record[codes]
        out.update(rec[rec >= 0].tolist())
    return out


def _reached_engine(r: ClientRecord) -> bool:
    return r.sent_ns is not None and r.http_status == 200 and r.error is None


def _why_incomplete(run: RunData, p: PhaseRecord, idx: list[int], finished: set[int]) -> str | None:
    if p.end_ns <= p.start_ns:
        return "no end time in scenarios.json"
    if not idx:
        return "no client records in requests.jsonl"
    records = [run.records[i] for i in idx]
    cut = sum(r.error == ERROR_INTERRUPTED or r.done_ns is None for r in records)
    if cut:
        return f"{cut} of {len(records)} streams cut short by the interruption (requests.jsonl)"
    if p.engine in run.traces:
        reached = [i for i in idx if _reached_engine(run.records[i])]
        lost = sum(i not in finished for i in reached)
        if lost:
            events = run.engines[p.engine].events_file
            return (f"{lost} of {len(reached)} requests have no finish event in {events.name if events else 'the'} "
                    f"event file of {p.engine} (its last events were never written or were truncated)")
    return None


def _never_started(manifest: dict, seen: set[tuple[str, str, str]]) -> list[MissingPhase]:
    planned = manifest.get("planned_phases")
    if isinstance(planned, list):
        out = []
        for entry in planned:
            if not isinstance(entry, dict):
                continue
            key = (str(entry.get("scenario")), str(entry.get("phase")), str(entry.get("engine")))
            if key not in seen:
                out.append(MissingPhase(*key, "never started"))
        return out
    # runs written before the runner recorded its plan: whole scenarios only
    started = {s for s, _, _ in seen}
    skipped = {s.get("scenario") for s in manifest.get("skipped_scenarios") or [] if isinstance(s, dict)}
    profile = manifest.get("profile")
    scenarios = (profile.get("scenarios") if isinstance(profile, dict) else None) or []
    return [MissingPhase(str(s["name"]), "*", "*", "never started (phase names unknown: manifest.json has no "
                                                    "planned_phases)")
            for s in scenarios if isinstance(s, dict) and s.get("name") not in started | skipped]


def _restrict(run: RunData, kept: list[PhaseRecord]) -> RunData:
    """``run`` with only ``kept`` phases (renumbered) and their client records; engine events whose
    request belongs to no kept phase keep no client record (they still count in the whole-file bound)."""
    phases = [dataclasses.replace(p, index=i) for i, p in enumerate(kept)]
    new_phase = np.full(len(run.phases) + 1, -1, dtype=np.int64)  # old index -> new; slot -1 stays -1
    for p_new, p_old in zip(phases, kept):
        new_phase[p_old.index] = p_new.index
    keys = {p.key for p in kept}
    keys |= {(p.scenario, p.phase, name) for p in kept if (name := _fleet_of(p)) is not None}  # balancer-refused
    new_record = np.full(len(run.records) + 1, -1, dtype=np.int64)
    records = []
    for i, r in enumerate(run.records):
        if (r.scenario, r.phase, r.engine) in keys:
            new_record[i] = len(records)
            records.append(r)
    traces = {
        name: EngineTrace(t.engine, t.events, t.records, new_record[t.req_record], new_phase[t.req_phase])
        for name, t in run.traces.items()
    }
    return dataclasses.replace(run, phases=phases, records=records, traces=traces, warnings=list(run.warnings),
                               stage_s=dict(run.stage_s))
