"""Isolation (promise 4): every user whose limit did not bind fares beside the throttled users as it
does on the phase's baseline, the same requests without the throttled neighbours' limits binding.

Which phases: each phase with a baseline, paired as the scenarios plan them. A ``shared`` phase (the
``isolation`` and ``kv-pressure`` scenarios) against its user's solo phase (role ``baseline``, the same
engine); a ``mix`` phase (role ``measure``) against ``mix-baseline``, the same requests on the
limiter-off engine.

Which users (``unbound``): a user did not bind in a phase when the limiter-on engine recorded no
``refuse`` event for it (kind 4 of the engine event file: a charge refused because the user was out
of budget) within the phase's time window (or for one of the phase's requests) and, in a mix, its
requests on the baseline stayed within its bound at its limit (``(W + 0.1) x N + 1`` on its client
chunks from the limiter-off engine): a user whose own requests ask more than its limit allows is bound
by its limit on any correct engine (a 50 tok/s user whose answers came at 331 tok/s on the limiter-off
engine cannot get them so fast beside anyone), and is judged by the bound, spacing and turns checks.
Only the limiter-off engine's record decides this, so a limiter cannot move a user out of the
isolation checks with it. The engine can tell
only when it records refusals: an event file with no refuse event at all and no per-step records
comes from an engine patched before refusals were recorded, and then no user counts as unbound: the
checks are made, for information, and say why. The ``isolation`` and ``kv-pressure`` scenarios' user
(the baseline phase's user) and a mix tier marked ``isolated`` are judged whatever the file says:
the scenario declares their limits out of reach.

How: outside a mix per user; in a mix per tier, pooled over the tier's unbound users (a user's own
requests in a mix are a handful). Same side on both phases: the client's chunks when the client
recorded them, the engine's emit events otherwise.

* time to first token: first token-carrying chunk (engine: first emit event) - sent, per request;
* inter-token gap: between consecutive chunks (emit events) of one request, pooled;
* end-to-end: last chunk (emit event) - sent, per request that finished (stop or length; not
  cancelled, no error);
* rate: the unit's tokens over the time from its first request sent to its last token. For a closed
  loop (the isolation scenario's streams, a closed-loop tier) the service sets it; for a mix tier with
  open-loop arrivals the arrivals do, and it falls only when the tier's last answers come late (judged
  all the same: the same requests on both engines). The span starts at the first request sent, not at
  the first token: from the first token, an engine whose first answer came late read a higher rate
  (cpu-tiny's crowd: a steady tier served in 13 ms at p50 failed at 0.86 x a limiter-off engine that
  kept its first requests 0.5 s in the queue, the same 1,067 tokens ending at the same time).

Each latency at p50, p90 and p99 must stay within ``factor x baseline + slack`` (Thresholds); the rate
at least ``isolation_min`` x the baseline's. A quantile is judged only when both phases have
``MIN_SAMPLES[q]`` samples for it (one sample beyond the quantile: 10 for p90, 100 for p99); with
fewer it is reported for information and says so (p50 is always judged).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from ratebench.analysis.load import RunData
from ratebench.analysis.overhead import BUSY_MACHINE_CPUS
from ratebench.analysis.segments import diffs_within, group_by
from ratebench.events import KIND_EMIT
from ratebench.runrecords import PhaseRecord

try:
    from ratebench.events import KIND_REFUSE
except ImportError:  # an events.py from before refusals were recorded: the kind ratebench/events.py gives them
    KIND_REFUSE = 4

# A request is sent clear of its user's limit when no refuse event of its user falls from one token
# period (1/N) plus this before it was sent to its first token: a user refused is out of budget for at
# most one token period (its TAT was at most one token past the burst), and the step's clock reading
# can trail the refusal by a step.
CLEAR_STEP_NS = 10_000_000
# samples each phase needs before a quantile is judged: one beyond it (p50: any)
MIN_SAMPLES = {50: 1, 90: 10, 99: 100}
QUANTILES = (50, 90, 99)
ENDED = ("stop", "length")  # client finish reasons of an answer that ended by itself

# (check name stem, what, Thresholds attribute prefix)
_MEASURES = (("ttft", "time to first token", "isolation_ttft"),
             ("e2e", "end-to-end latency", "isolation_e2e"),
             ("gap", "inter-token gap", "isolation_gap"))


def check_name(stem: str, q: int) -> str:
    """``isolation-ttft`` (p50, the name it always had), ``isolation-ttft-p90``, ``isolation-gap-p99``, ..."""
    if stem == "ttft" and q == 50:
        return "isolation-ttft"
    return f"isolation-{stem}-p{q}"


@dataclass
class Binding:
    """Which users' limits bound in a limiter-on phase, from its engine's refuse events."""

    known: bool  # the engine's event file records refusals
    refused: dict[str, int] = field(default_factory=dict)  # user -> refuse events in the phase
    why: str = ""  # how it was told, or why it cannot be
    # user -> tokens past its bound in the fullest window of its chunks on the baseline phase (the same
    # requests on the limiter-off engine): its own requests ask more than its limit allows, so the limit
    # binds on them whatever the limiter-on engine recorded (mix phases)
    over_limit: dict[str, float] = field(default_factory=dict)

    def bound(self, user: str) -> bool:
        return self.refused.get(user, 0) > 0 or user in self.over_limit


def records_refusals(events) -> bool:
    """Whether an engine event file comes from an engine that records refusals: it has refuse events, or
    per-step records (the same version of the patch writes both, so a file with steps and no refusal
    says nobody was refused)."""
    if len(events.records) and bool((events.records["kind"] == KIND_REFUSE).any()):
        return True
    steps = getattr(events, "steps", None)  # version 2 of the format
    return steps is not None and len(steps) > 0


def phase_binding(run: RunData, p: PhaseRecord) -> Binding:
    """The users refused a charge in phase ``p`` (its time window, or one of its requests)."""
    eng = run.engines[p.engine]
    if not eng.feature:
        return Binding(True, {}, "the limiter is off on this engine")
    trace = run.traces.get(p.engine)
    if trace is None:
        return Binding(False, {}, f"engine {p.engine} recorded no event file, so nothing says whose limit bound")
    if not records_refusals(trace.events):
        return Binding(False, {}, f"cannot tell whose limit bound: engine {p.engine}'s event file has no refuse "
                                  "event and no step records (an engine patched before refusals were recorded)")
    recs = trace.records
    sel = recs["kind"] == KIND_REFUSE
    sel &= ((recs["t_ns"] >= p.start_ns) & (recs["t_ns"] <= p.end_ns)) | (trace.req_phase[recs["req"]] == p.index)
    users, counts = np.unique(recs["user"][sel], return_counts=True)
    refused = {trace.events.strings[int(u)]: int(n) for u, n in zip(users, counts)}
    return Binding(True, refused, "bound: refused a charge (a refuse event) in the phase; unbound: none")


@dataclass
class Latencies:
    """One unit's requests in one phase, on one side."""

    side: str  # "client" or "engine"
    requests: int
    ttft_ns: np.ndarray
    e2e_ns: np.ndarray
    gap_ns: np.ndarray
    tokens: int
    first_ns: int | None  # the unit's first request sent (the rate's span starts there)
    last_ns: int | None  # ... and its last

    def of(self, stem: str) -> np.ndarray:
        return {"ttft": self.ttft_ns, "e2e": self.e2e_ns, "gap": self.gap_ns}[stem]

    @property
    def rate_tps(self) -> float | None:
        if self.first_ns is None or self.last_ns is None or self.last_ns <= self.first_ns:
            return None
        return self.tokens / ((self.last_ns - self.first_ns) / 1e9)


