"""What the analysis reads of a phase's ``params`` (``scenarios.json``, ``docs/run-folder.md``), typed.

A phase's ``params`` holds its scenario's parameters (the profile's, with the kind's defaults) and what
the scenario added while the phase ran (probes, the engine's /metrics, a fleet's members). The JSON
stays one object, so that any tool reads it; inside ratebench every key the analysis reads is a field
here, read once (:meth:`PhaseFacts.read`) and written by the scenarios under the same names
(:meth:`FleetInfo.to_json`, :meth:`Failover.to_json`, :meth:`BeamProbe.to_json`, and the ``KEY_*``
names below). The thresholds a profile may set per phase (``lateness_ms``, ``cancel_max_steps``,
``max_overhead``) are read through the thresholds table (``analysis/thresholds.py``), which names them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# params keys written by the scenarios beside the profile's parameters
KEY_SCHEDULING = "scheduling"  # the scheduling mode of an overhead round or a seed phase
KEY_ROUND = "round"  # an overhead round, from 1
KEY_BEAM_SEARCH = "beam_search"  # the beam search probes sent before the phase
# the requests answered in one body (not streamed) sent before the phase, and the user each must be charged to
KEY_UNSTREAMED = "unstreamed_probes"
KEY_KV_USAGE_MAX = "kv_usage_max"  # the engine's highest KV cache use over the phase (/metrics), 0 to 1
KEY_PREEMPTIONS = "preemptions"  # the engine's preemptions over the phase (/metrics)
KEY_FLEET = "fleet"  # a fleet phase: its fleet, the same in each member's record
KEY_FLEET_USER_COUNTERS = "fleet_user_counters"  # member -> user -> the /metrics counters' change
KEY_GREEDY = "greedy_answers"  # the answers that run to max_tokens were sent at temperature 0
KEY_ALONGSIDE = "alongside"  # what a task run beside the phase did (a fleet's failover; then moved)
KEY_CLIENT_LOOP_LAG = "client_loop_lag"  # how late the driver's loop read bytes over the phase
# the profile's parameters the analysis reads (the kinds' PARAMS name them)
KEY_PROMPT_TOKENS = "prompt_tokens"
KEY_STREAM_WAIT = "stream_wait"
KEY_PLACE_SHARE = "place_share"


@dataclass(frozen=True)
class BeamProbe:
    """One beam search request sent before a phase, and the engine's answer."""

    api: Any  # "completions" or "chat"
    sent: Any  # what it asked, in words
    status: Any  # the HTTP status (None: no answer)
    message: str  # the start of the answer's body

    @classmethod
    def read(cls, d: dict[str, Any]) -> BeamProbe:
        return cls(d.get("api"), d.get("sent"), d.get("status"), str(d.get("message") or ""))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Failover:
    """The member a fleet phase stopped: which, when, and the users it had served before."""

    engine: Any
    stopped_ns: int
    stopped_after_s: Any  # seconds into the phase, as written
    users_before: list[str]

    @classmethod
    def read(cls, d: Any) -> Failover | None:
        if not isinstance(d, dict):
            return None
        return cls(d.get("engine"), int(d.get("stopped_ns") or 0), d.get("stopped_after_s"),
                   list(d.get("users_before") or []))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FleetInfo:
    """A fleet phase's record, the same in each member's phase: the fleet, its policy and members."""

    name: str
    policy: str
    members: list[str]  # empty when not written: the members are the phases' engines
    balancer: Any = None
    served_by_header: Any = None
    requests: Any = None
    unserved: Any = None
    failover: Failover | None = None

    @classmethod
    def read(cls, d: Any) -> FleetInfo | None:
        if not isinstance(d, dict) or not d.get("name"):
            return None
        return cls(str(d["name"]), str(d.get("policy", "?")), [str(m) for m in d.get("members") or []],
                   d.get("balancer"), d.get("served_by_header"), d.get("requests"), d.get("unserved"),
                   Failover.read(d.get("failover")))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PhaseFacts:
    """Every key of a phase's params the analysis reads, typed (absent: the default)."""

    scheduling: str | None = None
    round: int | None = None
    beam_search: tuple[BeamProbe, ...] = ()
    prompt_tokens: Any = None  # the prompt's tokens as the profile gave them
    kv_usage_max: float | None = None
    preemptions: int | None = None
    kv_measured: bool = False  # kv_usage_max or preemptions written (a kv-pressure phase)
    fleet: FleetInfo | None = None
    fleet_user_counters: dict[str, dict[str, dict[str, float]] | None] | None = None
    greedy: bool = False
    stream_wait: tuple[str, ...] = ()
    place_share: bool = False

    @classmethod
    def read(cls, params: dict[str, Any]) -> PhaseFacts:
        counters = params.get(KEY_FLEET_USER_COUNTERS)
        return cls(
            scheduling=str(params[KEY_SCHEDULING]) if params.get(KEY_SCHEDULING) else None,
            round=params.get(KEY_ROUND) or None,
            beam_search=tuple(BeamProbe.read(p) for p in params.get(KEY_BEAM_SEARCH) or []),
            prompt_tokens=params.get(KEY_PROMPT_TOKENS),
            kv_usage_max=params.get(KEY_KV_USAGE_MAX), preemptions=params.get(KEY_PREEMPTIONS),
            kv_measured=KEY_KV_USAGE_MAX in params or KEY_PREEMPTIONS in params,
            fleet=FleetInfo.read(params.get(KEY_FLEET)),
            fleet_user_counters=counters if isinstance(counters, dict) and counters else None,
            greedy=bool(params.get(KEY_GREEDY)),
            stream_wait=tuple(params.get(KEY_STREAM_WAIT) or ()),
            place_share=bool(params.get(KEY_PLACE_SHARE)),
        )
