"""The ``kv-pressure`` scenario kind. Throttled requests never hold the KV another user needs, and none of
their streams starves: throttled_user's long-context streams fill most of a small KV cache (engine flags:
--num-gpu-blocks-override), then user's requests arrive one after another; user also runs alone first
(baseline). Preemptions and KV use are read from the engine's /metrics."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from ratebench.engine_metrics import engine_metrics
from ratebench.phasefacts import KEY_KV_USAGE_MAX, KEY_PREEMPTIONS, KEY_STREAM_WAIT
from ratebench.profiles import (
    REQUIRED, EngineFlags, Kind, Limits, ModelSpec, ProfileError, ScenarioSpec, Validator, register,
)
from ratebench.roles import PHASE_BASELINE, PHASE_SHARED
from ratebench.scenarios.base import (
    EngineRef, PhaseEstimate, PhasePlan, ScenarioContext, at_limits, on_every_mode, phase_salt, streams_of_user,
)
from ratebench.workload import StreamRequest, WorkloadError


PARAMS: dict[str, tuple[str, Any]] = {
    "throttled_user": ("user", REQUIRED),
    "throttled_streams": ("pos_int", 6),
    # instead of throttled_streams: as many streams as fill this fraction of the engine's KV cache
    # (its size read from /metrics when the phase starts), at least 2
    "kv_fill": ("fraction", None),
    "user": ("user", REQUIRED),
    "requests": ("pos_int", 6),  # the user's requests, one every interval_s after lead_s
    "interval_s": ("pos_num", 0.8),
    "lead_s": ("pos_num", 2.0),
    "user_prompt_tokens": ("pos_int", 512),
    "max_tokens": ("pos_int", 60),  # the user's requests
}


async def _sample_pressure(endpoint: str, out: dict[str, float], period_s: float = 0.2) -> None:
    """Until cancelled: the engine's KV cache use, its highest reading, into ``out``."""
    while True:
        m = await engine_metrics(endpoint)
        if "kv_cache_usage_perc" in m:
            out["kv_usage_max"] = max(out.get("kv_usage_max", 0.0), m["kv_cache_usage_perc"])
        await asyncio.sleep(period_s)


