"""The thresholds table: every threshold a check uses, with its ``verify-bound`` option, the unit that
option takes, its help and the promise whose checks it sets. The defaults are
:class:`ratebench.analysis.verdict.Thresholds`' (one place); the options of ``verify-bound`` are made
from this table (``ratebench/cli/verify.py``), and so is the Thresholds a command line asks for
(:func:`from_options`). A threshold added to Thresholds without a row here fails the tests
(tests/test_verify.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ratebench.analysis.verdict import Thresholds

_NS_PER = {"": 1, "ms": 1_000_000, "us": 1_000}


@dataclass(frozen=True)
class Threshold:
    """One threshold: the Thresholds field, its option, the option's unit ("" the field's own; "ms" or
    "us" for a field in nanoseconds), its help and the promise (a key of the promise table) it guards."""

    field: str
    option: str
    help: str
    promise: str
    unit: str = ""
    # a profile may set it for one scenario's phases: that scenario parameter (in the option's unit, the
    # profile schema's type ``phase_type``), combined with the command line's by ``phase_rule``: "wider"
    # the larger of the two; "unless-given" the parameter's, unless the command line gives one
    phase_param: str | None = None
    phase_type: str = ""
    phase_rule: str = "wider"

    @property
    def scale(self) -> int:
        return _NS_PER[self.unit]

    @property
    def optional(self) -> bool:
        return "None" in str(_FIELDS[self.field].type)

    @property
    def type(self) -> type:
        """What the option takes: a float for a field given in ms or us, else the field's own type."""
        return float if self.unit or "float" in str(_FIELDS[self.field].type) else int

    @property
    def default(self) -> float | int | None:
        """The Thresholds default, in the option's unit."""
        value = _FIELDS[self.field].default
        if value is None or not self.unit:
            return value
        return value / self.scale

    @property
    def param(self) -> str:
        """The option's Python parameter name."""
        return self.option.lstrip("-").replace("-", "_")


_FIELDS = {f.name: f for f in dataclasses.fields(Thresholds)}

TABLE: tuple[Threshold, ...] = (
    Threshold("delivery_min", "--delivery-min", "backlogged user's steady rate, at least this x its limit", "2"),
    Threshold("isolation_min", "--isolation-min", "a user whose limit did not bind: its rate beside throttled "
              "users, at least this x on the phase's baseline", "4"),
    Threshold("isolation_ttft_factor", "--isolation-ttft-factor", "its p50/p90/p99 time to first token, at most "
              "this x the baseline's + --isolation-ttft-slack-ms", "4"),
    Threshold("isolation_ttft_slack_ns", "--isolation-ttft-slack-ms", "added to the allowed time to first token",
              "4", "ms"),
    Threshold("isolation_e2e_factor", "--isolation-e2e-factor", "its p50/p90/p99 end-to-end latency, at most this "
              "x the baseline's + --isolation-e2e-slack-ms", "4"),
    Threshold("isolation_e2e_slack_ns", "--isolation-e2e-slack-ms", "added to the allowed end-to-end latency", "4",
              "ms"),
    Threshold("isolation_gap_factor", "--isolation-gap-factor", "its p50/p90/p99 inter-token gap, at most this x "
              "the baseline's + --isolation-gap-slack-ms", "4"),
    Threshold("isolation_gap_slack_ns", "--isolation-gap-slack-ms", "added to the allowed inter-token gap", "4",
              "ms"),
    Threshold("max_overhead", "--max-overhead", "fail when 1 - throughput(feature-on)/throughput(off or stock) "
              "(the median of the per-round ratios) exceeds this (default: the overhead scenario's max_overhead, "
              "else report only)", "overhead", phase_param="max_overhead", phase_type="fraction",
              phase_rule="unless-given"),
    Threshold("max_event_overhead", "--max-event-overhead", "fail when 1 - throughput(feature-on)/throughput("
              "feature-on without engine events) (the median of the per-round ratios) exceeds this (default: "
              "report only)", "events"),
    Threshold("cancel_max_steps", "--cancel-max-steps", "emit events of a cancelled request after the cancel (a "
              "mix's cancel_max_steps may allow more)", "reconciliation", phase_param="cancel_max_steps",
              phase_type="pos_int"),
    Threshold("trace_lateness_ns", "--trace-lateness-ms", "a trace or mix phase: the p99 of how late the driver "
              "sent its requests (default: the scenario's lateness_ms, else 20)", "replay", "ms",
              phase_param="lateness_ms", phase_type="pos_num", phase_rule="unless-given"),
    Threshold("stream_spread_max", "--stream-spread-max", "tokens between one user's streams while all are "
              "active", "2"),
    Threshold("jain_min", "--jain-min", "Jain's index across backlogged users with equal limits", "4"),
    Threshold("emit_tolerance_ns", "--emit-tolerance-ms", "widen windows on emit events by this much (default: "
              "the longest engine step measured in the phase; over a whole event file, on the engine)", "6", "ms"),
    Threshold("spacing_slack_ns", "--spacing-slack-ms", "even spacing: a backlogged user may fall short of N x W "
              "by 1 + N x (longest step period + this) tokens in a window", "2", "ms"),
    Threshold("wait_cpu_max", "--wait-cpu-max", "EngineCore CPUs spent while users wait, beyond what an idle "
              "engine and its steps cost", "waiting"),
    Threshold("wait_steps_max", "--wait-steps-max", "empty engine steps right after an empty step (re-wakes) per "
              "second of waiting for budget (a blocked engine wakes every 50 ms at most: 20)", "waiting"),
    Threshold("wake_max_ms", "--wake-max-ms", "a waiting engine's added p50 time to first token of a new request, "
              "and p50 abort latency", "waiting"),
    Threshold("stream_wait_factor", "--stream-wait-factor", "a throttled user's stream waits at most this x "
              "streams / limit + --stream-wait-slack-ms for a token", "2"),
    Threshold("stream_wait_slack_ns", "--stream-wait-slack-ms", "added to the allowed longest stream wait", "2",
              "ms"),
    Threshold("place_share_min", "--place-share-min", "with more streams than active places, every user's rate "
              "at least this x its max-min fair share", "4"),
    Threshold("place_share_max", "--place-share-max", "with more streams than active places, no user's rate "
              "above this x its max-min fair share (its streams took places where users take turns)", "4"),
    Threshold("place_share_priority_min", "--place-share-priority-min", "PRIORITY policy, users at several "
              "priorities: every user above the lowest priority gets at least this x its fair share of the active "
              "places (its streams take them first)", "4"),
    Threshold("place_jain_min", "--place-jain-min", "Jain's index of the users' rates / fair shares of the active "
              "places", "4"),
    Threshold("work_conservation_max_run_steps", "--work-conservation-max-run-steps", "work conservation: the "
              "longest run of consecutive engine steps that may leave a place or a slot idle, or held by a "
              "throttled request, while a request of a user with budget waits (1: the step in which a budget "
              "flips)", "4"),
    Threshold("work_conservation_places_max_run_steps", "--work-conservation-places-max-run-steps", "work "
              "conservation: the longest run of consecutive engine steps (synchronous scheduling) that may leave "
              "a place idle while a resident request of a user with budget gets no tokens (2: a budget flip, and "
              "a stream sitting out one step for its sibling's turn)", "4"),
    Threshold("witness_clock_ns", "--witness-clock-us", "two witnesses: how far (microseconds) the client's time "
              "may precede the engine's event for the same token, end of stream or send (the clock's "
              "resolution; one host clock)", "witness", "us"),
    Threshold("refusal_tolerance_tokens", "--refusal-tolerance-tokens", "refusal-witness: tokens a refused user's "
              "charges may fall short of the burst in the window ending at the refusal (refunds of the refusing "
              "step)", "witness"),
    Threshold("answers_logprob_tol", "--answers-logprob-tol", "answers-intact: how far (nats) below the "
              "limiter-off engine's likeliest token a token of a limiter-on answer that parted may score there "
              "and still count as its greedy choice (a tie the batch's rounding broke the other way)", "3"),
    Threshold("delivery_spread_max_ns", "--delivery-spread-max-ms", "two witnesses: how much (ms) the delay from "
              "a token's emit event to its arrival at the client may vary for one user in a phase (the client "
              "bound's windows widen by it; 250: two and a half bursts)", "witness", "ms"),
    Threshold("step_witness_slack_ns", "--step-witness-slack-ms", "two witnesses: how much (ms) the longest "
              "step the engine's file records in a phase (the bound's step tolerance on emits and client chunks) "
              "may exceed 2 x (the client's longest silence from that engine in the phase + the delivery spread)",
              "witness", "ms"),
)