class _EngineRequests:
    """Per request code of one engine trace: first and last emit, tokens, and each emit's gap."""

    def __init__(self, trace) -> None:
        recs = trace.records
        em = (recs["kind"] == KIND_EMIT) & (recs["count"] > 0)
        t, req, count = recs["t_ns"][em], recs["req"][em].astype(np.int64), recs["count"][em].astype(np.int64)
        g = group_by(req)
        n = len(trace.events.strings)
        self.first = np.full(n, -1, dtype=np.int64)
        self.last = np.full(n, -1, dtype=np.int64)
        self.tokens = np.zeros(n, dtype=np.int64)
        t_g, req_g = t[g.order], req[g.order]  # time order kept inside each request
        if len(g):
            self.first[g.keys] = t_g[g.starts]
            self.last[g.keys] = t_g[g.ends - 1]
            self.tokens[g.keys] = np.add.reduceat(count[g.order], g.starts)
        self.gaps, self.gap_req = diffs_within(t_g, req_g)
        has = trace.req_record >= 0
        self.code_of = dict(zip(trace.req_record[has].tolist(), np.flatnonzero(has).tolist()))  # record -> code
        self._gaps_sorted = bool(len(self.gap_req) < 2 or (self.gap_req[1:] >= self.gap_req[:-1]).all())

    def gaps_of(self, codes: np.ndarray) -> np.ndarray:
        """The gaps of these requests, in the order of ``gaps`` (by request code): O(their gaps and
        log all), not a pass over every gap of the engine per unit."""
        if not self._gaps_sorted:
            return self.gaps[np.isin(self.gap_req, codes)]
        u = np.unique(codes)
        lo = np.searchsorted(self.gap_req, u, side="left")
        hi = np.searchsorted(self.gap_req, u, side="right")
        n = hi - lo
        if not n.sum():
            return self.gaps[:0]
        idx = np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(int(n.sum()), dtype=np.int64)
        return self.gaps[idx]


