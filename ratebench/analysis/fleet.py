"""A fleet's phases judged as one: the per-user bound across every engine behind the balancer.

Each engine's limiter knows only its own requests. A fleet's phase is recorded once per member
engine (``params["fleet"]`` ties the records together, ``docs/run-folder.md``), so every check
made on one engine's file judges that engine alone. Here the members' event files (one host
clock) are merged per user: the charges (dispatch events), the emitted tokens and the chunks the
client received, each against the bound ``(W + 0.1) * N + 1``. A user whose requests a
round-robin balancer spread over K engines can receive up to K x N tokens a second while every
engine keeps its own bound; consistent hashing on the user keeps it on one engine.

The emit and client windows are widened by the most that any member's own checks allow (the
longest engine step; for the client, that plus the measured spread of delivery latency,
``witness.py``), so a merged window is held to no stricter a standard than each engine's.

Failover (a phase in which one member is stopped): a user the balancer moves from the stopped
engine to another starts there with a fresh budget, its burst unspent. Over a window that spans
the move it may receive what the old engine allowed over the part before, ``(W1 + 0.1) * N + 1``,
plus what the new one allows over the part after, ``(W2 + 0.1) * N + 1``, with ``W1 + W2 <= W``:
at most ``(W + 0.2) * N + 2``, one burst and one token more than the bound. Each move is allowed
exactly that (the windows widened by ``0.1 s + 1/N``); a user that was not moved gets nothing more.
The requests the stop cut short are judged here (:func:`failover_outcomes`): each completes, or
fails with something the client sees (an error, or ``finish_reason`` abort); none may end looking
complete without being so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ratebench.analysis.bound import NS_PER_S, BoundResult, check_bound
from ratebench.analysis.load import RunData
from ratebench.analysis.runsummary import RunSummary
from ratebench.events import KIND_DISPATCH, KIND_EMIT
from ratebench.runrecords import PhaseRecord
from ratebench.phasefacts import Failover


@dataclass
class FleetUser:
    """One user of one fleet phase: where its tokens came from and the bound across the fleet."""

    user: str
    limit_tps: int
    requests: int
    tokens_by_engine: dict[str, int]  # dispatch events (charges) per member that served the user
    moved: bool = False  # failover: served by the stopped engine and by another one
    allowance_ns: int = 0  # failover: the windows widened by one burst and one token for the move
    dispatch: BoundResult | None = None
    emit: BoundResult | None = None
    client: BoundResult | None = None

    @property
    def engines_used(self) -> int:
        return sum(1 for v in self.tokens_by_engine.values() if v > 0)


@dataclass
class FleetPhase:
    """A fleet's phase: its policy, members, and what became of the requests sent through it."""

    scenario: str
    phase: str
    fleet: str
    policy: str
    members: list[str]
    requests: int  # sent through the balancer
    unserved: list[str] = field(default_factory=list)  # "client id: why" of requests no member served
    unserved_users: list[str | None] = field(default_factory=list)  # the user of each of them
    users: list[FleetUser] = field(default_factory=list)
    failover: Failover | None = None  # the member stopped, when, and the users it had served before
    outcomes: "FailoverOutcomes | None" = None
    # the members' per-user counters on /metrics over the phase (--output-rate-metrics-users):
    # member -> user -> {"granted", "refused"}; None when a member did not export them
    counters: dict[str, dict[str, dict[str, float]] | None] | None = None
    counters_asked: bool = False  # the members ran with --output-rate-metrics-users N > 0


@dataclass
class FailoverOutcomes:
    """What became of a failover phase's requests, as the client saw them."""

    completed: int = 0  # every token asked for, finish_reason length or stop, no error
    failed_visibly: dict[str, list[str]] = field(default_factory=dict)  # how -> client ids
    lost_silently: list[str] = field(default_factory=list)  # "client id: what": looked complete, was not
    moved: dict[str, str] = field(default_factory=dict)  # user of the stopped engine -> engine after the stop
    not_moved: list[str] = field(default_factory=list)  # users of the stopped engine served by no other after
    silent: list[str] = field(default_factory=list)  # users of the stopped engine that sent nothing after the stop


