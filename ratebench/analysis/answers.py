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
and are not compared. Greedy answers of the same prompt agree across batch compositions here: 778 of
778 on cpu-tiny's mix, with 1,300 throttled requests moved out of their slots and back; a request
resumed on blocks it no longer held diverged from its first resumed token.

Figures only; :mod:`ratebench.analysis.checks` applies the threshold (none may differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ratebench.analysis.load import RunData

GREEDY_PARAM = "greedy_answers"
SNIPPET = 6  # tokens shown either side of the first difference


@dataclass
class Difference:
    client_id: str
    user: str | None
    position: int  # index of the first token that differs
    on: list[int]  # the limiter-on answer around it
    off: list[int]  # the baseline's


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


def answer_comparisons(run: RunData) -> list[AnswerComparison]:
    """Every greedy mix phase against its baseline, request by request."""
    out: list[AnswerComparison] = []
    by_phase: dict[tuple[str, str, str], list] = {}
    for r in run.records:
        by_phase.setdefault((r.scenario, r.phase, r.engine), []).append(r)
    for base in run.phases:
        if base.role != "baseline" or base.kind != "mix" or not base.params.get(GREEDY_PARAM):
            continue
        off = {(r.user, r.stream_index): r for r in by_phase.get(base.key, [])}
        for p in run.phases:
            if (p.scenario != base.scenario or p.kind != "mix" or p.role != "measure"
                    or not p.params.get(GREEDY_PARAM)):
                continue
            cmp = AnswerComparison(p.scenario, p.phase, p.engine, base.phase, base.engine)
            for a in by_phase.get(p.key, []):
                b = off.get((a.user, a.stream_index))
                if b is None or not a.ignore_eos or not b.ignore_eos or a.error or b.error:
                    continue
                if a.token_ids is None or b.token_ids is None:
                    cmp.without_ids += 1
                    continue
                n = min(len(a.token_ids), len(b.token_ids))
                if n == 0:
                    continue
                cmp.compared += 1
                cmp.tokens += n
                x, y = a.token_ids, b.token_ids
                if x[:n] != y[:n]:
                    k = next(i for i in range(n) if x[i] != y[i])
                    lo = max(0, k - SNIPPET)
                    cmp.differing.append(Difference(a.client_id, a.user, k, x[lo:k + SNIPPET],
                                                    y[lo:k + SNIPPET]))
            out.append(cmp)
    return out
