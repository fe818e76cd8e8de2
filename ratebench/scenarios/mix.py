"""The ``mix`` scenario kind. A seeded synthetic population (ratebench/mix.py), replayed like a trace: tiers of
users (<tier>-00.. at the tier's limit) and anonymous requests, open-loop arrivals or a burst.

A ``mix`` scenario makes its requests from a seed (``ratebench/mix.py``; its
parameters in ``docs/trace.md``): tiers of users, given in ``[[scenarios.tiers]]``
tables (``name``, ``users``, ``limit_tps``, ``rate``, ``tier_rate`` or ``burst``, or ``arrival = "closed"``
with ``streams``, ``requests``, ``think_s``, ``backlogged``), are named
``<name>-00``, ``<name>-01``, ... and take the tier's limit as if declared in
``[limits.users]``; those names must not be declared there.
"""

from __future__ import annotations

from typing import Any

from ratebench.analysis.thresholds import phase_params
from ratebench.answerscore import score_parted_answers
from ratebench.mix import CLOSED, TIER_ARRIVALS, mix_requests, tier_of_users, tier_users
from ratebench.phasefacts import KEY_BEAM_SEARCH, KEY_GREEDY
from ratebench.profiles import (
    REQUIRED, EngineFlags, Kind, Limits, ModelSpec, ProfileError, ScenarioSpec, Validator, register,
)
from ratebench.roles import PHASE_BASELINE, PHASE_MEASURE
from ratebench.scenarios.base import (
    ROLE_FEATURE_OFF, ROLE_FEATURE_ON, EngineRef, PhasePlan, ScenarioContext, beam_search_probes, engine_name,
    phase_salt,
)
from ratebench.scenarios.trace import trace_estimate, trace_streams, trace_phase_users
from ratebench.trace import TraceRequest


PARAMS: dict[str, tuple[str, Any]] = {
    "seed": ("nonneg_int", 0),
    "duration_s": ("pos_num", 10.0),  # arrivals within [0, duration_s)
    "arrivals": ("arrivals", "poisson"),
    # each: name, users, limit_tps, arrival; rate (per user per s) or tier_rate (the tier's), burst,
    # burst_requests; or, with
    # arrival = "closed": streams (open per user), requests (per user), think_s, backlogged
    "tiers": ("tiers", REQUIRED),
    "anonymous_rate": ("nonneg_num", 0),  # anonymous requests per second, in total
    "burst_at_s": ("nonneg_num", 0),  # when the burst tiers' users arrive, all at once
    "prompt_tokens": ("length", 32),
    "output_tokens": ("length", 64),  # max_tokens
    "eos_fraction": ("fraction", 0),  # a real EOS may end the answer
    "cancel_fraction": ("fraction", 0),  # closed after 20-80 % of max_tokens
    "prefix_fraction": ("fraction", 0),  # share one of prefix_groups prefixes of prefix_tokens
    "prefix_tokens": ("pos_int", 256),
    "prefix_groups": ("pos_int", 1),
    "chat_fraction": ("fraction", 0),
    "baseline": ("bool", False),  # also replay on the limiter-off engine (limits raised)
    # thresholds the profile may set for the mix's phases (the thresholds table): lateness_ms, each request
    # sent within this of its time (p99: trace-lateness; verify-bound's --trace-lateness-ms wins when given);
    # cancel_max_steps, engine steps allowed after a client's cancel (verify-bound's --cancel-max-steps when
    # higher): under a heavy mix an abort reaches the engine a few steps late, the limiter off alike
    **phase_params("trace_lateness_ns", "cancel_max_steps"),
}


def mix_phase_users(p: dict[str, Any], requests: list[TraceRequest]) -> dict[str, dict[str, Any]]:
    """The mix's users, each tier user with its tier; backlogged: the users of closed-loop tiers that say so."""
    tier_of = tier_of_users(p["tiers"])
    backlogged_tiers = {t["name"] for t in p["tiers"] if t.get("backlogged", False)}
    isolated_tiers = {t["name"] for t in p["tiers"] if t.get("isolated", False)}
    users = trace_phase_users(requests, [u for u, tier in tier_of.items() if tier in backlogged_tiers])
    for user, info in users.items():
        if user in tier_of:
            info["tier"] = tier_of[user]
            if tier_of[user] in isolated_tiers:
                info["isolated"] = True
    return users


