"""What a run will do, before it does it: the model, the engines (command line and
environment), the scenarios' phases in order with their expected durations.

The runner builds its engines and phases with these functions, and
``ratebench run --dry-run`` prints the same plan (:func:`plan_run`) without launching,
generating or writing anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ratebench.engine import EngineSpec, engine_env, flag_policy, records_events
from ratebench.models import ModelChoice, model_choice
from ratebench.profiles import Profile, ProfileError, ScenarioSpec
from ratebench.scenarios import (
    ROLE_FEATURE_ON,
    ROLE_NO_EVENTS,
    ROLE_STOCK,
    PhaseEstimate,
    PhasePlan,
    fleet_members,
    member_base,
    plan_scenario,
)

# Stand-ins in a dry run for what a real run settles only when it starts an engine.
PORT_PLACEHOLDER = "<free port>"
RUN_DIR_PLACEHOLDER = "<run folder>"
OVERLAY_PLACEHOLDER = "<temporary overlay folder>"


def profile_engine_flags(profile: Profile) -> list[str]:
    """The profile's vLLM flags, the same for every engine of a run."""
    e, m = profile.engine, profile.model
    flags = ["--max-num-seqs", str(e.max_num_seqs), "--max-num-active-seqs", str(e.max_num_active_seqs)]
    if e.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    if e.enable_chunked_prefill is not None:
        flags.append("--enable-chunked-prefill" if e.enable_chunked_prefill else "--no-enable-chunked-prefill")
    if e.enable_prefix_caching is not None:
        flags.append("--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching")
    if m.max_model_len is not None:
        flags += ["--max-model-len", str(m.max_model_len)]
    if m.dtype is not None:
        flags += ["--dtype", m.dtype]
    return flags + list(e.extra_args)


def engine_spec(profile: Profile, name: str, model_path: str, *, use_patch: bool,
                pristine_files: Callable[[], dict[str, bytes | None]]) -> EngineSpec:
    """The engine ``name`` (role-mode: patched-sync, stock-async, patched-priority, ...) of a run of ``profile``.

    ``pristine_files`` is called only for a stock engine beside the patch (served through the
    import overlay); ``use_patch`` False: every engine is stock vLLM as installed, limiter flags left out.
    """
    role, mode = member_base(name).rsplit("-", 1)  # a fleet's member (patched-sync.e1) is a patched-sync
    feature = role in (ROLE_FEATURE_ON, ROLE_NO_EVENTS) and use_patch
    kind = "stock" if role == ROLE_STOCK or not use_patch else "patched"
    lim = profile.limits
    flags = profile_engine_flags(profile)
    return EngineSpec(
        name=name, kind=kind, feature=feature, async_scheduling=(mode == "async"),
        scheduling_policy="priority" if mode == "priority" else flag_policy(flags),
        pristine_files=pristine_files() if kind == "stock" and use_patch else None,
        model=model_path, served_name=profile.model.served_name,
        flags=flags,
        default_tps=lim.default_tps if feature else None,
        user_tps=dict(lim.user_tps) if feature else {},
        env=_member_env(profile, name), record_events=role != ROLE_NO_EVENTS,
        cpu_async_overlay=profile.engine.cpu_async_overlay and mode == "async",
    )


def _member_env(profile: Profile, name: str) -> dict[str, str]:
    """The profile's engine environment; a fleet's k-th member on a GPU gets the k-th GPU (of the profile's
    CUDA_VISIBLE_DEVICES when it sets one): K engines on K GPUs."""
    env = dict(profile.engine.env)
    m = re.search(r"\.e([0-9]+)$", name)
    if m is not None and profile.device == "cuda":
        k = int(m.group(1))
        visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible and k >= len(visible):
            raise ProfileError(profile.path, "engine.env.CUDA_VISIBLE_DEVICES",
                               f"at least as many GPUs as the fleet's engines ({k + 1})", env["CUDA_VISIBLE_DEVICES"])
        env["CUDA_VISIBLE_DEVICES"] = visible[k] if visible else str(k)
    return env


def scenarios_for(profile: Profile, endpoint: str | None) -> tuple[list[ScenarioSpec], list[dict[str, str]]]:
    """The scenarios a run goes through, and those it skips (with why): attached to a server
    (``endpoint``), overhead is skipped and each scenario runs in its first scheduling mode only."""
    specs, skipped = [], []
    for spec in profile.scenarios:
        if endpoint is not None:
            if spec.kind in ("overhead", "fleet"):
                skipped.append({"scenario": spec.name,
                                "why": f"{spec.kind} needs engines ratebench launches (not --endpoint)"})
                continue
            params = spec.params
            if spec.kind == "mix" and params.get("baseline"):
                # the same requests on the limiter-off engine: one ratebench would have to launch
                skipped.append({"scenario": f"{spec.name}/mix-baseline",
                                "why": "the limiter-off baseline needs an engine ratebench launches (not "
                                       "--endpoint): the tiers are not judged against it"})
                params = {**params, "baseline": False}
            spec = type(spec)(name=spec.name, kind=spec.kind, scheduling=spec.scheduling[:1], params=params)
        specs.append(spec)
    return specs, skipped


