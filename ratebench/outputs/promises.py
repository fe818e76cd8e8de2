"""What each check stands for: the promise it tests, in words, and where to look when it fails;
and which promises a run exercised.

One table (``CHECKS``, which the check modules of ratebench/analysis/checks/ register) that the
console, report.md, report.html and verdict.json all use. The
promises are docs/promise.md section 1's, numbered 1 to 7, its flags refused at start-up, and section
5's identity, waiting costs nothing, reconciliation, two witnesses and overhead: the thirteen the
verdict counts
(``VERDICT_PROMISES``). "events" (recording events costs little, section 4) and "replay" (a trace
reached the engine on time) judge the run's instruments, not the limiter: their failures are
grouped like a promise's, but the verdict does not count them.

A check guards its ``promise`` (the group its failure is shown under) and the promises in ``also``.
A promise is exercised when at least one check guarding it was judged (passed or failed, not
information only) in the run; promise 5 (sync and async) when checks were judged on both a
synchronous and an asynchronous limiter-on engine (``promise_coverage``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ratebench.analysis.bound import BoundResult
from ratebench.analysis.checks import registered_meanings
from ratebench.analysis.checks.base import CheckMeaning
from ratebench.analysis.verdict import Check, UserPhaseSummary, Verdict
from ratebench.outputs.format import check_where, plot_file

PROMISES: dict[str, str] = {
    "1": "only output tokens are limited; prompt tokens are free",
    "2": "a user's concurrent requests share one budget of N tokens per second, spent evenly over time",
    "3": "a request out of budget pauses and later resumes; it is never truncated nor answered with an error",
    "4": "while one user is throttled, other users proceed as before",
    "5": "synchronous and asynchronous scheduling both keep the promise",
    "6": "the bound: in any window of W seconds a user receives at most (W + 0.1) * N + 1 output tokens",
    "7": "with --default-user-output-tokens-per-second unset the feature is off and the scheduler behaves as "
         "upstream",
    "identity": "each charge goes to the request's output_rate_user, or to __anonymous__ without one",
    "flags": "malformed limiter flags (a rate that is not a positive integer, per-user rates that are not a JSON "
             "object of positive integers, per-user rates without a default) are refused at start-up with a "
             "message that names the flag, and so are the configurations the limiter does not support; with the "
             "limiter on, beam search requests are refused at the API (HTTP 400)",
    "waiting": "waiting costs nothing: the engine blocks on its input queue while every request is throttled "
               "and wakes at once for a new request or an abort",
    "reconciliation": "for every finished request usage.completion_tokens = tokens streamed = tokens the engine "
                      "emitted; a cancelled stream's engine stops generating for it",
    "witness": "two witnesses, one host clock: the engine's event file agrees with what the client received "
               "(no token before the engine says it emitted it, none it never emitted)",
    "overhead": "with the feature on and limits never reached, the limiter costs little throughput against the "
                "feature off and against stock vLLM",
    "events": "recording engine events costs little",
    "replay": "a replayed trace reached the engine as the trace says: each request sent on time",
}

# each promise in a few words (no commas: the headline lists them), for the verdict's first line
PROMISE_NAMES: dict[str, str] = {
    "1": "only output tokens limited",
    "2": "one budget per user shared evenly",
    "3": "throttled requests resume complete",
    "4": "other users proceed as before",
    "5": "sync and async scheduling",
    "6": "the bound",
    "7": "feature off = upstream",
    "identity": "identity",
    "flags": "flags and beam search refused",
    "waiting": "waiting costs nothing",
    "reconciliation": "reconciliation",
    "witness": "two witnesses",
    "overhead": "overhead",
    "events": "event recording costs little",
    "replay": "trace replayed on time",
}

# the promises the verdict counts as exercised or not, in this order (docs/promise.md sections 1 and 5)
VERDICT_PROMISES: tuple[str, ...] = ("1", "2", "3", "4", "5", "6", "7", "flags", "identity", "waiting",
                                     "reconciliation", "witness", "overhead")

# What each check stands for: registered by its check module (ratebench/analysis/checks/), in the
# order of those modules.
CHECKS: dict[str, CheckMeaning] = registered_meanings()

_UNKNOWN = CheckMeaning("?", "see docs/promise.md section 5", "report.md, Checks")

# made on a limiter-off vLLM with the patch (kind "patched", feature off), these checks also guard these
# promises: engine-as-asked there says the limiter stayed off (no charges, no limits in its header)
OFF_ENGINE_ALSO: dict[str, tuple[str, ...]] = {"engine-as-asked": ("7",)}


def meaning(check_name: str) -> CheckMeaning:
    return CHECKS.get(check_name, _UNKNOWN)


def promise_text(key: str) -> str:
    """'promise 6: the bound: ...': a promise, by its key, in words."""
    label = f"promise {key}" if key.isdigit() else key
    return f"{label}: {PROMISES[key]}" if key in PROMISES else "no promise on record (see docs/promise.md section 5)"


def promise_name(key: str) -> str:
    """A promise in a few words ('the bound')."""
    return PROMISE_NAMES.get(key, key)


@dataclass
class PromiseCoverage:
    """One promise of the verdict: whether the run's phases exercised it, and on how many checks."""

    key: str  # a key of PROMISES
    name: str  # in a few words
    words: str  # in full (PROMISES)
    exercised: bool  # a check guarding it was judged (promise 5: on a sync and on an async limiter-on engine)
    checks_judged: int  # checks guarding it that passed or failed (not information only)
    checks_failed: int
    how: str  # how it was decided, in words