def kv_pressure(spec: ScenarioSpec) -> list[PhasePlan]:
    """A user with budget alone (baseline), then beside a throttled user whose long-context streams
    fill most of the KV cache: the user's requests arrive one after another while the throttled
    streams hold KV. The throttled streams run in the background and close when the user's last
    request ends. The engine's preemptions and its highest KV use are read from /metrics."""
    p = spec.params
    user, throttled = p["user"], p["throttled_user"]
    user_streams = p["requests"]

    async def user_requests(ctx: ScenarioContext, engine: EngineRef, salt: str, lead_s: float,
                            first_index: int = 0) -> list[StreamRequest]:
        reqs = await streams_of_user(ctx, engine, user, p["requests"], p["max_tokens"], salt,
                                     prompt_tokens=p["user_prompt_tokens"], first_index=first_index)
        for k, r in enumerate(reqs):
            r.delay_s = lead_s + k * p["interval_s"]
        return reqs

    async def baseline(ctx: ScenarioContext, engine: EngineRef) -> None:
        reqs = await user_requests(ctx, engine, phase_salt(ctx, engine, "kv-baseline"), 0.0)
        await ctx.phase(engine, "kv-baseline", reqs, {user: {"streams": user_streams, "backlogged": False}},
                        role=PHASE_BASELINE)

    async def shared(ctx: ScenarioContext, engine: EngineRef) -> None:
        salt = phase_salt(ctx, engine, "kv-shared")
        throttled_tokens = ctx.room_tokens(p["prompt_tokens"])
        streams, sizing = p["throttled_streams"], {}
        if p["kv_fill"] is not None:
            capacity = (await engine_metrics(engine.endpoint)).get("kv_cache_tokens")
            if capacity is None:
                raise WorkloadError(f"{engine.name}: /metrics gives no vllm:cache_config_info to size kv_fill from; "
                                    "set throttled_streams instead")
            # each stream holds its prompt and the tokens it gets over the phase (its share of the budget)
            span_s = p["lead_s"] + p["requests"] * p["interval_s"] + 2.0
            streams = max(2, int(p["kv_fill"] * capacity // p["prompt_tokens"]))
            held = p["prompt_tokens"] + -(-int(span_s * (ctx.limit_of(engine, throttled) or 0)) // streams)
            streams = max(2, int(p["kv_fill"] * capacity // held))
            sizing = {"kv_cache_tokens": int(capacity), "throttled_streams": streams}
        reqs = await streams_of_user(ctx, engine, throttled, streams, throttled_tokens, salt + " t", background=True)
        reqs += await user_requests(ctx, engine, salt + " u", p["lead_s"], first_index=p["throttled_streams"])
        before = await engine_metrics(engine.endpoint)
        seen: dict[str, float] = {}
        sampler = asyncio.create_task(_sample_pressure(engine.endpoint, seen))

        async def figures() -> dict[str, Any]:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            after = await engine_metrics(engine.endpoint)
            out: dict[str, Any] = {KEY_KV_USAGE_MAX: round(seen["kv_usage_max"], 4) if "kv_usage_max" in seen
                                   else None}
            if "num_preemptions" in before and "num_preemptions" in after:
                out[KEY_PREEMPTIONS] = int(after["num_preemptions"] - before["num_preemptions"])
            return out

        try:
            await ctx.phase(engine, "kv-shared", reqs, {
                throttled: {"streams": streams, "backlogged": True},
                user: {"streams": user_streams, "backlogged": False},
            }, role=PHASE_SHARED, params={"throttled_max_tokens": throttled_tokens, KEY_STREAM_WAIT: [throttled], **sizing},
                extra=figures)
        finally:
            sampler.cancel()

    def estimate(lead_s: float) -> Callable[[Limits | None], PhaseEstimate]:
        span = lead_s + (p["requests"] - 1) * p["interval_s"]
        return lambda limits: at_limits(limits, [(user, 1, p["max_tokens"])], wait_s=span,
                                        wait="the last request arriving at")

    return on_every_mode(spec, lambda main: [PhasePlan(spec.name, "kv-baseline", main, baseline, estimate(0.0)),
                                             PhasePlan(spec.name, "kv-shared", main, shared, estimate(p["lead_s"]))])


def validate(v: Validator, p: dict, where: str, limits: Limits, engine: EngineFlags, model: ModelSpec
             ) -> dict[str, int] | None:
    """The throttled user is throttled below the user, and has more streams than active places; a
    KV cache small enough to be under pressure is the profile's to set (the check on the phase says
    whether it was: kv-pressure-applied)."""
    max_len = model.max_model_len
    if limits.limit_of(p["user"]) <= limits.limit_of(p["throttled_user"]):
        raise ProfileError(v.path, f"{where}.user",
                           f"a user whose limit is above {p['throttled_user']}'s "
                           f"({limits.limit_of(p['throttled_user'])} tok/s)", p["user"])
    if p["throttled_streams"] < 2:
        raise ProfileError(v.path, f"{where}.throttled_streams",
                           "at least 2 (whether the user's streams take turns is checked)", p["throttled_streams"])
    if max_len is not None:
        for key in ("prompt_tokens", "user_prompt_tokens"):
            need = p[key] + (p["max_tokens"] if key == "user_prompt_tokens" else 1)
            if need >= max_len:
                raise ProfileError(v.path, f"{where}.{key}",
                                   f"prompt plus max_tokens within model.max_model_len ({max_len})", need)
    return None


KIND = register(Kind("kv-pressure", PARAMS, kv_pressure, validate=validate, fits_model=False))