def _client_side(records: list, sent_ok: list[int]) -> Latencies | None:
    with_chunks = [i for i in sent_ok if records[i].chunk_ns]
    if not with_chunks:
        return None
    lengths = np.fromiter((len(records[i].chunk_ns) for i in with_chunks), dtype=np.int64, count=len(with_chunks))
    t = np.fromiter(chain.from_iterable(records[i].chunk_ns for i in with_chunks), dtype=np.int64,
                    count=int(lengths.sum()))
    owner = np.repeat(np.arange(len(with_chunks)), lengths)
    sent = np.array([records[i].sent_ns for i in with_chunks], dtype=np.int64)
    ends = np.cumsum(lengths)
    first, last = t[ends - lengths], t[ends - 1]
    ended = np.array([_ended(records[i]) for i in with_chunks], dtype=bool)
    gaps, _ = diffs_within(t, owner)
    tokens = sum(sum(records[i].chunk_tokens) for i in with_chunks)
    return Latencies("client", len(sent_ok), first - sent, (last - sent)[ended], gaps, int(tokens),
                     int(sent.min()), int(last.max()))


def _engine_side(run: RunData, engine: str, cache: dict, sent_ok: list[int]) -> Latencies | None:
    trace = run.traces.get(engine)
    if trace is None:
        return None
    if engine not in cache:
        cache[engine] = _EngineRequests(trace)
    er: _EngineRequests = cache[engine]
    mine = [i for i in sent_ok if i in er.code_of and er.first[er.code_of[i]] >= 0]
    if not mine:
        return None
    c = np.array([er.code_of[i] for i in mine], dtype=np.int64)
    sent = np.array([run.records[i].sent_ns for i in mine], dtype=np.int64)
    ended = np.array([_ended(run.records[i]) for i in mine], dtype=bool)
    gaps = er.gaps_of(c)
    return Latencies("engine", len(sent_ok), er.first[c] - sent, (er.last[c] - sent)[ended], gaps,
                     int(er.tokens[c].sum()), int(sent.min()), int(er.last[c].max()))


def _other_cpus(p: PhaseRecord) -> float | None:
    return None if not p.machine_cpu or "other" not in p.machine_cpu else float(p.machine_cpu["other"])


def _busy_note(p: PhaseRecord, base: PhaseRecord) -> str:
    """Said when either phase shared the machine with other work (``BUSY_MACHINE_CPUS`` or more CPUs not
    of this run, ``scenarios.json`` machine_cpu): the figure may be the host's, not the limiter's. The
    check is judged all the same."""
    on, off = _other_cpus(p), _other_cpus(base)
    if max(on or 0.0, off or 0.0) < BUSY_MACHINE_CPUS:
        return ""
    fmt = lambda x: "not measured" if x is None else f"{x:.2f} CPUs"  # noqa: E731
    return (f"the machine was not quiet: other processes used {fmt(on)} during this phase and {fmt(off)} during "
            "its baseline; a latency failed here may be the host's, not the limiter's (rerun on a quiet machine)")


# the share of the baseline's steps (those that ran a request) with every active place taken and requests
# waiting, from which the isolation checks say that the baseline engine was full
FULL_BASELINE_SHARE = 0.5


