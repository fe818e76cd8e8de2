"""The refusals: malformed limiter flags are refused at start-up with a message that names the flag
(check flags-refused, from flags.json); with the limiter on, beam search requests are refused at the API
with HTTP 400 (check beam-search-refused, from the anonymous-and-spoofing phases' probes); with it off
they are served as upstream serves them (check beam-search-off-served, promise 7: the mix's phase on the
limiter-off engine probes it)."""

from __future__ import annotations

from ratebench.analysis.checks.base import CheckMeaning, meanings, per_run
from ratebench.analysis.load import RunData
from ratebench.analysis.prestart import flag_checks
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds

MEANINGS = meanings({
    "flags-refused": CheckMeaning("flags", "a malformed limiter flag was accepted, or refused without naming the "
                                  "flag, or valid flags did not reach the scheduler's config as given",
                                  "flags.json: each case, how it was refused (arguments or engine config) and the "
                                  "message"),
    "config-refused": CheckMeaning("flags", "a configuration the limiter does not support (speculative "
                                   "decoding, data or pipeline parallel, a custom scheduler class, KV connectors "
                                   "or offloading, EC connectors, pooling models) was accepted with the limiter "
                                   "on, or refused without naming the flag and the configuration, or refused "
                                   "with the limiter off",
                                   "flags.json: the cases of group config, how each was refused and the message"),
    "beam-search-refused": CheckMeaning("flags", "with the limiter on, a beam search request was not refused at "
                                        "the API with HTTP 400 naming beam search: its beams are charged as the "
                                        "user's tokens, and what the client is charged for is not its answer",
                                        "scenarios.json, the phase's params.beam_search: each probe's HTTP status "
                                        "and answer; engines/{engine}/engine.log"),
    "beam-search-off-served": CheckMeaning("7", "with the limiter off, a beam search request was not served "
                                           "(HTTP 200 with its choices) as upstream serves it: the patch's "
                                           "refusal reached an engine whose limiter is off",
                                           "scenarios.json, the phase's params.beam_search: each probe's HTTP "
                                           "status and answer; engines/{engine}/engine.log"),
})


@per_run(30)
def flags_refused(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return flag_checks(run)


@per_run(31)
def beam_search_refused(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    """Each beam search probe a phase sent (params.beam_search): on a limiter-on engine answered HTTP 400
    naming beam search (beam-search-refused); on a limiter-off one served, HTTP 200 with its choices
    (beam-search-off-served, promise 7)."""
    out = []
    for p in run.phases:
        engine = run.engines.get(p.engine)
        for probe in p.facts.beam_search:
            status, message = probe.status, probe.message
            if engine is not None and not engine.feature:
                ok = status == 200 and '"choices"' in message
                out.append(Check(
                    "beam-search-off-served", p.scenario, p.phase, p.engine, None, status, 200, "==",
                    "HTTP status", ok,
                    f"a beam search request on the {probe.api} API ({probe.sent}) to the limiter-off "
                    f"engine: HTTP {status}" + (", served with its choices" if ok else
                                                "; with the limiter off it must be served as upstream serves it "
                                                f"(HTTP 200 with its choices): {message[:200]!r}")))
                continue
            ok = status == 400 and "beam search" in message.lower()
            out.append(Check(
                "beam-search-refused", p.scenario, p.phase, p.engine, None, status, 400, "==", "HTTP status", ok,
                f"a beam search request on the {probe.api} API ({probe.sent}): HTTP {status}"
                + (", naming beam search" if ok else
                   f"; with the limiter on it must be refused with HTTP 400 naming beam search: {message[:200]!r}")))
    return out
