"""Profiles: one TOML file per machine/model set-up; schema, loading, validation.

A profile names the model, the device, the engine flags, the users and their
limits, the scheduling modes and the scenarios. The built-in profiles live in
``ratebench/profiles/*.toml`` (shipped as package data; ``profiles/`` at the
repository root points there). ``--profile`` takes a built-in name or a path.

Schema (every key is checked; unknown keys are errors)::

    [profile]
    name = "cpu-tiny"                 # optional; defaults to the file's stem
    description = "one line"          # shown by `ratebench profiles`
    device = "cpu"                    # "cpu" or "cuda"
    scheduling = ["sync", "async"]    # engines to build: sync and/or async scheduling
    startup_timeout_s = 300           # engine readiness timeout
    shutdown_grace_s = 20             # SIGINT -> SIGKILL grace period
    max_engines = 1                   # engines alive at once (1 on a GPU: each takes its memory)

    [model]
    source = "tiny"                   # "tiny": the generated tiny Qwen3; "path": name below
    name = "Qwen/Qwen3-8B"            # source = "path": local folder or Hugging Face id
    served_name = "tiny-qwen3"        # --served-model-name
    max_model_len = 2048              # --max-model-len (optional)
    dtype = "auto"                    # --dtype (optional)

    [engine]
    max_num_seqs = 16                 # --max-num-seqs: resident slots
    max_num_active_seqs = 4           # --max-num-active-seqs: per-step batch admission
    max_num_batched_tokens = 256      # --max-num-batched-tokens (optional)
    enable_chunked_prefill = true     # --[no-]enable-chunked-prefill (optional)
    enable_prefix_caching = true      # --[no-]enable-prefix-caching (optional)
    extra_args = []                   # more `vllm serve` flags, verbatim
    env = {}                          # environment variables for the engine
    cpu_async_overlay = false         # CPU: async engines keep --async-scheduling (ratebench/cpu_async.py)
    # optional: the model's decode step on this device by batch size (requests), in ms; --dry-run then
    # says for every user of a phase whether its limit is reachable with its streams (a stream gets
    # at most one token a step)
    reference_step_ms = { "1" = 16.4, "64" = 21.5 }

    [limits]
    default_tps = 100                 # --default-user-output-tokens-per-second
    [limits.users]                    # --user-output-tokens-per-second
    user-a = 20

    [[scenarios]]
    name = "seed-experiment"          # unique; defaults to the kind
    kind = "seed-experiment"          # one of SCENARIO_KINDS
    scheduling = ["sync", "async"]    # optional; default: the profile's first mode
    # ... the kind's parameters, see SCENARIO_PARAMS

Users named by a scenario must be keys of ``[limits.users]`` (write the
default rate there to use a user at the default rate). Rates are positive
integers, as the engine flags take them.

A ``trace`` scenario names a JSONL file of requests (``docs/trace.md``), a path
relative to the profile or a built-in trace (``ratebench/profiles/<name>.jsonl``);
the file is read and checked when the profile loads, its mistakes named by line::

    [[scenarios]]
    kind = "trace"
    trace = "example-trace"
    users_at_default_rate = false     # true: trace users not in [limits.users] take default_tps
    backlogged = []                   # users the trace keeps waiting: delivery and even spacing apply
    lateness_ms = 20                  # each request sent within this of its trace time (p99)

A ``mix`` scenario makes its requests from a seed (``ratebench/mix.py``; its
parameters in ``docs/trace.md``): tiers of users, given in ``[[scenarios.tiers]]``
tables (``name``, ``users``, ``limit_tps``, ``rate``, ``tier_rate`` or ``burst``, or ``arrival = "closed"``
with ``streams``, ``requests``, ``think_s``, ``backlogged``), are named
``<name>-00``, ``<name>-01``, ... and take the tier's limit as if declared in
``[limits.users]``; those names must not be declared there.

A ``fleet`` scenario runs ``engines`` limiter-on engines behind HAProxy
(``ratebench/balancer.py``), one phase per routing policy and a failover phase::

    [[scenarios]]
    kind = "fleet"
    users = ["user-a", "user-b"]      # each declared in [limits.users]
    streams = 4                       # per user, backlogged; at least `engines`
    max_tokens = 60
    engines = 2                       # K >= 2; on a GPU the k-th engine gets GPU k
    policies = ["round-robin", "user-hash"]
    user_header = "X-Ratebench-User"  # the header the balancer hashes (and requires)
    failover = true                   # then a user-hash phase in which one engine stops
    failover_after_s = 1.5
    failover_requests = 3             # per stream, a closed loop of short answers
    failover_max_tokens = 16
    light_users = ["user-c"]          # short answers beside the throttled users; their limits cannot bind
    light_requests = 8                # per light user, `light_every_s` apart, each of `light_max_tokens`
    light_max_tokens = 8              # (all of them within one burst of the user's limit)
    light_every_s = 0.25
    baseline = true                   # the policy phases again on a limiter-off fleet: isolation across it
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ratebench.events import ANONYMOUS_USER, APIS  # noqa: F401 - re-exported: profiles name them

BUILTIN_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "cpu-tiny"
SCHEDULING_MODES = ("sync", "async")
FLEET_POLICIES = ("round-robin", "user-hash")  # the fleet kind's routing policies (ratebench/balancer.py)


class ProfileError(ValueError):
    """A profile that cannot be used: names the file, the key and what was expected."""

    def __init__(self, path: Path | str, key: str, expected: str, got: Any = None, *, has_got: bool = True):
        self.path, self.key, self.expected = str(path), key, expected
        msg = f"{path}: {key}: expected {expected}"
        if has_got:
            msg += f", got {got!r}"
        super().__init__(msg)


def active_cap_users(p: dict[str, Any]) -> tuple[list[str], str]:
    """The users of an active-cap-fairness scenario: cap-00.. at limit_tps, and cap-high."""
    return [f"cap-{i:02d}" for i in range(p["users"])], "cap-high"


# ---- plain data ---------------------------------------------------------------------


@dataclass
class ModelSpec:
    source: str  # "tiny" | "path"
    name: str | None
    served_name: str
    max_model_len: int | None = None
    dtype: str | None = None


@dataclass
class EngineFlags:
    max_num_seqs: int
    max_num_active_seqs: int
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cpu_async_overlay: bool = False  # async engines run through ratebench/cpu_async.py (device "cpu" only)
    # the decode step by batch size (requests -> ms), for the dry run's reachability of the limits
    reference_step_ms: dict[int, float] = field(default_factory=dict)

    def step_ms_at(self, batch: int) -> float | None:
        """The reference decode step at ``batch`` requests (:func:`step_ms_at`)."""
        return step_ms_at(self.reference_step_ms, batch)


def step_ms_at(steps: dict[int, float], batch: int) -> float | None:
    """A decode step table (batch size -> ms) at ``batch`` requests: linear between the given sizes, the
    nearest one's outside them; None for an empty table."""
    if not steps:
        return None
    sizes = sorted(steps)
    if batch <= sizes[0]:
        return steps[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if batch <= hi:
            a, b = steps[lo], steps[hi]
            return a + (b - a) * (batch - lo) / (hi - lo)
    return steps[sizes[-1]]


@dataclass
class Limits:
    default_tps: int
    user_tps: dict[str, int]

    def limit_of(self, user: str | None) -> int:
        """The rate the engine gives ``user`` (None: the anonymous user)."""
        return self.user_tps.get(user or ANONYMOUS_USER, self.default_tps)


@dataclass
class ScenarioSpec:
    name: str
    kind: str
    scheduling: list[str]
    params: dict[str, Any]  # the kind's parameters, defaults filled in


@dataclass
class Profile:
    name: str
    description: str
    path: str
    device: str
    scheduling: list[str]
    startup_timeout_s: float
    shutdown_grace_s: float
    max_engines: int
    model: ModelSpec
    engine: EngineFlags
    limits: Limits
    scenarios: list[ScenarioSpec]

    def to_json(self) -> dict[str, Any]:
        """The profile as loaded, as plain JSON (for the manifest)."""
        return asdict(self)


@dataclass
class ProfileInfo:
    name: str
    path: Path
    description: str


# ---- scenario parameters ------------------------------------------------------------
# Each kind: parameter -> (checker, default). A default of REQUIRED must be given.

REQUIRED = object()


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _pos_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "pos_int": (_pos_int, "a positive integer"),
    "nonneg_int": (_nonneg_int, "an integer >= 0"),
    "pos_num": (_pos_num, "a positive number"),
    "num": (_num, "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "user": (lambda v: isinstance(v, str) and v != "", "a user name"),
    "api": (lambda v: v in APIS, f"one of {list(APIS)}"),
    "pos_int_list": (
        lambda v: isinstance(v, list) and len(v) > 0 and all(_pos_int(x) for x in v),
        "a non-empty list of positive integers",
    ),
    "user_list": (
        lambda v: isinstance(v, list) and all(isinstance(x, str) and x != "" for x in v) and len(set(v)) == len(v),
        "a list of distinct user names",
    ),
    "nonneg_num": (lambda v: _num(v) and v >= 0, "a number >= 0"),
    "fraction": (lambda v: _num(v) and 0 <= v <= 1, "a fraction from 0 to 1"),
    "arrivals": (lambda v: v in ("poisson", "constant"), 'one of ["poisson", "constant"]'),
    "overhead_against": (
        lambda v: isinstance(v, list) and len(v) > 0 and len(set(v)) == len(v)
        and all(x in ("feature-off", "stock", "no-events") for x in v),
        'a non-empty list of distinct engines among ["feature-off", "stock", "no-events"]',
    ),
    "length": (lambda v: _pos_int(v) or isinstance(v, dict),
               'a token count, or a table {dist = "fixed" | "uniform" | "lognormal", ...}'),
    "tiers": (lambda v: isinstance(v, list) and len(v) > 0 and all(isinstance(t, dict) for t in v),
              "a non-empty array of tier tables ([[scenarios.tiers]])"),
    "int_range": (
        lambda v: isinstance(v, list) and len(v) == 2 and all(_pos_int(x) for x in v) and v[0] <= v[1],
        "[low, high]: two positive integers, low <= high",
    ),
    "policies": (
        lambda v: isinstance(v, list) and len(v) > 0 and len(set(v)) == len(v) and all(x in FLEET_POLICIES for x in v),
        f"a non-empty list of distinct routing policies from {list(FLEET_POLICIES)}",
    ),
    "header": (lambda v: isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9-]+", v) is not None,
               "an HTTP header name (letters, digits and -)"),
}

