"""Identity: each charge goes to the request's output_rate_user, or to __anonymous__ without one;
nothing else a client sends changes it (check identity)."""

from __future__ import annotations


import re

import numpy as np

from ratebench.analysis.checks.base import CheckMeaning, meanings, per_run
from ratebench.analysis.load import RunData
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds
from ratebench.events import KIND_DISPATCH, KIND_EMIT
from ratebench.phasefacts import KEY_UNSTREAMED

MEANINGS = meanings({
    "identity": CheckMeaning("identity", "a charge went to another user than the request's output_rate_user "
                             "(or __anonymous__)", "{events}: the user field of the request the explanation names, "
                             "against requests.jsonl"),
    "identity-unstreamed": CheckMeaning("identity", "a request answered in one body (not streamed) was charged to "
                                        "another user than the one it named in vllm_xargs.output_rate_user (or "
                                        "__anonymous__), or not charged at all: a client could leave its budget by "
                                        "not streaming", "scenarios.json, the phase's params.unstreamed_probes, "
                                        "against {events}: the dispatch and emit events of each probe's "
                                        "X-Request-Id"),
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


@per_run(41)
def identity_unstreamed(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _identity_unstreamed(run)


def _identity_unstreamed(run: RunData) -> list[Check]:
    """Each request a phase sent answered in one body (params.unstreamed_probes: its X-Request-Id and the
    user it must be charged to): answered HTTP 200, every one of its charges and emits the user's, and as
    many tokens emitted as its usage says."""
    out = []
    for p in run.phases:
        probes = p.params.get(KEY_UNSTREAMED)
        if not isinstance(probes, list) or not probes:
            continue
        trace = run.traces.get(p.engine)
        for probe in probes:
            user, rid, api = probe.get("user"), str(probe.get("request_id")), probe.get("api")
            what = f"a request on the {api} API answered in one body, named {rid}, of {user}"
            if trace is None:
                out.append(Check("identity-unstreamed", p.scenario, p.phase, p.engine, user, None, 0, "<=",
                                 "events", None, f"{what}: not made, the engine has no event file"))
                continue
            if probe.get("status") != 200:
                out.append(Check("identity-unstreamed", p.scenario, p.phase, p.engine, user, None, 0, "<=",
                                 "events", False, f"{what}: answered HTTP {probe.get('status')}, where the limiter "
                                 "serves it as a streamed one"))
                continue
            strings = trace.events.strings
            pattern = re.compile(rf"(?<![0-9A-Za-z]){re.escape(rid)}(?![0-9])")
            codes = np.array([i for i, name in enumerate(strings) if pattern.search(name)], dtype=np.int64)
            charged: dict[str, int] = {}
            emitted = 0
            for kind in (KIND_DISPATCH, KIND_EMIT):
                ev = trace.of_kind(kind, ("req", "user", "count"))
                mine = np.isin(ev["req"], codes) if len(codes) else np.zeros(len(ev["req"]), dtype=bool)
                for code, count in zip(ev["user"][mine].tolist(), ev["count"][mine].tolist()):
                    if kind == KIND_DISPATCH:
                        charged[strings[code]] = charged.get(strings[code], 0) + int(count)
                    else:
                        emitted += int(count)
            others = {u: n for u, n in charged.items() if u != user}
            tokens = probe.get("completion_tokens")
            bad = sum(others.values()) + (0 if charged else 1) + (
                abs(emitted - tokens) if isinstance(tokens, int) else 0)
            if not charged:
                text = f"{what}: no charge in the engine's file names it (charged to nobody)"
            elif others:
                text = (f"{what}: charged to " + ", ".join(f"{u} ({n} tokens)" for u, n in sorted(others.items()))
                        + f" instead ({charged.get(user, 0)} tokens to {user})")
            elif isinstance(tokens, int) and emitted != tokens:
                text = f"{what}: {emitted} tokens emitted in the engine's file where its usage says {tokens}"
            else:
                text = f"{what}: its {charged[user]} charges all to {user}, {emitted} tokens emitted as its usage says"
            out.append(Check("identity-unstreamed", p.scenario, p.phase, p.engine, user, bad, 0, "<=", "tokens",
                             not bad, text))
    return out
