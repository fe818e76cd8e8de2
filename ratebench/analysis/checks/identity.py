"""Identity: each charge goes to the request's output_rate_user, or to __anonymous__ without one;
nothing else a client sends changes it (check identity)."""

from __future__ import annotations


from ratebench.analysis.checks.base import CheckMeaning, meanings, per_run
from ratebench.analysis.load import RunData
from ratebench.analysis.summary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds

MEANINGS = meanings({
    "identity": CheckMeaning("identity", "a charge went to another user than the request's output_rate_user "
                             "(or __anonymous__)", "{events}: the user field of the request the explanation names, "
                             "against requests.jsonl"),
})


@per_run(40)
def identity(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _identity(run, s)


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
