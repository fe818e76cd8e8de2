"""Promise 3 and reconciliation: a request out of budget pauses and later resumes, never truncated nor
answered with an error; usage.completion_tokens = tokens streamed = tokens the engine emitted; a
cancelled stream's engine stops generating for it; greedy answers are those of the limiter-off engine."""

from __future__ import annotations

from ratebench.analysis.answers import answer_comparisons
from ratebench.analysis.checks.base import CheckMeaning, RowContext, meanings, per_row, per_run
from ratebench.analysis.load import RunData
from ratebench.analysis.reconcile import cancel_problem
from ratebench.analysis.structured import PENALTY_TOL, structured_conformance
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.thresholds import for_phase
from ratebench.analysis.verdict import Check, Thresholds

MEANINGS = meanings({
    "reconciliation": CheckMeaning("3", "a finished request's usage.completion_tokens, streamed tokens and engine "
                                   "tokens disagree, it was cut short, or it was answered with an error",
                                   "requests.jsonl and {events} for the request the explanation names",
                                   also=("reconciliation",)),
    "cancellation": CheckMeaning("3", "after a client cancel the engine did not stop at once (or never finished "
                                 "the request)", "{events}: the finish event of the request the explanation "
                                 "names; {plot}, the streams panel", also=("reconciliation",)),
    "answers-intact": CheckMeaning("3", "a greedy answer of a mix differs from the same request's on the "
                                   "limiter-off engine: a request paused, moved out of its slot or resumed "
                                   "got another request's KV, or lost its own",
                                   "requests.jsonl: the token_ids of the request the explanation names, against "
                                   "the same request (stream_index) in the baseline phase"),
    "structured-answers": CheckMeaning("3", "an answer constrained by a JSON schema, a regex, a choice, a token "
                                       "set, bad words or min_tokens broke its constraint: a request paused, given back its "
                                       "token, moved out of its slot or resumed lost its grammar's state or its "
                                       "sampling state, or was masked with another request's",
                                       "requests.jsonl: the token_ids of the request the explanation names, and "
                                       "scenarios.json: the phase's option_bodies (its stream's constraint)"),
})


@per_row(70)
def reconciliation_and_cancellations(c: RowContext) -> list[Check]:
    """Finished requests reconcile; cancelled ones stopped at once."""
    run, th, ids = c.run, c.th, c.ids
    checks = []
    req_checks = c.s.request_checks.get((c.p_index, c.user), [])
    # a fleet's failover cut some answers short on purpose: fleet-failover-lost judges those
    cut = [r for r in req_checks if r.client_id in c.failover_cut]
    finished = [r for r in req_checks if not r.cancelled and r.client_id not in c.failover_cut]
    if finished:
        bad = [r for r in finished if not r.ok]
        cut_text = f" ({len(cut)} cut short by the fleet's failover: fleet-failover-lost)" if cut else ""
        checks.append(Check("reconciliation", *ids, len(bad), 0, "<=", "requests", not bad,
                            bad[0].problem + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") + cut_text
                            if bad else f"{len(finished)} finished requests: usage = streamed = emitted{cut_text}"))
    cancelled = [r for r in req_checks if r.cancelled]
    if cancelled:
        # a profile may allow more for a phase whose load delays aborts on their way to the engine
        # (a mix of a thousand streams on two cores: the limiter-off engine shows the same)
        max_steps = for_phase(th, "cancel_max_steps", run.phases[c.p_index].params)
        problems = [cancel_problem(r, max_steps) for r in cancelled]
        bad = [p for p in problems if p is not None]
        worst = max((r.emit_events_after_cancel or 0) for r in cancelled)
        charged = sum(r.charged_tokens or 0 for r in cancelled)
        lat = [r.abort_latency_ns for r in cancelled if r.abort_latency_ns is not None]
        lat_text = f", abort reached the engine within {max(lat) / 1e6:.1f} ms" if lat else ""
        checks.append(Check("cancellation", *ids, worst, max_steps, "<=", "steps", not bad,
                            bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") if bad else
                            f"{len(cancelled)} cancelled: engine stopped, at most {worst} step(s) after the "
                            f"cancel, {charged} tokens charged{lat_text}"))
    return checks


@per_run(150)
def answers_intact(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _answers_intact(run, th)


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


@per_run(155)
def structured_answers(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    """Per request-options phase: every constrained answer obeys its constraint, as a fresh matcher of it
    reads the answer's tokens (analysis/structured.py)."""
    out = []
    for c in structured_conformance(run, th.answers_logprob_tol if th is not None else PENALTY_TOL):
        ids = (c.scenario, c.phase, c.engine, None)
        if c.not_made is not None and not c.checked and not c.unscored:
            out.append(Check("structured-answers", *ids, None, 0, "<=", "requests", None,
                             f"not made: {c.not_made}"))
            continue
        text = (f"{len(c.broken)} of {c.checked} constrained answers ({', '.join(c.options)}; {c.tokens} tokens "
                f"held to them, each grammar's up to where it ended) broke their constraint")
        if c.broken:
            b = c.broken[0]
            text += (f"; first: {b.client_id} ({b.user or 'anonymous'}, {b.option}) at token {b.position}: "
                     f"{b.token} after {b.before}, {b.why}")
            if b.text:  # (no tokenizer loaded where every constraint is judged on token ids alone)
                text += f" (the answer up to it: {b.text[-80:]!r})"
        if c.without_ids:
            text += f"; {c.without_ids} without token ids not checked"
        if c.errors:
            text += f"; {c.errors} answered with an error (reconciliation judges those)"
        if c.not_made:
            text += f"; {c.not_made}"
        if c.unscored:
            text += (f"; {c.unscored} penalised answers could not be scored (first: {c.unscored_why}), failed: "
                     "an answer not judged is not passed")
        out.append(Check("structured-answers", *ids, len(c.broken) + c.unscored, 0, "<=", "requests",
                         not c.broken and not c.unscored, text))
    return out
