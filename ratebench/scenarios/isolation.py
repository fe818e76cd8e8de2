"""The ``isolation`` scenario kind. A throttled user with more streams than --max-num-active-seqs beside a
high-limit user; the high-limit user also runs alone (baseline)."""

from __future__ import annotations

from typing import Any, Callable

from ratebench.profiles import (
    REQUIRED, EngineFlags, Kind, Limits, ModelSpec, ProfileError, ScenarioSpec, Validator, register,
)
from ratebench.roles import PHASE_BASELINE, PHASE_SHARED
from ratebench.scenarios.base import (
    EngineRef, PhaseEstimate, PhasePlan, ScenarioContext, at_limits, on_every_mode, phase_salt, streams_of_user,
)


PARAMS: dict[str, tuple[str, Any]] = {
    "throttled_user": ("user", REQUIRED),
    "throttled_streams": ("pos_int", REQUIRED),
    "user": ("user", REQUIRED),
    "streams": ("pos_int", 2),
    "max_tokens": ("pos_int", 200),
    "lead_s": ("pos_num", 0.5),
}


def isolation(spec: ScenarioSpec) -> list[PhasePlan]:
    """A high-limit user alone (baseline), then beside a throttled user with many streams (shared)."""
    p = spec.params
    user, throttled = p["user"], p["throttled_user"]

    async def baseline(ctx: ScenarioContext, engine: EngineRef) -> None:
        solo = await streams_of_user(ctx, engine, user, p["streams"], p["max_tokens"],
                                     phase_salt(ctx, engine, "baseline"))
        await ctx.phase(engine, "baseline", solo, {user: {"streams": p["streams"], "backlogged": False}},
                        role=PHASE_BASELINE)

    async def shared(ctx: ScenarioContext, engine: EngineRef) -> None:
        throttled_tokens = min(ctx.room_tokens(p["prompt_tokens"]), 10 * p["max_tokens"])
        salt = phase_salt(ctx, engine, "shared")
        reqs = await streams_of_user(ctx, engine, throttled, p["throttled_streams"], throttled_tokens, salt + " t",
                                     background=True)
        reqs += await streams_of_user(ctx, engine, user, p["streams"], p["max_tokens"], salt + " u",
                                      delay_s=p["lead_s"], first_index=p["throttled_streams"])
        await ctx.phase(engine, "shared", reqs, {
            throttled: {"streams": p["throttled_streams"], "backlogged": True},
            user: {"streams": p["streams"], "backlogged": False},
        }, role=PHASE_SHARED, params={"throttled_max_tokens": throttled_tokens})

    def estimate(lead_s: float) -> Callable[[Limits | None], PhaseEstimate]:
        # The throttled user's streams run in the background, closed when the user's streams end.
        return lambda limits: at_limits(limits, [(user, p["streams"], p["max_tokens"])], wait_s=lead_s,
                                        wait="after a lead of")

    return on_every_mode(spec, lambda main: [PhasePlan(spec.name, "baseline", main, baseline, estimate(0.0)),
                                             PhasePlan(spec.name, "shared", main, shared, estimate(p["lead_s"]))])


def validate(v: Validator, p: dict, where: str, limits: Limits, engine: EngineFlags, model: ModelSpec
             ) -> dict[str, int] | None:
    """More throttled streams than active places; the user's limit above the throttled user's."""
    if p["throttled_streams"] <= engine.max_num_active_seqs:
        raise ProfileError(v.path, f"{where}.throttled_streams",
                           f"more streams than engine.max_num_active_seqs ({engine.max_num_active_seqs})",
                           p["throttled_streams"])
    if limits.limit_of(p["user"]) <= limits.limit_of(p["throttled_user"]):
        raise ProfileError(v.path, f"{where}.user",
                           f"a user whose limit is above {p['throttled_user']}'s "
                           f"({limits.limit_of(p['throttled_user'])} tok/s)", p["user"])
    return None


KIND = register(Kind("isolation", PARAMS, isolation, validate=validate))
