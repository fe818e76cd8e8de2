"""Promise 5: synchronous and asynchronous scheduling both keep the promise; each engine ran as the
run asked (check engine-as-asked; the verdict counts promise 5 exercised when checks were judged on
both kinds of limiter-on engine)."""

from __future__ import annotations

from ratebench.analysis.checks.base import WHOLE, CheckMeaning, meanings, per_run
from ratebench.analysis.load import RunData
from ratebench.analysis.summary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds

MEANINGS = meanings({
    "engine-as-asked": CheckMeaning("5", "an engine did not run as the run asked (another scheduling mode, "
                                    "other limits or burst, the limiter charging while off): what it showed "
                                    "proves nothing about the mode asked for",
                                    "engines/{engine}/engine.log and the header of {events}, against "
                                    "manifest.json's engines"),
})


@per_run(10)
def engines_as_asked(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _engines_as_asked(run)


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
