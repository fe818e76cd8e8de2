"""The ``active-cap-fairness`` scenario kind. Users share the --max-num-active-seqs places: more streams than
places, every user's limit above what the places deliver. "equal": users x streams at one limit; "high": the
users with one stream each first, then one user at high_limit_tps (cap-high) with high_streams after lead_s;
on the "priority" mode's engine (vLLM's PRIORITY policy) also "priority": "high" again with cap-high's
streams sent at priority -1, the others at 0 (higher priorities take the places first).
Users cap-00.. and cap-high take their limits as if declared in [limits.users]."""

from __future__ import annotations

from typing import Any

from ratebench.phasefacts import KEY_PLACE_SHARE
from ratebench.profiles import (
    EngineFlags, Kind, Limits, ModelSpec, ProfileError, ScenarioSpec, Validator, register,
)
from ratebench.scenarios.base import (
    ROLE_FEATURE_ON, EngineRef, PhaseEstimate, PhasePlan, ScenarioContext, engine_name, on_every_mode, phase_salt,
    streams_of_user,
)
from ratebench.workload import StreamRequest


PARAMS: dict[str, tuple[str, Any]] = {
    "users": ("pos_int", 8),
    "streams": ("pos_int", 2),  # per user
    "limit_tps": ("pos_int", 1000),
    "high_limit_tps": ("pos_int", 5000),
    "high_streams": ("pos_int", 2),
    "lead_s": ("pos_num", 0.5),
    "max_tokens": ("pos_int", 200),
}



def active_cap_users(p: dict[str, Any]) -> tuple[list[str], str]:
    """The users of an active-cap-fairness scenario: cap-00.. at limit_tps, and cap-high."""
    return [f"cap-{i:02d}" for i in range(p["users"])], "cap-high"

def active_cap_fairness(spec: ScenarioSpec) -> list[PhasePlan]:
    """More streams than --max-num-active-seqs places, every user's limit above what the places
    deliver, so the places decide each user's share. "cap-equal": users with equal limits and
    several streams each, all at once. "cap-high": the same users with one stream each, then one
    user with a higher limit arriving last. The verdict compares each user's tokens while all are
    running with its max-min fair share (place-share)."""
    p = spec.params
    low, high = active_cap_users(p)

    async def equal(ctx: ScenarioContext, engine: EngineRef) -> None:
        salt = phase_salt(ctx, engine, "cap-equal")
        reqs: list[StreamRequest] = []
        for i, u in enumerate(low):
            reqs += await streams_of_user(ctx, engine, u, p["streams"], p["max_tokens"], f"{salt} {u}",
                                          first_index=i * p["streams"])
        await ctx.phase(engine, "cap-equal", reqs, {u: {"streams": p["streams"], "backlogged": False} for u in low},
                        params={KEY_PLACE_SHARE: True})

    async def with_high(ctx: ScenarioContext, engine: EngineRef, name: str = "cap-high",
                        high_first: bool = False) -> None:
        salt = phase_salt(ctx, engine, name)
        reqs: list[StreamRequest] = []
        for i, u in enumerate(low):
            reqs += await streams_of_user(ctx, engine, u, 1, p["max_tokens"], f"{salt} {u}", first_index=i)
        # under vLLM's PRIORITY policy a lower value goes first
        extra = {"extra_body": {"priority": -1}} if high_first else {}
        reqs += await streams_of_user(ctx, engine, high, p["high_streams"], p["max_tokens"], f"{salt} {high}",
                                      first_index=len(low), delay_s=p["lead_s"], **extra)
        users = {u: {"streams": 1, "backlogged": False} for u in low}
        users[high] = {"streams": p["high_streams"], "backlogged": False}
        await ctx.phase(engine, name, reqs, users, params={KEY_PLACE_SHARE: True})

    async def with_high_first(ctx: ScenarioContext, engine: EngineRef) -> None:
        await with_high(ctx, engine, "cap-priority", high_first=True)

    def estimate(limits: Limits | None) -> PhaseEstimate:
        return PhaseEstimate(None, "the active places set it: users' limits are above what they deliver")

    def on(main: str) -> list[PhasePlan]:
        plans = [PhasePlan(spec.name, "cap-equal", main, equal, estimate),
                 PhasePlan(spec.name, "cap-high", main, with_high, estimate)]
        if main == engine_name(ROLE_FEATURE_ON, "priority"):
            # higher priorities first (place-share judges each level's shares of what the levels before left)
            plans.append(PhasePlan(spec.name, "cap-priority", main, with_high_first, estimate))
        return plans

    return on_every_mode(spec, on)


def validate(v: Validator, p: dict, where: str, limits: Limits, engine: EngineFlags, model: ModelSpec
             ) -> dict[str, int] | None:
    """More streams than active places, no more than the engine runs at once; the users
    cap-00.. and cap-high get their limits (engine flags, like [limits.users]): returned."""
    max_len = model.max_model_len
    places = engine.max_num_active_seqs
    total = p["users"] * p["streams"]
    if p["users"] < 2 or total <= places:
        raise ProfileError(v.path, f"{where}.users",
                           f"at least 2 users with more streams in all than engine.max_num_active_seqs "
                           f"({places})", p["users"])
    most = max(total, p["users"] + p["high_streams"])
    if most > engine.max_num_seqs:
        raise ProfileError(v.path, f"{where}.users",
                           f"users x streams and users + high_streams within engine.max_num_seqs "
                           f"({engine.max_num_seqs}), so that every stream runs and only the active places are "
                           "scarce", most)
    if p["high_limit_tps"] <= p["limit_tps"]:
        raise ProfileError(v.path, f"{where}.high_limit_tps", f"above limit_tps ({p['limit_tps']})",
                           p["high_limit_tps"])
    low, high = active_cap_users(p)
    added: dict[str, int] = {}
    for user in [*low, high]:
        if user in limits.user_tps:
            raise ProfileError(v.path, f"{where}.users",
                               f"users {low[0]}.. and {high} not declared in [limits.users]", user)
        added[user] = p["high_limit_tps"] if user == high else p["limit_tps"]
    if max_len is not None and p["prompt_tokens"] + p["max_tokens"] > max_len:
        raise ProfileError(v.path, f"{where}.max_tokens",
                           f"prompt plus max_tokens within model.max_model_len ({max_len})",
                           p["prompt_tokens"] + p["max_tokens"])
    return added


KIND = register(Kind("active-cap-fairness", PARAMS, active_cap_fairness, validate=validate, fits_model=False))