def full_share(run: RunData, phase: PhaseRecord) -> float | None:
    """Of ``phase``'s engine steps that gave tokens to a request, the share with every active place taken
    and requests waiting in the queue (its step records; None without them). On a limiter-off baseline
    above ``FULL_BASELINE_SHARE`` every request queues: the isolation figures then compare two queues."""
    trace = run.traces.get(phase.engine)
    if trace is None or not len(trace.events.steps):
        return None
    meta = trace.events.meta
    places = meta.get("max_num_active_seqs") or meta.get("max_num_seqs")
    if not places:
        return None
    steps = trace.events.steps
    t = steps["t_ns"]
    mine = steps[(t >= phase.start_ns) & (t <= phase.end_ns) & (steps["reqs"] > 0)]
    if not len(mine):
        return None
    return float(np.mean((mine["reqs"].astype(np.int64) >= int(places)) & (mine["waiting"] > 0)))


def _full_note(run: RunData, base: PhaseRecord, cache: dict) -> str:
    """Said when the baseline engine was full most of its phase: both engines queue, and the order in
    which each serves its queue, not what the limiter costs, sets the latencies compared. The check is
    judged all the same; size the phase below the engine's capacity to judge the limiter. (Measured once
    per baseline phase: ``cache``.)"""
    key = ("full", base.index)
    if key not in cache:
        cache[key] = full_share(run, base)
    share = cache[key]
    if share is None or share < FULL_BASELINE_SHARE:
        return ""
    return (f"the baseline engine was full: every active place taken with requests waiting in {share:.0%} of its "
            "steps, so both engines queue and these figures compare the order in which each serves its queue "
            "(size the phase below the engine's capacity to judge what the limiter costs)")


def _ended(r) -> bool:
    return not r.cancelled and r.error is None and r.finish_reason in ENDED


@dataclass
class Unit:
    """What one set of checks judges: a user, or a mix tier's unbound users pooled."""

    label: str  # the checks' user field: the user, or "<tier> tier"
    users: list[str]
    judged: bool  # False: figures for information, ``why`` says why
    why: str = ""
    note: str = ""  # said in every check of the unit


def _units(run: RunData, base: PhaseRecord, p: PhaseRecord, binding: Binding, rows: set) -> list[Unit]:
    """The units judged in ``p`` against ``base``."""
    users = [u for u in base.users if (base.index, u) in rows and (p.index, u) in rows]
    if p.kind != "mix":
        # the isolation and kv-pressure scenarios' user: out of reach of its limit by design
        out = []
        for u in users:
            note = ""
            if binding.known and binding.bound(u):
                note = (f"its limit bound in the phase ({binding.refused[u]} refuse events): judged all the same, "
                        "the scenario keeps it out of its limit's reach")
            out.append(Unit(u, [u], True, note=note))
        return out
    tiers: dict[str, list[str]] = {}
    for u in users:
        tiers.setdefault(p.users[u].tier or u, []).append(u)
    out = []
    for tier, members in tiers.items():
        label = f"{tier} tier" if p.users[members[0]].tier else tier
        isolated = any(p.users[u].get("isolated") for u in members)
        if isolated:
            bound = [u for u in members if binding.known and binding.bound(u)]
            note = "a tier marked isolated: judged whatever its binding"
            if bound:
                note += f" ({len(bound)} of its users were refused charges: {_names(bound)})"
            out.append(Unit(label, members, True, note=note))
        elif not binding.known:
            out.append(Unit(label, members, False, why=binding.why))
        else:
            unbound = [u for u in members if not binding.bound(u)]
            if not unbound:
                continue  # every user's limit bound: nothing of the tier to judge
            note = (f"{len(unbound)} unbound of {len(members)} users (no refuse event in the phase, and within "
                    "its limit on the baseline)")
            if len(unbound) < len(members):
                note += f"; bound, not judged: {_names([u for u in members if binding.bound(u)])}"
            out.append(Unit(label, unbound, True, note=note))
    return out


def _count(items: list, what: str) -> str:
    return f"{len(items)} {what}" + ("" if len(items) == 1 else "s")


def _names(users: list[str], most: int = 4) -> str:
    return ", ".join(users[:most]) + (f" and {len(users) - most} more" if len(users) > most else "")
