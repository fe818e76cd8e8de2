"""Promise 4: while one user is throttled, other users proceed as before (their latencies and rate
against the same requests on the limiter-off engine, checks isolation-*), users with equal limits get
equal rates (jain-fairness), and no place or slot idles or is held by a throttled request while a
user with budget waits (work-conservation*). The figures: analysis/isolation.py, workcons.py."""

from __future__ import annotations

import numpy as np

from ratebench.analysis.bound import check_bound
from ratebench.analysis.checks.base import ISOLATION_LOOK, LOWER, CheckMeaning, meanings, per_run
from ratebench.analysis.fairness import jain_index
from ratebench.analysis.fleet import fleet_groups
from ratebench.analysis.gaps import gap_stats
from ratebench.analysis.isolation import (
    _count, _names, CLEAR_STEP_NS, MIN_SAMPLES, QUANTILES, _MEASURES, Binding, KIND_REFUSE, Unit, _busy_note,
    _client_side, _engine_side, _full_note, _units, check_name, phase_binding,
)
from ratebench.analysis.load import RunData
from ratebench.analysis.segments import group_by
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds
from ratebench.analysis.workcons import work_conservation
from ratebench.runrecords import PhaseRecord
from ratebench.roles import PHASE_BASELINE, PHASE_MEASURE, PHASE_SHARED

MEANINGS = meanings({
    "isolation-rate": CheckMeaning("4", "a user (in a mix, a tier) whose limit did not bind got fewer tokens per "
                                   "second beside throttled users than on the phase's baseline",
                                   ISOLATION_LOOK),
    **{name: CheckMeaning("4", f"a user (in a mix, a tier) whose limit did not bind waited longer {what} beside "
                          "throttled users than on the phase's baseline (the same requests; in a mix, on the "
                          "limiter-off engine)", ISOLATION_LOOK)
       for name, what in (("isolation-ttft", "for its first token (p50)"),
                          ("isolation-ttft-p90", "for its first token (p90)"),
                          ("isolation-ttft-p99", "for its first token (p99)"),
                          ("isolation-e2e-p50", "for its whole answers (p50)"),
                          ("isolation-e2e-p90", "for its whole answers (p90)"),
                          ("isolation-e2e-p99", "for its whole answers (p99)"),
                          ("isolation-gap-p50", "between tokens (p50)"),
                          ("isolation-gap-p90", "between tokens (p90)"),
                          ("isolation-gap-p99", "between tokens (p99)"))},
    **{name: CheckMeaning("4", f"a request sent while its user had budget (its user's limit bound elsewhere in the "
                          f"phase) waited longer for its first token ({q}) beside throttled users than the same "
                          "request on the limiter-off engine", ISOLATION_LOOK)
       for name, q in (("isolation-ttft-clear", "p50"), ("isolation-ttft-clear-p90", "p90"))},
    "isolation-binding": CheckMeaning("4", "whose limit bound in a mix phase (refuse events), so which tiers "
                                      "isolation judged (information)", "{events}: the refuse events (kind 4)"),
    "jain-fairness": CheckMeaning("4", "users with equal limits got unequal steady rates", LOWER),
    "work-conservation": CheckMeaning("4", "for two or more engine steps in a row, a batch place or a resident slot "
                                      "stayed idle, or held by a throttled request, while a request of a user with "
                                      "budget waited", "{events}: the step records from the time the explanation "
                                      "gives (resident, throttled, waiting_ready, reqs, kv_free); {plot}"),
    "work-conservation-places": CheckMeaning("4", "for three or more engine steps in a row, a batch place stayed "
                                             "idle while a resident request of a user with budget got no tokens",
                                             "{events}: the step records from the time the explanation gives "
                                             "(resident, throttled, reqs, tokens); {plot}"),
})