# Parameters every scenario kind takes.
_COMMON = {"api": ("api", "completions"), "prompt_tokens": ("pos_int", 32)}

SCENARIO_PARAMS: dict[str, dict[str, tuple[str, Any]]] = {
    # One user limited to a low rate with 1 then 4 streams, beside a user at a higher rate.
    "seed-experiment": {
        "user": ("user", REQUIRED),
        "neighbour": ("user", REQUIRED),
        "streams": ("pos_int_list", [1, 4]),
        "neighbour_streams": ("pos_int", 1),
        "max_tokens": ("pos_int", 200),
        "neighbour_max_tokens": ("pos_int", 200),
    },
    # A throttled user with more streams than --max-num-active-seqs beside a high-limit
    # user; the high-limit user also runs alone (baseline).
    "isolation": {
        "throttled_user": ("user", REQUIRED),
        "throttled_streams": ("pos_int", REQUIRED),
        "user": ("user", REQUIRED),
        "streams": ("pos_int", 2),
        "max_tokens": ("pos_int", 200),
        "lead_s": ("pos_num", 0.5),
    },
    # Streams closed by the client mid-answer; then the same user's new streams.
    "cancellation": {
        "user": ("user", REQUIRED),
        "streams": ("pos_int", 4),
        "cancel_after_tokens": ("pos_int", 10),
        "cancel_after_s": ("pos_num", 1.0),
        "max_tokens": ("pos_int", 2000),
        "followup_streams": ("pos_int", 2),
        "followup_max_tokens": ("pos_int", 100),
        "settle_s": ("num", 0.5),
    },
    # Prompts several times --max-num-batched-tokens: chunked prefill.
    "long-prompt": {
        "user": ("user", REQUIRED),
        "streams": ("pos_int", 2),
        "max_tokens": ("pos_int", 100),
    },
    # Many requests sharing a long prefix (prefix-cache hits).
    "prefix-cache": {
        "user": ("user", REQUIRED),
        "requests": ("pos_int", 16),
        "concurrency": ("pos_int", 4),
        "prefix_tokens": ("pos_int", 512),
        "max_tokens": ("pos_int", 32),
    },
    # Short answers that end with a real EOS (no ignore_eos).
    "eos": {
        "user": ("user", REQUIRED),
        "requests": ("pos_int", 12),
        "concurrency": ("pos_int", 4),
        "answer_tokens": ("int_range", [2, 20]),
        "max_tokens": ("pos_int", 64),
        # Tiny random-weight models never choose EOS: a logit bias on the EOS token,
        # released by min_tokens, makes it come at a chosen length. 0: natural EOS.
        "eos_logit_bias": ("num", 0),
        "question": ("str", "Answer with one word: what colour is the sky on a clear day?"),
    },
    # Requests without output_rate_user share __anonymous__; nothing else a client sends
    # (the OpenAI `user` field, X-User-style headers, other vllm_xargs keys, a priority, on both APIs)
    # names spoof_as. named_user's streams send output_rate_user and the same spoofs.
    "anonymous-and-spoofing": {
        "streams": ("pos_int", 2),
        "spoof_streams": ("pos_int", 5),
        "spoof_as": ("user", REQUIRED),
        "named_user": ("user", None),
        "named_streams": ("pos_int", 2),
        "max_tokens": ("pos_int", 100),
    },
    # Waiting costs nothing and wakes at once: user's streams (a low limit) alone, with probe
    # requests of probe_user (unthrottled) and closed streams arriving while the engine waits.
    "waiting": {
        "user": ("user", REQUIRED),
        "probe_user": ("user", REQUIRED),
        "streams": ("pos_int", 4),
        "max_tokens": ("pos_int", 6),
        "wait_s": ("num", 4.0),
        "probes": ("pos_int", 8),
        "probe_max_tokens": ("pos_int", 4),
        "cancels": ("pos_int", 6),
        "busy_max_tokens": ("pos_int", 200),
    },
    # Throttled requests never hold the KV another user needs, and none of their streams starves:
    # throttled_user's long-context streams fill most of a small KV cache (engine flags:
    # --num-gpu-blocks-override), then user's requests arrive one after another; user also runs
    # alone first (baseline). Preemptions and KV use are read from the engine's /metrics.
    "kv-pressure": {
        "throttled_user": ("user", REQUIRED),
        "throttled_streams": ("pos_int", 6),
        # instead of throttled_streams: as many streams as fill this fraction of the engine's KV cache
        # (its size read from /metrics when the phase starts), at least 2
        "kv_fill": ("fraction", None),
        "user": ("user", REQUIRED),
        "requests": ("pos_int", 6),  # the user's requests, one every interval_s after lead_s
        "interval_s": ("pos_num", 0.8),
        "lead_s": ("pos_num", 2.0),
        "user_prompt_tokens": ("pos_int", 512),
        "max_tokens": ("pos_int", 60),  # the user's requests
    },
    # Users share the --max-num-active-seqs places: more streams than places, every user's limit
    # above what the places deliver. "equal": users x streams at one limit; "high": the users with
    # one stream each first, then one user at high_limit_tps (cap-high) with high_streams after lead_s. Users cap-00.. and cap-high
    # take their limits as if declared in [limits.users].
    "active-cap-fairness": {
        "users": ("pos_int", 8),
        "streams": ("pos_int", 2),  # per user
        "limit_tps": ("pos_int", 1000),
        "high_limit_tps": ("pos_int", 5000),
        "high_streams": ("pos_int", 2),
        "lead_s": ("pos_num", 0.5),
        "max_tokens": ("pos_int", 200),
    },
    # Limits never reached, against the feature off, stock vLLM and the limiter without engine events.
    "overhead": {
        "user": ("user", REQUIRED),
        "streams": ("pos_int", 8),
        "max_tokens": ("pos_int", 128),
        "rounds": ("pos_int", 2),
        # the engines the limiter-on engine is compared with (each one more engine to start)
        "against": ("overhead_against", ["feature-off", "stock", "no-events"]),
        # the most the limiter may cost: 1 - the median per-round throughput ratio against each engine of
        # `against` (verify-bound's --max-overhead wins when given); unset: reported, not judged
        "max_overhead": ("fraction", None),
    },
    # Replay a JSONL trace (docs/trace.md): each request at its arrival offset, with its user, prompt,
    # max_tokens, cancel, EOS, shared prefix and API. Every trace user is a row of the verdict.
    "trace": {
        "trace": ("str", REQUIRED),  # a path relative to the profile's folder, or a built-in trace name
        "users_at_default_rate": ("bool", False),  # trace users not in [limits.users] take default_tps
        "backlogged": ("user_list", []),  # users the trace keeps waiting for tokens: delivery, even spacing
        "lateness_ms": ("pos_num", 20),  # each request sent within this of its trace time (p99: trace-lateness)
    },
    # A seeded synthetic population (ratebench/mix.py), replayed like a trace: tiers of users
    # (<tier>-00.. at the tier's limit) and anonymous requests, open-loop arrivals or a burst.
    "mix": {
        "seed": ("nonneg_int", 0),
        "duration_s": ("pos_num", 10.0),  # arrivals within [0, duration_s)
        "arrivals": ("arrivals", "poisson"),
        # each: name, users, limit_tps, arrival; rate (per user per s) or tier_rate (the tier's), burst,
        # burst_requests; or, with
        # arrival = "closed": streams (open per user), requests (per user), think_s, backlogged
        "tiers": ("tiers", REQUIRED),
        "anonymous_rate": ("nonneg_num", 0),  # anonymous requests per second, in total
        "burst_at_s": ("nonneg_num", 0),  # when the burst tiers' users arrive, all at once
        "prompt_tokens": ("length", 32),
        "output_tokens": ("length", 64),  # max_tokens
        "eos_fraction": ("fraction", 0),  # a real EOS may end the answer
        "cancel_fraction": ("fraction", 0),  # closed after 20-80 % of max_tokens
        "prefix_fraction": ("fraction", 0),  # share one of prefix_groups prefixes of prefix_tokens
        "prefix_tokens": ("pos_int", 256),
        "prefix_groups": ("pos_int", 1),
        "chat_fraction": ("fraction", 0),
        "lateness_ms": ("pos_num", 20),
        "baseline": ("bool", False),  # also replay on the limiter-off engine (limits raised)
        # engine steps allowed after a client's cancel (verify-bound's --cancel-max-steps when higher):
        # under a heavy mix an abort reaches the engine a few steps late, the limiter off alike
        "cancel_max_steps": ("pos_int", None),
    },
    # A fleet: `engines` limiter-on engines of the same flags behind a load balancer (HAProxy), one
    # phase per routing policy. Each of `users` sends `streams` backlogged streams through the
    # balancer, with its name in `user_header` (as a gateway that authenticates users sets it) and
    # in vllm_xargs. The per-user bound is judged across the fleet as well as per engine: under
    # round-robin a user's streams spread over the engines and the fleet gives it up to
    # engines x its limit (FAIL, by design of the policy); under user-hash it holds.
    "fleet": {
        "users": ("user_list", REQUIRED),
        "streams": ("pos_int", 4),
        "max_tokens": ("pos_int", 60),
        "engines": ("pos_int", 2),
        "policies": ("policies", list(FLEET_POLICIES)),
        "user_header": ("header", "X-Ratebench-User"),
        # a last phase under user-hash in which the engine serving the most users is stopped
        # `failover_after_s` in; each stream is a closed loop of `failover_requests` answers of
        # `failover_max_tokens`, so that its user goes on sending after the move
        "failover": ("bool", True),
        "failover_after_s": ("pos_num", 1.5),
        "failover_requests": ("pos_int", 3),
        "failover_max_tokens": ("pos_int", 16),
        # users whose limits cannot bind: each sends `light_requests` answers of `light_max_tokens` through
        # the balancer, open loop, `light_every_s` apart, while the backlogged users are throttled (all of a
        # light user's tokens of a phase fit in one burst of its limit)
        "light_users": ("user_list", []),
        "light_requests": ("pos_int", 8),
        "light_max_tokens": ("pos_int", 8),
        "light_every_s": ("pos_num", 0.25),
        # each policy's phase again on `engines` limiter-off engines behind a balancer of their own (the same
        # requests): isolation judges the light users across the fleet against it
        "baseline": ("bool", False),
    },
}
# Kinds whose requests say their own prompt and API (no common parameters).
_OWN_REQUESTS = ("trace", "mix")
for _name, _kind in SCENARIO_PARAMS.items():
    for _k, _v in _COMMON.items():
        if _name not in _OWN_REQUESTS:
            _kind.setdefault(_k, _v)
