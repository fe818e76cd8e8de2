"""What each check stands for: the promise it tests, in words, and where to look when it fails;
and which promises a run exercised.

One table (``CHECKS``) that the console, report.md, report.html and verdict.json all use. The
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
             "message that names the flag",
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
    "flags": "flags refused at start-up",
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

# where-to-look texts: {plot} is the phase's plot, {events} the engine's event file
_UPPER = "{plot}, the user's panel: red, slack under the bound over time, its tightest window shaded"
_LOWER = "{plot}, the user's panel: blue, the margin above even spacing over time, its emptiest window shaded"
_REPORT_ROW = "report.md, the row of {where}"
_ISOLATION_LOOK = ("verdict.json, checks: the isolation-* checks of {where} (every quantile, both phases' figures); "
                   "{plot}, the gaps panel, against the baseline phase's plot")


@dataclass(frozen=True)
class CheckMeaning:
    promise: str  # a key of PROMISES: the one its failure is shown under
    broke: str  # what a failure of this check means, in words
    look: str  # where to look, a template (see above)
    also: tuple[str, ...] = ()  # other promises (keys of PROMISES) the check guards


CHECKS: dict[str, CheckMeaning] = {
    "bound-dispatch": CheckMeaning("6", "the engine charged more tokens in a window than the bound allows",
                                   _UPPER),
    "bound-emit": CheckMeaning("6", "the engine emitted more tokens in a window than the bound allows "
                               "(with one engine step of tolerance)", _UPPER + " (dashed: emit)"),
    "bound-client": CheckMeaning("6", "the client received more tokens in a window than the bound allows, even "
                                 "with the windows widened by the engine step and the spread of the measured "
                                 "delivery latency (client arrival - engine emit)",
                                 "requests.jsonl: the chunk times of the user's requests in the worst window, "
                                 "against their emit events in {events}"),
    "witness-order": CheckMeaning("witness", "a token (or a stream's end) reached the client before the engine's "
                                  "event file says the engine emitted (finished) it, or the file has the engine "
                                  "handling a request before the client sent it: the file's times are not what "
                                  "happened, and every check made on them proves nothing",
                                  "requests.jsonl: the chunk_ns of the request the explanation names, against "
                                  "its emit events in {events}"),
    "refusal-witness": CheckMeaning("witness", "the engine's event file says a user was refused a charge while its "
                                    "own charges leave it well inside its budget: a refusal the limiter did not "
                                    "make (it would take the user out of the isolation checks)",
                                    "{events}: the user's dispatch and refuse events around the time the "
                                    "explanation names"),
    "witness-emits": CheckMeaning("witness", "the client received tokens for which the engine's event file has no "
                                  "emit event: the file leaves out what the engine did",
                                  "{events}: the emit events of the request the explanation names, against its "
                                  "chunk_tokens in requests.jsonl"),
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
    "bound-dispatch-run": CheckMeaning("6", "over the engine's whole event file, a window holds more charges than "
                                       "the bound allows (the limiter's state must carry across phases)",
                                       "{events}; report.md, the bound over each engine's whole event file"),
    "bound-emit-run": CheckMeaning("6", "over the engine's whole event file, a window holds more emitted tokens "
                                   "than the bound allows", "{events}; report.md, the bound over each engine's "
                                   "whole event file"),
    "delivery": CheckMeaning("2", "a user that always waits for tokens got less than its N tokens per second "
                             "in steady state (over-throttled, or charged without emitting)",
                             _LOWER + " (fewer than N tokens a second: the blue line sinks)"),
    "rate-seed": CheckMeaning("2", "the measured rate beside the limit (information)", _REPORT_ROW),
    "even-spacing-dispatch": CheckMeaning("2", "the user's charges came in clumps: some window inside its backlog "
                                          "got fewer than N * W tokens less the allowance (the lower side of the "
                                          "bound)", _LOWER),
    "even-spacing-emit": CheckMeaning("2", "the user's emitted tokens came in clumps: some window inside its backlog "
                                      "got fewer than N * W tokens less the allowance (the lower side of the "
                                      "bound)", _LOWER + " (dashed: emit)"),
    "stream-fairness": CheckMeaning("2", "one user's streams did not take turns on the shared budget",
                                    "{plot}, the streams panel (one line per stream)"),
    "engine-as-asked": CheckMeaning("5", "an engine did not run as the run asked (another scheduling mode, "
                                    "other limits or burst, the limiter charging while off): what it showed "
                                    "proves nothing about the mode asked for",
                                    "engines/{engine}/engine.log and the header of {events}, against "
                                    "manifest.json's engines"),
    "reconciliation": CheckMeaning("3", "a finished request's usage.completion_tokens, streamed tokens and engine "
                                   "tokens disagree, it was cut short, or it was answered with an error",
                                   "requests.jsonl and {events} for the request the explanation names",
                                   also=("reconciliation",)),
    "answers-intact": CheckMeaning("3", "a greedy answer of a mix differs from the same request's on the "
                                   "limiter-off engine: a request paused, moved out of its slot or resumed "
                                   "got another request's KV, or lost its own",
                                   "requests.jsonl: the token_ids of the request the explanation names, against "
                                   "the same request (stream_index) in the baseline phase"),
    "cancellation": CheckMeaning("3", "after a client cancel the engine did not stop at once (or never finished "
                                 "the request)", "{events}: the finish event of the request the explanation "
                                 "names; {plot}, the streams panel", also=("reconciliation",)),
    "charge-parity": CheckMeaning("1", "a request was charged for steps that sampled no token (a prefill chunk, "
                                  "or a charge without an emit)", "{events}: dispatch against emit events of the "
                                  "request the explanation names"),
    "prompt-free": CheckMeaning("1", "long prompts waited for their first token as if their prompt tokens were "
                                "charged against the user's budget", "report.md, times to first token of the "
                                "long-prompt phase; {events}: the first emit of each request against its send"),
    "isolation-rate": CheckMeaning("4", "a user (in a mix, a tier) whose limit did not bind got fewer tokens per "
                                   "second beside throttled users than on the phase's baseline",
                                   _ISOLATION_LOOK),
    **{name: CheckMeaning("4", f"a user (in a mix, a tier) whose limit did not bind waited longer {what} beside "
                          "throttled users than on the phase's baseline (the same requests; in a mix, on the "
                          "limiter-off engine)", _ISOLATION_LOOK)
       for name, what in (("isolation-ttft", "for its first token (p50)"),
                          ("isolation-ttft-p90", "for its first token (p90)"),
                          ("isolation-ttft-p99", "for its first token (p99)"),
                          ("isolation-e2e-p50", "for its whole answers (p50)"),
                          ("isolation-e2e-p90", "for its whole answers (p90)"),
                          ("isolation-e2e-p99", "for its whole answers (p99)"),
                          ("isolation-gap-p50", "between tokens (p50)"),
                          ("isolation-gap-p90", "between tokens (p90)"),
                          ("isolation-gap-p99", "between tokens (p99)"))},
    **{name: CheckMeaning("4", f"a request sent while its user had budget (its user's limit bound elsewhere in the "
                          f"phase) waited longer for its first token ({q}) beside throttled users than the same "
                          "request on the limiter-off engine", _ISOLATION_LOOK)
       for name, q in (("isolation-ttft-clear", "p50"), ("isolation-ttft-clear-p90", "p90"))},
    "isolation-binding": CheckMeaning("4", "whose limit bound in a mix phase (refuse events), so which tiers "
                                      "isolation judged (information)", "{events}: the refuse events (kind 4)"),
    "jain-fairness": CheckMeaning("4", "users with equal limits got unequal steady rates", _LOWER),
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
    "place-share-jain": CheckMeaning("4", "with more streams than active places, the users' shares of the places "
                                     "were uneven", "verdict.json, checks: each user's rate against its fair share; "
                                     "{plot}"),
    "work-conservation": CheckMeaning("4", "for two or more engine steps in a row, a batch place or a resident slot "
                                      "stayed idle, or held by a throttled request, while a request of a user with "
                                      "budget waited", "{events}: the step records from the time the explanation "
                                      "gives (resident, throttled, waiting_ready, reqs, kv_free); {plot}"),
    "work-conservation-places": CheckMeaning("4", "for three or more engine steps in a row, a batch place stayed "
                                             "idle while a resident request of a user with budget got no tokens",
                                             "{events}: the step records from the time the explanation gives "
                                             "(resident, throttled, reqs, tokens); {plot}"),
    "overhead": CheckMeaning("overhead", "with limits never reached, the limiter costs more throughput than "
                             "allowed against the limiter off or stock vLLM",
                             "report.md, Overhead: the ratios' spread and the CPUs other processes took; the rounds' "
                             "plot; verdict.json, overheads: each round", also=("7",)),
    "witness-delivery": CheckMeaning("witness", "the delays between the engine's emits and the client's arrivals "
                                     "varied by more than allowed: the client got tokens in clumps the event "
                                     "file does not show (an output path that holds tokens back)",
                                     "requests.jsonl chunk times against {events}' emit events of the user; {plot}"),
    "flags-refused": CheckMeaning("flags", "a malformed limiter flag was accepted, or refused without naming the "
                                  "flag, or valid flags did not reach the scheduler's config as given",
                                  "flags.json: each case, how it was refused (arguments or engine config) and the "
                                  "message"),
    "feature-off-upstream": CheckMeaning("7", "with the limiter off, the installed scheduler did not schedule as "
                                         "upstream's on the same requests (another order, another request, "
                                         "another preemption), or could not be compared",
                                         "feature-off.json: each configuration's first differing step, both "
                                         "values"),
    "event-recording": CheckMeaning("events", "recording engine events costs more throughput than allowed",
                                    "report.md, Overhead: the feature-on/feature-on-no-events rounds"),
    "identity": CheckMeaning("identity", "a charge went to another user than the request's output_rate_user "
                             "(or __anonymous__)", "{events}: the user field of the request the explanation names, "
                             "against requests.jsonl"),
    "wait-cpu": CheckMeaning("waiting", "the engine core used CPU while every request was throttled (it polls "
                             "instead of blocking)", "{events} and engines/{engine}/engine.log around the phase"),
    "wait-steps": CheckMeaning("waiting", "while every request was throttled, the engine kept scheduling empty "
                               "steps (it polls instead of blocking until a request is ready, a new request or an "
                               "abort)", "{events}: the step records of the phase (reqs 0, throttled or waiting, "
                               "their clocks' spacing)"),
    "wake-first-token": CheckMeaning("waiting", "while every request was throttled, a new request waited for the "
                                     "engine's timeout instead of waking it at once", "{events}: the new request's "
                                     "first dispatch against its send time (requests.jsonl)"),
    "wake-abort": CheckMeaning("waiting", "while every request was throttled, an abort waited for the engine's "
                               "timeout instead of waking it at once", "{events}: the aborted request's finish "
                               "event against its cancel time (requests.jsonl)"),
    "trace-lateness": CheckMeaning("replay", "the driver sent the trace's requests later than the stated lateness: "
                                   "the run did not replay the trace faithfully (a busy machine, too many requests "
                                   "at once)", "requests.jsonl: sent_ns - scheduled_ns of the phase's requests; "
                                   "scenarios.json machine_cpu"),
}

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
