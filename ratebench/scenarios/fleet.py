"""The ``fleet`` scenario kind. A fleet: `engines` limiter-on engines of the same flags behind a load balancer
(HAProxy), one phase per routing policy. Each of `users` sends `streams` backlogged streams through the
balancer, with its name in `user_header` (as a gateway that authenticates users sets it) and in vllm_xargs.
The per-user bound is judged across the fleet as well as per engine: under round-robin a user's streams
spread over the engines and the fleet gives it up to engines x its limit (FAIL, by design of the policy);
under user-hash it holds.

A ``fleet`` scenario runs ``engines`` limiter-on engines behind HAProxy
(``ratebench/balancer.py``), one phase per routing policy and a failover phase::

    [[scenarios]]
    kind = "fleet"
    users = ["user-a", "user-b"]      # each declared in [limits.users]
    streams = 4                       # per user, backlogged; at least `engines`
    max_tokens = 60
    engines = 2                       # K >= 2; on a GPU the k-th engine gets GPU k
    policies = ["round-robin", "user-hash"]
    user_header = "X-Ratebench-User"  # the header the balancer hashes (and requires)
    failover = true                   # then a user-hash phase in which one engine stops
    failover_after_s = 1.5
    failover_requests = 3             # per stream, a closed loop of short answers
    failover_max_tokens = 16
    light_users = ["user-c"]          # short answers beside the throttled users; their limits cannot bind
    light_requests = 8                # per light user, `light_every_s` apart, each of `light_max_tokens`
    light_max_tokens = 8              # (all of them within one burst of the user's limit); the light
                                      # users take turns evenly within each interval
    light_every_s = 0.25
    baseline = true                   # the policy phases again on a limiter-off fleet: isolation across it
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, Awaitable, Callable

from ratebench.engine_metrics import fleet_user_counters
from ratebench.phasefacts import KEY_FLEET_USER_COUNTERS, Failover
from ratebench.profiles import (
    FLEET_POLICIES, REQUIRED, EngineFlags, Kind, Limits, ModelSpec, ProfileError, ScenarioSpec, Validator, register,
)
from ratebench.roles import PHASE_BASELINE, PHASE_MEASURE
from ratebench.scenarios.base import (
    FAILOVER_THINK_S, FLEET_STAGGER_S, EngineRef, PhaseEstimate, PhasePlan, ScenarioContext, at_limits, fleet_name,
    phase_salt, streams_of_user,
)
from ratebench.workload import StreamRequest, WorkloadError


PARAMS: dict[str, tuple[str, Any]] = {
    "users": ("user_list", REQUIRED),
    "streams": ("pos_int", 4),
    "max_tokens": ("pos_int", 60),
    "engines": ("pos_int", 2),
    "policies": ("policies", list(FLEET_POLICIES)),
    "user_header": ("header", "X-Ratebench-User"),
    # a last phase under user-hash in which the engine serving the most users is stopped
    # `failover_after_s` in; each stream is a closed loop of `failover_requests` answers of
    # `failover_max_tokens`, so that its user goes on sending after the move
    "failover": ("bool", True),
    "failover_after_s": ("pos_num", 1.5),
    "failover_requests": ("pos_int", 3),
    "failover_max_tokens": ("pos_int", 16),
    # users whose limits cannot bind: each sends `light_requests` answers of `light_max_tokens` through
    # the balancer, open loop, `light_every_s` apart, while the backlogged users are throttled (all of a
    # light user's tokens of a phase fit in one burst of its limit)
    "light_users": ("user_list", []),
    "light_requests": ("pos_int", 8),
    "light_max_tokens": ("pos_int", 8),
    "light_every_s": ("pos_num", 0.25),
    # each policy's phase again on `engines` limiter-off engines behind a balancer of their own (the same
    # requests): isolation judges the light users across the fleet against it
    "baseline": ("bool", False),
}


async def _user_counters_over_phase(engine: EngineRef) -> Callable[[], Awaitable[dict[str, Any]]]:
    """Read the members' per-user counters now; the returned ``extra`` reads them again at the phase's end
    and gives ``fleet_user_counters``: member -> user -> what the phase added (None: not exported)."""
    before = await fleet_user_counters(engine.member_endpoints)

    async def after() -> dict[str, Any]:
        # The last step's stats reach the API server's metrics with its outputs, a little after the client
        # got its last chunk: read until two reads 200 ms apart agree (at most 3 s).
        now = await fleet_user_counters(engine.member_endpoints)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            again = await fleet_user_counters(engine.member_endpoints)
            if again == now:
                break
            now = again
        out: dict[str, Any] = {}
        for member, counts in now.items():
            if counts is None:
                out[member] = None
                continue
            old = before.get(member) or {}
            out[member] = {u: {k: v - (old.get(u) or {}).get(k, 0.0) for k, v in c.items()} for u, c in counts.items()}
        return {KEY_FLEET_USER_COUNTERS: out}
    return after


def fleet(spec: ScenarioSpec) -> list[PhasePlan]:
    """A fleet of limiter-on engines behind a load balancer, one phase per routing policy: each user's
    backlogged streams go through the balancer, the user named in the gateway's header and in
    vllm_xargs. The verifier judges the per-user bound across the fleet (analysis/fleet.py).

    ``light_users`` send short answers through the same balancer while the backlogged users are
    throttled, each user's tokens of the phase within one burst (its limit cannot bind); with
    ``baseline`` each policy's phase runs again, the same requests, on a limiter-off fleet of as many
    engines (``<policy>-baseline`` on fleet<K>-off-<mode>), and isolation judges the light users
    across the fleet against it (analysis/isolation.py)."""
    p = spec.params

    async def light_requests(ctx: ScenarioContext, engine: EngineRef, salt: str, heavy: int) -> list[StreamRequest]:
        """Each light user's answers, open loop, ``light_every_s`` apart from just after the last
        backlogged stream was sent (so that round-robin has placed those first). The light users take
        turns evenly within each interval (user j of L sends j/L of it later), so that one slow moment of
        the host delays one answer, not one of every light user at once: isolation's quantiles are taken
        over all of them, and samples that share a moment would fail or pass together."""
        out: list[StreamRequest] = []
        start = heavy * FLEET_STAGGER_S + p["light_every_s"] / 2
        for j, user in enumerate(p["light_users"]):
            reqs = await streams_of_user(ctx, engine, user, p["light_requests"], p["light_max_tokens"],
                                         f"{salt} {user}", first_index=heavy + j * p["light_requests"],
                                         headers={p["user_header"]: user})
            for k, req in enumerate(reqs):
                req.delay_s = start + (k + j / len(p["light_users"])) * p["light_every_s"]
            out += reqs
        return out

    def run_of(policy: str, *, baseline: bool = False):
        phase = f"{policy}-baseline" if baseline else policy

        async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
            # the baseline's requests are those of the first mode's limiter-on fleet (its salt: the same prompts)
            on = fleet_name(p["engines"], spec.scheduling[0]) if baseline else engine.name
            salt = f"{ctx.driver.run_id} {ctx.spec.name} {on} {policy}"
            reqs: list[StreamRequest] = []
            for i, user in enumerate(p["users"]):  # a user's streams one after another: round-robin spreads them
                reqs += await streams_of_user(ctx, engine, user, p["streams"], p["max_tokens"], f"{salt} {user}",
                                              first_index=i * p["streams"], headers={p["user_header"]: user})
            # sent 25 ms apart, so that they reach the balancer in this order (sent at once, they arrive in any
            # order, and round-robin can give both streams of a user to one engine)
            for k, req in enumerate(reqs):
                req.delay_s = k * FLEET_STAGGER_S
            users = {u: {"streams": p["streams"], "backlogged": True} for u in p["users"]}
            if p["light_users"]:
                reqs += await light_requests(ctx, engine, salt, len(reqs))
                users.update({u: {"streams": 1, "backlogged": False, "light": True} for u in p["light_users"]})
            await ctx.phase(engine, phase, reqs, users, role=PHASE_BASELINE if baseline else PHASE_MEASURE,
                            params={"ignore_eos": True, "policy": policy}, route=policy,
                            extra=None if baseline else await _user_counters_over_phase(engine))
        return run

    def estimate(limits: Limits | None) -> PhaseEstimate:
        est = at_limits(limits, [(u, p["streams"], p["max_tokens"]) for u in p["users"]])
        if p["light_users"] and est.at_least_s is not None:
            light_s = len(p["users"]) * p["streams"] * FLEET_STAGGER_S + p["light_requests"] * p["light_every_s"]
            if light_s > est.at_least_s:
                est = replace(est, at_least_s=light_s, basis=f"{est.basis}; light users' answers sent over "
                                                             f"{light_s:.1f} s")
        return est

    async def failover(ctx: ScenarioContext, engine: EngineRef) -> None:
        """user-hash, each user's streams a closed loop of short requests; ``failover_after_s`` in, the
        member serving the most users is stopped as if it died. The balancer's health checks take it
        out and consistent hashing moves its users to the next engine on the ring (a fresh budget
        there); requests in flight on it fail, each with an error the client sees."""
        salt = phase_salt(ctx, engine, "failover")
        reqs: list[StreamRequest] = []
        n = p["streams"] * p["failover_requests"]
        for i, user in enumerate(p["users"]):
            reqs += await streams_of_user(ctx, engine, user, n, p["failover_max_tokens"], f"{salt} {user}",
                                          first_index=i * n, headers={p["user_header"]: user}, loop_group=user,
                                          loop_streams=p["streams"], delay_s=FAILOVER_THINK_S)
        phase_start = time.monotonic_ns()

        async def stop_one() -> dict[str, Any]:
            await asyncio.sleep(p["failover_after_s"])
            served: dict[str, set[str]] = {}
            for r in ctx.driver.records:
                if r.fleet == engine.name and r.scenario == spec.name and r.phase == "failover" and r.engine != r.fleet:
                    served.setdefault(r.engine, set()).add(r.user)
            victim = max(engine.members, key=lambda m: (len(served.get(m, ())), -engine.members.index(m)))
            t_ns = time.monotonic_ns()
            if ctx.stop_member is None:
                raise WorkloadError("a fleet's failover phase needs engines ratebench launched")
            await asyncio.to_thread(ctx.stop_member, engine.name, victim)
            ctx.driver.console.print(f"  failover: stopped {victim} {(t_ns - phase_start) / 1e9:.2f} s into the phase "
                                     f"(it served {', '.join(sorted(served.get(victim, ()))) or 'no user yet'})",
                                     highlight=False)
            return Failover(victim, t_ns, round((t_ns - phase_start) / 1e9, 3),
                            sorted(served.get(victim, ()))).to_json()

        # not backlogged: a stopped engine's users are cut off mid-answer (delivery is not the question here)
        await ctx.phase(engine, "failover", reqs, {u: {"streams": p["streams"], "backlogged": False}
                                                   for u in p["users"]},
                        params={"ignore_eos": True, "policy": "user-hash"}, route="user-hash", alongside=stop_one)

    def failover_estimate(limits: Limits | None) -> PhaseEstimate:
        return at_limits(limits, [(u, p["streams"], p["failover_requests"] * p["failover_max_tokens"])
                                  for u in p["users"]])

    plans = []
    for mode in spec.scheduling:
        name = fleet_name(p["engines"], mode)
        plans += [PhasePlan(spec.name, policy, name, run_of(policy), estimate) for policy in p["policies"]]
        if p["failover"]:
            plans.append(PhasePlan(spec.name, "failover", name, failover, failover_estimate))
    if p["baseline"]:
        # the limiter-off fleet, once (as a mix's baseline): every scheduling mode's fleet is judged against it
        off = fleet_name(p["engines"], spec.scheduling[0], off=True)
        plans += [PhasePlan(spec.name, f"{policy}-baseline", off, run_of(policy, baseline=True), estimate)
                  for policy in p["policies"]]
    return plans


def validate(v: Validator, p: dict, where: str, limits: Limits, engine: EngineFlags, model: ModelSpec
             ) -> dict[str, int] | None:
    if not p["users"]:
        raise ProfileError(v.path, f"{where}.users", "at least one user", p["users"])
    for user in p["users"]:
        if user not in limits.user_tps:
            raise ProfileError(v.path, f"{where}.users",
                               f"users declared in [limits.users] (known: {sorted(limits.user_tps)})", user)
    if p["engines"] < 2:
        raise ProfileError(v.path, f"{where}.engines", "at least 2 engines (a fleet of one is one engine)",
                           p["engines"])
    if p["streams"] < p["engines"]:
        raise ProfileError(v.path, f"{where}.streams",
                           f"at least as many streams as engines ({p['engines']}), so that round-robin spreads "
                           "a user over the fleet", p["streams"])
    for key in ("max_tokens", "failover_max_tokens", "light_max_tokens"):
        if model.max_model_len is not None and p["prompt_tokens"] + p[key] >= model.max_model_len:
            raise ProfileError(v.path, f"{where}.{key}",
                               f"prompt_tokens + {key} below model.max_model_len ({model.max_model_len})", p[key])
    for user in p["light_users"]:
        if user in p["users"]:
            raise ProfileError(v.path, f"{where}.light_users", "users not in `users` (those are backlogged)",
                               user)
        burst = 0.1 * limits.limit_of(user) + 1
        if p["light_requests"] * p["light_max_tokens"] > burst:
            raise ProfileError(v.path, f"{where}.light_users",
                               f"users whose limit cannot bind: light_requests x light_max_tokens "
                               f"({p['light_requests'] * p['light_max_tokens']}) within one burst of the "
                               f"user's limit (0.1 s x {limits.limit_of(user)} tok/s + 1 = {burst:g} tokens); "
                               "give it a higher limit in [limits.users] or send less", user)
    if p["baseline"] and not p["light_users"]:
        raise ProfileError(v.path, f"{where}.baseline",
                           "light_users to judge against it (the backlogged users' limits bind: isolation "
                           "judges the users whose limits do not)", p["baseline"])
    if p["failover"]:
        # the stop must come while the users still send: well before their closed loops end at their limits
        lasts = min(p["streams"] * p["failover_requests"] * p["failover_max_tokens"] / limits.limit_of(u)
                    for u in p["users"])
        if p["failover_after_s"] > lasts / 2:
            raise ProfileError(v.path, f"{where}.failover_after_s",
                               f"at most half the failover phase at the users' limits ({lasts / 2:.2f} s: "
                               "streams x failover_requests x failover_max_tokens / limit), so that users "
                               "still send after the stop", p["failover_after_s"])
    return None


KIND = register(Kind("fleet", PARAMS, fleet, validate=validate, fits_model=False))
