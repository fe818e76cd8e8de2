"""The verdict: plain dataclasses that every output format renders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ratebench.analysis.bound import BURST_NS, BoundResult
from ratebench.analysis.gaps import GapStats
from ratebench.analysis.rates import RateFigures
from ratebench.analysis.spacing import SpacingResult
from ratebench.analysis.steps import EngineStep


THRESHOLD_ROW = "threshold"  # the metadata key of a Thresholds field's row (analysis/thresholds.py reads it)


def threshold(default: Any, option: str, help: str, promise: str, *, unit: str = "", phase_param: str | None = None,
              phase_type: str = "", phase_rule: str = "wider") -> Any:
    """A Thresholds field and its row of the thresholds table, in one place: its default; its verify-bound
    option, the unit that option takes ("" the field's own; "ms" or "us" for a field in nanoseconds) and its
    help; the promise (a key of the promise table) whose checks it sets; and, where a profile may set it for
    one scenario's phases, that scenario parameter, its schema type and how it combines with the command
    line's (:class:`ratebench.analysis.thresholds.Threshold`)."""
    row = dict(option=option, help=help, promise=promise, unit=unit, phase_param=phase_param,
               phase_type=phase_type, phase_rule=phase_rule)
    return field(default=default, metadata={THRESHOLD_ROW: row})


@dataclass
class Thresholds:
    """Every threshold a check uses, each declared once with its default, its verify-bound option, help and
    the promise it guards (:func:`threshold`; the table of ``analysis/thresholds.py`` is made from these).
    A new check's threshold is one field here."""

    # backlogged user's steady rate / N
    delivery_min: float = threshold(
        0.97, "--delivery-min", "backlogged user's steady rate, at least this x its limit", "2")
    # isolation (analysis/isolation.py), for every user whose limit did not bind, against the phase's
    # baseline: its rate (tokens over first to last token) at least this x the baseline's
    isolation_min: float = threshold(
        0.9, "--isolation-min", "a user whose limit did not bind: its rate beside throttled users, at least this "
        "x on the phase's baseline", "4")
    # and its p50, p90 and p99 latencies at most factor x the baseline's + slack. 1.5 x: the limiter-on
    # engine may run a batch up to half as large again (the throttled users' requests still come and go,
    # prefill and all) and pays its own bookkeeping; the slacks: a busy 2-core host's scheduling noise,
    # where the driver, the API server and the engine share the cores (a preempted process waits one
    # 4-10 ms time slice or two), plus, end to end, one such wait per few tokens of a short answer.
    # Time to first token: first chunk (engine: first emit) - sent.
    isolation_ttft_factor: float = threshold(
        1.5, "--isolation-ttft-factor", "its p50/p90/p99 time to first token, at most this x the baseline's + "
        "--isolation-ttft-slack-ms", "4")
    isolation_ttft_slack_ns: int = threshold(
        20_000_000, "--isolation-ttft-slack-ms", "added to the allowed time to first token", "4", unit="ms")
    # end to end: last chunk (engine: last emit) - sent, answers that ended by themselves
    isolation_e2e_factor: float = threshold(
        1.5, "--isolation-e2e-factor", "its p50/p90/p99 end-to-end latency, at most this x the baseline's + "
        "--isolation-e2e-slack-ms", "4")
    isolation_e2e_slack_ns: int = threshold(
        50_000_000, "--isolation-e2e-slack-ms", "added to the allowed end-to-end latency", "4", unit="ms")
    # inter-token gap: between one request's consecutive chunks (emit events); about one engine step, so
    # the factor covers a larger batch and the slack one descheduled wake-up
    isolation_gap_factor: float = threshold(
        1.5, "--isolation-gap-factor", "its p50/p90/p99 inter-token gap, at most this x the baseline's + "
        "--isolation-gap-slack-ms", "4")
    isolation_gap_slack_ns: int = threshold(
        20_000_000, "--isolation-gap-slack-ms", "added to the allowed inter-token gap", "4", unit="ms")
    # 1 - the median per-round throughput(feature-on) / throughput(feature off or stock) (None: report only)
    max_overhead: float | None = threshold(
        None, "--max-overhead", "fail when 1 - throughput(feature-on)/throughput(off or stock) (the median of the "
        "per-round ratios) exceeds this (default: the overhead scenario's max_overhead, else report only)", "overhead",
        phase_param="max_overhead", phase_type="fraction", phase_rule="unless-given")
    # 1 - the median per-round throughput(feature-on) / throughput(feature-on, no engine events)
    max_event_overhead: float | None = threshold(
        None, "--max-event-overhead", "fail when 1 - throughput(feature-on)/throughput(feature-on without engine "
        "events) (the median of the per-round ratios) exceeds this (default: report only)", "events")
    # emit events of a cancelled request after the cancel
    cancel_max_steps: int = threshold(
        1, "--cancel-max-steps", "emit events of a cancelled request after the cancel (a mix's cancel_max_steps "
        "may allow more)", "reconciliation", phase_param="cancel_max_steps", phase_type="pos_int")
    # a trace or mix phase: p99 of how late the driver sent its requests (None: the scenario's lateness_ms,
    # else DEFAULT_TRACE_LATENESS_NS)
    trace_lateness_ns: int | None = threshold(
        None, "--trace-lateness-ms", "a trace or mix phase: the p99 of how late the driver sent its requests "
        "(default: the scenario's lateness_ms, else 20)", "replay",
        unit="ms", phase_param="lateness_ms", phase_type="pos_num", phase_rule="unless-given")
    # tokens between one user's streams while all are active
    stream_spread_max: int = threshold(
        2, "--stream-spread-max", "tokens between one user's streams while all are active", "2")
    # Jain's index across backlogged users with equal limits
    jain_min: float = threshold(
        0.95, "--jain-min", "Jain's index across backlogged users with equal limits", "4")
    # even spacing: a backlogged user may fall short of N * W by 1 + N * (P + this) in a window
    # (P: the phase's longest step period; this: a blocked engine's wake-up on a busy host)
    spacing_slack_ns: int = threshold(
        5_000_000, "--spacing-slack-ms", "even spacing: a backlogged user may fall short of N x W by 1 + N x "
        "(longest step period + this) tokens in a window", "2", unit="ms")
    # waiting: EngineCore CPUs spent beyond what its steps and its idle loop cost, while users wait
    wait_cpu_max: float = threshold(
        0.2, "--wait-cpu-max", "EngineCore CPUs spent while users wait, beyond what an idle engine and its steps "
        "cost", "waiting")
    # waiting, any phase with step records: re-wakes (empty steps right after an empty step) per second
    # of waiting for budget. A blocked engine wakes every 50 ms at most when nothing comes (20/s); a loop
    # that schedules every millisecond while it waits, about 1,000/s
    wait_steps_max: float = threshold(
        40.0, "--wait-steps-max", "empty engine steps right after an empty step (re-wakes) per second of waiting "
        "for budget (a blocked engine wakes every 50 ms at most: 20)", "waiting")
    # a waiting engine wakes at once: probes' p50 first token over the idle engine's, closed streams'
    # p50 abort latency (ms)
    wake_max_ms: float = threshold(
        10.0, "--wake-max-ms", "a waiting engine's added p50 time to first token of a new request, and p50 abort "
        "latency", "waiting")
    # no stream starves: a throttled user's stream waits at most factor * S / N + slack for a token
    # (S streams at N tok/s taking turns give each one a token every S / N s)
    stream_wait_factor: float = threshold(
        2.0, "--stream-wait-factor", "a throttled user's stream waits at most this x streams / limit + "
        "--stream-wait-slack-ms for a token", "2")
    stream_wait_slack_ns: int = threshold(
        300_000_000, "--stream-wait-slack-ms", "added to the allowed longest stream wait", "2", unit="ms")
    # the active places: each user's rate while all want tokens / its max-min fair share
    # the worst user's
    place_share_min: float = threshold(
        0.5, "--place-share-min", "with more streams than active places, every user's rate at least this x its "
        "max-min fair share", "4")
    # Jain's index of those ratios
    place_jain_min: float = threshold(
        0.9, "--place-jain-min", "Jain's index of the users' rates / fair shares of the active places", "4")
    # ... and the best user's: no user takes much more than its share while the others want tokens. With
    # many users the others' loss is spread thin: a user with two streams taking a place every step
    # beside six users with one (4 places) got 1.75 x, the others 0.87 x and Jain's index 0.91
    place_share_max: float = threshold(
        1.25, "--place-share-max", "with more streams than active places, no user's rate above this x its max-min "
        "fair share (its streams took places where users take turns)", "4")
    # PRIORITY policy: the worst ratio of a user above the lowest priority. Its streams take the places
    # first, so only step timing stands between it and its whole share (the shipped patch 0.99 to 1.00 on
    # cpu-tiny); places that go round every stream alike give a priority -1 user 0.50 in cap-priority
    place_share_priority_min: float = threshold(
        0.85, "--place-share-priority-min", "PRIORITY policy, users at several priorities: every user above the "
        "lowest priority gets at least this x its fair share of the active places (its streams take them first)", "4")
    # work conservation: the longest run of consecutive steps that left a place or a slot idle, or held by a
    # throttled request, while a request of a user with budget waited (1: the step in which a budget flips)
    work_conservation_max_run_steps: int = threshold(
        1, "--work-conservation-max-run-steps", "work conservation: the longest run of consecutive engine steps "
        "that may leave a place or a slot idle, or held by a throttled request, while a request of a user with "
        "budget waits (1: the step in which a budget flips)", "4")
    # ... and the longest run of steps that left a place idle while a resident request of a user with budget
    # got no tokens (work-conservation-places; 2: a budget flip and a stream sitting out one step for a
    # sibling whose turn holds its user's token)
    work_conservation_places_max_run_steps: int = threshold(
        2, "--work-conservation-places-max-run-steps", "work conservation: the longest run of consecutive engine "
        "steps (synchronous scheduling) that may leave a place idle while a resident request of a user with "
        "budget gets no tokens (2: a budget flip, and a stream sitting out one step for its sibling's turn)", "4")
    # a refusal must be earned: tokens a refused user's charges may fall short of the bound's burst in
    # the window ending at the refusal (charges refunded at the end of the refusing step are not dispatches)
    refusal_tolerance_tokens: float = threshold(
        2.0, "--refusal-tolerance-tokens", "refusal-witness: tokens a refused user's charges may fall short of "
        "the burst in the window ending at the refusal (refunds of the refusing step)", "witness")
    # answers-intact: how far (nats) below the limiter-off engine's likeliest token a token of a limiter-on
    # answer that parted from the baseline's may score there and still count as its greedy choice, a tie
    # broken the other way by the batch's rounding (analysis/answers.py, ratebench/answerscore.py)
    answers_logprob_tol: float = threshold(
        0.05, "--answers-logprob-tol", "answers-intact: how far (nats) below the limiter-off engine's likeliest "
        "token a token of a limiter-on answer that parted may score there and still count as its greedy choice (a "
        "tie the batch's rounding broke the other way)", "3")
    # widening of windows on emit events (None: the phase's longest engine step)
    emit_tolerance_ns: int | None = threshold(
        None, "--emit-tolerance-ms", "widen windows on emit events by this much (default: the longest engine step "
        "measured in the phase; over a whole event file, on the engine)", "6", unit="ms")
    # two witnesses (analysis/witness.py): how far the client's time may precede the engine's for the same
    # token, end of stream or send. One clock (CLOCK_MONOTONIC, 1 ns resolution through the vDSO, one
    # timekeeper for all CPUs): this is reading it, not delivery, which takes hundreds of microseconds
    witness_clock_ns: int = threshold(
        5_000, "--witness-clock-us", "two witnesses: how far (microseconds) the client's time may precede the "
        "engine's event for the same token, end of stream or send (the clock's resolution; one host clock)", "witness",
        unit="us")
    # two witnesses: the most a user's tokens' delivery latency (client arrival - engine emit) may vary in a
    # phase: bound-client widens its windows by that spread, so a wide one hides clumps. 2.5 bursts: the
    # API server of a busy two-core machine held a chunk up to 44 ms in ten clean cpu-tiny runs
    delivery_spread_max_ns: int = threshold(
        250_000_000, "--delivery-spread-max-ms", "two witnesses: how much (ms) the delay from a token's emit "
        "event to its arrival at the client may vary for one user in a phase (the client bound's windows widen by "
        "it; 250: two and a half bursts)", "witness", unit="ms")
    # two witnesses: the longest step the engine's file records in a phase (bound-emit's and bound-client's
    # tolerance) may exceed twice the client's longest silence plus the delivery spread by this much
    # (analysis/witness.py, witness-steps): waking threads on a busy machine
    step_witness_slack_ns: int = threshold(
        20_000_000, "--step-witness-slack-ms", "two witnesses: how much (ms) the longest step the engine's file "
        "records in a phase (the bound's step tolerance on emits and client chunks) may exceed 2 x (the client's "
        "longest silence from that engine in the phase + the delivery spread)", "witness", unit="ms")
    burst_ns: int = BURST_NS


@dataclass
class Check:
    """One check: its figure beside its threshold, and why it passed or failed."""

    name: str
    scenario: str  # "*" for checks over a whole engine file
    phase: str
    engine: str
    user: str | None
    figure: float | int | None
    threshold: float | int | None
    op: str  # how figure compares with threshold: ">=", "<="; "vs" beside a reference (information)
    unit: str
    passed: bool | None  # None: informational
    explanation: str

    @property
    def status(self) -> str:
        return "info" if self.passed is None else ("pass" if self.passed else "fail")


@dataclass
class UserPhaseSummary:
    """One user in one scenario phase: the table row of every report."""

    scenario: str
    phase: str
    engine: str
    user: str
    role: str
    kind: str
    limit_tps: int | None
    streams: int
    backlogged: bool
    requests: int
    tier: str | None = None  # a mix's tier user: its tier's name (scenarios.json users[u].tier)
    dispatch_rate: RateFigures | None = None
    emit_rate: RateFigures | None = None
    client_rate: RateFigures | None = None
    bound_dispatch: BoundResult | None = None
    bound_emit: BoundResult | None = None
    bound_client: BoundResult | None = None  # information only
    gaps_emit_request: GapStats | None = None
    gaps_emit_user: GapStats | None = None
    gaps_client_request: GapStats | None = None
    gaps_client_user: GapStats | None = None
    stream_spread: int | None = None
    # vLLM's PRIORITY policy and the user's streams sent at several priorities: those priorities, and
    # stream_spread is the largest spread among the streams of one priority (each takes turns within it)
    stream_priorities: list[int] | None = None
    # a stream sent several requests and the user's budget was never spent to the bound: the spread of
    # every two streams counted only while both had a request in service (fairness.stream_spread; None:
    # no two ever were)
    streams_resent: bool = False
    stream_spread_in_service: int | None = None
    # the most the user's dispatches in the phase held above N x a window's length (refusals.peak_head):
    # N x burst or more, its budget was spent to the bound at some moment
    peak_head_tokens: float | None = None
    spacing_dispatch: SpacingResult | None = None  # even spacing (the lower side) on dispatch events
    spacing_emit: SpacingResult | None = None  # ... and on emit events
    ttft_client: GapStats | None = None  # first token-carrying chunk - sent, per request
    ttft_engine: GapStats | None = None  # the engine's first emit event - sent, per request
    # charge parity over the finished requests with engine events: dispatch events - emitted tokens
    charge_requests: int = 0  # requests looked at
    charge_excess_tokens: int = 0  # sum of dispatch events - emitted tokens (negative: tokens never charged)
    charge_over_allowance: int = 0  # tokens charged beyond each request's allowance, summed
    charge_worst: str | None = None  # the request furthest past its allowance, in words
    streamed_tokens: int = 0
    cancelled: int = 0
    cancelled_charged_tokens: int = 0
    passed: bool = True

    def spent_to_bound(self, burst_ns: int) -> bool:
        """Whether the user's dispatches in the phase spent its budget to the bound at some moment
        (within one token of N x burst above N x a window's length: its next token would be refused)."""
        return (self.peak_head_tokens is not None and bool(self.limit_tps)
                and self.peak_head_tokens >= self.limit_tps * burst_ns / 1e9 - 1)


@dataclass
class EngineUserBound:
    """The bound over one engine's whole event file for one user (limiter state spans phases)."""

    engine: str
    user: str
    limit_tps: int
    dispatch: BoundResult | None
    emit: BoundResult | None


@dataclass
class PairedRatio:
    """throughput(a) / throughput(b) for one pair of overhead roles, round by round."""

    median: float  # of the per-round ratios: the figure the checks use
    min: float
    max: float
    rounds: int  # rounds in which both roles ran
    pooled: float  # all tokens / all time of a, over the same of b
    per_round: dict[str, float]  # round ("sync-1", ...) -> ratio


@dataclass
class OverheadSummary:
    scenario: str
    throughput_tps: dict[str, float]  # role -> total tokens / summed phase durations (first sent to last token)
    tokens: dict[str, int]
    ratios: dict[str, float]  # "feature-on/feature-off", ... -> pooled ratio (throughput_tps a / b)
    paired: dict[str, PairedRatio] = field(default_factory=dict)  # the same pairs, round by round
    round_throughput_tps: dict[str, dict[str, float]] = field(default_factory=dict)  # round -> role -> tok/s
    # role -> median over its phases of the phase's median time from one engine step to the next
    # (emit to emit); roles whose engine records events only
    step_p50_ns: dict[str, float] = field(default_factory=dict)
    # round -> role -> CPUs that processes outside the run kept busy during that phase (runs that measured it)
    round_other_cpu: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class MissingPhase:
    """A scenario phase the verdict of a partial run does not check, and why."""

    scenario: str
    phase: str
    engine: str
    why: str

    @property
    def label(self) -> str:
        return f"{self.scenario}/{self.phase}@{self.engine}"


@dataclass
class Verdict:
    run_dir: str
    run_id: str | None
    profile_name: str | None
    manifest_summary: dict
    thresholds: Thresholds
    engine_steps: dict[str, EngineStep]
    rows: list[UserPhaseSummary]
    engine_bounds: list[EngineUserBound]
    overheads: list[OverheadSummary]
    checks: list[Check]
    warnings: list[str] = field(default_factory=list)
    waiting: list = field(default_factory=list)  # analysis.waiting.WaitingSummary per waiting scenario
    # verify-bound --partial on a run that did not complete: only its completed phases were checked
    partial: bool = False
    missing_phases: list[MissingPhase] = field(default_factory=list)  # phases not checked, and why
    # analysis.tierlatency.TierLatency per tier of each many-user phase (a mix), beside its baseline
    tier_latency: list = field(default_factory=list)
    # engine -> async_scheduling as its event file's header says the engine ran (engines with an event file
    # whose header tells): with the engine names' -sync/-async, which modes promise 5 was exercised in
    # (outputs/promises.py)
    engine_async_scheduling: dict[str, bool] = field(default_factory=dict)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]

    @property
    def passed(self) -> bool:
        """Every check passed on a complete run (a partial verdict never passes)."""
        return not self.failures and not self.partial

    @property
    def outcome(self) -> str:
        """PASS, FAIL, PARTIAL (every check of the completed phases passed) or FAIL (PARTIAL)."""
        if self.failures:
            return "FAIL (PARTIAL)" if self.partial else "FAIL"
        return "PARTIAL" if self.partial else "PASS"

    def summary(self) -> str:
        """A few plain lines: the outcome and each failure in one line."""
        n_info = sum(c.passed is None for c in self.checks)
        n = len(self.checks) - n_info
        lines = [f"verdict: {self.outcome}: {n - len(self.failures)} of {n} checks passed "
                 f"({n_info} informational); report: {self.run_dir}/report.md"]
        for c in self.failures:
            who = f" {c.user}" if c.user else ""
            lines.append(f"FAIL {c.name} {c.scenario}/{c.phase}@{c.engine}{who}: {c.explanation}")
        return "\n".join(lines)
