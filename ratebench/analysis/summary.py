"""Per engine, per user, per scenario phase: every figure the checks and reports use.

Vectorized over events: one stable sort per grouping, then one pass per group
(user, or phase and user) over numpy slices. Never a Python loop over events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ratebench.analysis.bound import _result, check_bound_grouped
from ratebench.analysis.fairness import stream_spread
from ratebench.analysis.gaps import gap_stats, gaps_merged, gaps_per_request
from ratebench.analysis.load import RunData
from ratebench.analysis.rates import rate_figures
from ratebench.analysis.reconcile import (
    NO_TIME,
    RequestCheck,
    engine_request_totals,
    events_after,
    reconcile_request,
    view_of,
)
from ratebench.analysis.segments import group_by
from ratebench.analysis.series import request_streams
from ratebench.analysis.steps import EngineStep, estimate_engine_step
from ratebench.analysis.verdict import EngineUserBound, OverheadSummary, Thresholds, UserPhaseSummary
from ratebench.events import KIND_DISPATCH, KIND_EMIT

ANONYMOUS = "__anonymous__"
OVERHEAD_ROLES = ("feature-on", "feature-off", "stock")


@dataclass
class RunSummary:
    engine_steps: dict[str, EngineStep]
    rows: dict[tuple[int, str], UserPhaseSummary]  # (phase index, user)
    engine_bounds: list[EngineUserBound]
    request_checks: dict[tuple[int, str], list[RequestCheck]]
    overheads: list[OverheadSummary]
    warnings: list[str] = field(default_factory=list)


def client_user(user: str | None) -> str:
    return ANONYMOUS if user is None else user


def summarize_run(run: RunData, thresholds: Thresholds) -> RunSummary:
    """Compute every per-user figure of a loaded run."""
    summary = RunSummary({}, {}, [], {}, [])
    rows = summary.rows
    for p in run.phases:
        for user, spec in p.users.items():
            rows[(p.index, user)] = _new_row(run, p.index, user)
    phase_of = {p.key: p.index for p in run.phases}
    for name in run.traces:
        _summarize_engine(run, name, summary, thresholds, phase_of)
    _summarize_clients(run, summary, thresholds, phase_of)
    summary.overheads = _overheads(run, phase_of)
    return summary


def _new_row(run: RunData, phase_index: int, user: str) -> UserPhaseSummary:
    p = run.phases[phase_index]
    spec = p.users.get(user)
    limit = run.engines[p.engine].limit_of(user)
    if spec is not None and spec.limit_tps is not None and spec.limit_tps != limit:
        limit = spec.limit_tps if limit is None else limit
    return UserPhaseSummary(
        scenario=p.scenario, phase=p.phase, engine=p.engine, user=user, role=p.role, kind=p.kind,
        limit_tps=limit, streams=spec.streams if spec else 0, backlogged=bool(spec and spec.backlogged),
        requests=0,
    )


def _row(run: RunData, summary: RunSummary, phase_index: int, user: str) -> UserPhaseSummary:
    key = (phase_index, user)
    if key not in summary.rows:
        summary.rows[key] = _new_row(run, phase_index, user)
    return summary.rows[key]


def _summarize_engine(run: RunData, name: str, summary: RunSummary, th: Thresholds, phase_of: dict) -> None:
    trace = run.traces[name]
    eng = run.engines[name]
    recs = trace.records
    strings = trace.events.strings
    n_codes = max(len(strings), 1)
    kind = recs["kind"]
    d = recs[kind == KIND_DISPATCH]
    e = recs[kind == KIND_EMIT]
    d_t, d_req, d_user = d["t_ns"], d["req"].astype(np.int64), d["user"].astype(np.int64)
    e_t, e_req, e_user = e["t_ns"], e["req"].astype(np.int64), e["user"].astype(np.int64)
    e_c = e["count"].astype(np.int64)
    step = estimate_engine_step(d_t, d_req, e_t, e_req, e_c)
    summary.engine_steps[name] = step
    if step.method != "dispatch-to-emit" and len(e_t):
        summary.warnings.append(f"engine {name}: engine step {step.method}; emit bound checked without tolerance")
    tol = step.longest_ns

    user_codes = np.unique(np.concatenate([d_user, e_user])) if len(recs) else np.empty(0, dtype=np.int64)
    limits = {int(c): eng.limit_of(strings[c]) for c in user_codes}
    # the whole file: a limiter's state carries across phases
    whole_d = check_bound_grouped(d_t, d_user, limits, burst_ns=th.burst_ns)
    whole_e = check_bound_grouped(e_t, e_user, limits, counts=e_c, burst_ns=th.burst_ns, tolerance_ns=tol)
    for c in user_codes:
        c = int(c)
        if limits.get(c) is not None:
            summary.engine_bounds.append(
                EngineUserBound(name, strings[c], int(limits[c]), whole_d.get(c), whole_e.get(c))
            )

    req_stream = request_streams(run, trace)
    has = trace.req_record >= 0

    # per phase and user
    for t_all, req_all, user_all, c_all, is_emit in (
        (d_t, d_req, d_user, None, False),
        (e_t, e_req, e_user, e_c, True),
    ):
        ph = trace.req_phase[req_all] if len(req_all) else np.empty(0, dtype=np.int64)
        m = ph >= 0
        t, req, user = t_all[m], req_all[m], user_all[m]
        c = c_all[m] if c_all is not None else None
        groups = group_by(ph[m] * n_codes + user)
        for _, key, sl in groups.slices():
            idx = groups.order[sl]
            p_index, u_code = divmod(int(key), n_codes)
            row = _row(run, summary, p_index, strings[u_code])
            tg, rg = t[idx], req[idx]
            if not is_emit:
                if row.limit_tps:
                    row.bound_dispatch = _result(tg, np.ones(len(tg), dtype=np.int64), row.limit_tps, th.burst_ns, 0)
                row.dispatch_rate = rate_figures(tg, None, row.limit_tps, th.burst_ns)
                if row.streams > 1 or len(np.unique(rg)) > 1:
                    row.stream_spread = stream_spread(tg, req_stream[rg] if (req_stream[rg] >= 0).all() else rg)
            else:
                cg = c[idx]
                if row.limit_tps:
                    keep = cg > 0
                    row.bound_emit = _result(tg[keep], cg[keep], row.limit_tps, th.burst_ns, tol)
                row.emit_rate = rate_figures(tg, cg, row.limit_tps, th.burst_ns)
                row.gaps_emit_request = gap_stats(gaps_per_request(tg, rg))
                row.gaps_emit_user = gap_stats(gaps_merged(tg))

    # reconciliation: per-request totals, then one Python step per client record
    totals = engine_request_totals(recs, n_codes)
    cancel_cut = np.full(n_codes, NO_TIME, dtype=np.int64)
    for code in np.flatnonzero(has):
        r = run.records[trace.req_record[code]]
        if r.cancelled:
            cancel_cut[code] = r.cancel_ns if r.cancel_ns is not None else (r.done_ns or NO_TIME)
    after_cancel = events_after(recs, cancel_cut, kinds=(KIND_EMIT,))
    after_finish = events_after(recs, totals.finish_ns)
    code_of_record = {int(trace.req_record[code]): int(code) for code in np.flatnonzero(has)}
    for i, r in enumerate(run.records):
        if r.engine != name:
            continue
        code = code_of_record.get(i)
        view = view_of(totals, code, after_cancel, after_finish) if code is not None else None
        chk = reconcile_request(r, view, engine_has_events=True, cancel_max_steps=th.cancel_max_steps)
        _add_request_check(summary, phase_of, r, chk)


def _add_request_check(summary: RunSummary, phase_of: dict, r, chk: RequestCheck | None) -> None:
    if chk is None:
        return
    p_index = phase_of.get((r.scenario, r.phase, r.engine))
    if p_index is not None:
        summary.request_checks.setdefault((p_index, client_user(r.user)), []).append(chk)


def _summarize_clients(run: RunData, summary: RunSummary, th: Thresholds, phase_of: dict) -> None:
    by_group: dict[tuple[int, str], list] = {}
    for r in run.records:
        p_index = phase_of.get((r.scenario, r.phase, r.engine))
        if p_index is None:
            summary.warnings.append(f"client record {r.client_id}: phase {r.scenario}/{r.phase}@{r.engine} not in scenarios.json")
            continue
        by_group.setdefault((p_index, client_user(r.user)), []).append(r)
    for (p_index, user), recs in by_group.items():
        row = _row(run, summary, p_index, user)
        row.requests = len(recs)
        row.streamed_tokens = sum(r.streamed_tokens for r in recs)
        if run.engines[row.engine].events_file is None:
            # no engine events (stock vLLM): reconcile the client side alone
            for r in recs:
                _add_request_check(summary, phase_of, r, reconcile_request(r, None, engine_has_events=False))
        cancelled = [r for r in recs if r.cancelled]
        row.cancelled = len(cancelled)
        checks = summary.request_checks.get((p_index, user), [])
        row.cancelled_charged_tokens = sum(c.charged_tokens or 0 for c in checks if c.cancelled)
        with_chunks = [r for r in recs if r.chunk_ns]
        if not with_chunks:
            continue
        per_req_t = [np.asarray(r.chunk_ns, dtype=np.int64) for r in with_chunks]
        per_req_c = [np.asarray(r.chunk_tokens, dtype=np.int64) for r in with_chunks]
        t = np.concatenate(per_req_t)
        c = np.concatenate(per_req_c)
        order = np.argsort(t, kind="stable")
        t, c = t[order], c[order]
        row.client_rate = rate_figures(t, c, row.limit_tps, th.burst_ns)
        if row.limit_tps:
            keep = c > 0
            row.bound_client = _result(t[keep], c[keep], row.limit_tps, th.burst_ns, 0)
        row.gaps_client_request = gap_stats(np.concatenate([np.diff(x) for x in per_req_t]))
        row.gaps_client_user = gap_stats(gaps_merged(t))


def _overheads(run: RunData, phase_of: dict) -> list[OverheadSummary]:
    out: list[OverheadSummary] = []
    scenarios = {p.scenario for p in run.phases if p.role in OVERHEAD_ROLES}
    for scen in sorted(scenarios):
        tokens = {role: 0 for role in OVERHEAD_ROLES}
        span = {role: 0 for role in OVERHEAD_ROLES}
        for p in run.phases:
            if p.scenario != scen or p.role not in OVERHEAD_ROLES:
                continue
            recs = [r for r in run.records if phase_of.get((r.scenario, r.phase, r.engine)) == p.index and r.chunk_ns]
            if not recs:
                continue
            tokens[p.role] += sum(r.streamed_tokens for r in recs)
            span[p.role] += max(r.chunk_ns[-1] for r in recs) - min(r.chunk_ns[0] for r in recs)
        tput = {role: tokens[role] * 1e9 / span[role] for role in OVERHEAD_ROLES if span[role] > 0}
        ratios = {}
        for a, b in (("feature-on", "feature-off"), ("feature-on", "stock"), ("feature-off", "stock")):
            if a in tput and b in tput and tput[b] > 0:
                ratios[f"{a}/{b}"] = tput[a] / tput[b]
        out.append(OverheadSummary(scen, tput, {k: v for k, v in tokens.items() if k in tput}, ratios))
    return out
