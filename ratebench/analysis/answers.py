"""Answers intact (promise 3): a request paused for budget, parked, or moved out of its resident slot
and resumed answers as the same request does on the limiter-off engine.

The limiter pauses requests in ways upstream never does: a throttled request is parked for many
steps, gives its slot to a user with budget while keeping its KV blocks, or gives those up and
recomputes. A mistake there (resuming on blocks it no longer holds, on a stale token count, with
another request's KV) does not change how many tokens an answer has or when they come, so the
bound, spacing and reconciliation all pass: only the answer's content shows it.

Which requests: a ``mix`` phase (role ``measure``) and its ``mix-baseline`` (role ``baseline``), both
with the phase parameter ``greedy_answers`` (the driver sends the same prompts to every engine, and
every request that runs to ``max_tokens`` (``ignore_eos``) at temperature 0), paired by their index
in the mix (user and ``stream_index``). For each pair in which both got token ids (``choices[].token_ids``,
``return_token_ids``) and neither was answered with an error, the tokens both received must agree: a
cancelled answer is compared up to where it was cut. Answers that end with EOS sample (temperature 1)
and are not compared. A request resumed on blocks it no longer held diverged from its first resumed
token.

Ties. Two engines may break a tie differently: the batch a request shares changes the kernels' rounding
(bfloat16 logits), and where two tokens are that close in probability the greedy choice falls either
way. cpu-tiny's random model is flat and ties are common: 1 of 885 answers parted at one in each of two
mix runs, both at two tokens of the same bfloat16 logit. So the driver scores every limiter-on answer
that parts on the limiter-off engine (``ratebench/answerscore.py``: per token, its logprob there beside
that engine's likeliest token's, in the context of the answer's own tokens), and such an answer passes
when every token of it is the limiter-off engine's greedy choice up to ``tol`` nats: where it parted the
two tokens tied, and what followed is that engine's own greedy continuation. ``tol``: the logits of this
model are spaced 2^-6 apart in bfloat16 (the logprobs of the likeliest tokens lie between -5 and -2);
the same token's logprob on the two engines differed by at most 0.031 (two such steps) over 885 answers,
and the two ties seen were exact; 0.05 allows three steps. An answer that resumed on the wrong context
is scored against the right one, and falls outside it. A pair that parts unscored (a run folder from
before scoring, or a run interrupted before its baseline ended) fails, as before.

Figures only; :mod:`ratebench.analysis.checks` applies the threshold (none may differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ratebench.analysis.load import RunData
from ratebench.runrecords import greedy_pair_comparable
from ratebench.roles import PHASE_BASELINE, PHASE_MEASURE

SNIPPET = 6  # tokens shown either side of the first difference
# nats a scored token may lie below the limiter-off engine's likeliest and still count as its greedy
# choice (verify-bound's --answers-logprob-tol; derived in the module's docstring)
DEFAULT_LOGPROB_TOL = 0.05


@dataclass
class Difference:
    client_id: str
    user: str | None
    position: int  # index of the first token that differs
    on: list[int]  # the limiter-on answer around it
    off: list[int]  # the baseline's
    # scored (ratebench/answerscore.py): the first token of the limiter-on answer that is not the limiter-off
    # engine's greedy choice within the tolerance, its logprob there and the likeliest token's (None: none)
    not_greedy_at: int | None = None
    logprob: float | None = None
    top_logprob: float | None = None
    scored: bool = False


@dataclass
class AnswerComparison:
    scenario: str
    phase: str
    engine: str
    base_phase: str
    base_engine: str
    compared: int = 0  # request pairs compared
    tokens: int = 0  # tokens compared
    without_ids: int = 0  # pairs where a side carried no token ids
    differing: list[Difference] = field(default_factory=list)
    ties: list[Difference] = field(default_factory=list)  # pairs that parted at a tie (not failures)


def answer_comparisons(run: RunData, tol: float = DEFAULT_LOGPROB_TOL) -> list[AnswerComparison]:
    """Every greedy mix phase against its baseline, request by request."""
    out: list[AnswerComparison] = []
    by_phase: dict[tuple[str, str, str], list] = {}
    for r in run.records:
        by_phase.setdefault((r.scenario, r.phase, r.engine), []).append(r)
    for base in run.phases:
        if base.role != PHASE_BASELINE or base.kind != "mix" or not base.facts.greedy:
            continue
        off = {(r.user, r.stream_index): r for r in by_phase.get(base.key, [])}
        for p in run.phases:
            if (p.scenario != base.scenario or p.kind != "mix" or p.role != PHASE_MEASURE
                    or not p.facts.greedy):
                continue
            cmp = AnswerComparison(p.scenario, p.phase, p.engine, base.phase, base.engine)
            for a in by_phase.get(p.key, []):
                b = off.get((a.user, a.stream_index))
                if b is None or not greedy_pair_comparable(a, b):
                    continue
                if a.token_ids is None or b.token_ids is None:
                    cmp.without_ids += 1
                    continue
                n = min(len(a.token_ids), len(b.token_ids))
                if n == 0:
                    continue
                cmp.compared += 1
                cmp.tokens += n
                _compare(cmp, a, b, n, tol)
            out.append(cmp)
    return out


def _compare(cmp: AnswerComparison, a, b, n: int, tol: float) -> None:
    """One pair: ``a`` on the limiter-on engine, ``b`` the baseline's, their first ``n`` tokens."""
    x, y = a.token_ids, b.token_ids
    if x[:n] == y[:n]:
        return
    k = next(i for i in range(n) if x[i] != y[i])
    lo = max(0, k - SNIPPET)
    d = Difference(a.client_id, a.user, k, x[lo:k + SNIPPET], y[lo:k + SNIPPET])
    scores = a.answer_scores
    if scores is None or len(scores) < n:
        cmp.differing.append(d)
        return
    d.scored = True
    for j in range(n):
        lp, top = scores[j]
        if top - lp > tol:
            d.not_greedy_at, d.logprob, d.top_logprob = j, lp, top
            cmp.differing.append(d)
            return
    lp, top = scores[k]
    d.logprob, d.top_logprob = lp, top
    cmp.ties.append(d)