@per_run(70)
def isolation(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return isolation_checks(run, s, th)


@per_run(80)
def fleet_isolation(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return fleet_isolation_checks(run, th)


@per_run(100)
def jain(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _jain(run, s, th)


@per_run(130)
def work_conservation_checks(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _work_conservation(run, th)


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
    for base in (q for q in run.phases if q.role == PHASE_BASELINE):
        shared = [q for q in run.phases if q.scenario == base.scenario
                  and (q.role == PHASE_SHARED or (q.kind == "mix" and q.role == PHASE_MEASURE))]
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
        # The rate's span (first request sent to last token) is an end-to-end time, with the same timing
        # noise as the end-to-end latencies: it may be 1 / isolation_min x the baseline's plus their slack
        # (a unit of a few short answers, 150 ms, would otherwise fail for 20 ms of a busy machine; a span
        # of seconds is judged at isolation_min as before).
        slack_s = th.isolation_e2e_slack_ns / 1e9
        span_allowed_s = lat_on.tokens / (th.isolation_min * rb) + slack_s
        least = (lat_on.tokens / span_allowed_s) / rb if lat_on.tokens else th.isolation_min
        text = (f"{head}: {lat_on.tokens} tokens at {rx:.1f} tok/s vs {lat_off.tokens} at {rb:.1f} tok/s "
                f"(tokens over first request sent to last token); allowed: the span within 1 / "
                f"{th.isolation_min:g} x the baseline's + {slack_s * 1e3:g} ms ({span_allowed_s * 1e3:.0f} ms for "
                f"these tokens, {lat_on.tokens / rx * 1e3:.0f} ms taken)")
        if p.kind == "mix":
            text += "; where arrivals are open loop they set this rate, and it falls only when answers come late"
        out.append(Check("isolation-rate", *ids, round(ratio, 4), round(least, 4), ">=", "x baseline",
                         (ratio >= least) if unit.judged else None, text + tail))
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
        if members[0].role != PHASE_MEASURE or not all(run.engines.get(m.engine) is not None
                                                   and run.engines[m.engine].feature for m in members):
            continue
        base_key = next((k for k in groups if k[0] == scenario and k[1] == f"{phase}-baseline"
                         and groups[k][0].role == PHASE_BASELINE), None)
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


def _jain(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    out = []
    for p in run.phases:
        by_limit: dict[int, list[tuple[str, float]]] = {}
        for (p_index, user), row in s.rows.items():
            if p_index != p.index or not row.backlogged or not row.limit_tps:
                continue
            rate = row.dispatch_rate or row.emit_rate
            if rate is not None and rate.steady_rate_tps is not None:
                by_limit.setdefault(row.limit_tps, []).append((user, rate.steady_rate_tps))
        for limit, pairs in sorted(by_limit.items()):
            j = jain_index([r for _, r in pairs])
            if j is None:
                continue
            out.append(Check("jain-fairness", p.scenario, p.phase, p.engine, f"{len(pairs)} users at {limit} tok/s",
                             round(j, 5), th.jain_min, ">=", "index", j >= th.jain_min,
                             f"Jain's index of steady rates {min(r for _, r in pairs):.1f}.."
                             f"{max(r for _, r in pairs):.1f} tok/s"))
    return out


def _work_conservation(run: RunData, th: Thresholds) -> list[Check]:
    """Per phase and engine with step records: no run of consecutive steps left a place or a slot idle,
    or held by a throttled request, while a request of a user with budget waited (a single step, the
    one in which a budget flips, excepted). On an engine with the limiter off: the same figures, for
    information (the reference)."""
    out = []
    limit = th.work_conservation_max_run_steps
    for wc in work_conservation(run):
        ids = (wc.scenario, wc.phase, wc.engine, None)
        if wc.not_judged is not None:
            out.append(Check("work-conservation", *ids, None, limit, "<=", "steps", None,
                             f"{wc.not_judged}: work conservation not judged"))
            continue
        lim = wc.limits
        text = (f"{wc.violating} of {wc.steps} steps ({wc.violating_pct:.2f} %) left an active place idle while "
                f"a request of a user with budget waited and a throttled resident could have given way, or there "
                f"was room (fewer than {lim.max_num_active_seqs} requests given tokens, token budget left, and a "
                f"throttled resident, or a free slot and free KV for the smallest ready request's tokens: "
                f"{wc.place} place; of them {wc.slot} slot: all {lim.max_num_seqs} slots taken, one or more by a "
                f"throttled request)")
        if wc.violating:
            text += (f"; longest run {wc.longest_run_steps} step(s), {wc.longest_run_ns / 1e6:.1f} ms, from "
                     f"{wc.longest_run_start_ns / 1e9:.3f} s into the phase; {wc.long_runs} of {wc.runs} runs "
                     f"longer than one step")
        if wc.witness is None and wc.limiter_on:
            text += ("; readiness as the engine's record counts it (its event file has no arrive records: the "
                     "verifier's own replay of the charges could not be made)")
        elif wc.witness is not None:
            text += (f"; the verifier's replay of each user's charges (arrive records) found {wc.witness} more step(s) "
                     "in which the record counted nobody ready while a never-started request of a user with budget "
                     "waited and a throttled resident held a slot"
                     + (f" (first: {wc.witness_first})" if wc.witness_first else ""))
        text += f"; allowed: runs of at most {limit} step(s) (the step in which a budget flips)"
        if not wc.limiter_on:
            text = "limiter off (the reference, not judged): " + text
        passed = None if not wc.limiter_on else wc.longest_run_steps <= limit
        out.append(Check("work-conservation", *ids, wc.longest_run_steps, limit, "<=", "steps", passed, text))
        # a place idle while a resident of a user with budget got no tokens
        plimit = th.work_conservation_places_max_run_steps
        ptext = (f"{wc.resident} of {wc.steps} steps left an active place and token budget unused while a resident "
                 f"request of a user with budget (on the bench, not parked for its budget) got no tokens; longest "
                 f"run {wc.resident_longest_run} step(s); allowed: runs of at most {plimit} (a budget flip, and a "
                 "stream sitting out one step for a sibling whose turn holds its user's token)")
        if not wc.resident_judged:
            ptext = ("not judged under asynchronous scheduling (a request whose step is in flight may sit out the "
                     "next one): " + ptext)
        elif not wc.limiter_on:
            ptext = "limiter off (the reference, not judged): " + ptext
        ppassed = None if not (wc.limiter_on and wc.resident_judged) else wc.resident_longest_run <= plimit
        out.append(Check("work-conservation-places", *ids, wc.resident_longest_run, plimit, "<=", "steps", ppassed,
                         ptext))
    return out