def plan_phases(specs: list[ScenarioSpec]) -> list[tuple[ScenarioSpec, PhasePlan]]:
    """Every phase of the scenarios, in the order they run."""
    return [(spec, plan) for spec in specs for plan in plan_scenario(spec)]


def engines_wanted(upcoming: list[str], max_engines: int) -> list[str]:
    """Before a phase (``upcoming``: the engines of it and the phases after it, in order): its engine
    and as many of the following phases' as ``max_engines`` allows, by next use (a fleet counts as
    its members)."""
    out, used = [], 0
    for name in dict.fromkeys(upcoming):
        size = len(fleet_members(name) or [name])
        if out and used + size > max_engines:
            break
        out.append(name)
        used += size
    return out


def engine_starts(phase_engines: list[str], max_engines: int) -> list[list[str]]:
    """The engines a run starts, wave by wave (a wave before a phase): the runner keeps
    :func:`engines_wanted` running before each phase and stops an engine no later phase needs."""
    running: set[str] = set()
    waves = []
    for k in range(len(phase_engines)):
        wanted = engines_wanted(phase_engines[k:], max_engines)
        wave = [n for n in wanted if n not in running]
        if wave:
            waves.append(wave)
        running = set(wanted) & set(phase_engines[k + 1:])
    return waves


@dataclass
class PlannedEngine:
    """An engine a run launches: its spec, its exact command line and what it sets in its environment."""

    spec: EngineSpec
    argv: list[str]
    env: dict[str, str]  # over the inherited environment, from which the event file variable is removed
    phases: int  # how many phases run on it


@dataclass
class PlannedPhase:
    scenario: str
    kind: str
    phase: str
    engine: str
    estimate: PhaseEstimate


@dataclass
class Reach:
    """Whether a user's limit is reachable with its streams on the profile's reference step."""

    phase: PlannedPhase
    user: str
    streams: int
    limit_tps: int
    batch: int  # requests in a step: the phase's streams, at most the active places
    step_ms: float
    max_tps: float  # streams x 1000 / step_ms: a stream gets at most one token a step

    @property
    def reachable(self) -> bool:
        return self.max_tps >= self.limit_tps


def reachability(plan: "RunPlan") -> list[Reach]:
    """For every limiter-on phase's users whose budgets set its length: the most its streams can get
    at the profile's reference decode step (``engine.reference_step_ms``); empty without one."""
    flags = plan.profile.engine
    out = []
    for ph in plan.phases:
        users = ph.estimate.users
        if not users:
            continue
        batch = min(sum(n for _, n, _ in users), flags.max_num_active_seqs)
        step_ms = flags.step_ms_at(batch)
        if step_ms is None:
            return []
        out += [Reach(ph, user, n, limit, batch, step_ms, n * 1000.0 / step_ms) for user, n, limit in users]
    return out


@dataclass
class RunPlan:
    """What ``ratebench run`` would do with these options."""

    profile: Profile
    model: ModelChoice | None  # None: attached to --endpoint
    endpoint: str | None
    use_patch: bool
    engines: list[PlannedEngine] = field(default_factory=list)  # in order of first use
    phases: list[PlannedPhase] = field(default_factory=list)
    engine_starts: list[list[str]] = field(default_factory=list)  # waves, see engine_starts()
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def at_least_s(self) -> float:
        """The phases' expected durations added up (those the engine's speed sets count 0)."""
        return sum(p.estimate.at_least_s or 0.0 for p in self.phases)


def plan_run(profile: Profile, *, model: str | None = None, endpoint: str | None = None,
             use_patch: bool = True) -> RunPlan:
    """The plan of a run; reads the profile and looks for the model, launches and writes nothing."""
    specs, skipped = scenarios_for(profile, endpoint)
    phases = plan_phases(specs)
    plan = RunPlan(profile=profile, model=None if endpoint is not None else model_choice(profile, model),
                   endpoint=endpoint, use_patch=use_patch, skipped=skipped)
    specs_by_engine: dict[str, EngineSpec] = {}
    uses: dict[str, int] = {}
    for spec, phase in phases:
        # a fleet's phase runs on each of its members (and its balancer)
        for name in fleet_members(phase.engine) or [phase.engine]:
            uses[name] = uses.get(name, 0) + 1
            if endpoint is None and name not in specs_by_engine:
                specs_by_engine[name] = engine_spec(profile, name, plan.model.path, use_patch=use_patch,
                                                    pristine_files=dict)  # {}: the overlay, not its content
        first = (fleet_members(phase.engine) or [phase.engine])[0]
        feature = endpoint is not None or specs_by_engine[first].feature
        plan.phases.append(PlannedPhase(spec.name, spec.kind, phase.phase, phase.engine,
                                        phase.estimate(profile.limits if feature else None)))
    for name, spec in specs_by_engine.items():
        events = f"{RUN_DIR_PLACEHOLDER}/engines/{name}/events.rbev" if records_events(spec) else None
        overlay = OVERLAY_PLACEHOLDER if spec.pristine_files is not None else None
        plan.engines.append(PlannedEngine(spec, spec.argv(PORT_PLACEHOLDER),
                                          engine_env(spec, events_path=events, overlay_dir=overlay), uses[name]))
    if endpoint is None:
        plan.engine_starts = engine_starts([ph.engine for ph in plan.phases], profile.max_engines)
    return plan
