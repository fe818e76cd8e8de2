"""The pressure scenarios' checks (kv-pressure, active-cap-fairness): the phase ran short of KV
(promise 4's setting), no stream of a throttled user starved (promise 2), and with more streams than
active places every user got its fair share of them (promise 4)."""

from __future__ import annotations

from ratebench.analysis.checks.base import CheckMeaning, meanings, per_run
from ratebench.analysis.load import RunData
from ratebench.analysis.pressure import SETTLE_NS, place_shares, stream_waits
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds

MEANINGS = meanings({
    "kv-pressure-applied": CheckMeaning("4", "the kv-pressure phase never ran short of KV cache: it shows nothing "
                                        "about throttled requests holding KV", "engines/{engine}/engine.log: the KV "
                                        "cache size; the profile's --num-gpu-blocks-override and prompt lengths"),
    "stream-wait": CheckMeaning("2", "one of a throttled user's streams waited far longer for a token than the "
                                "user's budget shared by its streams allows (it lost its KV and its turn while its "
                                "siblings kept the budget)", "{plot}, the streams panel: the stream the explanation "
                                "names; {events}: its dispatch events"),
    "place-share": CheckMeaning("4", "with more streams than active places, a user got far less than its fair share "
                                "of the places (places went to whoever was first in the running list)",
                                "verdict.json, checks: each user's rate against its fair share; {plot}"),
    "place-share-max": CheckMeaning("4", "with more streams than active places, a user got far more than its "
                                    "fair share of the places (its streams each took a place where users take "
                                    "turns), at the cost of every other user", "verdict.json, checks: each "
                                    "user's rate against its fair share; {plot}"),
    "place-share-priority": CheckMeaning("4", "under vLLM's PRIORITY policy, a user of a higher priority got "
                                         "less than its whole fair share of the active places (places went "
                                         "round the streams whatever their priorities)", "verdict.json, checks: "
                                         "each user's rate against its fair share, by priority; {plot}"),
    "place-share-jain": CheckMeaning("4", "with more streams than active places, the users' shares of the places "
                                     "were uneven", "verdict.json, checks: each user's rate against its fair share; "
                                     "{plot}"),
})


@per_run(120)
def pressure(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _pressure(run, th)


def _pressure(run: RunData, th: Thresholds) -> list[Check]:
    """Under KV pressure: the phase was under pressure, no stream of a throttled user starved. With
    more streams than active places: every user got its fair share of them."""
    out = []
    for p in run.phases:
        if p.facts.kv_measured:
            usage, preempted = p.facts.kv_usage_max, p.facts.preemptions
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
                f"{w.wait_ns / 1e6:.0f} ms for its {w.where}"
                + (f" (less {w.excused_ns / 1e6:.0f} ms of full engine steps, prefilling other prompts)"
                   if w.excused_ns else "")
                + f" with {w.tokens} tokens in all; allowed "
                f"{th.stream_wait_factor:g} x {sw.streams} streams / {sw.limit_tps} tok/s + "
                f"{th.stream_wait_slack_ns / 1e6:g} ms = {allowed_ns / 1e6:.0f} ms; the streams' longest waits "
                + ", ".join(f"{x / 1e6:.0f}" for x in waits) + " ms"
                + (f" (PRIORITY policy, the user's streams at priorities {', '.join(map(str, sw.priorities))}: "
                   "a stream's waits leave out the time while a stream of a higher priority of its user was open)"
                   if sw.priorities else "")))
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
            if ps.priorities:
                levels = ", ".join(f"{u} {ps.priorities[u]}" for u in sorted(ps.priorities))
                window += (f" (PRIORITY policy, users at priorities {levels}: higher priorities first, each "
                           f"level's max-min shares of what the levels before left, a user's capped by its limit "
                           f"and by its streams / {ps.places} places of the rate)")
            out.append(Check("place-share", p.scenario, p.phase, p.engine, worst_user, round(worst, 4),
                             th.place_share_min, ">=", "x fair share", worst >= th.place_share_min,
                             f"{worst_user} got {worst:.2f} x its max-min fair share of the active places {window}"))
            best_user, best = ps.best
            out.append(Check("place-share-max", p.scenario, p.phase, p.engine, best_user, round(best, 4),
                             th.place_share_max, "<=", "x fair share", best <= th.place_share_max,
                             f"{best_user} got {best:.2f} x its fair share of the active places {window}"))
            above = ps.worst_above_lowest
            if above is not None:
                high_user, high = above
                out.append(Check("place-share-priority", p.scenario, p.phase, p.engine, high_user, round(high, 4),
                                 th.place_share_priority_min, ">=", "x fair share",
                                 high >= th.place_share_priority_min,
                                 f"{high_user}, above the lowest priority, got {high:.2f} x its fair share of the "
                                 f"active places {window}"))
            j = ps.jain
            if j is not None:
                out.append(Check("place-share-jain", p.scenario, p.phase, p.engine,
                                 f"{len(ps.ratios)} users", round(j, 4), th.place_jain_min, ">=", "index",
                                 j >= th.place_jain_min,
                                 f"Jain's index of the users' rates / fair shares {window}"))
    return out
