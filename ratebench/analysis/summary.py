"""Per engine, per user, per scenario phase: every figure the checks and reports use (kept in
:class:`~ratebench.analysis.runsummary.RunSummary`; the client's side: :mod:`~ratebench.analysis.clientsummary`).

Vectorized over events: one stable sort per grouping, then one pass per group
(user, or phase and user) over numpy slices. Never a Python loop over events.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ratebench.analysis.bound import bound_result, check_bound_grouped
from ratebench.analysis.clientsummary import ClientChunks, summarize_clients, witness_rows
from ratebench.analysis.fairness import stream_spread
from ratebench.analysis.gaps import gap_stats, gaps_merged
from ratebench.analysis.load import RunData
from ratebench.analysis.overhead import busy_machine_warnings, overhead_summaries
from ratebench.analysis.rates import rate_figures
from ratebench.analysis.refusals import peak_head
from ratebench.analysis.reconcile import (
    NO_TIME,
    AnswerEnds,
    engine_request_totals,
    events_after_grouped,
    reconcile_request,
    view_of,
)
from ratebench.analysis import rowgroups
from ratebench.analysis.runsummary import (
    IdentityTally,
    Measure,
    RunSummary,
    add_request_check,
    client_user,
    new_row,
    row_of,
)
from ratebench.analysis.series import request_streams
from ratebench.analysis.spacing import check_spacing_many
from ratebench.analysis.steps import engine_step, step_latencies
from ratebench.analysis.waiting import waiting_summaries
from ratebench.analysis.verdict import EngineUserBound
from ratebench.events import FINISH_REASONS, KIND_DISPATCH

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = 1, 2, 3  # events.FINISH_REASONS codes


def summarize_run(run: RunData, measure: Measure = Measure()) -> RunSummary:
    """Compute every per-user figure of a loaded run, from the run alone."""
    summary = RunSummary({}, {}, [], {}, [])
    rows = summary.rows
    for p in run.phases:
        for user, spec in p.users.items():
            row = rows[(p.index, user)] = new_row(run, p.index, user)
            if spec.limit_tps != row.limit_tps:
                summary.warnings.append(
                    f"{p.label} {user}: scenarios.json says limit {spec.limit_tps}, the engine's flags give "
                    f"{run.engines[p.engine].limit_of(user)}; checked against {row.limit_tps}")
    phase_of = {p.key: p.index for p in run.phases}
    ends = AnswerEnds.of_manifest(run.manifest)  # where the model's answers end (reconciliation)
    if ends.stop_token_ids is None and any(
            r.finish_reason == "stop" for r in run.records):
        summary.warnings.append(
            "answers that ended with 'stop' were not held against the model's stop tokens: the run did not record "
            "them (manifest.json's model_stop_token_ids: a run attached with --endpoint, or one from before)")
    t0 = time.perf_counter()
    chunks = ClientChunks(run.records)  # the engines' first-token figures read its send times
    summary.stage_s["client chunks"] = time.perf_counter() - t0
    for name in run.traces:
        t0 = time.perf_counter()
        _summarize_engine(run, name, summary, measure, phase_of, ends, chunks.sent)
        summary.stage_s[f"engine {name}"] = time.perf_counter() - t0
    t0 = t1 = time.perf_counter()
    summary.witness = witness_rows(run, summary, measure, phase_of, chunks)
    summary.stage_s["witness"] = time.perf_counter() - t1
    summarize_clients(run, summary, measure, phase_of, ends, chunks)
    summary.overheads = overhead_summaries(run, phase_of)
    summary.waiting = waiting_summaries(run, summary.rows, summary.request_checks, summary.steps_per_phase)
    summary.warnings.extend(busy_machine_warnings(summary.overheads))
    summary.stage_s["client records"] = time.perf_counter() - t0
    return summary


class _Laps:
    """Wall time of consecutive parts of one function, added into a ``stage_s`` dict."""

    def __init__(self, stage_s: dict[str, float], prefix: str) -> None:
        self.stage_s, self.prefix, self.t = stage_s, prefix, time.perf_counter()

    def __call__(self, label: str) -> None:
        now = time.perf_counter()
        key = self.prefix + label
        self.stage_s[key] = self.stage_s.get(key, 0.0) + now - self.t
        self.t = now


def _summarize_engine(run: RunData, name: str, summary: RunSummary, th: Measure, phase_of: dict,
                      ends: AnswerEnds, sent_all: np.ndarray) -> None:
    trace = run.traces[name]
    eng = run.engines[name]
    lap = _Laps(summary.stage_s, f"engine {name}: ")
    recs = trace.records
    strings = trace.events.strings
    n_codes = max(len(strings), 1)
    req_col, user_col = recs["req"], recs["user"]
    # the columns and groupings are the trace's, shared with the other analyses of this engine
    dispatch, emits = trace.of_kind(KIND_DISPATCH), trace.emits()  # emits: those carrying tokens
    d_t, d_req, d_user = dispatch["t_ns"], dispatch["req"], dispatch["user"]
    e_t, e_req, e_user = emits["t_ns"], emits["req"], emits["user"]
    e_c = emits["count"].astype(np.int64)
    e_unit = bool(len(e_c) == 0 or e_c.max() == 1)

    lap("columns")
    # per-request groupings, shared by the step estimate and the per-request gaps
    (d_by_req, d_t_r), (e_by_req, e_t_r) = trace.by_request(KIND_DISPATCH), trace.by_request("emits")
    lost_t, lost_req = rowgroups.lost_charges(recs, req_col, d_req, e_req, e_c, d_by_req, d_t_r, n_codes)
    lap("group by request")
    latencies = step_latencies(d_t, d_req, e_t, e_req, e_c, dispatch_groups=d_by_req, emit_groups=e_by_req,
                               grouped_times=(d_t_r, e_t_r))
    step = engine_step(latencies)
    summary.engine_steps[name] = step
    if not isinstance(latencies, str):
        summary.step_latencies[name] = latencies
    phase_steps = rowgroups.phase_steps(run, name, latencies)
    summary.steps_per_phase.update({k: len(v[0]) for k, v in phase_steps.items()})
    if step.method != "dispatch-to-emit" and len(e_t) and eng.feature:
        summary.warnings.append(f"engine {name}: engine step {step.method}; emit bound checked without tolerance")
    # the emit bound's tolerance: the longest dispatch-to-emit step that started in the row's phase (every
    # emit of a phase's requests comes from one: they are sent after it starts and answered before it
    # ends); the whole file's bound takes the engine's longest. One slow step elsewhere on the engine (a
    # structured-output backend compiling its grammar before another phase) widens no phase's windows.
    tol = step.longest_ns if th.emit_tolerance_ns is None else th.emit_tolerance_ns
    phase_tol = {} if th.emit_tolerance_ns is not None else {k: int(v[3]) for k, v in phase_steps.items()}
    lap("step estimate")

    user_codes = np.flatnonzero(np.bincount(user_col, minlength=n_codes)) if len(recs) else []
    limits = {int(c): eng.limit_of(strings[c]) for c in user_codes}
    req_stream = request_streams(run, trace)
    req_phase = trace.req_phase
    # under vLLM's PRIORITY policy a user's streams take turns within a priority (higher priorities first)
    req_priority = None
    if trace.runs_priority_policy:
        req_priority = np.zeros(len(trace.req_record), dtype=np.int64)
        has = np.flatnonzero(trace.req_record >= 0)
        if len(has):
            req_priority[has] = [run.records[i].priority for i in trace.req_record[has]]

    # the user the engine charged each client record's request (rows follow the engine's view)
    first_user = np.full(n_codes, -1, dtype=np.int64)
    if len(e_by_req):
        first_user[e_by_req.keys] = e_user[e_by_req.order[e_by_req.starts]]
    if len(d_by_req):
        first_user[d_by_req.keys] = d_user[d_by_req.order[d_by_req.starts]]
    known = (trace.req_record >= 0) & (first_user >= 0)
    # requests whose events name more than one user
    mixed = np.zeros(n_codes, dtype=bool)
    mixed[d_req[d_user != first_user[d_req]]] = True
    mixed[e_req[e_user != first_user[e_req]]] = True
    for code, i, u_code in zip(np.flatnonzero(known).tolist(), trace.req_record[known].tolist(),
                               first_user[known].tolist()):
        engine_user = strings[u_code]
        r = run.records[i]
        sent = client_user(r.user)
        if engine_user != sent:
            summary.engine_user_of_record[i] = engine_user
        if not eng.feature:
            continue
        p_index = phase_of.get((r.scenario, r.phase, r.engine))
        if p_index is None:
            continue
        tally = summary.identity.setdefault((p_index, sent), IdentityTally())
        tally.requests += 1
        if engine_user != sent or mixed[code]:
            charged = sorted({strings[u] for u in np.unique(np.concatenate([d_user[d_req == code],
                                                                           e_user[e_req == code]]))})
            how = f" (sent with {r.spoof})" if r.spoof else ""
            tally.mismatches.append(f"{r.client_id}{how}: sent as {sent}, charged to {', '.join(charged)}")

    # per-request emit gaps: the gap from the previous emit of the same request, at each emit (-1: first),
    # in the grouped-by-request layout of e_t_r
    gap_r = np.full(len(e_t), -1, dtype=np.int64)
    if len(e_t) > 1:
        same = np.ones(len(e_t) - 1, dtype=bool)  # the next emit (grouped) is of the same request
        same[e_by_req.ends[:-1] - 1] = False
        gap_r[1:][same] = np.diff(e_t_r)[same]

    lap("users, gaps per request")
    # per phase and user
    phase_bounds: dict[str, dict[int, tuple[int, object]]] = {"dispatch": {}, "emit": {}}
    all_in_phases = True
    for label, t_all, req_all, user_all, c_all in (
        ("dispatch", d_t, d_req, d_user, None),
        ("emit", e_t, e_req, e_user, None if e_unit else e_c),
    ):
        by_req, t_r = (d_by_req, d_t_r) if label == "dispatch" else (e_by_req, e_t_r)
        rows = rowgroups.rows_from_requests(by_req, t_r, req_all, user_all, first_user, req_phase, n_codes)
        if rows is not None:  # positions into the grouped-by-request layout
            pos, group_list, in_phases = rows
            t = t_r[pos]
            req = np.repeat(by_req.keys, by_req.sizes)[pos]
            c = None if c_all is None else c_all[by_req.order[pos]]
            request_gaps = gap_r[pos] if label == "emit" else None
        else:
            order, group_list, in_phases = rowgroups.phase_user_groups(req_all, user_all, req_phase, user_codes,
                                                                       len(run.phases), n_codes)
            t = t_all[order]
            req = req_all[order]
            c = None if c_all is None else c_all[order]
            if label == "emit":
                gap_at_emit = np.empty_like(gap_r)
                gap_at_emit[e_by_req.order] = gap_r
                request_gaps = gap_at_emit[order]
        all_in_phases = all_in_phases and in_phases
        lap("per phase and user: grouping")
        spacing_of = _spacing_per_group(run, summary, strings, label, group_list, t, req, c, phase_steps,
                                        lost_t, lost_req, n_codes)
        lap("per phase and user: even spacing")
        for k, (p_index, u_code, sl) in enumerate(group_list):
            row = row_of(run, summary, p_index, strings[u_code])
            ps = phase_steps.get(p_index)
            steps = (ps[0], ps[1]) if ps is not None else None  # the engine's step starts and periods
            tg = t[sl]
            cg = None if c is None else c[sl]
            rg = req[sl]
            spacing = spacing_of.get(k)
            if label == "dispatch":
                row.spacing_dispatch = spacing
                if row.limit_tps:
                    row.bound_dispatch = bound_result(tg, None, row.limit_tps, th.burst_ns, 0)
                    phase_bounds[label].setdefault(u_code, []).append((row.limit_tps, row.bound_dispatch))
                row.dispatch_rate = rate_figures(tg, None, row.limit_tps, th.burst_ns, steps)
                if row.streams > 1 or (len(rg) and rg.min() != rg.max()):
                    streams = req_stream[rg]
                    by_stream = streams if streams.min() >= 0 else rg
                    levels = None if req_priority is None else np.unique(req_priority[rg])
                    if levels is not None and len(levels) > 1:
                        prio = req_priority[rg]
                        spreads = [x for x in (stream_spread(tg[prio == lv], by_stream[prio == lv])
                                               for lv in levels) if x is not None]
                        row.stream_spread = max(spreads) if spreads else None
                        row.stream_priorities = levels.tolist()
                    else:
                        row.stream_spread = stream_spread(tg, by_stream)
                    # a stream that sent several requests: also the spread counted only while every
                    # stream had one in service (judged for users whose limit never bound: checks/even.py)
                    if row.limit_tps:
                        row.peak_head_tokens = peak_head(tg, row.limit_tps)
                    if (row.stream_spread is not None and not row.spent_to_bound(th.burst_ns)
                            and len(np.unique(rg)) > len(np.unique(by_stream))):
                        row.streams_resent = True
                        row.stream_spread_in_service = stream_spread(tg, by_stream, rg)
            else:
                row.spacing_emit = spacing
                if row.limit_tps:
                    row.bound_emit = bound_result(tg, cg, row.limit_tps, th.burst_ns, phase_tol.get(p_index, tol))
                    phase_bounds[label].setdefault(u_code, []).append((row.limit_tps, row.bound_emit))
                row.emit_rate = rate_figures(tg, cg, row.limit_tps, th.burst_ns, steps)
                g = request_gaps[sl]
                row.gaps_emit_request = gap_stats(g[g >= 0])
                row.gaps_emit_user = gap_stats(gaps_merged(tg))
        lap("per phase and user: figures per group")

    # the whole file: a limiter's state carries across phases. When every event is in a
    # phase and each user ran in one phase only, that phase's result is the whole file's.
    def whole(label, t_all, user_all, counts, tolerance):
        per_user = phase_bounds[label]
        present = np.flatnonzero(np.bincount(user_all, minlength=n_codes)) if len(user_all) else []
        limited = {int(u) for u in present if limits.get(int(u)) is not None}
        if all_in_phases and set(per_user) == limited and all(
                len(v) == 1 and v[0][0] == limits[u] for u, v in per_user.items()):
            return {u: v[0][1] for u, v in per_user.items()}
        return check_bound_grouped(t_all, user_all, limits, counts=counts, burst_ns=th.burst_ns,
                                   tolerance_ns=tolerance)

    whole_d = whole("dispatch", d_t, d_user, None, 0)
    whole_e = whole("emit", e_t, e_user, None if e_unit else e_c, tol)
    for c in user_codes:
        c = int(c)
        if limits.get(c) is not None:
            summary.engine_bounds.append(
                EngineUserBound(name, strings[c], int(limits[c]), whole_d.get(c), whole_e.get(c))
            )
    has = trace.req_record >= 0
    lap("whole file")

    # reconciliation: per-request totals, then one Python step per client record
    totals = engine_request_totals(recs, n_codes, columns=(d_req, e_req, None if e_unit else e_c))
    cancel_cut = np.full(n_codes, NO_TIME, dtype=np.int64)
    for code, i in zip(np.flatnonzero(has).tolist(), trace.req_record[has].tolist()):
        r = run.records[i]
        if r.cancelled:
            cancel_cut[code] = r.cancel_ns if r.cancel_ns is not None else (r.done_ns or NO_TIME)
    e_c_r = None if e_unit else e_c[e_by_req.order]
    after_cancel = (events_after_grouped(e_t_r, e_by_req, cancel_cut, e_c_r) if (cancel_cut < NO_TIME).any()
                    else None)
    d_late, _ = events_after_grouped(d_t_r, d_by_req, totals.finish_ns)
    e_late, e_late_tok = events_after_grouped(e_t_r, e_by_req, totals.finish_ns, e_c_r)
    after_finish = (d_late + e_late, e_late_tok)
    lap("reconciliation totals")
    if eng.feature:
        _charge_parity(run, name, summary, totals, first_user, strings, n_codes)
    _engine_ttft(run, name, summary, e_t_r, e_by_req, first_user, strings, n_codes, sent_all)
    lap("charge parity, time to first token")
    code_of_record = dict(zip(trace.req_record[has].tolist(), np.flatnonzero(has).tolist()))
    # Python lists: one request at a time below, where numpy scalar indexing costs more than the check
    totals_py = dataclasses.replace(totals, **{f.name: getattr(totals, f.name).tolist()
                                               for f in dataclasses.fields(totals)})
    after_cancel = None if after_cancel is None else tuple(a.tolist() for a in after_cancel)
    after_finish = tuple(a.tolist() for a in after_finish)
    for i, r in enumerate(run.records):
        if r.engine != name:
            continue
        code = code_of_record.get(i)
        view = view_of(totals_py, code, after_cancel, after_finish) if code is not None else None
        chk = reconcile_request(r, view, engine_has_events=True, ends=ends)
        add_request_check(summary, phase_of, i, r, chk)
    lap("reconciliation per request")


def _spacing_per_group(run: RunData, summary: RunSummary, strings, label: str, group_list: list, t: np.ndarray,
                       req: np.ndarray, c: np.ndarray | None, phase_steps: dict, lost_t: np.ndarray,
                       lost_req: np.ndarray, n_codes: int) -> dict[int, object]:
    """Even spacing of every (phase, user) group judged (backlogged, with a limit, steps measured), by
    position in ``group_list``: all the groups of one phase at once on the phase's step index
    (``spacing.check_spacing_many``), so the cost follows the events, not users x steps. On emit
    events, the cancelled requests' charges without an emit (``lost_*``, by request code) count at
    their dispatch, gathered per group from its own requests."""
    lost_of: dict[int, np.ndarray] = {}  # group position -> positions into lost_*
    if label == "emit" and len(lost_t) and len(group_list):
        sizes = np.array([sl.stop - sl.start for _, _, sl in group_list], dtype=np.int64)
        firsts = np.array([sl.start for _, _, sl in group_list], dtype=np.int64)
        lost_codes = np.unique(lost_req)
        hit = np.flatnonzero(np.isin(req, lost_codes))
        # each group's slice of positions: which group each event of a cancelled request is in
        order = np.argsort(firsts, kind="stable")
        at = np.searchsorted(firsts[order], hit, side="right") - 1
        gpos = order[np.maximum(at, 0)]
        inside = (at >= 0) & (hit >= firsts[gpos]) & (hit < firsts[gpos] + sizes[gpos])
        pairs = np.unique(gpos[inside] * np.int64(n_codes) + req[hit[inside]].astype(np.int64))
        lost_req64 = lost_req.astype(np.int64)
        for g in np.unique(pairs // n_codes).tolist():
            codes = pairs[(pairs >= g * n_codes) & (pairs < (g + 1) * n_codes)] - g * n_codes
            lo = np.searchsorted(lost_req64, codes, side="left")
            hi = np.searchsorted(lost_req64, codes, side="right")
            lost_of[g] = np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist())])
    by_phase: dict[int, list[tuple[int, tuple]]] = {}
    for k, (p_index, u_code, sl) in enumerate(group_list):
        row = row_of(run, summary, p_index, strings[u_code])
        if not (row.backlogged and row.limit_tps and p_index in phase_steps):
            continue
        ts, rs, cs = t[sl], req[sl], None if c is None else c[sl]
        sel = lost_of.get(k)
        if sel is not None and len(sel):  # the cancelled requests' charges without an emit, at their dispatch
            ts = np.concatenate([ts, lost_t[sel]])
            rs = np.concatenate([rs, lost_req[sel]])
            if cs is not None:
                cs = np.concatenate([cs, np.ones(len(sel), dtype=cs.dtype)])
            o = np.argsort(ts, kind="stable")
            ts, rs, cs = ts[o], rs[o], None if cs is None else cs[o]
        by_phase.setdefault(p_index, []).append((k, (ts, rs, row.limit_tps, cs)))
    out: dict[int, object] = {}
    for p_index, items in by_phase.items():
        starts, periods, worked, longest_latency, index = phase_steps[p_index]
        results = check_spacing_many([it for _, it in items], index,
                                     shift_ns=longest_latency if label == "emit" else 0)
        out.update(zip((k for k, _ in items), results))
    return out


def _charge_parity(run: RunData, name: str, summary: RunSummary, totals, first_user: np.ndarray,
                   strings: list[str], n_codes: int) -> None:
    """Per row: dispatch events - emitted tokens of each finished request, against its allowance.

    Allowance: 0 for a request finished by length, and by stop under synchronous scheduling;
    1 for a stop under async scheduling (the look-ahead step dispatched before the stop was
    seen); for an abort (or another reason) the steps already dispatched when it came: 1, 2 with
    async scheduling. Fewer charges than tokens is outside the allowance too (tokens never charged).
    """
    trace = run.traces[name]
    meta_async = trace.events.meta.get("async_scheduling")
    is_async = bool(run.engines[name].async_scheduling if meta_async is None else meta_async)
    codes = np.flatnonzero((totals.finish_reason >= 0) & (trace.req_phase >= 0) & (first_user >= 0))
    if len(codes) == 0:
        return
    excess = totals.dispatched[codes].astype(np.int64) - totals.emitted[codes]
    reason = totals.finish_reason[codes]
    allowance = np.full(len(codes), 2 if is_async else 1, dtype=np.int64)
    allowance[reason == FINISH_LENGTH] = 0
    allowance[reason == FINISH_STOP] = 1 if is_async else 0
    over = np.maximum(excess - allowance, 0) + np.maximum(-excess, 0)
    for p_index, u_code, pos in rowgroups.row_groups(trace, codes, first_user, n_codes):
        row = row_of(run, summary, p_index, strings[u_code])
        row.charge_requests = len(pos)
        row.charge_excess_tokens = int(excess[pos].sum())
        row.charge_over_allowance = int(over[pos].sum())
        if row.charge_over_allowance:
            w = pos[int(np.argmax(over[pos]))]
            code = int(codes[w])
            rec = trace.req_record[code]
            who = run.records[rec].client_id if rec >= 0 else strings[code]
            row.charge_worst = (f"{who}: {int(totals.dispatched[code])} dispatch events for "
                                f"{int(totals.emitted[code])} tokens emitted, finished by "
                                f"{FINISH_REASONS.get(int(reason[w]), 'unknown')} (allowed {int(allowance[w])} more)")


def _engine_ttft(run: RunData, name: str, summary: RunSummary, e_t_r: np.ndarray, e_by_req, first_user: np.ndarray,
                 strings: list[str], n_codes: int, sent_all: np.ndarray) -> None:
    """Per row: the engine's first emit event of each request minus the client's send time (``sent_all``:
    every client record's, -1 when never sent)."""
    trace = run.traces[name]
    if len(e_by_req) == 0:
        return
    codes = e_by_req.keys.astype(np.int64)
    rec = trace.req_record[codes]
    keep = (rec >= 0) & (trace.req_phase[codes] >= 0) & (first_user[codes] >= 0)
    codes, first_emit, rec = codes[keep], e_t_r[e_by_req.starts[keep]], rec[keep]
    sent = sent_all[rec]
    keep = sent >= 0
    codes, ttft = codes[keep], first_emit[keep].astype(np.int64) - sent[keep]
    for p_index, u_code, pos in rowgroups.row_groups(trace, codes, first_user, n_codes):
        row_of(run, summary, p_index, strings[u_code]).ttft_engine = gap_stats(ttft[pos])