def engine_async(verdict: Verdict, engine: str) -> bool | None:
    """Whether an engine ran with async scheduling: its event file's header, else its name (-async,
    -sync); None when neither tells."""
    if engine in verdict.engine_async_scheduling:
        return verdict.engine_async_scheduling[engine]
    if engine.endswith("-async"):
        return True
    if engine.endswith("-sync"):
        return False
    return None


def _engine_entry(verdict: Verdict, engine: str) -> dict:
    return (verdict.manifest_summary.get("engines") or {}).get(engine) or {}


def guarded_promises(verdict: Verdict, check: Check) -> tuple[str, ...]:
    """The promises a check guards: its own, those in ``also``, and on a limiter-off patched engine those
    of ``OFF_ENGINE_ALSO``."""
    m = meaning(check.name)
    keys = (m.promise, *m.also)
    e = _engine_entry(verdict, check.engine)
    if check.name in OFF_ENGINE_ALSO and e and not e.get("feature") and e.get("kind", "patched") == "patched":
        keys += OFF_ENGINE_ALSO[check.name]
    return keys


def _checks_text(n: int) -> str:
    return f"{n} check" if n == 1 else f"{n} checks"


def _label(check: Check, key: str) -> str:
    """A judged check's name, with its engine where only that engine makes it guard the promise."""
    m = meaning(check.name)
    return check.name if key == m.promise or key in m.also else f"{check.name} on {check.engine}"


def _checks_of(key: str) -> list[str]:
    """The names of the checks that can guard a promise (for the words of an unexercised one)."""
    names = [n for n, m in CHECKS.items() if key == m.promise or key in m.also]
    names += [f"{n} on a limiter-off engine" for n, keys in OFF_ENGINE_ALSO.items() if key in keys]
    return names


def promise_coverage(verdict: Verdict) -> list[PromiseCoverage]:
    """Each promise the verdict counts (VERDICT_PROMISES), in order: exercised or not, its judged and failed
    checks, and how that was decided."""
    judged: dict[str, list[Check]] = {k: [] for k in PROMISES}
    info: dict[str, set[str]] = {k: set() for k in PROMISES}
    for c in verdict.checks:
        for k in guarded_promises(verdict, c):
            if k not in judged:
                continue
            if c.passed is None:
                info[k].add(c.name)
            else:
                judged[k].append(c)
    out = []
    for k in VERDICT_PROMISES:
        checks = judged[k]
        failed = sum(c.passed is False for c in checks)
        if k == "5":
            exercised, how = _both_modes(verdict)
            how = f"{_checks_text(len(checks))} judged (engine-as-asked); checks judged on limiter-on engines: {how}"
        elif checks:
            kinds = sorted({_label(c, k) for c in checks})
            exercised, how = True, f"{_checks_text(len(checks))} judged ({', '.join(kinds)})"
        elif info[k]:
            exercised, how = False, f"its checks were information only ({', '.join(sorted(info[k]))})"
        else:
            exercised, how = False, f"none of its checks was made ({', '.join(_checks_of(k))})"
        out.append(PromiseCoverage(k, promise_name(k), PROMISES[k], exercised, len(checks), failed, how))
    return out


def _both_modes(verdict: Verdict) -> tuple[bool, str]:
    """Promise 5: checks (other than engine-as-asked, which says only how the engine ran: the check that
    guards promise 5 itself) judged on a synchronous and on an asynchronous limiter-on engine."""
    engines: dict[bool, dict[str, int]] = {False: {}, True: {}}
    for c in verdict.checks:
        if c.passed is None or c.name == "engine-as-asked" or not _engine_entry(verdict, c.engine).get("feature"):
            continue
        mode = engine_async(verdict, c.engine)
        if mode is not None:
            engines[mode][c.engine] = engines[mode].get(c.engine, 0) + 1

    def said(mode: bool) -> str:
        if not engines[mode]:
            return f"no judged check on {'an async' if mode else 'a sync'} limiter-on engine"
        return f"{'async' if mode else 'sync'}: " + ", ".join(f"{e} ({_checks_text(n)})"
                                                              for e, n in sorted(engines[mode].items()))

    return bool(engines[False] and engines[True]), f"{said(False)}; {said(True)}"


