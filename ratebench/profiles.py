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
    scheduling = ["sync", "async"]    # engines to build: sync, async and/or priority scheduling
                                      # ("priority": sync scheduling, --scheduling-policy priority)
    startup_timeout_s = 300           # engine readiness timeout
    shutdown_grace_s = 20             # SIGINT -> SIGKILL grace period
    max_engines = 1                   # engines alive at once (1 on a GPU: each takes its memory)
    stall_timeout_s = 60              # a stream that gets no byte for this long is closed as stalled

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
    kind = "seed-experiment"          # one of scenario_kinds()
    scheduling = ["sync", "async"]    # optional; default: the profile's first mode
    # ... the kind's parameters: PARAMS of its module in ratebench/scenarios/

Users named by a scenario must be keys of ``[limits.users]`` (write the
default rate there to use a user at the default rate). Rates are positive
integers, as the engine flags take them.

Each kind's parameters, with what they mean, are the ``PARAMS`` of its module in
``ratebench/scenarios/`` (trace and mix: also ``docs/trace.md``).
"""

from __future__ import annotations

import json
import importlib
import re
import sys
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ratebench.events import ANONYMOUS_USER, APIS  # noqa: F401 - re-exported: profiles name them

BUILTIN_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "cpu-tiny"
# The limiter-on engines a scenario can run on: synchronous or asynchronous scheduling (promise 5), and
# synchronous scheduling under vLLM's PRIORITY policy ("priority": its queue is upstream's priority heap,
# and the limiter's places, victims and turns follow priorities), so that a limiter broken only under
# that policy meets a real engine too.
SCHEDULING_MODES = ("sync", "async", "priority")
FLEET_POLICIES = ("round-robin", "user-hash")  # the fleet kind's routing policies (ratebench/balancer.py)


class ProfileError(ValueError):
    """A profile that cannot be used: names the file, the key and what was expected."""

    def __init__(self, path: Path | str, key: str, expected: str, got: Any = None, *, has_got: bool = True):
        self.path, self.key, self.expected = str(path), key, expected
        msg = f"{path}: {key}: expected {expected}"
        if has_got:
            msg += f", got {got!r}"
        super().__init__(msg)


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
    # a stream that gets no byte from the server for this long is closed and recorded as stalled (an
    # error its phase's reconciliation names), so a limiter that never wakes a user costs a run this
    # long per phase, not the client's whole patience
    stall_timeout_s: float = 60.0

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
    "token_ids": (
        lambda v: isinstance(v, list) and all(_nonneg_int(x) for x in v) and len(set(v)) == len(v),
        "a list of distinct token ids (integers >= 0)",
    ),
    "user_list": (
        lambda v: isinstance(v, list) and all(isinstance(x, str) and x != "" for x in v) and len(set(v)) == len(v),
        "a list of distinct user names",
    ),
    "str_list": (
        lambda v: isinstance(v, list) and all(isinstance(x, str) and x != "" for x in v),
        "a list of non-empty strings",
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

# Parameters every scenario kind takes, but those whose requests say their own prompt and API
# (Kind.common False).
_COMMON = {"api": ("api", "completions"), "prompt_tokens": ("pos_int", 32)}


@dataclass(frozen=True)
class Kind:
    """A scenario kind: its parameters (name -> (check of ``_CHECKS``, default or ``REQUIRED``)),
    the rules that make a scenario of it able to show what it is for, and its phases. Each kind is one
    module of :mod:`ratebench.scenarios` that registers its Kind (:func:`register`); the profile
    schema looks kinds up here and never imports one.

    ``validate(v, params, where, limits, engine, model)`` raises :class:`ProfileError` naming the
    key, may complete ``params`` (what it read, e.g. a trace's digest), and returns the users the
    scenario adds with their limits (engine flags, like [limits.users]), or None. ``plan(spec)``
    gives the scenario's phases (a list of ``ratebench.scenarios.base.PhasePlan``)."""

    name: str
    params: dict[str, tuple[str, Any]]
    plan: Callable[[ScenarioSpec], list]
    validate: Callable[..., dict[str, int] | None] | None = None
    common: bool = True  # takes the parameters every kind takes (_COMMON)
    fits_model: bool = True  # the rule that a prompt plus its max_tokens fits model.max_model_len applies


_KINDS: dict[str, Kind] = {}
# The package that registers the built-in kinds when it is imported: loaded by name, as a plugin would be.
KINDS_PACKAGE = "ratebench.scenarios"


def register(kind: Kind) -> Kind:
    """Make a scenario kind known to profiles (a kind module calls this when it is imported)."""
    if kind.name in _KINDS and _KINDS[kind.name] is not kind:
        raise ValueError(f"scenario kind {kind.name!r} is registered twice")
    _KINDS[kind.name] = kind
    return kind


def kinds() -> dict[str, Kind]:
    """The scenario kinds by name, in the order their package registers them."""
    if KINDS_PACKAGE not in sys.modules:
        importlib.import_module(KINDS_PACKAGE)
    return _KINDS


def scenario_kinds() -> tuple[str, ...]:
    return tuple(kinds())

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
    v = Validator(path)
    v.keys(data, "", {"profile", "model", "engine", "limits", "scenarios"}, required={"model", "engine", "limits", "scenarios"})

    prof = v.table(data, "profile", optional=True)
    v.keys(prof, "profile", {"name", "description", "device", "scheduling", "startup_timeout_s", "shutdown_grace_s",
                             "max_engines", "stall_timeout_s"})
    name = v.get(prof, "profile", "name", "str", Path(path).stem)
    description = v.get(prof, "profile", "description", "str", "")
    device = v.get(prof, "profile", "device", None, "cpu")
    if device not in ("cpu", "cuda"):
        raise ProfileError(path, "profile.device", '"cpu" or "cuda"', device)
    scheduling = v.scheduling(prof, "profile.scheduling", ["sync"])
    startup_timeout_s = float(v.get(prof, "profile", "startup_timeout_s", "pos_num", 600))
    shutdown_grace_s = float(v.get(prof, "profile", "shutdown_grace_s", "pos_num", 20))
    max_engines = v.get(prof, "profile", "max_engines", "pos_int", 1)
    stall_timeout_s = float(v.get(prof, "profile", "stall_timeout_s", "pos_num", 60))

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
        stall_timeout_s=stall_timeout_s,
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


class Validator:
    """Reads a profile's tables, naming the file, the key and what was expected in every error."""

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
            raise ProfileError(self.path, full, "a non-empty list of distinct modes from "
                               + json.dumps(list(SCHEDULING_MODES)), value)
        return list(value)

    def scenario(self, raw: Any, where: str, profile_modes: list[str], limits: Limits, engine: EngineFlags,
                 model: ModelSpec) -> ScenarioSpec:
        """One [[scenarios]] table; the users it adds get their limits in ``limits`` (the profile's own)."""
        if not isinstance(raw, dict):
            raise ProfileError(self.path, where, "a table", raw)
        known = kinds()
        kind = raw.get("kind")
        if kind not in known:
            raise ProfileError(self.path, f"{where}.kind", f"one of {list(known)}", kind)
        k = known[kind]
        schema = dict(k.params)
        if k.common:
            for key, value in _COMMON.items():
                schema.setdefault(key, value)
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
        added = k.validate(self, params, where, limits, engine, model) if k.validate is not None else None
        if k.fits_model:
            _fits_model(self, params, where, model)
        limits.user_tps.update(added or {})
        return ScenarioSpec(name=name, kind=kind, scheduling=modes, params=params)

def _fits_model(v: Validator, p: dict, where: str, model: ModelSpec) -> None:
    """A prompt (and any shared prefix) plus the longest answer within model.max_model_len."""
    max_len = model.max_model_len
    if max_len is not None:
        need = p.get("prefix_tokens", 0) + p["prompt_tokens"] + max(
            p.get("max_tokens", 0), p.get("followup_max_tokens", 0), p.get("neighbour_max_tokens", 0))
        if need > max_len:
            raise ProfileError(v.path, f"{where}.prompt_tokens",
                               f"prompt plus max_tokens within model.max_model_len ({max_len})", need)
