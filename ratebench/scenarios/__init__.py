"""Scenario implementations: what each kind of a profile sends, phase by phase.

A scenario is planned as a list of *phases* (:func:`plan_scenario`), each on one
engine; the runner starts that engine and runs the phase on the workload driver.
Each phase ends in
one :class:`PhaseRecord` (an entry of ``scenarios.json``, see
``docs/run-folder.md``) that says which users took part, at which limits, and
whether their streams were backlogged (always waiting for tokens, so the
delivery check applies).

One module per kind (its ``PARAMS``, the ``validate`` rules that make a scenario of it able to show
what it is for, its phases), each registering a :class:`ratebench.profiles.Kind` when imported;
:mod:`~ratebench.scenarios.base` holds what they share. Adding a kind is a module here, imported
below, and its entry in a profile.
"""

# each registers its kind, in this order (the order profiles list them in)
from ratebench.scenarios import (
    seed_experiment, isolation, cancellation, long_prompt, prefix_cache, eos, anonymous, waiting, kv_pressure,
    active_cap, overhead, trace, mix, fleet,
)
from ratebench.profiles import ScenarioSpec, kinds
from ratebench.scenarios.base import (  # the names the runner, the plan and the tests use
    FAILOVER_THINK_S, FLEET_STAGGER_S, ROLE_FEATURE_OFF, ROLE_FEATURE_ON, ROLE_FLEET, ROLE_NO_EVENTS, ROLE_STOCK,
    SUMMARY_MAX_USERS, EngineRef, PhaseEstimate, PhasePlan, PhaseRecord, ScenarioContext, engine_name, fleet_members,
    fleet_name, member_base, phase_summary,
)


def plan_scenario(spec: ScenarioSpec) -> list[PhasePlan]:
    """The phases of one scenario, in order (the runner starts their engines and runs them)."""
    return kinds()[spec.kind].plan(spec)


__all__ = [
    "FAILOVER_THINK_S", "FLEET_STAGGER_S", "ROLE_FEATURE_OFF", "ROLE_FEATURE_ON", "ROLE_FLEET", "ROLE_NO_EVENTS",
    "ROLE_STOCK", "SUMMARY_MAX_USERS", "EngineRef", "PhaseEstimate", "PhasePlan", "PhaseRecord", "ScenarioContext",
    "engine_name", "fleet_members", "fleet_name", "member_base", "phase_summary", "plan_scenario",
    "seed_experiment", "isolation", "cancellation", "long_prompt", "prefix_cache", "eos", "anonymous", "waiting",
    "kv_pressure", "active_cap", "overhead", "trace", "mix", "fleet",
]