SCENARIO_KINDS = tuple(SCENARIO_PARAMS)

# Parameters naming users, per kind (checked against [limits.users]).
_USER_PARAMS = ("user", "neighbour", "throttled_user", "spoof_as", "named_user", "probe_user")


# ---- loading ------------------------------------------------------------------------


def list_profiles() -> list[ProfileInfo]:
    """The built-in profiles, by name."""
    out = []
    for path in sorted(BUILTIN_DIR.glob("*.toml")):
        try:
            with path.open("rb") as f:
                data = tomllib.load(f)
            desc = str(data.get("profile", {}).get("description", ""))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            desc = f"(unreadable: {exc})"
        out.append(ProfileInfo(name=path.stem, path=path, description=desc))
    return out


def resolve_profile_path(name_or_path: str) -> Path:
    """A built-in profile name, or a path to a TOML file."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise ProfileError(p, "file", "an existing profile TOML file", has_got=False)
        return p
    builtin = BUILTIN_DIR / f"{name_or_path}.toml"
    if builtin.is_file():
        return builtin
    names = ", ".join(i.name for i in list_profiles()) or "none"
    raise ProfileError(name_or_path, "profile", f"a built-in profile name ({names}) or a .toml path", has_got=False)


def load_profile(name_or_path: str = DEFAULT_PROFILE) -> Profile:
    """Load and validate a profile; raises ProfileError naming file, key and expectation."""
    path = resolve_profile_path(name_or_path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(path, "(file)", f"valid TOML ({exc})", has_got=False) from exc
    except OSError as exc:
        raise ProfileError(path, "(file)", f"a readable file ({exc.strerror})", has_got=False) from exc
    return parse_profile(data, path)


def parse_profile(data: dict[str, Any], path: Path | str) -> Profile:
    """Validate a profile's parsed TOML."""
    v = _Validator(path)
    v.keys(data, "", {"profile", "model", "engine", "limits", "scenarios"}, required={"model", "engine", "limits", "scenarios"})

    prof = v.table(data, "profile", optional=True)
    v.keys(prof, "profile", {"name", "description", "device", "scheduling", "startup_timeout_s", "shutdown_grace_s",
                             "max_engines"})
    name = v.get(prof, "profile", "name", "str", Path(path).stem)
    description = v.get(prof, "profile", "description", "str", "")
    device = v.get(prof, "profile", "device", None, "cpu")
    if device not in ("cpu", "cuda"):
        raise ProfileError(path, "profile.device", '"cpu" or "cuda"', device)
    scheduling = v.scheduling(prof, "profile.scheduling", ["sync"])
    startup_timeout_s = float(v.get(prof, "profile", "startup_timeout_s", "pos_num", 600))
    shutdown_grace_s = float(v.get(prof, "profile", "shutdown_grace_s", "pos_num", 20))
    max_engines = v.get(prof, "profile", "max_engines", "pos_int", 1)

    m = v.table(data, "model")
    v.keys(m, "model", {"source", "name", "served_name", "max_model_len", "dtype"})
    source = v.get(m, "model", "source", None, "path")
    if source not in ("tiny", "path"):
        raise ProfileError(path, "model.source", '"tiny" (the generated model) or "path"', source)
    model_name = v.get(m, "model", "name", "str", None)
    if source == "path" and model_name is None:
        raise ProfileError(path, "model.name", 'a model folder or Hugging Face id when source = "path"', has_got=False)
    model = ModelSpec(
        source=source,
        name=model_name,
        served_name=v.get(m, "model", "served_name", "str", "tiny-qwen3" if source == "tiny" else model_name),
        max_model_len=v.get(m, "model", "max_model_len", "pos_int", None),
        dtype=v.get(m, "model", "dtype", "str", None),
    )

    e = v.table(data, "engine")
    v.keys(e, "engine", {"max_num_seqs", "max_num_active_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                         "enable_prefix_caching", "extra_args", "env", "cpu_async_overlay", "reference_step_ms"},
           required={"max_num_seqs", "max_num_active_seqs"})
    steps = e.get("reference_step_ms", {})
    if not isinstance(steps, dict):
        raise ProfileError(path, "engine.reference_step_ms", 'a table of batch size to ms, e.g. { "1" = 16.4 }', steps)
    reference_step_ms: dict[int, float] = {}
    for key, ms in steps.items():
        if not (str(key).isdigit() and int(key) > 0):
            raise ProfileError(path, f"engine.reference_step_ms.{key}", "a batch size: a positive integer", key)
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or ms <= 0:
            raise ProfileError(path, f"engine.reference_step_ms.{key}", "a positive number of milliseconds", ms)
        reference_step_ms[int(key)] = float(ms)
    extra_args = e.get("extra_args", [])
    if not (isinstance(extra_args, list) and all(isinstance(a, str) for a in extra_args)):
        raise ProfileError(path, "engine.extra_args", "a list of strings", extra_args)
    env = e.get("env", {})
    if not (isinstance(env, dict) and all(isinstance(x, str) for x in env.values())):
        raise ProfileError(path, "engine.env", "a table of strings", env)
    engine = EngineFlags(
        max_num_seqs=v.get(e, "engine", "max_num_seqs", "pos_int", REQUIRED),
        max_num_active_seqs=v.get(e, "engine", "max_num_active_seqs", "pos_int", REQUIRED),
        max_num_batched_tokens=v.get(e, "engine", "max_num_batched_tokens", "pos_int", None),
        enable_chunked_prefill=v.get(e, "engine", "enable_chunked_prefill", "bool", None),
        enable_prefix_caching=v.get(e, "engine", "enable_prefix_caching", "bool", None),
        extra_args=list(extra_args),
        env=dict(env),
        cpu_async_overlay=v.get(e, "engine", "cpu_async_overlay", "bool", False),
        reference_step_ms=reference_step_ms,
    )
    if engine.cpu_async_overlay and device != "cpu":
        raise ProfileError(path, "engine.cpu_async_overlay", 'false unless profile.device is "cpu"', True)
    if engine.max_num_active_seqs > engine.max_num_seqs:
        raise ProfileError(path, "engine.max_num_active_seqs", f"at most engine.max_num_seqs ({engine.max_num_seqs})",
                           engine.max_num_active_seqs)

    lim = v.table(data, "limits")
    v.keys(lim, "limits", {"default_tps", "users"}, required={"default_tps"})
    default_tps = v.get(lim, "limits", "default_tps", "pos_int", REQUIRED)
    users = v.table(lim, "users", optional=True, prefix="limits")
    user_tps: dict[str, int] = {}
    for user, rate in users.items():
        if user == ANONYMOUS_USER:
            raise ProfileError(path, f"limits.users.{user}", "a user name other than __anonymous__ (it takes default_tps)",
                               user)
        if not _pos_int(rate):
            raise ProfileError(path, f"limits.users.{user}", "a positive integer rate in tokens per second", rate)
        user_tps[user] = rate
    limits = Limits(default_tps=default_tps, user_tps=user_tps)

    raw_scenarios = data["scenarios"]
    if not isinstance(raw_scenarios, list) or not raw_scenarios:
        raise ProfileError(path, "scenarios", "a non-empty array of tables ([[scenarios]])", raw_scenarios)
    scenarios: list[ScenarioSpec] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_scenarios):
        sc = v.scenario(raw, f"scenarios[{i}]", scheduling, limits, engine, model)
        if sc.name in seen:
            raise ProfileError(path, f"scenarios[{i}].name", "a name not used by another scenario", sc.name)
        if sc.kind == "fleet" and any(s.kind == "fleet" for s in scenarios):
            # two would share member engines (patched-<mode>.e<k>): a member stopped by one's failover
            # would be started again under its name, its event file and manifest entry overwritten
            raise ProfileError(path, f"scenarios[{i}].kind", "at most one fleet scenario in a profile", sc.kind)
        if sc.kind == "fleet" and sc.params["engines"] > max_engines:
            raise ProfileError(path, "profile.max_engines",
                               f"at least the fleet's engines ({sc.params['engines']}): a fleet's phase runs on "
                               "all of them at once", max_engines)
        seen.add(sc.name)
        scenarios.append(sc)

    return Profile(
        name=name, description=description, path=str(path), device=device, scheduling=scheduling,
        startup_timeout_s=startup_timeout_s, shutdown_grace_s=shutdown_grace_s,
        max_engines=max_engines, model=model, engine=engine, limits=limits, scenarios=scenarios,
    )


