"""The ``long-prompt`` scenario kind. Prompts several times --max-num-batched-tokens: chunked prefill."""

from __future__ import annotations

from typing import Any

from ratebench.profiles import (
    REQUIRED, EngineFlags, Kind, Limits, ModelSpec, ProfileError, ScenarioSpec, Validator, register,
)
from ratebench.scenarios.base import (
    EngineRef, PhasePlan, ScenarioContext, at_limits, on_every_mode, phase_salt, streams_of_user,
)


PARAMS: dict[str, tuple[str, Any]] = {
    "user": ("user", REQUIRED),
    "streams": ("pos_int", 2),
    "max_tokens": ("pos_int", 100),
}


def long_prompt(spec: ScenarioSpec) -> list[PhasePlan]:
    """Prompts several times --max-num-batched-tokens, so prefill runs in chunks."""
    p = spec.params

    async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
        reqs = await streams_of_user(ctx, engine, p["user"], p["streams"], p["max_tokens"],
                                     phase_salt(ctx, engine, "long"))
        await ctx.phase(engine, "long-prompt", reqs, {p["user"]: {"streams": p["streams"], "backlogged": True}},
                        params={"max_num_batched_tokens": ctx.profile.engine.max_num_batched_tokens})

    def estimate(limits):
        return at_limits(limits, [(p["user"], p["streams"], p["max_tokens"])])

    return on_every_mode(spec, lambda main: [PhasePlan(spec.name, "long-prompt", main, run, estimate)])


def validate(v: Validator, p: dict, where: str, limits: Limits, engine: EngineFlags, model: ModelSpec
             ) -> dict[str, int] | None:
    """Prompts at least twice engine.max_num_batched_tokens, so that prefill runs in chunks."""
    batched = engine.max_num_batched_tokens
    if batched is None:
        raise ProfileError(v.path, "engine.max_num_batched_tokens",
                           "a value when a long-prompt scenario runs (prompts are sized from it)",
                           has_got=False)
    if p["prompt_tokens"] < 2 * batched:
        raise ProfileError(v.path, f"{where}.prompt_tokens",
                           f"at least twice engine.max_num_batched_tokens ({2 * batched}), so prefill is chunked",
                           p["prompt_tokens"])
    return None


KIND = register(Kind("long-prompt", PARAMS, long_prompt, validate=validate))
