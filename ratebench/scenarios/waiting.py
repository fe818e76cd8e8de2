"""The ``waiting`` scenario kind. Waiting costs nothing and wakes at once: user's streams (a low limit) alone,
with probe requests of probe_user (unthrottled) and closed streams arriving while the engine waits."""

from __future__ import annotations

import random
from typing import Any

from ratebench.profiles import REQUIRED, Kind, Limits, ScenarioSpec, register
from ratebench.roles import PHASE_IDLE, PHASE_STEPS, PHASE_WAITING
from ratebench.scenarios.base import (
    ROLE_FEATURE_ON, EngineRef, PhaseEstimate, PhasePlan, ScenarioContext, at_limits, engine_name, phase_salt,
    streams_of_user,
)
from ratebench.workload import StreamRequest


PARAMS: dict[str, tuple[str, Any]] = {
    "user": ("user", REQUIRED),
    "probe_user": ("user", REQUIRED),
    "streams": ("pos_int", 4),
    "max_tokens": ("pos_int", 6),
    "wait_s": ("num", 4.0),
    "probes": ("pos_int", 8),
    "probe_max_tokens": ("pos_int", 4),
    "cancels": ("pos_int", 6),
    "busy_max_tokens": ("pos_int", 200),
}


def waiting(spec: ScenarioSpec) -> list[PhasePlan]:
    """Waiting costs nothing and wakes at once: a low-limit user's streams, nobody else, so the engine
    waits for the user's budget most of the time. Probe requests of an unthrottled user arrive while
    it waits, and some of the user's streams are closed while it waits; the same probes first reach
    the idle engine (the baseline for their first token), then the user's tokens are served
    unthrottled (what a step costs the EngineCore, for its CPU time in the waiting phase)."""
    p = spec.params
    user, probe_user = p["user"], p["probe_user"]
    rng = random.Random(f"{spec.name} waiting")
    # irregular offsets, so probes and closes do not line up with the user's ready times
    probe_at = sorted(rng.uniform(0.4, p["wait_s"] - 0.4) for _ in range(p["probes"]))
    cancel_at = sorted(rng.uniform(0.6, p["wait_s"] - 0.4) for _ in range(p["cancels"]))

    async def probes(ctx: ScenarioContext, engine: EngineRef, salt: str, at: list[float]) -> list[StreamRequest]:
        reqs = await streams_of_user(ctx, engine, probe_user, len(at), p["probe_max_tokens"], salt)
        for r, t in zip(reqs, at):
            r.delay_s = t
        return reqs

    async def idle(ctx: ScenarioContext, engine: EngineRef) -> None:
        spacing = [0.3 * k for k in range(p["probes"])]
        reqs = await probes(ctx, engine, phase_salt(ctx, engine, "idle probe"), spacing)
        await ctx.phase(engine, "idle", reqs, {probe_user: {"streams": p["probes"], "backlogged": False}},
                        role=PHASE_IDLE)

    async def busy(ctx: ScenarioContext, engine: EngineRef) -> None:
        reqs = await streams_of_user(ctx, engine, probe_user, p["streams"], p["busy_max_tokens"],
                                     phase_salt(ctx, engine, "busy"))
        await ctx.phase(engine, "busy", reqs, {probe_user: {"streams": p["streams"], "backlogged": False}},
                        role=PHASE_STEPS)

    async def throttled(ctx: ScenarioContext, engine: EngineRef) -> None:
        salt = phase_salt(ctx, engine, "waiting")
        reqs = await streams_of_user(ctx, engine, user, p["streams"], p["max_tokens"], salt)
        closed = await streams_of_user(ctx, engine, user, p["cancels"], p["max_tokens"], salt + " closed",
                                       first_index=p["streams"])
        for r, t in zip(closed, cancel_at):
            r.cancel_after_s = t
        reqs += closed
        reqs += await probes(ctx, engine, salt + " probe", probe_at)
        await ctx.phase(engine, "waiting", reqs, {
            user: {"streams": p["streams"] + p["cancels"], "backlogged": True},
            probe_user: {"streams": p["probes"], "backlogged": False},
        }, role=PHASE_WAITING, params={"probe_at_s": [round(t, 3) for t in probe_at],
                                   "cancel_at_s": [round(t, 3) for t in cancel_at]})

    def estimate_idle(limits: Limits | None) -> PhaseEstimate:
        return PhaseEstimate(0.3 * (p["probes"] - 1), f"{p['probes']} probes 0.3 s apart")

    def estimate_waiting(limits: Limits | None) -> PhaseEstimate:
        return at_limits(limits, [(user, p["streams"], p["max_tokens"])])

    # On every engine the profile runs: with async scheduling the engine loop waits differently (its
    # batch queue holds the empty batch it just scheduled).
    plans = []
    for mode in spec.scheduling:
        engine = engine_name(ROLE_FEATURE_ON, mode)
        plans += [PhasePlan(spec.name, "idle", engine, idle, estimate_idle),
                  PhasePlan(spec.name, "busy", engine, busy,
                            lambda limits: PhaseEstimate(None, "unthrottled: the engine's speed sets it")),
                  PhasePlan(spec.name, "waiting", engine, throttled, estimate_waiting)]
    return plans


KIND = register(Kind("waiting", PARAMS, waiting))
