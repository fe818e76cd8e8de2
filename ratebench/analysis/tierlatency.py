"""Latency by tier: each phase of many users (a ``mix``), its users pooled by tier, beside its baseline
phase (``mix-baseline``: the same requests on the limiter-off engine), with the figures ``vllm bench
serve`` prints for a run. Figures only: no check judges them (the isolation checks,
``analysis/isolation.py``, judge the tiers whose limits did not bind, from the same per-request
latencies, which this module takes from there).

A user's tier is its mix tier (``scenarios.json`` ``users[u].tier``, users ``<tier>-NN``); a user
without one (the mix's anonymous requests) is a tier of its own. The baseline phase's users are
grouped as the limiter-on phase's.

Per tier and phase, on the client side (its token-carrying chunks), or on the engine's emit events
when the client recorded no chunks on one of the two phases (both then on the engine's side):

* requests: the requests sent; ended: those that ended by themselves (stop or length);
* output tokens: the tokens received (engine: emitted);
* throughput: output tokens / (the tier's last token - its first request sent), in the phase;
* TTFT: first token - sent, per request;
* TPOT: (last token - first token) / (tokens - 1), per request of two tokens or more;
* ITL: the time between consecutive chunks (emit events) of one request, pooled;
* E2EL: last token - sent, per request that ended by itself;

each at p50, p90 and p99 (``gap_stats``: linear interpolation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ratebench.analysis.gaps import GapStats, gap_stats
from ratebench.analysis.isolation import Latencies, _client_side, _engine_side, _EngineRequests
from ratebench.analysis.load import RunData
from ratebench.analysis.runsummary import RunSummary
from ratebench.runrecords import PhaseRecord
from ratebench.profiles import ANONYMOUS_USER
from ratebench.roles import PHASE_BASELINE

KINDS = ("mix",)  # the kinds of phase read by tier
BASELINE = PHASE_BASELINE  # the role of a phase's baseline (mix-baseline)


@dataclass
class ServeFigures:
    """One tier's requests in one phase, as ``vllm bench serve`` reports a run (times in ns)."""

    side: str  # "client" (its chunks) or "engine" (emit events)
    requests: int  # sent
    ended: int  # ended by themselves (stop, length): E2EL's samples
    output_tokens: int
    duration_s: float | None  # first request sent to last token
    throughput_tps: float | None  # output tokens / duration_s
    ttft: GapStats | None = None
    tpot: GapStats | None = None
    itl: GapStats | None = None
    e2el: GapStats | None = None


@dataclass
class TierLatency:
    """One tier of one many-user phase, beside the same users on the phase's baseline."""

    scenario: str
    tier: str
    phase: str  # the limiter-on phase
    engine: str
    users: list[str] = field(default_factory=list)
    limits_tps: list[int | None] = field(default_factory=list)  # the distinct limits of its users in ``phase``
    on: ServeFigures | None = None  # None: the tier sent nothing in the phase
    baseline_phase: str | None = None  # None: the phase has no baseline
    baseline_engine: str | None = None
    baseline: ServeFigures | None = None


def baseline_of(run: RunData, p: PhaseRecord) -> PhaseRecord | None:
    """The baseline phase of a many-user phase: its scenario's phase of role baseline (of the same
    scheduling mode, ``-sync``/``-async``, when there are several)."""
    bases = [q for q in run.phases if q.scenario == p.scenario and q.role == BASELINE and q.index != p.index]
    mode = p.engine.rsplit("-", 1)[-1]
    return next((q for q in bases if q.engine.rsplit("-", 1)[-1] == mode), bases[0] if bases else None)


def _tier_of(p: PhaseRecord, user: str) -> str:
    entry = p.users.get(user)
    tier = entry.tier if entry is not None else None
    return tier if tier is not None else user


def _tiers(p: PhaseRecord, users: list[str]) -> dict[str, list[str]]:
    """Tier -> its users, in the order of their first (sorted) user; anonymous requests last."""
    tiers: dict[str, list[str]] = {}
    for u in sorted(users):
        tiers.setdefault(_tier_of(p, u), []).append(u)
    last = {t: tiers.pop(t) for t in [t for t in tiers if t == ANONYMOUS_USER]}
    return {**tiers, **last}