def mix(spec: ScenarioSpec) -> list[PhasePlan]:
    """A seeded synthetic population (ratebench/mix.py) replayed like a trace, on the limiter-on engine
    of every scheduling mode of the scenario; with ``baseline``, the same requests again on the
    limiter-off engine of the first mode (limits raised), the baseline of every mode's phase."""
    p = spec.params
    requests = mix_requests(p)
    mode = spec.scheduling[0]

    def phase_of(phase: str, role: str):
        async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
            # the same prompts on every engine (each engine runs the mix once, so no prompt meets the
            # prefix cache it left): the limiter-on and limiter-off answers can be held together
            reqs = await trace_streams(ctx, engine, requests, f"{ctx.driver.run_id} {ctx.spec.name} mix")

            async def score() -> dict[str, Any]:
                # the baseline's answers are in: score the limiter-on answers that parted from them here
                # (ratebench/answerscore.py), so answers-intact can tell a tie broken either way from a
                # request that lost its context
                on = [r for r in ctx.driver.records if r.scenario == ctx.spec.name and r.phase == "mix"]
                off = [r for r in ctx.driver.records if r.scenario == ctx.spec.name and r.phase == phase
                       and r.engine == engine.name]
                return await score_parted_answers(engine.endpoint, engine.model, on, off,
                                                  {q.stream_index: q for q in reqs}, engine.name)

            params: dict[str, Any] = {"trace_duration_s": max(r.at_s for r in requests), KEY_GREEDY: True}
            if not engine.feature:
                # promise 7 at the API: with the limiter off beam search is served (a probe on each API,
                # done before the phase starts)
                params[KEY_BEAM_SEARCH] = await beam_search_probes(ctx, engine, None, phase_salt(ctx, engine, phase))
            await ctx.phase(engine, phase, reqs, mix_phase_users(p, requests), role=role, params=params,
                            extra=score if role == PHASE_BASELINE else None)
        return run

    plans = [PhasePlan(spec.name, "mix", engine_name(ROLE_FEATURE_ON, m), phase_of("mix", PHASE_MEASURE),
                       lambda limits: trace_estimate(requests, limits)) for m in spec.scheduling]
    if p["baseline"]:
        plans.append(PhasePlan(spec.name, "mix-baseline", engine_name(ROLE_FEATURE_OFF, mode),
                               phase_of("mix-baseline", PHASE_BASELINE), lambda limits: trace_estimate(requests, limits)))
    return plans