def with_run_options(profile: Profile, *, scenarios: list[str] | None = None, overhead_rounds: int | None = None,
                     max_engines: int | None = None, engine_args: list[str] | None = None) -> Profile:
    """The profile as ``ratebench run``'s options change it (a copy; the run's manifest records it).

    ``scenarios``: run only these, by name, in the profile's order; ``overhead_rounds``: the rounds of
    the overhead scenarios run; ``max_engines``: engines alive at once; ``engine_args``: more
    ``vllm serve`` flags for every engine, after the profile's (argparse takes a flag's last value).
    Raises ProfileError naming the option.
    """
    names = [s.name for s in profile.scenarios]
    chosen = list(profile.scenarios)
    if scenarios:
        for name in scenarios:
            if name not in names:
                raise ProfileError(profile.path, "--scenario", f"a scenario of this profile ({', '.join(names)})", name)
        chosen = [s for s in profile.scenarios if s.name in scenarios]
    if overhead_rounds is not None:
        if not _pos_int(overhead_rounds):
            raise ProfileError(profile.path, "--overhead-rounds", "a positive integer", overhead_rounds)
        if not any(s.kind == "overhead" for s in chosen):
            raise ProfileError(profile.path, "--overhead-rounds", "an overhead scenario among those that run",
                               has_got=False)
        chosen = [replace(s, params={**s.params, "rounds": overhead_rounds}) if s.kind == "overhead" else s
                  for s in chosen]
    if max_engines is not None and not _pos_int(max_engines):
        raise ProfileError(profile.path, "--max-engines", "a positive integer", max_engines)
    if engine_args and not all(isinstance(a, str) and a for a in engine_args):
        raise ProfileError(profile.path, "--engine-arg", "non-empty strings", engine_args)
    engine = replace(profile.engine, extra_args=[*profile.engine.extra_args, *(engine_args or [])])
    return replace(profile, scenarios=chosen, engine=engine,
                   max_engines=profile.max_engines if max_engines is None else max_engines)


