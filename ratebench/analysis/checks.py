"""Turning the run's figures into checks, each with its figure, threshold and one-line reason."""

from __future__ import annotations

import numpy as np

from ratebench.analysis.answers import answer_comparisons
from ratebench.analysis.bound import BoundResult
from ratebench.analysis.fairness import jain_index
from ratebench.analysis.prestart import feature_off_checks, flag_checks
from ratebench.analysis.fleet import cut_by_failover, fleet_phases
from ratebench.analysis.isolation import Binding, fleet_isolation_checks, isolation_checks, phase_binding
from ratebench.analysis.lateness import lateness_checks
from ratebench.analysis.load import RunData
from ratebench.analysis.spacing import SpacingResult
from ratebench.analysis.overhead import EVENTS_PAIR, ROLE_ON
from ratebench.analysis.pressure import SETTLE_NS, place_shares, stream_waits
from ratebench.analysis.reconcile import cancel_problem
from ratebench.analysis.summary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds, UserPhaseSummary
from ratebench.analysis.waiting import WAIT_MIN_NS, BudgetWait, budget_waits
from ratebench.analysis.witness import WitnessResult
from ratebench.analysis.refusals import refusal_witnesses
from ratebench.analysis.workcons import work_conservation

WHOLE = "*"


def _bound_check(name: str, scen: str, phase: str, engine: str, user: str, b: BoundResult, what: str,
                 informational: bool = False, tolerance_text: str | None = None) -> Check:
    w = b.worst
    tol = f" + step {b.tolerance_ns / 1e6:.1f} ms" if b.tolerance_ns else ""
    if tolerance_text is not None:
        tol = tolerance_text
    if w is None:
        return Check(name, scen, phase, engine, user, None, 0, ">=", "tokens", None if informational else True,
                     f"no {what}")
    text = (
        f"worst window {w.window_s:.3f} s on {what}: {w.tokens} tokens, allowed "
        f"(W + {b.burst_ns / 1e9:g}{tol}) * {b.limit_tps} + 1 = {w.allowed_tokens:.2f}, slack {w.slack_tokens:+.3f}"
    )
    return Check(name, scen, phase, engine, user, round(w.slack_tokens, 9), 0, ">=", "tokens",
                 None if informational else b.passed, text)


def _stream_fairness(row: UserPhaseSummary, binding: Binding, th: Thresholds, ids: tuple) -> Check:
    """A user's streams take turns on its budget. A user whose limit bound in the phase (a refuse
    event, or its own dispatches spent its budget to the bound: the verifier's replay), or one whose
    binding cannot be told, is judged on every token while all its streams were active. A user whose
    limit never bound shares no budget: while a stream of it waits between two requests for a resident
    slot its siblings run, as on an engine without the limiter, so every two of its streams are judged
    while both had a request in service (the places among resident streams are the limiter's)."""
    strict = (not binding.known or binding.bound(row.user) or row.spent_to_bound(th.burst_ns)
              or not row.streams_resent)
    text = f"largest difference between {row.streams} streams' token counts while all were active: {row.stream_spread}"
    if strict:
        return Check("stream-fairness", *ids, row.stream_spread, th.stream_spread_max, "<=", "tokens",
                     row.stream_spread <= th.stream_spread_max, text)
    why = (f"its limit never bound: no refuse event, and its dispatches never spent its budget to the bound, so "
           f"a stream queued between its requests for a slot is out of the count, as on an engine without the "
           f"limiter; {row.stream_spread} counting those waits")
    figure = row.stream_spread_in_service
    if figure is None:
        return Check("stream-fairness", *ids, None, th.stream_spread_max, "<=", "tokens", None,
                     f"not judged: no two of its {row.streams} streams ever had a request in service together, so "
                     f"none waited on another for a place ({why})")
    return Check("stream-fairness", *ids, figure, th.stream_spread_max, "<=", "tokens", figure <= th.stream_spread_max,
                 f"largest difference between two of {row.streams} streams' token counts counted while both had a "
                 f"request in service: {figure} ({why})")