def validate(v: Validator, p: dict, where: str, limits: Limits, engine: EngineFlags, model: ModelSpec
             ) -> dict[str, int] | None:
    """Each tier and length is well formed; the tiers' users get their limits (returned:
    they are engine flags like [limits.users]); the seed makes at least one request, and each fits."""
    max_len = model.max_model_len

    names: set[str] = set()
    added: dict[str, int] = {}
    open_keys = ("rate", "tier_rate", "burst", "burst_requests")
    closed_keys = ("streams", "requests", "think_s", "backlogged")
    tier_keys = {"name", "users", "limit_tps", "arrival", "isolated", *open_keys, *closed_keys}
    for i, tier in enumerate(p["tiers"]):
        at = f"{where}.tiers[{i}]"
        v.keys(tier, at, tier_keys, required={"name", "users"})
        name = v.get(tier, at, "name", "str", REQUIRED)
        # a tier whose users must proceed as in the mix-baseline phase (a limit they never reach)
        if v.get(tier, at, "isolated", "bool", False) and not p["baseline"]:
            raise ProfileError(v.path, f"{at}.isolated", f"{where}.baseline = true with it (the phase its "
                               "users are compared with)", has_got=False)
        if not all(c.isalnum() or c in "-_." for c in name) or name in names:
            raise ProfileError(v.path, f"{at}.name", "a unique name of letters, digits, - _ .", name)
        names.add(name)
        v.get(tier, at, "users", "pos_int", REQUIRED)
        limit = v.get(tier, at, "limit_tps", "pos_int", None)
        arrival = tier.get("arrival", p["arrivals"])
        if arrival not in TIER_ARRIVALS:
            raise ProfileError(v.path, f"{at}.arrival", f"one of {list(TIER_ARRIVALS)}".replace("'", '"'),
                               arrival)
        if arrival == CLOSED:
            for key in open_keys:
                if key in tier:
                    raise ProfileError(v.path, f"{at}.{key}", 'no rate nor burst with arrival = "closed" (each '
                                       "user sends its next request when one of its streams ends): remove it",
                                       has_got=False)
            streams = v.get(tier, at, "streams", "pos_int", 1)
            requests = v.get(tier, at, "requests", "pos_int", REQUIRED)
            v.get(tier, at, "think_s", "nonneg_num", 0)
            v.get(tier, at, "backlogged", "bool", False)
            if streams > requests:
                raise ProfileError(v.path, f"{at}.streams", f"at most requests ({requests}), the requests each "
                                   "user sends in all", streams)
        else:
            for key in closed_keys:
                if key in tier:
                    raise ProfileError(v.path, f"{at}.{key}", 'arrival = "closed" with it (an open-loop user '
                                       "sends at its rate or in a burst)", has_got=False)
            burst = v.get(tier, at, "burst", "bool", False)
            if "tier_rate" in tier and (burst or "rate" in tier):
                raise ProfileError(v.path, f"{at}.tier_rate", "a tier with neither rate (per user) nor burst "
                                   "(tier_rate is the requests per second of the whole tier): keep one of them",
                                   tier["tier_rate"])
            v.get(tier, at, "tier_rate", "nonneg_num", None)
            v.get(tier, at, "rate", "nonneg_num", None if burst or "tier_rate" in tier else REQUIRED)
            v.get(tier, at, "burst_requests", "pos_int", 1)
            if not burst and tier.get("burst_requests") is not None:
                raise ProfileError(v.path, f"{at}.burst_requests", "burst = true with it", has_got=False)
        for user in tier_users(tier):
            if user in limits.user_tps or user in added:
                raise ProfileError(v.path, f"{at}.name", f"a tier whose users ({user}, ...) are not declared "
                                   "in [limits.users] or by another tier", name)
            if limit is not None:
                added[user] = limit
    for key in ("prompt_tokens", "output_tokens"):
        spec = p[key]
        if isinstance(spec, dict):
            forms = {"fixed": {"value"}, "uniform": {"low", "high"}, "lognormal": {"median", "sigma"}}
            dist = spec.get("dist")
            if dist not in forms:
                raise ProfileError(v.path, f"{where}.{key}.dist", f"one of {sorted(forms)}", dist)
            v.keys(spec, f"{where}.{key}", {"dist", *forms[dist], *(("max",) if dist == "lognormal" else ())},
                      required=forms[dist])
            for k in forms[dist] | {"max"}:
                v.get(spec, f"{where}.{key}", k, "pos_num" if k in ("median", "sigma") else "pos_int", None)
            if dist == "uniform" and spec["low"] > spec["high"]:
                raise ProfileError(v.path, f"{where}.{key}.low", f"at most high ({spec['high']})", spec["low"])
    requests = mix_requests(p)
    if not requests:
        raise ProfileError(v.path, f"{where}.tiers", "rates, a burst or anonymous_rate that make at least one "
                           f"request in duration_s ({p['duration_s']:g} s) with seed {p['seed']}", has_got=False)
    if max_len is not None:
        need = max((r.prefix_tokens or 0) + r.prompt + r.max_tokens for r in requests)
        if need > max_len:
            raise ProfileError(v.path, f"{where}.output_tokens",
                               f"prefix, prompt and max_tokens within model.max_model_len ({max_len})", need)
    p["mix_requests"] = len(requests)
    return added


KIND = register(Kind("mix", PARAMS, mix, validate=validate, fits_model=False, common=False))