class _Validator:
    def __init__(self, path: Path | str) -> None:
        self.path = path

    def keys(self, table: dict, where: str, allowed: set[str], required: set[str] = frozenset()) -> None:
        for key in table:
            if key not in allowed:
                full = f"{where}.{key}" if where else key
                raise ProfileError(self.path, full, f"one of the known keys {sorted(allowed)}", key)
        for key in required:
            if key not in table:
                full = f"{where}.{key}" if where else key
                raise ProfileError(self.path, full, "this key (it is required)", has_got=False)

    def table(self, data: dict, key: str, optional: bool = False, prefix: str = "") -> dict:
        full = f"{prefix}.{key}" if prefix else key
        if key not in data:
            if optional:
                return {}
            raise ProfileError(self.path, full, "a table (it is required)", has_got=False)
        value = data[key]
        if not isinstance(value, dict):
            raise ProfileError(self.path, full, "a table", value)
        return value

    def get(self, table: dict, where: str, key: str, check: str | None, default: Any) -> Any:
        if key not in table:
            if default is REQUIRED:
                raise ProfileError(self.path, f"{where}.{key}", "this key (it is required)", has_got=False)
            return default
        value = table[key]
        if check is not None:
            ok, expected = _CHECKS[check]
            if not ok(value):
                raise ProfileError(self.path, f"{where}.{key}", expected, value)
        return value

    def scheduling(self, table: dict, full: str, default: list[str]) -> list[str]:
        key = full.rsplit(".", 1)[-1]
        value = table.get(key, default)
        if (not isinstance(value, list) or not value or any(m not in SCHEDULING_MODES for m in value)
                or len(set(value)) != len(value)):
            raise ProfileError(self.path, full, 'a non-empty list of distinct modes from ["sync", "async"]', value)
        return list(value)

    def scenario(self, raw: Any, where: str, profile_modes: list[str], limits: Limits, engine: EngineFlags,
                 model: ModelSpec) -> ScenarioSpec:
        if not isinstance(raw, dict):
            raise ProfileError(self.path, where, "a table", raw)
        kind = raw.get("kind")
        if kind not in SCENARIO_PARAMS:
            raise ProfileError(self.path, f"{where}.kind", f"one of {list(SCENARIO_KINDS)}", kind)
        schema = SCENARIO_PARAMS[kind]
        self.keys(raw, where, {"name", "kind", "scheduling", *schema})
        name = self.get(raw, where, "name", "str", kind)
        modes = self.scheduling(raw, f"{where}.scheduling", profile_modes[:1])
        for mode in modes:
            if mode not in profile_modes:
                raise ProfileError(self.path, f"{where}.scheduling", f"modes listed in profile.scheduling {profile_modes}",
                                   modes)
        params = {key: self.get(raw, where, key, check, default) for key, (check, default) in schema.items()}
        for key in _USER_PARAMS:
            user = params.get(key)
            if user is not None and user not in limits.user_tps:
                raise ProfileError(self.path, f"{where}.{key}",
                                   f"a user declared in [limits.users] (known: {sorted(limits.user_tps)})", user)
        self._scenario_rules(kind, params, where, limits, engine, model)
        return ScenarioSpec(name=name, kind=kind, scheduling=modes, params=params)

    def _fleet_rules(self, p: dict, where: str, limits: Limits, model: ModelSpec) -> None:
        if not p["users"]:
            raise ProfileError(self.path, f"{where}.users", "at least one user", p["users"])
        for user in p["users"]:
            if user not in limits.user_tps:
                raise ProfileError(self.path, f"{where}.users",
                                   f"users declared in [limits.users] (known: {sorted(limits.user_tps)})", user)
        if p["engines"] < 2:
            raise ProfileError(self.path, f"{where}.engines", "at least 2 engines (a fleet of one is one engine)",
                               p["engines"])
        if p["streams"] < p["engines"]:
            raise ProfileError(self.path, f"{where}.streams",
                               f"at least as many streams as engines ({p['engines']}), so that round-robin spreads "
                               "a user over the fleet", p["streams"])
        for key in ("max_tokens", "failover_max_tokens", "light_max_tokens"):
            if model.max_model_len is not None and p["prompt_tokens"] + p[key] >= model.max_model_len:
                raise ProfileError(self.path, f"{where}.{key}",
                                   f"prompt_tokens + {key} below model.max_model_len ({model.max_model_len})", p[key])
        for user in p["light_users"]:
            if user in p["users"]:
                raise ProfileError(self.path, f"{where}.light_users", "users not in `users` (those are backlogged)",
                                   user)
            burst = 0.1 * limits.limit_of(user) + 1
            if p["light_requests"] * p["light_max_tokens"] > burst:
                raise ProfileError(self.path, f"{where}.light_users",
                                   f"users whose limit cannot bind: light_requests x light_max_tokens "
                                   f"({p['light_requests'] * p['light_max_tokens']}) within one burst of the "
                                   f"user's limit (0.1 s x {limits.limit_of(user)} tok/s + 1 = {burst:g} tokens); "
                                   "give it a higher limit in [limits.users] or send less", user)
        if p["baseline"] and not p["light_users"]:
            raise ProfileError(self.path, f"{where}.baseline",
                               "light_users to judge against it (the backlogged users' limits bind: isolation "
                               "judges the users whose limits do not)", p["baseline"])
        if p["failover"]:
            # the stop must come while the users still send: well before their closed loops end at their limits
            lasts = min(p["streams"] * p["failover_requests"] * p["failover_max_tokens"] / limits.limit_of(u)
                        for u in p["users"])
            if p["failover_after_s"] > lasts / 2:
                raise ProfileError(self.path, f"{where}.failover_after_s",
                                   f"at most half the failover phase at the users' limits ({lasts / 2:.2f} s: "
                                   "streams x failover_requests x failover_max_tokens / limit), so that users "
                                   "still send after the stop", p["failover_after_s"])

    def _scenario_rules(self, kind: str, p: dict, where: str, limits: Limits, engine: EngineFlags,
                        model: ModelSpec) -> None:
        """What makes a scenario able to show what it is for."""
        max_len = model.max_model_len
        if kind == "trace":
            self._trace_rules(p, where, limits, max_len)
            return
        if kind == "mix":
            self._mix_rules(p, where, limits, max_len)
            return
        if kind == "isolation":
            if p["throttled_streams"] <= engine.max_num_active_seqs:
                raise ProfileError(self.path, f"{where}.throttled_streams",
                                   f"more streams than engine.max_num_active_seqs ({engine.max_num_active_seqs})",
                                   p["throttled_streams"])
            if limits.limit_of(p["user"]) <= limits.limit_of(p["throttled_user"]):
                raise ProfileError(self.path, f"{where}.user",
                                   f"a user whose limit is above {p['throttled_user']}'s "
                                   f"({limits.limit_of(p['throttled_user'])} tok/s)", p["user"])
        if kind == "fleet":
            self._fleet_rules(p, where, limits, model)
            return
        if kind == "kv-pressure":
            self._kv_pressure_rules(p, where, limits, engine, max_len)
            return
        if kind == "active-cap-fairness":
            self._active_cap_rules(p, where, limits, engine, max_len)
            return
        if kind == "long-prompt":
            batched = engine.max_num_batched_tokens
            if batched is None:
                raise ProfileError(self.path, "engine.max_num_batched_tokens",
                                   "a value when a long-prompt scenario runs (prompts are sized from it)",
                                   has_got=False)
            if p["prompt_tokens"] < 2 * batched:
                raise ProfileError(self.path, f"{where}.prompt_tokens",
                                   f"at least twice engine.max_num_batched_tokens ({2 * batched}), so prefill is chunked",
                                   p["prompt_tokens"])
        if kind == "eos" and p["answer_tokens"][1] >= p["max_tokens"]:
            raise ProfileError(self.path, f"{where}.answer_tokens", f"answers shorter than max_tokens ({p['max_tokens']})",
                               p["answer_tokens"])
        if max_len is not None:
            need = p.get("prefix_tokens", 0) + p["prompt_tokens"] + max(
                p.get("max_tokens", 0), p.get("followup_max_tokens", 0), p.get("neighbour_max_tokens", 0))
            if need > max_len:
                raise ProfileError(self.path, f"{where}.prompt_tokens",
                                   f"prompt plus max_tokens within model.max_model_len ({max_len})", need)

    def _kv_pressure_rules(self, p: dict, where: str, limits: Limits, engine: EngineFlags,
                           max_len: int | None) -> None:
        """The throttled user is throttled below the user, and has more streams than active places; a
        KV cache small enough to be under pressure is the profile's to set (the check on the phase says
        whether it was: kv-pressure-applied)."""
        if limits.limit_of(p["user"]) <= limits.limit_of(p["throttled_user"]):
            raise ProfileError(self.path, f"{where}.user",
                               f"a user whose limit is above {p['throttled_user']}'s "
                               f"({limits.limit_of(p['throttled_user'])} tok/s)", p["user"])
        if p["throttled_streams"] < 2:
            raise ProfileError(self.path, f"{where}.throttled_streams",
                               "at least 2 (whether the user's streams take turns is checked)", p["throttled_streams"])
        if max_len is not None:
            for key in ("prompt_tokens", "user_prompt_tokens"):
                need = p[key] + (p["max_tokens"] if key == "user_prompt_tokens" else 1)
                if need >= max_len:
                    raise ProfileError(self.path, f"{where}.{key}",
                                       f"prompt plus max_tokens within model.max_model_len ({max_len})", need)

    def _active_cap_rules(self, p: dict, where: str, limits: Limits, engine: EngineFlags,
                          max_len: int | None) -> None:
        """More streams than active places, no more than the engine runs at once; the users
        cap-00.. and cap-high get their limits (engine flags, like [limits.users])."""
        places = engine.max_num_active_seqs
        total = p["users"] * p["streams"]
        if p["users"] < 2 or total <= places:
            raise ProfileError(self.path, f"{where}.users",
                               f"at least 2 users with more streams in all than engine.max_num_active_seqs "
                               f"({places})", p["users"])
        most = max(total, p["users"] + p["high_streams"])
        if most > engine.max_num_seqs:
            raise ProfileError(self.path, f"{where}.users",
                               f"users x streams and users + high_streams within engine.max_num_seqs "
                               f"({engine.max_num_seqs}), so that every stream runs and only the active places are "
                               "scarce", most)
        if p["high_limit_tps"] <= p["limit_tps"]:
            raise ProfileError(self.path, f"{where}.high_limit_tps", f"above limit_tps ({p['limit_tps']})",
                               p["high_limit_tps"])
        low, high = active_cap_users(p)
        for user in [*low, high]:
            if user in limits.user_tps:
                raise ProfileError(self.path, f"{where}.users",
                                   f"users {low[0]}.. and {high} not declared in [limits.users]", user)
            limits.user_tps[user] = p["high_limit_tps"] if user == high else p["limit_tps"]
        if max_len is not None and p["prompt_tokens"] + p["max_tokens"] > max_len:
            raise ProfileError(self.path, f"{where}.max_tokens",
                               f"prompt plus max_tokens within model.max_model_len ({max_len})",
                               p["prompt_tokens"] + p["max_tokens"])

    def _trace_rules(self, p: dict, where: str, limits: Limits, max_len: int | None) -> None:
        """The trace file reads (its own errors name its file and line), its users have limits, the
        backlogged users are in it, and each request fits the model. Records the file's resolved path,
        digest and size in the parameters (the scenario reads the file again when it runs)."""
        from ratebench.trace import TraceError, read_trace, resolve_trace, trace_sha256, trace_users

        try:
            path = resolve_trace(p["trace"], Path(self.path).parent, BUILTIN_DIR)
        except TraceError as exc:
            raise ProfileError(self.path, f"{where}.trace", exc.expected, p["trace"]) from None
        try:
            requests = read_trace(path)
        except TraceError as exc:
            key = f"line {exc.line}" + (f": {exc.field}" if exc.field else "") if exc.line else "(file)"
            raise ProfileError(path, key, exc.expected, exc.got, has_got=exc.has_got) from None
        users = trace_users(requests)
        requests = sorted(requests, key=lambda r: r.line)  # the first mistake in the file is the one named
        if not p["users_at_default_rate"]:
            for r in requests:
                if r.user is not None and r.user not in limits.user_tps:
                    raise ProfileError(path, f"line {r.line}: user",
                                       f"a user declared in [limits.users] of {self.path} (known: "
                                       f"{sorted(limits.user_tps)}), or {where}.users_at_default_rate = true",
                                       r.user)
        for user in p["backlogged"]:
            if user not in users:
                raise ProfileError(self.path, f"{where}.backlogged", f"users of the trace ({', '.join(users)})", user)
        if max_len is not None:
            for r in requests:
                need = (r.prefix_tokens or 0) + (r.prompt if isinstance(r.prompt, int) else 0) + r.max_tokens
                if need > max_len:
                    raise ProfileError(path, f"line {r.line}: max_tokens",
                                       f"prefix, prompt and max_tokens within model.max_model_len ({max_len}) of "
                                       f"{self.path}", need)
        p["trace_path"] = str(path.resolve())
        p["trace_sha256"] = trace_sha256(path)
        p["trace_requests"] = len(requests)

    def _mix_rules(self, p: dict, where: str, limits: Limits, max_len: int | None) -> None:
        """Each tier and length is well formed; the tiers' users get their limits in ``limits``
        (they are engine flags like [limits.users]); the seed makes at least one request, and each fits."""
        from ratebench.mix import CLOSED, TIER_ARRIVALS, mix_requests, tier_users

        names: set[str] = set()
        open_keys = ("rate", "tier_rate", "burst", "burst_requests")
        closed_keys = ("streams", "requests", "think_s", "backlogged")
        tier_keys = {"name", "users", "limit_tps", "arrival", "isolated", *open_keys, *closed_keys}
        for i, tier in enumerate(p["tiers"]):
            at = f"{where}.tiers[{i}]"
            self.keys(tier, at, tier_keys, required={"name", "users"})
            name = self.get(tier, at, "name", "str", REQUIRED)
            # a tier whose users must proceed as in the mix-baseline phase (a limit they never reach)
            if self.get(tier, at, "isolated", "bool", False) and not p["baseline"]:
                raise ProfileError(self.path, f"{at}.isolated", f"{where}.baseline = true with it (the phase its "
                                   "users are compared with)", has_got=False)
            if not all(c.isalnum() or c in "-_." for c in name) or name in names:
                raise ProfileError(self.path, f"{at}.name", "a unique name of letters, digits, - _ .", name)
            names.add(name)
            self.get(tier, at, "users", "pos_int", REQUIRED)
            limit = self.get(tier, at, "limit_tps", "pos_int", None)
            arrival = tier.get("arrival", p["arrivals"])
            if arrival not in TIER_ARRIVALS:
                raise ProfileError(self.path, f"{at}.arrival", f"one of {list(TIER_ARRIVALS)}".replace("'", '"'),
                                   arrival)
            if arrival == CLOSED:
                for key in open_keys:
                    if key in tier:
                        raise ProfileError(self.path, f"{at}.{key}", 'no rate nor burst with arrival = "closed" (each '
                                           "user sends its next request when one of its streams ends): remove it",
                                           has_got=False)
                streams = self.get(tier, at, "streams", "pos_int", 1)
                requests = self.get(tier, at, "requests", "pos_int", REQUIRED)
                self.get(tier, at, "think_s", "nonneg_num", 0)
                self.get(tier, at, "backlogged", "bool", False)
                if streams > requests:
                    raise ProfileError(self.path, f"{at}.streams", f"at most requests ({requests}), the requests each "
                                       "user sends in all", streams)
            else:
                for key in closed_keys:
                    if key in tier:
                        raise ProfileError(self.path, f"{at}.{key}", 'arrival = "closed" with it (an open-loop user '
                                           "sends at its rate or in a burst)", has_got=False)
                burst = self.get(tier, at, "burst", "bool", False)
                if "tier_rate" in tier and (burst or "rate" in tier):
                    raise ProfileError(self.path, f"{at}.tier_rate", "a tier with neither rate (per user) nor burst "
                                       "(tier_rate is the requests per second of the whole tier): keep one of them",
                                       tier["tier_rate"])
                self.get(tier, at, "tier_rate", "nonneg_num", None)
                self.get(tier, at, "rate", "nonneg_num", None if burst or "tier_rate" in tier else REQUIRED)
                self.get(tier, at, "burst_requests", "pos_int", 1)
                if not burst and tier.get("burst_requests") is not None:
                    raise ProfileError(self.path, f"{at}.burst_requests", "burst = true with it", has_got=False)
            for user in tier_users(tier):
                if user in limits.user_tps:
                    raise ProfileError(self.path, f"{at}.name", f"a tier whose users ({user}, ...) are not declared "
                                       "in [limits.users] or by another tier", name)
                if limit is not None:
                    limits.user_tps[user] = limit
        for key in ("prompt_tokens", "output_tokens"):
            spec = p[key]
            if isinstance(spec, dict):
                forms = {"fixed": {"value"}, "uniform": {"low", "high"}, "lognormal": {"median", "sigma"}}
                dist = spec.get("dist")
                if dist not in forms:
                    raise ProfileError(self.path, f"{where}.{key}.dist", f"one of {sorted(forms)}", dist)
                self.keys(spec, f"{where}.{key}", {"dist", *forms[dist], *(("max",) if dist == "lognormal" else ())},
                          required=forms[dist])
                for k in forms[dist] | {"max"}:
                    self.get(spec, f"{where}.{key}", k, "pos_num" if k in ("median", "sigma") else "pos_int", None)
                if dist == "uniform" and spec["low"] > spec["high"]:
                    raise ProfileError(self.path, f"{where}.{key}.low", f"at most high ({spec['high']})", spec["low"])
        requests = mix_requests(p)
        if not requests:
            raise ProfileError(self.path, f"{where}.tiers", "rates, a burst or anonymous_rate that make at least one "
                               f"request in duration_s ({p['duration_s']:g} s) with seed {p['seed']}", has_got=False)
        if max_len is not None:
            need = max((r.prefix_tokens or 0) + r.prompt + r.max_tokens for r in requests)
            if need > max_len:
                raise ProfileError(self.path, f"{where}.output_tokens",
                                   f"prefix, prompt and max_tokens within model.max_model_len ({max_len})", need)
        p["mix_requests"] = len(requests)