def build_checks(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    checks: list[Check] = []
    # 1. the bound over each engine's whole file
    for eb in s.engine_bounds:
        if eb.dispatch is not None:
            checks.append(_bound_check("bound-dispatch-run", WHOLE, WHOLE, eb.engine, eb.user, eb.dispatch,
                                       "dispatch events, whole engine file"))
        if eb.emit is not None:
            checks.append(_bound_check("bound-emit-run", WHOLE, WHOLE, eb.engine, eb.user, eb.emit,
                                       "emit events, whole engine file"))
    failover_cut = cut_by_failover(run)
    bindings: dict = {}  # phase index -> whose limit bound in it (isolation.phase_binding)
    for (p_index, user), row in sorted(s.rows.items(), key=lambda kv: kv[0]):
        ids = (row.scenario, row.phase, row.engine, user)
        # 1. the bound in the phase
        if row.bound_dispatch is not None:
            checks.append(_bound_check("bound-dispatch", *ids, row.bound_dispatch, "dispatch events"))
        if row.bound_emit is not None:
            checks.append(_bound_check("bound-emit", *ids, row.bound_emit, "emit events"))
        # two witnesses: the client's times against the engine's events (analysis/witness.py)
        witness = s.witness.get((p_index, user))
        if row.bound_client is not None:
            checks.append(_bound_client(row.bound_client, witness, ids))
        if witness is not None:
            checks.extend(_witness(witness, th, ids))
        # 2. delivery, and even spacing (the lower side of the bound on every window)
        if row.backlogged and row.limit_tps:
            checks.append(_delivery(row, th, ids))
            for name, result, what in (("even-spacing-dispatch", row.spacing_dispatch, "dispatch events"),
                                       ("even-spacing-emit", row.spacing_emit, "emit events")):
                if result is not None:
                    checks.append(_spacing(name, result, what, th, ids))
        # prompt tokens are free: long prompts' first token far sooner than charging the prompt would allow
        prompt_free = _prompt_free(run.phases[p_index], row, ids)
        if prompt_free is not None:
            checks.append(prompt_free)
        # 3. rates, for information
        rate = row.emit_rate or row.client_rate
        if rate is not None and rate.seed_rate_tps is not None:
            checks.append(Check("rate-seed", *ids, round(rate.seed_rate_tps, 3), row.limit_tps, "vs", "tok/s", None,
                                f"{rate.tokens} tokens over {(rate.last_ns - rate.first_ns) / 1e9:.3f} s "
                                f"({'engine emit' if row.emit_rate else 'client'}), limit {row.limit_tps}"))
        # 5. reconciliation and cancellations
        req_checks = s.request_checks.get((p_index, user), [])
        # a fleet's failover cut some answers short on purpose: fleet-failover-lost judges those
        cut = [c for c in req_checks if c.client_id in failover_cut]
        finished = [c for c in req_checks if not c.cancelled and c.client_id not in failover_cut]
        if finished:
            bad = [c for c in finished if not c.ok]
            cut_text = f" ({len(cut)} cut short by the fleet's failover: fleet-failover-lost)" if cut else ""
            checks.append(Check("reconciliation", *ids, len(bad), 0, "<=", "requests", not bad,
                                bad[0].problem + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") + cut_text
                                if bad else f"{len(finished)} finished requests: usage = streamed = emitted{cut_text}"))
        cancelled = [c for c in req_checks if c.cancelled]
        if cancelled:
            # a profile may allow more for a phase whose load delays aborts on their way to the engine
            # (a mix of a thousand streams on two cores: the limiter-off engine shows the same)
            max_steps = max(th.cancel_max_steps, int(run.phases[p_index].params.get("cancel_max_steps") or 0))
            problems = [cancel_problem(c, max_steps) for c in cancelled]
            bad = [p for p in problems if p is not None]
            worst = max((c.emit_events_after_cancel or 0) for c in cancelled)
            charged = sum(c.charged_tokens or 0 for c in cancelled)
            lat = [c.abort_latency_ns for c in cancelled if c.abort_latency_ns is not None]
            lat_text = f", abort reached the engine within {max(lat) / 1e6:.1f} ms" if lat else ""
            checks.append(Check("cancellation", *ids, worst, max_steps, "<=", "steps", not bad,
                                bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") if bad else
                                f"{len(cancelled)} cancelled: engine stopped, at most {worst} step(s) after the "
                                f"cancel, {charged} tokens charged{lat_text}"))
        # 6. every charge samples a token: dispatch events = emitted tokens, request by request
        if row.charge_requests:
            checks.append(_charge_parity(row, ids))
        # 8. the user's streams take turns
        if row.stream_spread is not None:
            if p_index not in bindings:
                bindings[p_index] = phase_binding(run, run.phases[p_index])
            checks.append(_stream_fairness(row, bindings[p_index], th, ids))
    checks.extend(_engines_as_asked(run))
    checks.extend(feature_off_checks(run))
    checks.extend(flag_checks(run))
    checks.extend(_identity(run, s))
    checks.extend(_waiting(s, th))
    checks.extend(_budget_waits(run, s, th))
    checks.extend(isolation_checks(run, s, th))
    checks.extend(fleet_isolation_checks(run, th))
    checks.extend(_overhead(run, s, th))
    checks.extend(_jain(run, s, th))
    checks.extend(lateness_checks(run))
    checks.extend(_pressure(run, th))
    checks.extend(_work_conservation(run, th))
    checks.extend(_refusal_witness(run, th))
    checks.extend(_answers_intact(run, th))
    checks.extend(_fleet(run, s, th))
    return checks


def _fleet_counters(fp) -> list[Check]:
    """The operator's view of a fleet: each member's per-user granted counter on /metrics over the phase
    (``--output-rate-metrics-users``) against that member's dispatch events of the user, exactly. Summed
    over the members it is the user's tokens across the fleet."""
    out = []
    for fu in fp.users:
        parts, worst = [], 0
        for member in fp.members:
            counted = (fp.counters.get(member) or {}).get(fu.user, {}).get("granted", 0.0)
            events = fu.tokens_by_engine.get(member, 0)
            worst = max(worst, abs(int(round(counted)) - events))
            parts.append(f"{member} {counted:g} counted, {events} dispatch events")
        total = sum((fp.counters.get(m) or {}).get(fu.user, {}).get("granted", 0.0) for m in fp.members)
        out.append(Check("fleet-metrics", fp.scenario, fp.phase, fp.fleet, fu.user, worst, 0, "<=", "tokens",
                         worst == 0, f"vllm:output_rate_tokens_granted_total over the phase, per engine: "
                                     f"{'; '.join(parts)}; across the fleet {total:g} tokens"))
    return out


def _failover(fp, where: str) -> list[Check]:
    """A fleet's failover phase: no request lost silently, and every user of the stopped engine served by
    another one after the stop."""
    o, fo = fp.outcomes, fp.failover
    visibly = "; ".join(f"{len(ids)} {how}" for how, ids in o.failed_visibly.items()) or "none"
    head = (f"{where}; {fo.get('engine')} stopped {fo.get('stopped_after_s')} s into the phase: "
            f"{fp.requests} requests, {o.completed} completed, failed with what the client sees: {visibly}")
    lost = o.lost_silently
    out = [Check("fleet-failover-lost", fp.scenario, fp.phase, fp.fleet, None, len(lost), 0, "<=", "requests",
                 not lost, head + (f"; lost silently: {lost[0]}" + (f" (and {len(lost) - 1} more)" if len(lost) > 1
                                                                    else "") if lost else "; none lost silently"))]
    users = fo.get("users_before") or []
    moved = "; ".join(f"{u} to {e}" for u, e in o.moved.items()) or "none"
    judged = bool(o.moved or o.not_moved)
    text = (f"{len(users)} users on {fo.get('engine')} before the stop; served by another engine after it: {moved}"
            + (f"; never served again: {', '.join(o.not_moved)}" if o.not_moved else "")
            + (f"; sent nothing after the stop (not judged): {', '.join(o.silent)}" if o.silent else ""))
    if not users:
        text = f"no user had been served by {fo.get('engine')} before the stop: the failover moved nobody"
    if not judged:
        text = "not exercised, " + text
    out.append(Check("fleet-failover-moved", fp.scenario, fp.phase, fp.fleet, None, len(o.not_moved), 0, "<=",
                     "users", not o.not_moved if judged else None, text))
    return out


def _fleet(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    """A fleet's phases as one (analysis/fleet.py): every request sent through the balancer served by a
    member engine, and each user's bound across the members' merged events and the client's chunks."""
    out = []
    for fp in fleet_phases(run, s, th.burst_ns):
        where = f"policy {fp.policy}, {len(fp.members)} engines behind the balancer"
        bad = fp.unserved
        fo = fp.failover
        text = (f"{len(bad)} of {fp.requests} requests sent through the balancer were served by no engine ({where}): "
                f"{bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")) if bad else \
            f"{fp.requests} requests sent through the balancer, each served by a member engine ({where})"
        passed = not bad
        if fo is not None:
            # refusals while the balancer finds the stopped engine gone are the phase's plan, for the users that
            # engine served; a user it never served must see none
            before = set(fo.get("users_before") or [])
            others = [b for b, u in zip(bad, fp.unserved_users) if u not in before]
            passed = not others
            text = (f"failover ({fo.get('engine')} stopped; its users' refusals judged by fleet-failover-*), "
                    f"{len(others)} refused of users it never served: " + text)
            bad = others
        out.append(Check("fleet-served", fp.scenario, fp.phase, fp.fleet, None, len(bad), 0, "<=", "requests",
                         passed, text))
        if fp.outcomes is not None:
            out.extend(_failover(fp, where))
        if fp.counters is not None and all(isinstance(c, dict) for c in fp.counters.values()):
            out.extend(_fleet_counters(fp))
        elif fp.counters_asked and fo is None:  # (a failover's stopped engine has no /metrics to read)
            missing = [m for m in fp.members if not isinstance((fp.counters or {}).get(m), dict)]
            out.append(Check("fleet-metrics", fp.scenario, fp.phase, fp.fleet, None, len(missing), 0, "<=",
                             "engines", False, f"the engines ran with --output-rate-metrics-users, and "
                                                f"{', '.join(missing)} exported no per-user counter on /metrics"))
        for fu in fp.users:
            spread = ", ".join(f"{e} {n}" for e, n in fu.tokens_by_engine.items())
            ids = (fp.scenario, fp.phase, fp.fleet, fu.user)
            for name, b, what in (("fleet-bound-dispatch", fu.dispatch, "charges (dispatch events)"),
                                  ("fleet-bound-emit", fu.emit, "emitted tokens (one engine step of tolerance)"),
                                  ("fleet-bound-client", fu.client, "tokens the client received (windows widened "
                                   "as each engine's bound-client)")):
                if b is None or b.worst is None:
                    continue
                w = b.worst
                text = (f"{where}: the user's {what} across the fleet, merged from {fu.engines_used} of "
                        f"{len(fp.members)} engines (charges per engine: {spread}); worst window "
                        f"{(w.end_ns - w.start_ns) / 1e9:.3f} s held {w.tokens} tokens, {w.allowed_tokens:.1f} allowed "
                        f"at {fu.limit_tps} tok/s")
                if fu.moved:
                    text += (f" + one burst and one token for its move off the stopped engine (windows widened by "
                             f"{fu.allowance_ns / 1e6:.1f} ms)")
                if not b.passed and fu.engines_used > 1:
                    text += (f": each engine kept its own bound, the fleet gave the user up to "
                             f"{fu.engines_used} x its limit ({fp.policy} spread its requests over the engines)")
                out.append(Check(name, *ids, round(w.slack_tokens, 3), 0, ">=", "tokens", b.passed, text))
    return out


def _answers_intact(run: RunData, th: Thresholds) -> list[Check]:
    """Per greedy mix phase: every answer (up to where it was cut) token for token as the same request's on the
    limiter-off engine, or, where the two part, the limiter-off engine's greedy answer up to ties, scored there
    (analysis/answers.py)."""
    out = []
    tol = th.answers_logprob_tol
    for c in answer_comparisons(run, tol):
        ids = (c.scenario, c.phase, c.engine, None)
        against = f"the same requests on {c.base_phase}@{c.base_engine}"
        if not c.compared:
            out.append(Check("answers-intact", *ids, None, 0, "<=", "requests", None,
                             f"no greedy answer to compare with {against}"
                             + (f" ({c.without_ids} without token ids)" if c.without_ids else "")))
            continue
        text = f"{len(c.differing)} of {c.compared} greedy answers ({c.tokens} tokens) differ from {against}"
        if c.differing:
            d = c.differing[0]
            text += f"; first: {d.client_id} ({d.user or 'anonymous'}) from token {d.position}: {d.on} against {d.off}"
            if d.not_greedy_at is not None:
                text += (f"; scored on the limiter-off engine, its token {d.not_greedy_at} has logprob "
                         f"{d.logprob:.4f} where that engine's likeliest has {d.top_logprob:.4f} (more than "
                         f"{tol:g} apart: not a tie, not its greedy answer)")
            elif not d.scored:
                text += "; not scored on the limiter-off engine"
        if c.ties:
            t = c.ties[0]
            text += (f"; {len(c.ties)} parted at a tie and went on as the limiter-off engine's greedy "
                     f"answer (scored there: every token within {tol:g} of its likeliest), first {t.client_id} at "
                     f"token {t.position}, logprob {t.logprob:.4f} against {t.top_logprob:.4f}")
        if c.without_ids:
            text += f"; {c.without_ids} pairs without token ids not compared"
        out.append(Check("answers-intact", *ids, len(c.differing), 0, "<=", "requests", not c.differing, text))
    return out


def _bound_client(b: BoundResult, w: WitnessResult | None, ids) -> Check:
    """The bound on the client's chunk times, its windows widened by the emit tolerance T and the spread of
    the measured delivery latency (witness.py: every token of a client window was emitted in a window
    Lmax - Lmin longer). Information only where no latency was measured (no engine events)."""
    if w is None or w.client_tolerance_ns is None:
        return _bound_check("bound-client", *ids, b, "client chunks (information only: no engine emit events "
                            "to measure the delivery latency against)", informational=True)
    tol = (f" + step {w.emit_tolerance_ns / 1e6:.1f} ms + delivery spread {w.spread_ns / 1e6:.1f} ms"
           if b.tolerance_ns else "")
    c = _bound_check("bound-client", *ids, b, "client chunks", tolerance_text=tol)
    c.explanation += (f"; delivery latency (client arrival - engine emit) {w.latency_min_ns / 1e6:.2f}.."
                      f"{w.latency_max_ns / 1e6:.2f} ms, p50 {w.latency_p50_ns / 1e6:.2f} ms over {w.tokens} tokens")
    return c


def _witness(w: WitnessResult, th: Thresholds, ids) -> list[Check]:
    """witness-order: nothing reached the client before the engine says it made it (tokens against their
    emits, the stream's end against the finish, the send against the request's first event), within the
    clock's resolution; witness-emits: every token the client received has an emit event."""
    out = []
    worst = w.worst
    clock_ms = th.witness_clock_ns / 1e6

    def margin(e, text: str) -> str:
        ms = e.early_ns / 1e6
        return text.format(d=f"{ms:.3f} ms before" if ms > 0 else f"{-ms:.3f} ms after")

    if worst is not None:
        what, e = worst
        parts = []
        if w.worst_token is not None:
            t = w.worst_token
            parts.append(margin(t, f"tokens ({w.tokens} of {w.requests} requests): token {t.token} of {t.client_id} "
                                   "reached the client {d} its emit event"))
        if w.worst_end is not None:
            parts.append(margin(w.worst_end, f"stream ends ({w.ends}): {w.worst_end.client_id}'s came {{d}} the "
                                             "engine's finish event"))
        if w.worst_sent is not None:
            parts.append(margin(w.worst_sent, f"sends ({w.sent}): the engine's first event of "
                                              f"{w.worst_sent.client_id} came {{d}} the client sent it"))
        ms = e.early_ns / 1e6
        ok = e.early_ns <= th.witness_clock_ns
        head = (f"the client's times contradict the engine's event file by {ms:.3f} ms" if not ok else
                f"the client's times agree with the engine's event file (closest {ms:+.3f} ms)")
        out.append(Check("witness-order", *ids, round(ms, 6), clock_ms, "<=", "ms", ok,
                         f"{head}, allowed {clock_ms:g} ms (the clock's resolution); worst of each: "
                         + "; ".join(parts)))
    if w.latency_max_ns is not None and w.spread_ns is not None:
        # bound-client widens its windows by this spread: a wide one lets a client see several bursts at
        # once where the engine's emits were even (an output path that holds tokens back)
        spread_ms, allowed_ms = w.spread_ns / 1e6, th.delivery_spread_max_ns / 1e6
        out.append(Check("witness-delivery", *ids, round(spread_ms, 6), allowed_ms, "<=", "ms",
                         w.spread_ns <= th.delivery_spread_max_ns,
                         f"tokens reached the client {w.latency_min_ns / 1e6:.2f} to {w.latency_max_ns / 1e6:.2f} ms "
                         f"after their emit events (p50 {w.latency_p50_ns / 1e6:.2f} ms, {w.tokens} tokens): a spread "
                         f"of {spread_ms:.2f} ms, allowed {allowed_ms:g} ms (bound-client's windows widen by this "
                         "spread: a wider one would hide tokens held back and sent in clumps)"))
    if w.requests or w.unemitted_tokens:
        bad = w.unemitted_tokens
        text = (f"{bad} tokens in {w.unemitted_requests} request(s) reached the client with no emit event in the "
                f"engine's file; most: {w.unemitted_example}" if bad else
                f"every one of the {w.tokens} tokens the client received in {w.requests} request(s) has its emit "
                "event")
        out.append(Check("witness-emits", *ids, bad, 0, "<=", "tokens", not bad, text))
    return out


def _engines_as_asked(run: RunData) -> list[Check]:
    """Each engine with an event file ran as the run asked: the scheduling mode (vLLM's CPU platform
    turns --async-scheduling off without a word, and then promise 5's async half is never run), the
    limits and burst in its header, the CPU async overlay's own evidence, and no charges with the
    limiter off."""
    out = []
    for name, problems in sorted(run.engine_problems.items()):
        eng = run.engines[name]
        asked = (f"{'async' if eng.async_scheduling else 'sync'} scheduling, limiter "
                 f"{'on' if eng.feature else 'off'}")
        out.append(Check("engine-as-asked", WHOLE, WHOLE, name, None, len(problems), 0, "<=", "problems",
                         not problems,
                         "; ".join(problems) if problems else f"ran as asked ({asked}; its event file's header)"))
    return out


def _delivery(row: UserPhaseSummary, th: Thresholds, ids) -> Check:
    """The steady rate on dispatch events (charges) and on emitted tokens; both must reach the threshold,
    so a limiter that charges without emitting cannot pass on its charges alone."""
    measured = [(src, r) for src, r in (("dispatch", row.dispatch_rate), ("emit", row.emit_rate))
                if r is not None and r.steady_rate_tps is not None]
    if not measured:
        rate = row.dispatch_rate or row.emit_rate
        tokens = rate.tokens if rate else 0
        return Check("delivery", *ids, None, th.delivery_min, ">=", "x limit", None,
                     f"{tokens} tokens: too few past the initial burst to measure a steady rate")
    ratios = [(src, r, r.steady_rate_tps / row.limit_tps) for src, r in measured]
    worst = min(x for _, _, x in ratios)
    text = "; ".join(
        f"steady {src} rate {r.steady_rate_tps:.2f} tok/s = {x:.3f} x limit {row.limit_tps} "
        f"({r.steady_tokens} tokens beyond the {r.tokens - r.steady_tokens}-token burst over "
        f"{(r.last_ns - r.first_ns) / 1e9:.2f} s)" for src, r, x in ratios)
    return Check("delivery", *ids, round(worst, 4), th.delivery_min, ">=", "x limit", worst >= th.delivery_min, text)


def _spacing(name: str, r: SpacingResult, what: str, th: Thresholds, ids) -> Check:
    """Fewest tokens in a window of the backlog against N * W less 1 + N * (P + slack)."""
    allowance = r.allowance_tokens(th.spacing_slack_ns)
    w = r.worst
    if w is None:
        return Check(name, *ids, None, round(allowance, 3), "<=", "tokens short", None,
                     f"no window to judge on {what}: the engine, not the budget, limited the user "
                     f"(fewer waiting requests than tokens due per step)")
    ok = w.deficit_tokens <= allowance
    text = (f"emptiest window {w.window_s * 1e3:.1f} ms on {what} ({r.backlog_s:.2f} s judged in {r.intervals} "
            f"run(s) of steps): {w.tokens} tokens where {r.limit_tps} tok/s x W = {w.expected_tokens:.2f}, "
            f"{w.deficit_tokens:.2f} short; allowed 1 + N x (longest step period "
            f"{r.step_ns / 1e6:.1f} ms + slack {th.spacing_slack_ns / 1e6:g} ms) = {allowance:.2f}")
    return Check(name, *ids, round(w.deficit_tokens, 3), round(allowance, 3), "<=", "tokens short", ok, text)


def _prompt_free(phase, row: UserPhaseSummary, ids) -> Check | None:
    """Only output tokens are limited: in a long-prompt phase, the p50 time to first token (engine side:
    first emit - sent; client side without events) stays under a quarter of what charging the prompt at
    the user's limit would take (prompt tokens / N / 4)."""
    prompt_tokens = phase.params.get("prompt_tokens")
    ttft = row.ttft_engine or row.ttft_client
    if phase.kind != "long-prompt" or not row.limit_tps or not prompt_tokens or ttft is None:
        return None
    limit_s = prompt_tokens / row.limit_tps / 4
    p50_s = ttft.p50_ns / 1e9
    return Check("prompt-free", *ids, round(p50_s, 4), round(limit_s, 4), "<=", "s", p50_s <= limit_s,
                 f"p50 time to first token of {ttft.count} requests with {prompt_tokens}-token prompts "
                 f"{p50_s * 1e3:.0f} ms ({'engine' if row.ttft_engine else 'client'} side); charging the prompt "
                 f"at {row.limit_tps} tok/s would take {prompt_tokens / row.limit_tps:.1f} s (allowed a quarter)")


def _waiting(s: RunSummary, th: Thresholds) -> list[Check]:
    """The waiting scenario: CPU spent waiting, and how soon the waiting engine takes a new request or an abort."""
    out = []
    for w in s.waiting:
        ids = (w.scenario, w.waiting.phase, w.engine)
        if w.waiting_excess_cpus is None:
            out.append(Check("wait-cpu", *ids, None, None, th.wait_cpu_max, "<=", "CPUs", None,
                             "EngineCore CPU time not measured (attached engine, or no EngineCore process found)"))
        else:
            x = w.waiting_excess_cpus
            out.append(Check("wait-cpu", *ids, None, round(x, 4), th.wait_cpu_max, "<=", "CPUs", x <= th.wait_cpu_max,
                             f"EngineCore spent {w.waiting.cpu_s:.2f} CPU-s over {w.waiting.wall_s:.2f} s of waiting "
                             f"with {w.waiting.steps} steps; an idle engine keeps {w.idle_cpus:.3f} CPUs busy and a step "
                             f"costs {w.step_cpu_ms:.2f} ms (solved from the idle phase: {w.idle.cpu_s:.2f} CPU-s, "
                             f"{w.idle.wall_s:.2f} s, {w.idle.steps} steps; and the busy phase: {w.busy.cpu_s:.2f} "
                             f"CPU-s, {w.busy.wall_s:.2f} s, {w.busy.steps} steps): {x:+.3f} CPUs beyond that"))
        added = w.wake_added_ms
        if added is not None:
            out.append(Check("wake-first-token", *ids, w.probe_user, round(added, 3), th.wake_max_ms, "<=", "ms",
                             added <= th.wake_max_ms,
                             f"p50 time to first token of {w.probes} probes while the engine waits "
                             f"{w.probe_ttft_waiting_p50_ms:.1f} ms vs {w.probe_ttft_idle_p50_ms:.1f} ms on the idle "
                             f"engine: {added:+.1f} ms"))
        if w.abort_latency_ms:
            p50 = w.abort_p50_ms
            out.append(Check("wake-abort", *ids, None, round(p50, 3), th.wake_max_ms, "<=", "ms",
                             p50 <= th.wake_max_ms,
                             f"{len(w.abort_latency_ms)} streams closed while the engine waits: the abort reached "
                             f"the engine in p50 {p50:.1f} ms (max {max(w.abort_latency_ms):.1f} ms)"))
    return out


def _budget_waits(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    """Every phase on a limiter-on engine with step records that waited for budget at least WAIT_MIN_NS in
    all (analysis/waiting.py): wait-steps, the engine's re-wakes per second of waiting (a loop that
    schedules while it waits), and wait-cpu, the EngineCore's CPU beyond an idle engine's and its steps',
    per second of waiting (the waiting scenario's own waiting phase keeps its wait-cpu over the phase)."""
    out = []
    for w in budget_waits(run, s.steps_per_phase, s.waiting):
        if w.wait_ns < WAIT_MIN_NS:
            continue  # not exercised: too little waiting to measure
        ids = (w.scenario, w.phase, w.engine, None)
        waited = (f"{w.wait_s:.2f} s of {w.wall_s:.2f} s waiting for budget after {w.empty_steps} empty steps "
                  f"(of {w.steps}; nothing scheduled, every request held by its user's budget; longest wait "
                  f"{w.longest_wait_ns / 1e6:.1f} ms)")
        polls = ("the engine's loop steps at a fixed cadence by construction (manifest.json engines."
                 f"{w.engine}.loop = polls: the test harness), so its waiting is information only: ")
        rate = w.rewakes_per_s
        text = (f"{waited}: {w.rewakes} of them right after two empty steps, {rate:.1f} per second of "
                f"waiting (a blocked engine wakes every 50 ms at most when nothing comes: 20; a loop that "
                f"schedules every millisecond: about 1,000)")
        out.append(Check("wait-steps", *ids, round(rate, 3), th.wait_steps_max, "<=", "steps/s",
                         None if w.loop_polls else rate <= th.wait_steps_max,
                         polls + text if w.loop_polls else text))
        if w.waiting_scenario:
            continue  # its wait-cpu is the waiting scenario's (over the whole phase)
        out.append(_wait_cpu(w, th, waited, polls))
    return out


def _wait_cpu(w: BudgetWait, th: Thresholds, waited: str, polls: str) -> Check:
    ids = (w.scenario, w.phase, w.engine, None)
    x = w.excess_cpus
    if w.cpu_s is None:
        why = "the EngineCore's CPU time was not measured (attached engine, or no EngineCore process found)"
    elif w.model is None:
        why = ("no idle and busy phases on this engine to price its steps and its idle loop (the waiting "
               "scenario's); wait-steps judges the wait without them")
    else:
        why = (f"the model prices the {w.sampling_steps} sampling steps, not the {w.empty_steps} empty steps a "
               f"blocked engine runs between users' tokens (pricing those would let a loop that polls through "
               f"schedule() pay for itself); judged in the waiting scenario, where every request waits, and by "
               f"wait-steps here ({x:+.3f} CPUs per second of waiting measured)")
    return Check("wait-cpu", *ids, None if x is None else round(x, 4), th.wait_cpu_max, "<=", "CPUs", None,
                 f"{polls if w.loop_polls else ''}{waited}; information only: {why}")


def _identity(run: RunData, s: RunSummary) -> list[Check]:
    """Every request charged to the user it sent in vllm_xargs.output_rate_user (or __anonymous__)."""
    out = []
    for (p_index, user), tally in sorted(s.identity.items()):
        p = run.phases[p_index]
        bad = tally.mismatches
        text = (f"{tally.requests} requests, each charged to the user it sent (vllm_xargs.output_rate_user, "
                f"or __anonymous__ without one)")
        if bad:
            text = f"{len(bad)} of {tally.requests} requests charged to another user: " + "; ".join(bad[:3]) + (
                f" (and {len(bad) - 3} more)" if len(bad) > 3 else "")
        out.append(Check("identity", p.scenario, p.phase, p.engine, user, len(bad), 0, "<=", "requests", not bad,
                         text))
    return out


def _charge_parity(row: UserPhaseSummary, ids) -> Check:
    ok = row.charge_over_allowance == 0
    text = (f"{row.charge_requests} finished requests: dispatch events - emitted tokens = {row.charge_excess_tokens:+d} "
            f"in all, {row.charge_over_allowance} beyond the allowance (0 for length, and stop when synchronous; "
            f"the look-ahead step after a stop, the steps dispatched before an abort)")
    if not ok:
        text += f"; worst {row.charge_worst}"
    return Check("charge-parity", *ids, row.charge_over_allowance, 0, "<=", "tokens", ok, text)


def _profile_max_overhead(run: RunData, scenario: str) -> float | None:
    """The overhead scenario's own threshold (its ``max_overhead`` parameter), if its profile gives one."""
    for p in run.phases:
        if p.scenario == scenario and p.params.get("max_overhead") is not None:
            return float(p.params["max_overhead"])
    return None


def _overhead(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    """feature-on against each other role: 1 - the median of the per-round throughput ratios, judged
    against ``--max-overhead`` or else the scenario's ``max_overhead`` (the profile's), if either is given."""
    out = []
    for o in s.overheads:
        profile_limit = _profile_max_overhead(run, o.scenario)
        for pair, pooled in o.ratios.items():
            if not pair.startswith(f"{ROLE_ON}/"):
                continue
            a, b = pair.split("/")
            paired = o.paired.get(pair)
            ratio = paired.median if paired is not None else pooled
            overhead = 1 - ratio
            name, limit = ("event-recording", th.max_event_overhead) if pair == EVENTS_PAIR else \
                ("overhead", th.max_overhead)
            source = "--max-overhead" if name == "overhead" else "--max-event-overhead"
            if name == "overhead" and limit is None and profile_limit is not None:
                limit, source = profile_limit, "the profile's max_overhead"
            passed = None if limit is None else overhead <= limit
            if paired is not None:
                text = (f"median of {paired.rounds} per-round throughput ratios {a}/{b} {paired.median:.3f} "
                        f"(spread {paired.min:.3f}..{paired.max:.3f}), pooled {pooled:.3f}")
            else:
                text = f"no round ran both: pooled ratio {pooled:.3f}"
            text += f"; throughput over all rounds {a} {o.throughput_tps[a]:.1f} vs {b} {o.throughput_tps[b]:.1f} tok/s"
            if a in o.step_p50_ns and b in o.step_p50_ns:
                text += (f"; engine step p50 {o.step_p50_ns[a] / 1e6:.3f} ms vs "
                         f"{o.step_p50_ns[b] / 1e6:.3f} ms")
            text += f"; at most {limit:g} ({source})" if limit is not None else "; report only (no threshold given)"
            out.append(Check(name, o.scenario, pair, "*", None, round(overhead, 4), limit, "<=", "fraction", passed,
                             text))
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


def _pressure(run: RunData, th: Thresholds) -> list[Check]:
    """Under KV pressure: the phase was under pressure, no stream of a throttled user starved. With
    more streams than active places: every user got its fair share of them."""
    out = []
    for p in run.phases:
        if "kv_usage_max" in p.params or "preemptions" in p.params:
            usage, preempted = p.params.get("kv_usage_max"), p.params.get("preemptions")
            applied = bool(preempted) or (usage is not None and usage >= 0.95)
            out.append(Check(
                "kv-pressure-applied", p.scenario, p.phase, p.engine, None, preempted, 1, ">=", "preemptions",
                applied,
                f"{preempted if preempted is not None else 'unknown'} preemptions, highest KV cache use "
                f"{'unknown' if usage is None else f'{usage:.0%}'}"
                + ("" if applied else ": the phase never ran short of KV, so it shows nothing; make the KV cache "
                   "smaller (--num-gpu-blocks-override) or the throttled user's prompts longer")))
        for sw in stream_waits(run, p):
            w = sw.worst
            if w is None:
                continue
            allowed_ns = th.stream_wait_factor * sw.expected_ns + th.stream_wait_slack_ns
            waits = sorted((x.wait_ns for x in sw.waits), reverse=True)
            out.append(Check(
                "stream-wait", p.scenario, p.phase, p.engine, sw.user, round(w.wait_ns / 1e6, 1),
                round(allowed_ns / 1e6, 1), "<=", "ms", w.wait_ns <= allowed_ns,
                f"longest wait of a stream for a token: stream {w.stream_index} ({w.client_id}) waited "
                f"{w.wait_ns / 1e6:.0f} ms for its {w.where} with {w.tokens} tokens in all; allowed "
                f"{th.stream_wait_factor:g} x {sw.streams} streams / {sw.limit_tps} tok/s + "
                f"{th.stream_wait_slack_ns / 1e6:g} ms = {allowed_ns / 1e6:.0f} ms; the streams' longest waits "
                + ", ".join(f"{x / 1e6:.0f}" for x in waits) + " ms"))
        ps = place_shares(run, p)
        if ps is not None and ps.done_early:
            out.append(Check(
                "place-share", p.scenario, p.phase, p.engine, ", ".join(ps.done_early), 0.0, 0.0, ">",
                "s measured", False,
                f"the users never all wanted tokens at once: {', '.join(ps.done_early)} had every answer "
                f"done before the last user's first request (plus {SETTLE_NS / 1e6:.0f} ms), so the places' "
                "shares were never measured; lengthen the phase (the scenario's max_tokens) or bring the "
                "last user sooner (lead_s)"))
        elif ps is not None:
            worst_user, worst = ps.worst
            rates = ", ".join(f"{u} {ps.rates_tps[u]:.0f}/{ps.fair_tps[u]:.0f}" for u in sorted(ps.rates_tps))
            window = f"over {ps.window_s:.2f} s while every user wanted tokens; tok/s got/fair: {rates}"
            out.append(Check("place-share", p.scenario, p.phase, p.engine, worst_user, round(worst, 4),
                             th.place_share_min, ">=", "x fair share", worst >= th.place_share_min,
                             f"{worst_user} got {worst:.2f} x its max-min fair share of the active places {window}"))
            j = ps.jain
            if j is not None:
                out.append(Check("place-share-jain", p.scenario, p.phase, p.engine,
                                 f"{len(ps.ratios)} users", round(j, 4), th.place_jain_min, ">=", "index",
                                 j >= th.place_jain_min,
                                 f"Jain's index of the users' rates / fair shares {window}"))
    return out


def _refusal_witness(run: RunData, th: Thresholds) -> list[Check]:
    """Each refused user's worst refusal against its own charges: GCRA refuses only a user whose
    charges in some window ending at the refusal reach N x (W + burst) (ratebench/analysis/refusals.py).
    A refusal the charges do not explain would take the user out of the isolation checks."""
    out = []
    tol = th.refusal_tolerance_tokens
    for w in refusal_witnesses(run, th.burst_ns):
        short = w.worst_short_tokens
        head = "no charge before it" if not np.isfinite(w.worst_head_tokens) else f"{w.worst_head_tokens:.2f}"
        text = (f"{w.refusals} refuse event(s); at the one furthest from its bound ({w.worst_t_ns / 1e9:.3f} s "
                f"into the phase) the user's charges in the fullest window ending there exceeded {w.limit_tps} "
                f"tok/s x its length by {head} tokens, where a refusal needs the burst, {w.limit_tps} x "
                f"{th.burst_ns / 1e9:g} s = {w.limit_tps * th.burst_ns / 1e9:.2f} ({short:+.2f} short, "
                f"{tol:g} allowed: charges refunded at the end of the refusing step)")
        out.append(Check("refusal-witness", w.scenario, w.phase, w.engine, w.user,
                         round(short, 3) if np.isfinite(short) else None, tol, "<=", "tokens",
                         bool(short <= tol), text))
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
