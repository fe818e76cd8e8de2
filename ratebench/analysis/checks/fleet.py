"""The fleet's checks (a fleet of limiter-on engines behind a load balancer): each user's bound across
the members (promise 6), every request served and none lost at a failover (promise 3), moved users
served again (promise 4), the members' per-user counters against their events (two witnesses)."""

from __future__ import annotations


from ratebench.analysis.checks.base import CheckMeaning, meanings, per_run
from ratebench.analysis.fleet import fleet_phases
from ratebench.analysis.load import RunData
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds

MEANINGS = meanings({
    "fleet-bound-dispatch": CheckMeaning("6", "behind a load balancer, a user's charges merged across the fleet's "
                                         "engines exceed the bound: each engine's limiter knows only its own "
                                         "requests, and the routing policy spread the user's requests over them "
                                         "(route by user: user-hash)",
                                         "balancers/<fleet>/haproxy.cfg (the policy); the user's dispatch events "
                                         "in each member's engines/<member>/events.rbev; requests.jsonl's engine "
                                         "field (the member that served each request)"),
    "fleet-bound-emit": CheckMeaning("6", "behind a load balancer, a user's emitted tokens merged across the "
                                     "fleet's engines exceed the bound (one engine step of tolerance)",
                                     "the user's emit events in each member's engines/<member>/events.rbev"),
    "fleet-bound-client": CheckMeaning("6", "behind a load balancer, the tokens a user received from the whole "
                                       "fleet exceed the bound (windows widened as each engine's bound-client)",
                                       "requests.jsonl: the user's chunk times in the fleet's phase"),
    "fleet-failover-lost": CheckMeaning("3", "when an engine of the fleet stopped, a request ended looking complete "
                                        "(no error, finish_reason length or stop) without every token it asked for: "
                                        "lost silently", "requests.jsonl: the request the explanation names (its "
                                        "completion_tokens, finish_reason, engine)"),
    "fleet-failover-moved": CheckMeaning("4", "when an engine of the fleet stopped, a user it served was never served "
                                         "by another engine afterwards: the balancer did not move it",
                                         "balancers/<fleet>/balancer.log (the engine marked down, the user's "
                                         "requests after); requests.jsonl's engine field"),
    "fleet-metrics": CheckMeaning("witness", "an engine's per-user counter on /metrics "
                                  "(vllm:output_rate_tokens_granted_total, --output-rate-metrics-users) "
                                  "disagrees with its event file's charges of the user over the phase: the "
                                  "figure an operator sums across a fleet is not what the limiter charged",
                                  "scenarios.json params.fleet_user_counters (the counters' change over the "
                                  "phase, per engine) against the user's dispatch events in each member's "
                                  "engines/<member>/events.rbev"),
    "fleet-served": CheckMeaning("3", "a request sent through the load balancer was served by no engine (refused, "
                                 "or lost when an engine left): a user's request answered with an error",
                                 "requests.jsonl: the request's error and http_status; "
                                 "balancers/<fleet>/balancer.log"),
})


@per_run(160)
def fleet(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _fleet(run, s, th)


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
    head = (f"{where}; {fo.engine} stopped {fo.stopped_after_s} s into the phase: "
            f"{fp.requests} requests, {o.completed} completed, failed with what the client sees: {visibly}")
    lost = o.lost_silently
    out = [Check("fleet-failover-lost", fp.scenario, fp.phase, fp.fleet, None, len(lost), 0, "<=", "requests",
                 not lost, head + (f"; lost silently: {lost[0]}" + (f" (and {len(lost) - 1} more)" if len(lost) > 1
                                                                    else "") if lost else "; none lost silently"))]
    users = fo.users_before
    moved = "; ".join(f"{u} to {e}" for u, e in o.moved.items()) or "none"
    judged = bool(o.moved or o.not_moved)
    text = (f"{len(users)} users on {fo.engine} before the stop; served by another engine after it: {moved}"
            + (f"; never served again: {', '.join(o.not_moved)}" if o.not_moved else "")
            + (f"; sent nothing after the stop (not judged): {', '.join(o.silent)}" if o.silent else ""))
    if not users:
        text = f"no user had been served by {fo.engine} before the stop: the failover moved nobody"
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
            before = set(fo.users_before)
            others = [b for b, u in zip(bad, fp.unserved_users) if u not in before]
            passed = not others
            text = (f"failover ({fo.engine} stopped; its users' refusals judged by fleet-failover-*), "
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
