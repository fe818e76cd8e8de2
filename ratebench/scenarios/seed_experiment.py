"""The ``seed-experiment`` scenario kind. One user limited to a low rate with 1 then 4 streams, beside a user
at a higher rate."""

from __future__ import annotations

from typing import Any, Callable

from ratebench.phasefacts import KEY_SCHEDULING
from ratebench.profiles import REQUIRED, Kind, Limits, ScenarioSpec, register
from ratebench.scenarios.base import (
    ROLE_FEATURE_ON, EngineRef, PhaseEstimate, PhasePlan, ScenarioContext, at_limits, engine_name, phase_salt,
    streams_of_user,
)


PARAMS: dict[str, tuple[str, Any]] = {
    "user": ("user", REQUIRED),
    "neighbour": ("user", REQUIRED),
    "streams": ("pos_int_list", [1, 4]),
    "neighbour_streams": ("pos_int", 1),
    "max_tokens": ("pos_int", 200),
    "neighbour_max_tokens": ("pos_int", 200),
}


def seed_experiment(spec: ScenarioSpec) -> list[PhasePlan]:
    """The seed's experiment: a low-limit user with 1 then 4 streams beside a higher-limit user."""
    p = spec.params

    def phase_of(n: int, mode: str, phase: str):
        async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
            salt = phase_salt(ctx, engine, phase)
            reqs = await streams_of_user(ctx, engine, p["user"], n, p["max_tokens"], salt + " a")
            reqs += await streams_of_user(ctx, engine, p["neighbour"], p["neighbour_streams"],
                                          p["neighbour_max_tokens"], salt + " b")
            await ctx.phase(engine, phase, reqs, {
                p["user"]: {"streams": n, "backlogged": True},
                p["neighbour"]: {"streams": p["neighbour_streams"], "backlogged": True},
            }, params={"ignore_eos": True, KEY_SCHEDULING: mode})
        return run

    def estimate_of(n: int) -> Callable[[Limits | None], PhaseEstimate]:
        return lambda limits: at_limits(limits, [(p["user"], n, p["max_tokens"]),
                                                 (p["neighbour"], p["neighbour_streams"], p["neighbour_max_tokens"])])

    plans = []
    for mode in spec.scheduling:
        for n in p["streams"]:
            phase = f"{n}-stream" if n == 1 else f"{n}-streams"
            plans.append(PhasePlan(spec.name, phase, engine_name(ROLE_FEATURE_ON, mode), phase_of(n, mode, phase),
                                   estimate_of(n)))
    return plans


KIND = register(Kind("seed-experiment", PARAMS, seed_experiment))
