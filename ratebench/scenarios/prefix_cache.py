"""The ``prefix-cache`` scenario kind. Many requests sharing a long prefix (prefix-cache hits)."""

from __future__ import annotations

from typing import Any

from ratebench.engine_metrics import prefix_cache_counters
from ratebench.profiles import REQUIRED, Kind, ScenarioSpec, register
from ratebench.scenarios.base import EngineRef, PhasePlan, ScenarioContext, at_limits, on_every_mode, phase_salt
from ratebench.workload import StreamRequest


PARAMS: dict[str, tuple[str, Any]] = {
    "user": ("user", REQUIRED),
    "requests": ("pos_int", 16),
    "concurrency": ("pos_int", 4),
    "prefix_tokens": ("pos_int", 512),
    "max_tokens": ("pos_int", 32),
}


def prefix_cache(spec: ScenarioSpec) -> list[PhasePlan]:
    """Many requests that share one long prefix: prefix-cache hits."""
    p = spec.params

    async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
        maker = await ctx.driver.prompts(engine.endpoint, engine.model)
        salt = phase_salt(ctx, engine, "prefix")
        prefix = await maker.token_prompt(p["prefix_tokens"], salt + " shared")
        reqs = []
        for i in range(p["requests"]):
            prompt = prefix + await maker.token_prompt(p["prompt_tokens"], f"{salt} {i}")
            reqs.append(StreamRequest(user=p["user"], prompt=prompt, max_tokens=p["max_tokens"], stream_index=i,
                                      prompt_tokens=len(prompt)))
        before = await prefix_cache_counters(engine.endpoint)

        async def hits() -> dict[str, Any]:
            after = await prefix_cache_counters(engine.endpoint)
            return {k: after[k] - before[k] for k in after if k in before}

        await ctx.phase(engine, "prefix-cache", reqs,
                        {p["user"]: {"streams": p["concurrency"], "backlogged": True}},
                        concurrency=p["concurrency"], extra=hits)

    def estimate(limits):
        return at_limits(limits, [(p["user"], p["requests"], p["max_tokens"])])

    return on_every_mode(spec, lambda main: [PhasePlan(spec.name, "prefix-cache", main, run, estimate)])


KIND = register(Kind("prefix-cache", PARAMS, prefix_cache))