# Thresholds fields that are no command-line option: the bound's burst is the promise's 100 ms (DESIGN
# section 1), never what an engine's header says it ran (engine-as-asked holds the header to it).
NOT_OPTIONS = ("burst_ns",)

DEFAULT_TRACE_LATENESS_NS = 20_000_000  # trace_lateness_ns when neither the command line nor the phase sets it
_BY_FIELD = {t.field: t for t in TABLE}


def phase_params(*fields: str) -> dict[str, tuple[str, Any]]:
    """A scenario kind's PARAMS entries for the thresholds its profile may set per phase (the table's
    ``phase_param`` of each field, left unset by default)."""
    return {_BY_FIELD[f].phase_param: (_BY_FIELD[f].phase_type, None) for f in fields}  # type: ignore[misc]


def phase_param_of(field: str) -> str | None:
    """The scenario parameter through which a profile sets threshold ``field`` per phase (None: none)."""
    return _BY_FIELD[field].phase_param


def for_phase(th: Thresholds, field: str, params: dict[str, Any]) -> Any:
    """The threshold ``field`` for a phase whose scenario parameters are ``params``: the command line's
    (``th``) and the phase's (its ``phase_param``, in the option's unit) combined by the row's rule."""
    t = _BY_FIELD[field]
    given = getattr(th, field)
    raw = params.get(t.phase_param) if t.phase_param else None
    own = None if raw is None else (round(float(raw) * t.scale) if t.unit else t.type(raw))
    if t.phase_rule == "unless-given":
        return given if given is not None else own
    if own is None:
        return given
    return own if given is None else max(given, own)


def from_options(values: dict[str, Any]) -> Thresholds:
    """The Thresholds of a command line: ``values`` by parameter name (:attr:`Threshold.param`), in the
    options' units; a threshold left out keeps its default."""
    fields: dict[str, Any] = {}
    for t in TABLE:
        if t.param not in values:
            continue
        value = values[t.param]
        fields[t.field] = value if value is None or not t.unit else round(value * t.scale)
    return Thresholds(**fields)