def cut_by_failover(run: RunData) -> set[str]:
    """Client ids of the requests a failover's stop cut short on the stopped engine (ended at or after
    the stop, with an error or finish_reason abort): not reconciled as finished answers."""
    out: set[str] = set()
    for p in run.phases:
        fo = p.facts.fleet.failover if p.facts.fleet is not None else None
        if fo is None or fo.engine != p.engine:
            continue
        stopped = fo.stopped_ns
        for r in run.records:
            if (r.scenario, r.phase, r.engine) == p.key and (r.done_ns or 0) >= stopped and (
                    r.error is not None or r.finish_reason in ("abort", "error")):
                out.add(r.client_id)
    return out


def failover_outcomes(records: list, members: list[str], failover: Failover) -> FailoverOutcomes:
    out = FailoverOutcomes()
    stopped, victim = failover.stopped_ns, failover.engine
    for r in records:
        if r.error is None and r.finish_reason in ("length", "stop") and r.completion_tokens is not None and (
                r.completion_tokens == r.max_tokens or (r.finish_reason == "stop" and not r.ignore_eos)):
            out.completed += 1
        elif r.error is not None:
            how = ("refused by the balancer (HTTP " + str(r.http_status) + ")" if r.engine not in members and
                   r.http_status else "cut by the stop (" + r.error.split(":")[0] + ")" if r.engine == victim
                   else r.error.split(":")[0])
            out.failed_visibly.setdefault(how, []).append(r.client_id)
        elif r.finish_reason in ("abort", "error"):
            out.failed_visibly.setdefault(f"finish_reason {r.finish_reason} (the engine stopped mid-answer)",
                                          []).append(r.client_id)
        else:
            out.lost_silently.append(f"{r.client_id} ({r.user}, {r.engine}): finish_reason {r.finish_reason!r}, "
                                     f"{r.completion_tokens} of {r.max_tokens} tokens, no error")
    for user in failover.users_before:
        after = sorted({r.engine for r in records if r.user == user and r.engine in members and r.engine != victim
                        and (r.sent_ns or 0) >= stopped})
        if after:
            out.moved[user] = ", ".join(after)
        elif any(r.user == user and (r.sent_ns or 0) >= stopped for r in records):
            out.not_moved.append(user)
        else:
            out.silent.append(user)
    return out


def fleet_groups(run: RunData) -> dict[tuple[str, str, str], list[PhaseRecord]]:
    """(scenario, phase, fleet) -> the member records of each fleet phase (``params["fleet"]`` ties them)."""
    groups: dict[tuple[str, str, str], list[PhaseRecord]] = {}
    for p in run.phases:
        if p.facts.fleet is not None:
            groups.setdefault((p.scenario, p.phase, p.facts.fleet.name), []).append(p)
    return groups


def fleet_phases(run: RunData, s: RunSummary, burst_ns: int) -> list[FleetPhase]:
    """Every fleet phase of the run, its users' bounds across its member engines."""
    out = []
    for (scenario, phase, fleet), records in fleet_groups(run).items():
        indices = [p.index for p in records]
        first = run.phases[indices[0]].facts
        info = first.fleet
        members = info.members or [run.phases[i].engine for i in indices]
        mine = [r for r in run.records if r.fleet == fleet and r.scenario == scenario and r.phase == phase]
        fp = FleetPhase(scenario, phase, fleet, info.policy, members, len(mine), failover=info.failover)
        if fp.failover is not None:
            fp.outcomes = failover_outcomes(mine, members, fp.failover)
        if first.fleet_user_counters is not None:
            fp.counters = first.fleet_user_counters
        # (a limiter-off fleet, a baseline, counts nothing whatever its flags say)
        fp.counters_asked = any(_asks_for_counters((run.manifest.get("engines") or {}).get(m) or {})
                                and getattr(run.engines.get(m), "feature", False) for m in members)
        for r in mine:
            if r.engine not in members:
                why = r.error or (f"HTTP {r.http_status}" if r.http_status else "no answer")
                fp.unserved.append(f"{r.client_id} ({r.user}): {why}; no engine named in the balancer's answer")
                fp.unserved_users.append(r.user)
        users = sorted({u for i in indices for u in run.phases[i].users} | {r.user for r in mine if r.user})
        for user in users:
            fu = _fleet_user(run, s, indices, user, [r for r in mine if r.user == user], burst_ns,
                             fp.failover.engine if fp.failover else None)
            if fu is not None:
                fp.users.append(fu)
        out.append(fp)
    return out


