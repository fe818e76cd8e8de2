"""The ``cancellation`` scenario kind. Streams closed by the client mid-answer; then the same user's new
streams."""

from __future__ import annotations

import asyncio
from typing import Any

from ratebench.profiles import REQUIRED, Kind, Limits, ScenarioSpec, register
from ratebench.scenarios.base import (
    EngineRef, PhaseEstimate, PhasePlan, ScenarioContext, at_limits, on_every_mode, phase_salt, streams_of_user,
)


PARAMS: dict[str, tuple[str, Any]] = {
    "user": ("user", REQUIRED),
    "streams": ("pos_int", 4),
    "cancel_after_tokens": ("pos_int", 10),
    "cancel_after_s": ("pos_num", 1.0),
    "max_tokens": ("pos_int", 2000),
    "followup_streams": ("pos_int", 2),
    "followup_max_tokens": ("pos_int", 100),
    "settle_s": ("num", 0.5),
}


def cancellation(spec: ScenarioSpec) -> list[PhasePlan]:
    """Streams closed mid-answer (after k tokens or t seconds); then new streams of the same user."""
    p = spec.params
    user = p["user"]

    async def cancel(ctx: ScenarioContext, engine: EngineRef) -> None:
        max_tokens = min(p["max_tokens"], ctx.room_tokens(p["prompt_tokens"]))
        reqs = await streams_of_user(ctx, engine, user, p["streams"], max_tokens, phase_salt(ctx, engine, "cancel"))
        for r in reqs:
            if r.stream_index % 2 == 0:
                r.cancel_after_tokens = p["cancel_after_tokens"]
            else:
                r.cancel_after_s = p["cancel_after_s"]
        await ctx.phase(engine, "cancel", reqs, {user: {"streams": p["streams"], "backlogged": True}},
                        params={"max_tokens": max_tokens})

    async def followup(ctx: ScenarioContext, engine: EngineRef) -> None:
        await asyncio.sleep(p["settle_s"])
        follow = await streams_of_user(ctx, engine, user, p["followup_streams"], p["followup_max_tokens"],
                                       phase_salt(ctx, engine, "followup"))
        await ctx.phase(engine, "followup", follow, {user: {"streams": p["followup_streams"], "backlogged": True}})

    def estimate_cancel(limits: Limits | None) -> PhaseEstimate:
        # Even streams close after cancel_after_tokens tokens, odd ones after cancel_after_s.
        by_tokens = at_limits(limits, [(user, (p["streams"] + 1) // 2, p["cancel_after_tokens"])])
        if by_tokens.at_least_s is None or by_tokens.at_least_s < p["cancel_after_s"]:
            return PhaseEstimate(p["cancel_after_s"], f"the last streams close after {p['cancel_after_s']:g} s")
        return by_tokens

    def estimate_followup(limits: Limits | None) -> PhaseEstimate:
        return at_limits(limits, [(user, p["followup_streams"], p["followup_max_tokens"])], wait_s=p["settle_s"],
                         wait="after a pause of")

    return on_every_mode(spec, lambda main: [PhasePlan(spec.name, "cancel", main, cancel, estimate_cancel),
                                             PhasePlan(spec.name, "followup", main, followup, estimate_followup)])


KIND = register(Kind("cancellation", PARAMS, cancellation))