def broken_promises(verdict: Verdict) -> list[str]:
    """The keys of the promises with a failed check, in PROMISES order (those the verdict does not count,
    events and replay, included)."""
    broken = {k for c in verdict.failures for k in guarded_promises(verdict, c)}
    return [k for k in (*PROMISES, "?") if k in broken]


def promise_clause(verdict: Verdict, coverage: list[PromiseCoverage] | None = None) -> str:
    """'10 of 13 promises exercised; not exercised: waiting costs nothing, sync and async scheduling'."""
    coverage = promise_coverage(verdict) if coverage is None else coverage
    done = sum(p.exercised for p in coverage)
    text = f"{done} of {len(coverage)} promises exercised"
    missing = [p.name for p in coverage if not p.exercised]
    return text + (f"; not exercised: {', '.join(missing)}" if missing else "")


def headline(verdict: Verdict, coverage: list[PromiseCoverage] | None = None) -> str:
    """The verdict's first line: 'PASS, 13 of 13 promises exercised'; 'PASS, 12 of 13 promises exercised;
    not exercised: waiting costs nothing'; 'FAIL, broken: the bound; 13 of 13 promises exercised'."""
    if not verdict.failures:
        return f"{verdict.outcome}, {promise_clause(verdict, coverage)}"
    broken = ", ".join(promise_name(k) if k != "?" else "no promise on record" for k in broken_promises(verdict))
    return f"{verdict.outcome}, broken: {broken}; {promise_clause(verdict, coverage)}"


@dataclass
class FailureHint:
    """A failed check in words: which promise, what broke, where to look."""

    check: Check
    promise: str  # a key of PROMISES ("?" for a check not in CHECKS)
    broke: str
    look: str


def failures_by_promise(verdict: Verdict) -> list[tuple[str, list[FailureHint]]]:
    """The failed checks grouped by the promise they test, in PROMISES order: (promise_text, hints)."""
    groups: dict[str, list[FailureHint]] = {}
    for h in failure_hints(verdict):
        groups.setdefault(h.promise, []).append(h)
    order = {k: i for i, k in enumerate(PROMISES)}
    return [(promise_text(k), groups[k]) for k in sorted(groups, key=lambda k: order.get(k, len(order)))]


def failure_hints(verdict: Verdict) -> list[FailureHint]:
    """One hint per failed check, in the verdict's order."""
    rows = {(r.scenario, r.phase, r.engine, r.user): r for r in verdict.rows}
    whole = {(b.engine, b.user): b for b in verdict.engine_bounds}
    out = []
    for c in verdict.failures:
        m = meaning(c.name)
        look = m.look.format(
            plot=plot_file(c.scenario, c.phase, c.engine),
            events=f"engines/{c.engine}/events.rbev", engine=c.engine, where=check_where(c))
        window = _worst_window(c, rows.get((c.scenario, c.phase, c.engine, c.user)), whole.get((c.engine, c.user)))
        if window:
            look += f"; {window}"
        out.append(FailureHint(c, m.promise, m.broke, look))
    return out


def _worst_window(c: Check, row: UserPhaseSummary | None, whole) -> str | None:
    """The worst window of a bound check, placed in time: from the user's first event in the phase,
    or on the engine's clock for a whole-file bound."""
    if c.name in ("bound-dispatch-run", "bound-emit-run") and whole is not None:
        b = whole.dispatch if c.name == "bound-dispatch-run" else whole.emit
        return _window_text(b, None, "(monotonic clock)")
    if row is None:
        return None
    source = {"bound-dispatch": (row.bound_dispatch, row.dispatch_rate, "dispatch"),
              "bound-emit": (row.bound_emit, row.emit_rate, "emit"),
              "bound-client": (row.bound_client, row.client_rate, "client chunk")}.get(c.name)
    if source is None:
        return None
    b, rate, what = source
    first = rate.first_ns if rate is not None else None
    return _window_text(b, first, f"from {row.user}'s first {what} of the phase")


def _window_text(b: BoundResult | None, origin_ns: int | None, where: str) -> str | None:
    if b is None or b.worst is None:
        return None
    w = b.worst
    origin = origin_ns or 0
    return f"worst window at {(w.start_ns - origin) / 1e9:.3f}..{(w.end_ns - origin) / 1e9:.3f} s {where}"