def _asks_for_counters(entry: dict) -> bool:
    flags = [str(f) for f in entry.get("flags") or []]
    for i, flag in enumerate(flags):
        value = flag.split("=", 1)[1] if flag.startswith("--output-rate-metrics-users=") else (
            flags[i + 1] if flag == "--output-rate-metrics-users" and i + 1 < len(flags) else None)
        if value is not None:
            return value.strip() not in ("", "0")
    return False


def _fleet_user(run: RunData, s: RunSummary, indices: list[int], user: str, records: list, burst_ns: int,
                stopped: str | None) -> FleetUser | None:
    limit = None
    d_t: list[np.ndarray] = []
    e_t: list[np.ndarray] = []
    e_c: list[np.ndarray] = []
    by_engine: dict[str, int] = {}
    emit_tol = client_tol = 0
    for i in indices:
        p = run.phases[i]
        eng = run.engines.get(p.engine)
        trace = run.traces.get(p.engine)
        if eng is None or trace is None:
            continue
        limit = limit or eng.limit_of(user)
        row = s.rows.get((i, user))
        if row is not None:
            if row.bound_emit is not None:
                emit_tol = max(emit_tol, row.bound_emit.tolerance_ns)
            if row.bound_client is not None:
                client_tol = max(client_tol, row.bound_client.tolerance_ns)
        code = trace.events.string_index(user)
        if code is None:
            by_engine[p.engine] = 0
            continue
        recs = trace.records
        in_phase = (trace.req_phase[recs["req"]] == i) & (recs["user"] == code)
        d = recs[in_phase & (recs["kind"] == KIND_DISPATCH)]
        e = recs[in_phase & (recs["kind"] == KIND_EMIT)]
        by_engine[p.engine] = int(len(d))
        d_t.append(d["t_ns"])
        e_t.append(e["t_ns"])
        e_c.append(e["count"].astype(np.int64))
    if not limit:
        return None
    fu = FleetUser(user, int(limit), len(records), by_engine)
    if stopped is not None and by_engine.get(stopped, 0) > 0 and any(
            n > 0 for e, n in by_engine.items() if e != stopped):
        fu.moved = True
        fu.allowance_ns = burst_ns + -(-NS_PER_S // fu.limit_tps)  # one burst and one token (module docstring)
    if d_t:
        t = np.concatenate(d_t)
        fu.dispatch = check_bound(t, fu.limit_tps, burst_ns=burst_ns, tolerance_ns=fu.allowance_ns)
        t, c = np.concatenate(e_t), np.concatenate(e_c)
        keep = c > 0
        fu.emit = check_bound(t[keep], fu.limit_tps, counts=c[keep], burst_ns=burst_ns,
                              tolerance_ns=emit_tol + fu.allowance_ns)
    chunks_t = [np.asarray(r.chunk_ns, dtype=np.int64) for r in records if r.chunk_ns]
    if chunks_t:
        t = np.concatenate(chunks_t)
        c = np.concatenate([np.asarray(r.chunk_tokens, dtype=np.int64) for r in records if r.chunk_ns])
        keep = c > 0
        fu.client = check_bound(t[keep], fu.limit_tps, counts=c[keep], burst_ns=burst_ns,
                                tolerance_ns=client_tol + fu.allowance_ns)
    return fu