def _tpot(run: RunData, lat: Latencies, indices: list[int], engine: str, cache: dict) -> GapStats | None:
    """Per request of two tokens or more: (last token - first token) / (tokens - 1), on ``lat``'s side."""
    if lat.side == "client":
        recs = [run.records[i] for i in indices]
        rows = [(r.chunk_ns[0], r.chunk_ns[-1], sum(r.chunk_tokens)) for r in recs if r.chunk_ns]
        if not rows:
            return None
        first, last, tokens = (np.array(x, dtype=np.int64) for x in zip(*rows))
    else:
        er: _EngineRequests = cache[engine]
        codes = np.array([er.code_of[i] for i in indices if i in er.code_of], dtype=np.int64)
        codes = codes[er.first[codes] >= 0] if len(codes) else codes
        first, last, tokens = er.first[codes], er.last[codes], er.tokens[codes]
    many = tokens > 1
    return gap_stats((last[many] - first[many]) / (tokens[many] - 1))


def _figures(run: RunData, lat: Latencies | None, indices: list[int], engine: str, cache: dict) -> ServeFigures:
    if lat is None:  # nothing came back on either side
        return ServeFigures("client", len(indices), 0, 0, None, None)
    first_sent = min(run.records[i].sent_ns for i in indices)
    duration = (lat.last_ns - first_sent) / 1e9 if lat.last_ns is not None else None
    return ServeFigures(lat.side, lat.requests, int(len(lat.e2e_ns)), lat.tokens, duration,
                        lat.tokens / duration if duration else None, ttft=gap_stats(lat.ttft_ns),
                        tpot=_tpot(run, lat, indices, engine, cache), itl=gap_stats(lat.gap_ns),
                        e2el=gap_stats(lat.e2e_ns))


def _sides(run: RunData, cache: dict, on: tuple[str, list[int]], off: tuple[str, list[int]] | None):
    """Both phases' latencies on the same side: the client's, or the engine's where the client recorded
    no chunks on one of them."""
    units = [on] + ([off] if off is not None else [])
    lats = [_client_side(run.records, idx) if idx else None for _, idx in units]
    if any(idx and lat is None for (_, idx), lat in zip(units, lats)):
        engine = [_engine_side(run, eng, cache, idx) if idx else None for eng, idx in units]
        if all(lat is not None or not idx for (_, idx), lat in zip(units, engine)):
            lats = engine
    return lats + [None] * (2 - len(lats))


def tier_latencies(run: RunData, s: RunSummary) -> list[TierLatency]:
    """Each many-user phase (limiter on) by tier, with its baseline phase's figures for the same users."""
    phase_of = {q.key: q.index for q in run.phases}
    sent: dict[tuple[int, str], list[int]] = {}
    for i, r in enumerate(run.records):
        k = phase_of.get((r.scenario, r.phase, r.engine))
        if k is not None and r.sent_ns is not None:
            sent.setdefault((k, s.user_of(i, r.user)), []).append(i)
    cache: dict = {}
    out: list[TierLatency] = []
    for p in run.phases:
        if p.kind not in KINDS or p.role == BASELINE:
            continue
        base = baseline_of(run, p)
        users = [*p.users, *sorted({u for k, u in sent if k == p.index and u not in p.users})]
        for tier, members in _tiers(p, users).items():
            on = [i for u in members for i in sent.get((p.index, u), [])]
            off = [i for u in members for i in sent.get((base.index, u), [])] if base is not None else []
            if not on and not off:
                continue
            lat_on, lat_off = _sides(run, cache, (p.engine, on), (base.engine, off) if base is not None else None)
            limits = sorted({p.users[u].limit_tps for u in members if u in p.users}, key=lambda x: (x is None, x or 0))
            line = TierLatency(p.scenario, tier, p.phase, p.engine, members, limits,
                               on=_figures(run, lat_on, on, p.engine, cache) if on else None)
            if base is not None:
                line.baseline_phase, line.baseline_engine = base.phase, base.engine
                line.baseline = _figures(run, lat_off, off, base.engine, cache) if off else None
            out.append(line)
    return out
