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

from ratebench.analysis.bound import check_bound
from ratebench.analysis.gaps import gap_stats
from ratebench.analysis.fleet import fleet_groups
from ratebench.analysis.load import RunData
from ratebench.analysis.overhead import BUSY_MACHINE_CPUS
from ratebench.analysis.segments import diffs_within, group_by
from ratebench.analysis.summary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds
from ratebench.events import KIND_EMIT, PhaseRecord

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


def isolation_checks(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    """Each phase with a baseline: every unit's latencies and rate against the baseline's."""
    out: list[Check] = []
    rows = set(s.rows)
    records_of: dict[tuple[int, str], list[int]] = {}
    phase_of = {q.key: q.index for q in run.phases}
    for i, r in enumerate(run.records):
        k = phase_of.get((r.scenario, r.phase, r.engine))
        if k is not None:
            records_of.setdefault((k, s.user_of(i, r.user)), []).append(i)
    cache: dict = {}  # engine -> _EngineRequests; ("full", baseline phase index) -> its full share
    for base in (q for q in run.phases if q.role == "baseline"):
        shared = [q for q in run.phases if q.scenario == base.scenario
                  and (q.role == "shared" or (q.kind == "mix" and q.role == "measure"))]
        same_engine = [q for q in shared if q.engine == base.engine]
        # the phases on the baseline's engine, else every one of them (a mix on each scheduling
        # mode's limiter-on engine against the one limiter-off baseline)
        for p in same_engine or shared:
            binding = phase_binding(run, p)
            if p.kind == "mix" and binding.known:
                binding.over_limit = _over_limit(run, base, p, records_of)
            units = _units(run, base, p, binding, rows)
            if p.kind == "mix":
                out.append(_binding_check(p, binding, units))
            for unit in units:
                on = [i for u in unit.users for i in records_of.get((p.index, u), [])]
                off = [i for u in unit.users for i in records_of.get((base.index, u), [])]
                out.extend(_unit_checks(run, cache, p, base, unit, on, off, th))
            if p.kind == "mix" and binding.known:
                out.extend(_clear_checks(run, p, base, binding, units, records_of, th))
    return out


def _over_limit(run: RunData, base: PhaseRecord, p: PhaseRecord, records_of: dict) -> dict[str, float]:
    """The users of mix phase ``p`` whose requests, on the baseline phase ``base`` (the limiter-off
    engine), came faster than their limit in ``p`` allows: the bound ``(W + burst) x N + 1`` broken in
    some window of their client chunks (tokens past it in the fullest one)."""
    out: dict[str, float] = {}
    for u, pu in p.users.items():
        limit = pu.limit_tps
        if not limit:
            continue
        t: list[int] = []
        c: list[int] = []
        for i in records_of.get((base.index, u), []):
            t.extend(run.records[i].chunk_ns)
            c.extend(run.records[i].chunk_tokens)
        if not t:
            continue
        order = np.argsort(np.asarray(t, dtype=np.int64), kind="stable")
        counts = np.asarray(c, dtype=np.int64)[order]
        keep = counts > 0
        res = check_bound(np.asarray(t, dtype=np.int64)[order][keep], int(limit), counts=counts[keep])
        if not res.passed and res.worst is not None:
            out[u] = -res.worst.slack_tokens
    return out


def _binding_check(p: PhaseRecord, binding: Binding, units: list[Unit]) -> Check:
    """For information: whose limit bound in a mix phase, and what isolation judges there."""
    judged = [u for u in units if u.judged]
    if not binding.known:
        text = binding.why + "; judged only the tiers marked isolated" + (
            f" ({', '.join(u.label for u in judged)})" if judged else " (none)")
    else:
        bound = sorted(u for u, n in binding.refused.items() if n and u in p.users)
        over = sorted(u for u in binding.over_limit if u in p.users and u not in bound)
        text = (f"{len(bound)} of {len(p.users)} users were refused a charge in the phase (bound: "
                f"{_names(bound) if bound else 'none'})"
                + (f"; {len(over)} more asked more than their limits allow on the baseline (bound: {_names(over)}, "
                   "the most past its bound "
                   f"{max(binding.over_limit[u] for u in over):.1f} tokens)" if over else "")
                + "; isolation judges "
                + (", ".join(f"{u.label} ({_count(u.users, 'user')})" for u in judged) if judged else "nobody"))
    return Check("isolation-binding", p.scenario, p.phase, p.engine, None,
                 sum(len(u.users) for u in judged), None, "vs", "users judged", None, text)


def _unit_checks(run: RunData, cache: dict, p: PhaseRecord, base: PhaseRecord, unit: Unit, on: list[int],
                 off: list[int], th: Thresholds) -> list[Check]:
    sent_on = [i for i in on if run.records[i].sent_ns is not None]
    sent_off = [i for i in off if run.records[i].sent_ns is not None]
    eng_on = _engine_side(run, p.engine, cache, sent_on)
    eng_off = _engine_side(run, base.engine, cache, sent_off)
    lat_on, lat_off = _client_side(run.records, sent_on), _client_side(run.records, sent_off)
    if lat_on is None or lat_off is None:
        lat_on, lat_off = eng_on, eng_off
    if lat_on is None or lat_off is None:
        return []
    engine_ttft = ""
    if lat_on.side == "client" and eng_on is not None and eng_off is not None and len(eng_on.ttft_ns) \
            and len(eng_off.ttft_ns):
        engine_ttft = (f"; engine side (first emit - sent) p50 {np.percentile(eng_on.ttft_ns, 50) / 1e6:.1f} ms vs "
                       f"{np.percentile(eng_off.ttft_ns, 50) / 1e6:.1f} ms")
    ids = (p.scenario, p.phase, p.engine, unit.label)
    who = unit.label
    if unit.users != [unit.label]:
        who += f", {_count(unit.users, 'user')} ({_names(unit.users)})"
    head = (f"{who}: {lat_on.requests} requests vs {lat_off.requests} on the baseline {base.phase}@{base.engine} "
            f"({lat_on.side} side)")
    tail = "".join(f"; {x}" for x in (unit.note, "" if unit.judged else f"information only: {unit.why}",
                                      _busy_note(p, base), _full_note(run, base, cache)) if x)
    out = []
    for stem, what, attr in _MEASURES:
        factor, slack_ns = getattr(th, f"{attr}_factor"), getattr(th, f"{attr}_slack_ns")
        x_all, b_all = lat_on.of(stem), lat_off.of(stem)
        sx, sb = gap_stats(x_all), gap_stats(b_all)
        if sx is None or sb is None:
            continue
        for q in QUANTILES:
            x, b = getattr(sx, f"p{q}_ns"), getattr(sb, f"p{q}_ns")
            allowed = factor * b + slack_ns
            need = MIN_SAMPLES[q]
            enough = sx.count >= need and sb.count >= need
            text = (f"{head}: p{q} {what} {x / 1e6:.1f} ms vs {b / 1e6:.1f} ms, allowed {factor:g} x + "
                    f"{slack_ns / 1e6:g} ms = {allowed / 1e6:.1f} ms ({sx.count} vs {sb.count} samples; "
                    f"max {sx.max_ns / 1e6:.1f} vs {sb.max_ns / 1e6:.1f} ms)")
            if stem == "ttft" and q == 50:
                text += engine_ttft
            text += tail
            if not enough:
                text += (f"; too few samples for a p{q} ({need} needed on both phases, one beyond the quantile): "
                         + ("information only, judged at p50" if unit.judged else "judged at p50 at most"))
            passed = (x <= allowed) if (unit.judged and enough) else None
            out.append(Check(check_name(stem, q), *ids, round(x / 1e6, 3), round(allowed / 1e6, 3), "<=", "ms",
                             passed, text))
    rx, rb = lat_on.rate_tps, lat_off.rate_tps
    if rx is not None and rb:
        ratio = rx / rb
        text = (f"{head}: {lat_on.tokens} tokens at {rx:.1f} tok/s vs {lat_off.tokens} at {rb:.1f} tok/s "
                f"(tokens over first request sent to last token)")
        if p.kind == "mix":
            text += "; where arrivals are open loop they set this rate, and it falls only when answers come late"
        out.append(Check("isolation-rate", *ids, round(ratio, 4), th.isolation_min, ">=", "x baseline",
                         (ratio >= th.isolation_min) if unit.judged else None, text + tail))
    return out


def _refuse_times(run: RunData, engine: str) -> dict[str, np.ndarray]:
    """user -> the sorted times of its refuse events on ``engine`` (empty without an event file)."""
    trace = run.traces.get(engine)
    if trace is None:
        return {}
    recs = trace.records
    m = recs["kind"] == KIND_REFUSE
    t, user = recs["t_ns"][m], recs["user"][m].astype(np.int64)
    out: dict[str, np.ndarray] = {}
    if len(t):
        g = group_by(user)
        t_g = t[g.order]
        for k, a, b in zip(g.keys.tolist(), g.starts.tolist(), g.ends.tolist()):
            out[trace.events.strings[k]] = np.sort(t_g[a:b])
    return out


def _clear_pairs(run: RunData, p: PhaseRecord, base: PhaseRecord, u: str, refused: np.ndarray,
                 records_of: dict) -> list[tuple[int, int]]:
    """The requests of bound user ``u`` in mix phase ``p`` sent clear of its limit, each paired with
    the same request on ``base`` (the k-th scheduled with the k-th; none when the counts differ): no
    refuse event of ``u`` from one token period before it was sent (the longest a user refused stays
    out of budget) to its first token, and a first token on both engines."""
    def by_schedule(idx: list[int]) -> list[int]:
        return sorted(idx, key=lambda i: (run.records[i].scheduled_ns or 0, i))

    on, off = by_schedule(records_of.get((p.index, u), [])), by_schedule(records_of.get((base.index, u), []))
    limit = p.users[u].limit_tps
    if len(on) != len(off) or not limit:
        return []
    period = int(1e9 / limit) + CLEAR_STEP_NS
    out = []
    for i, j in zip(on, off):
        r, b = run.records[i], run.records[j]
        if r.sent_ns is None or r.first_token_ns is None or b.sent_ns is None or b.first_token_ns is None:
            continue
        k = np.searchsorted(refused, r.sent_ns - period, "left")
        if k < len(refused) and refused[k] <= r.first_token_ns:
            continue
        out.append((i, j))
    return out


def _clear_checks(run: RunData, p: PhaseRecord, base: PhaseRecord, binding: Binding, units: list[Unit],
                  records_of: dict, th: Thresholds) -> list[Check]:
    """A mix tier's requests sent clear of their users' limits, of its bound users (refused a charge in
    the phase, or past their limits on the baseline: the unit checks skip them), against the same
    requests on the baseline: time to first token at p50 and p90."""
    judged_users = {u for unit in units if unit.judged for u in unit.users}
    refused_at = _refuse_times(run, p.engine)
    tiers: dict[str, list[str]] = {}
    bound = dict(binding.refused)
    for u in binding.over_limit:
        bound[u] = bound.get(u, 0) + 1
    for u, n in bound.items():
        if n and u in p.users and u not in judged_users:
            tiers.setdefault(p.users[u].tier or u, []).append(u)
    out = []
    factor, slack_ns = th.isolation_ttft_factor, th.isolation_ttft_slack_ns
    for tier, members in sorted(tiers.items()):
        pairs = [pair for u in sorted(members)
                 for pair in _clear_pairs(run, p, base, u, refused_at.get(u, np.empty(0, np.int64)), records_of)]
        if not pairs:
            continue
        on = np.array([run.records[i].first_token_ns - run.records[i].sent_ns for i, _ in pairs], dtype=np.int64)
        off = np.array([run.records[j].first_token_ns - run.records[j].sent_ns for _, j in pairs], dtype=np.int64)
        label = f"{tier} tier" if p.users[members[0]].tier else tier
        total = sum(len(records_of.get((p.index, u), [])) for u in members)
        head = (f"{label}, {_count(members, 'bound user')} ({_names(sorted(members))}): "
                f"{len(pairs)} of their {total} requests sent clear of their limits (no refuse event of their "
                f"user from one token period before sent to the first token) vs the same requests on the "
                f"baseline {base.phase}@{base.engine} (client side)")
        for q in (50, 90):
            x, b = float(np.percentile(on, q)), float(np.percentile(off, q))
            allowed = factor * b + slack_ns
            enough = len(pairs) >= MIN_SAMPLES[q]
            text = (f"{head}: p{q} time to first token {x / 1e6:.1f} ms vs {b / 1e6:.1f} ms, allowed {factor:g} x + "
                    f"{slack_ns / 1e6:g} ms = {allowed / 1e6:.1f} ms")
            if not enough:
                text += f"; too few samples for a p{q} ({MIN_SAMPLES[q]} needed): information only"
            name = "isolation-ttft-clear" if q == 50 else f"isolation-ttft-clear-p{q}"
            out.append(Check(name, p.scenario, p.phase, p.engine, label, round(x / 1e6, 3), round(allowed / 1e6, 3),
                             "<=", "ms", (x <= allowed) if enough else None, text))
    return out



# ---- a fleet -------------------------------------------------------------------------------------------


def _fleet_view(records: list[PhaseRecord], fleet: str) -> PhaseRecord:
    """A fleet's phase as one record: named after the fleet, its users those of every member (no engine
    of that name has an event file, so the unit checks judge the client's side)."""
    users: dict = {}
    for r in records:
        for u, entry in r.users.items():
            users.setdefault(u, entry)
    first = records[0]
    return PhaseRecord(scenario=first.scenario, kind=first.kind, phase=first.phase, engine=fleet,
                       start_ns=min(r.start_ns for r in records), end_ns=max(r.end_ns for r in records),
                       users=users, role=first.role, params=first.params, index=first.index,
                       machine_cpu=first.machine_cpu)


def fleet_isolation_checks(run: RunData, th: Thresholds) -> list[Check]:
    """Isolation across a fleet: each policy's phase on the limiter-on fleet against ``<phase>-baseline``,
    the same requests on a limiter-off fleet of as many engines behind a balancer of its own (the fleet
    scenario's ``baseline``). The users whose limits did not bind on any member (no refuse event on any
    member's file in the phase, and within their bound on the baseline fleet's client chunks, merged over
    its members) are pooled, as a mix tier's are, and judged as one unit on the client's side by the
    isolation checks' thresholds; the checks name the fleet. Whose limit bound is told as in a mix, from
    every member's record."""
    groups = fleet_groups(run)
    out: list[Check] = []
    for (scenario, phase, fleet), members in groups.items():
        if members[0].role != "measure" or not all(run.engines.get(m.engine) is not None
                                                   and run.engines[m.engine].feature for m in members):
            continue
        base_key = next((k for k in groups if k[0] == scenario and k[1] == f"{phase}-baseline"
                         and groups[k][0].role == "baseline"), None)
        if base_key is None:
            continue
        p, base = _fleet_view(members, fleet), _fleet_view(groups[base_key], base_key[2])
        on_of: dict[str, list[int]] = {}
        off_of: dict[str, list[int]] = {}
        for i, r in enumerate(run.records):
            if r.scenario == scenario and r.fleet == fleet and r.phase == phase:
                on_of.setdefault(r.user, []).append(i)
            elif r.scenario == scenario and r.fleet == base_key[2] and r.phase == base_key[1]:
                off_of.setdefault(r.user, []).append(i)
        # whose limit bound: refused on any member, or past its bound on the baseline fleet
        bindings = [phase_binding(run, m) for m in members]
        binding = Binding(all(b.known for b in bindings), {},
                          "; ".join(dict.fromkeys(b.why for b in bindings if not b.known))
                          or "bound: refused a charge (a refuse event) on any of the fleet's engines in the phase")
        for b in bindings:
            for u, n in b.refused.items():
                binding.refused[u] = binding.refused.get(u, 0) + n
        if binding.known:
            binding.over_limit = _over_limit(run, base, p, {(base.index, u): idx for u, idx in off_of.items()})
        users = [u for u in p.users if on_of.get(u) and off_of.get(u)]
        if binding.known:
            unbound = [u for u in users if not binding.bound(u)]
            units = [Unit("unbound users", unbound, True,
                          note=f"{len(unbound)} unbound of {len(users)} users across the fleet's {len(members)} "
                               "engines (no refuse event on any of them, and within its limit on the baseline "
                               "fleet), pooled")] if unbound else []
        else:
            units = [Unit("unbound users", users, False, why=binding.why)] if users else []
        out.append(_binding_check(p, binding, units))
        for unit in units:
            on = [i for u in unit.users for i in on_of.get(u, [])]
            off = [i for u in unit.users for i in off_of.get(u, [])]
            out.extend(_unit_checks(run, {}, p, base, unit, on, off, th))
    return out
