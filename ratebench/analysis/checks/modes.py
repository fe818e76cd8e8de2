"""Promise 5: synchronous and asynchronous scheduling both keep the promise; each engine ran as the
run asked (check engine-as-asked; the verdict counts promise 5 exercised when checks were judged on
both kinds of limiter-on engine)."""

from __future__ import annotations

from ratebench.analysis.checks.base import WHOLE, CheckMeaning, meanings, per_run
from ratebench.analysis.load import EngineInfo, RunData
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds
from ratebench.events import KIND_DISPATCH

MEANINGS = meanings({
    "engine-as-asked": CheckMeaning("5", "an engine did not run as the run asked (another scheduling mode or policy, "
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
    for name in sorted(run.traces):
        eng = run.engines[name]
        problems = engine_problems(run, name)
        policy = "" if eng.scheduling_policy is None else f", {eng.scheduling_policy} policy"
        asked = (f"{'async' if eng.async_scheduling else 'sync'} scheduling{policy}, limiter "
                 f"{'on' if eng.feature else 'off'}")
        out.append(Check("engine-as-asked", WHOLE, WHOLE, name, None, len(problems), 0, "<=", "problems",
                         not problems,
                         "; ".join(problems) if problems else f"ran as asked ({asked}; its event file's header)"))
    return out


def engine_problems(run: RunData, name: str) -> list[str]:
    """Where an engine with an event file did not run as the run asked: its file's header against
    manifest.json, the CPU async overlay's warnings, charges with the limiter off."""
    eng, trace = run.engines[name], run.traces[name]
    entry = (run.manifest.get("engines") or {}).get(name) or {}
    problems = _meta_disagreements(name, eng, trace.events.meta)
    problems += [w for w in entry.get("warnings") or [] if isinstance(w, str) and "CPU async overlay" in w]
    charges = 0 if eng.feature else int((trace.records["kind"] == KIND_DISPATCH).sum())
    if charges:
        problems.append(f"engine {name}: {charges} dispatch events (charges) with the limiter off")
    return problems


def _meta_disagreements(name: str, eng: EngineInfo, meta: dict) -> list[str]:
    """Where the engine's own event-file header disagrees with manifest.json."""
    out = []
    if "async_scheduling" in meta and bool(meta["async_scheduling"]) != eng.async_scheduling:
        out.append(f"engine {name}: ran with async_scheduling={meta['async_scheduling']} (its event file), "
                   f"asked for {eng.async_scheduling} (manifest.json)")
    ran_policy = meta.get("policy")
    if eng.scheduling_policy is not None and isinstance(ran_policy, str) \
            and ran_policy.lower() != eng.scheduling_policy:
        out.append(f"engine {name}: ran the {ran_policy} scheduling policy (its event file), asked for "
                   f"{eng.scheduling_policy.upper()} (manifest.json)")
    if not eng.feature and meta.get("default_tps") is not None:
        out.append(f"engine {name}: meant to run with the limiter off, its event file says "
                   f"default_tps={meta['default_tps']}")
    if eng.feature:
        if "default_tps" in meta and meta["default_tps"] != eng.default_tps:
            out.append(f"engine {name}: event file says default_tps={meta['default_tps']}, manifest {eng.default_tps}")
        if "user_tps" in meta and {str(k): int(v) for k, v in (meta["user_tps"] or {}).items()} != eng.user_tps:
            out.append(f"engine {name}: event file's user_tps differ from manifest.json's")
    if "burst_ns" in meta and meta["burst_ns"] not in (None, 100_000_000):
        out.append(f"engine {name}: the engine's burst is {meta['burst_ns']} ns; the promise checked is 100 ms")
    return out
