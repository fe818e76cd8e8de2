"""The ``overhead`` scenario kind. Limits never reached, against the feature off, stock vLLM and the limiter
without engine events."""

from __future__ import annotations

from typing import Any

from ratebench.analysis.thresholds import phase_params
from ratebench.phasefacts import KEY_ROUND, KEY_SCHEDULING
from ratebench.profiles import REQUIRED, Kind, Limits, ScenarioSpec, register
from ratebench.roles import OVERHEAD_ROLE_OF_ENGINE
from ratebench.scenarios.base import (
    ROLE_FEATURE_OFF, ROLE_FEATURE_ON, ROLE_NO_EVENTS, ROLE_STOCK, EngineRef, PhaseEstimate, PhasePlan,
    ScenarioContext, engine_name, phase_salt, streams_of_user,
)


PARAMS: dict[str, tuple[str, Any]] = {
    "user": ("user", REQUIRED),
    "streams": ("pos_int", 8),
    "max_tokens": ("pos_int", 128),
    "rounds": ("pos_int", 2),
    # the engines the limiter-on engine is compared with (each one more engine to start)
    "against": ("overhead_against", ["feature-off", "stock", "no-events"]),
    # the most the limiter may cost: 1 - the median per-round throughput ratio against each engine of
    # `against` (the thresholds table: verify-bound's --max-overhead wins when given); unset: reported, not judged
    **phase_params("max_overhead"),
}


def overhead(spec: ScenarioSpec) -> list[PhasePlan]:
    """Limits never reached, the same without engine events, feature off and stock vLLM (those the
    profile's ``against`` names), interleaved round by round in a rotating order: output throughput
    of each.

    The events-off engine runs in the first scheduling mode only (one engine more per mode costs
    memory, or restarts where ``profile.max_engines`` is small)."""
    p = spec.params
    role_names = OVERHEAD_ROLE_OF_ENGINE  # engine role -> the phase role the overhead analysis pairs by

    def phase_of(phase: str, role: str, rnd: int, mode: str):
        async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
            reqs = await streams_of_user(ctx, engine, p["user"], p["streams"], p["max_tokens"],
                                         phase_salt(ctx, engine, phase))
            await ctx.phase(engine, phase, reqs, {p["user"]: {"streams": p["streams"], "backlogged": False}},
                            role=role_names[role], params={KEY_ROUND: rnd + 1, KEY_SCHEDULING: mode})
        return run

    def estimate(limits: Limits | None) -> PhaseEstimate:
        return PhaseEstimate(None, f"limits never reached: {p['streams']} x {p['max_tokens']} tok")

    against = p.get("against", ["feature-off", "stock", "no-events"])
    plans = []
    for mode in spec.scheduling:
        roles = [ROLE_FEATURE_ON]
        if mode == spec.scheduling[0] and "no-events" in against:
            roles.append(ROLE_NO_EVENTS)
        roles += [role for role, name in ((ROLE_FEATURE_OFF, "feature-off"), (ROLE_STOCK, "stock")) if name in against]
        for rnd in range(p["rounds"]):
            # Rotate the order each round so no engine always goes first.
            order = roles[rnd % len(roles):] + roles[: rnd % len(roles)]
            for role in order:
                phase = f"{role_names[role]}-{mode}-{rnd + 1}"
                plans.append(PhasePlan(spec.name, phase, engine_name(role, mode), phase_of(phase, role, rnd, mode),
                                       estimate))
    return plans


KIND = register(Kind("overhead", PARAMS, overhead))
