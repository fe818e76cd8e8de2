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
:mod:`~ratebench.scenarios.base` holds what they share. Adding a kind is a module here (imported
with the others when this package is) and its entry in a profile.
"""

import importlib
import pkgutil

from ratebench.profiles import ScenarioSpec, kinds
from ratebench.scenarios.base import (  # the names the runner, the plan and the tests use
    FAILOVER_THINK_S, FLEET_STAGGER_S, ROLE_FEATURE_OFF, ROLE_FEATURE_ON, ROLE_FLEET, ROLE_NO_EVENTS, ROLE_STOCK,
    SUMMARY_MAX_USERS, EngineRef, PhaseEstimate, PhasePlan, PhaseRecord, ScenarioContext, engine_name, fleet_members,
    fleet_name, member_base, phase_summary,
)


# Every module of this package but base is a kind and registers it when imported, in the order below
# (the order profiles list kinds in), then any other module in name order: a new kind is its module.
_ORDER = ("seed_experiment", "isolation", "cancellation", "long_prompt", "prefix_cache", "eos", "parallel_sampling",
          "request_options", "anonymous", "waiting", "kv_pressure", "active_cap", "overhead", "trace", "mix", "fleet")
_MODULES = sorted((m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"),
                  key=lambda name: (_ORDER.index(name) if name in _ORDER else len(_ORDER), name))
for _name in _MODULES:
    importlib.import_module(f"{__name__}.{_name}")


def plan_scenario(spec: ScenarioSpec) -> list[PhasePlan]:
    """The phases of one scenario, in order (the runner starts their engines and runs them)."""
    return kinds()[spec.kind].plan(spec)


__all__ = [
    "FAILOVER_THINK_S", "FLEET_STAGGER_S", "ROLE_FEATURE_OFF", "ROLE_FEATURE_ON", "ROLE_FLEET", "ROLE_NO_EVENTS",
    "ROLE_STOCK", "SUMMARY_MAX_USERS", "EngineRef", "PhaseEstimate", "PhasePlan", "PhaseRecord", "ScenarioContext",
    "engine_name", "fleet_members", "fleet_name", "member_base", "phase_summary", "plan_scenario",
    "kinds",
]
