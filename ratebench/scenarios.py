"""Scenario implementations: what each kind of a profile sends, phase by phase.

A scenario is planned as a list of *phases* (:func:`plan_scenario`), each on one
engine; the runner starts that engine and runs the phase on the workload driver.
Each phase ends in
one :class:`PhaseRecord` (an entry of ``scenarios.json``, see
``docs/run-folder.md``) that says which users took part, at which limits, and
whether their streams were backlogged (always waiting for tokens, so the
delivery check applies).
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

from ratebench.analysis import overhead as overhead_analysis
from ratebench.analysis.answers import GREEDY_PARAM
from ratebench.analysis.bound import BURST_NS, NS_PER_S
from ratebench.analysis.waiting import ROLE_IDLE, ROLE_STEPS, ROLE_WAITING
from ratebench.answerscore import score_parted_answers
from ratebench.engine import engine_core_cpu_s
from ratebench.events import PhaseRecord
from ratebench.profiles import ANONYMOUS_USER, Limits, Profile, ScenarioSpec, active_cap_users
from ratebench.mix import mix_requests, tier_of_users
from ratebench.trace import TraceRequest, read_trace
from ratebench.workload import Driver, PhaseContext, StreamRequest, WorkloadError, ssl_context

# Engine roles: the engine with the limiter on, the same with engine events off (overhead
# only: what recording the events costs), the same code with the limiter off, stock vLLM.
ROLE_FEATURE_ON = "patched"
ROLE_NO_EVENTS = "patched-noevents"
ROLE_FEATURE_OFF = "feature-off"
ROLE_STOCK = "stock"
# Engine steps that may still charge a user after its phase's last client event.
_BURST_REFILL_MARGIN_NS = 100_000_000


def engine_name(role: str, mode: str) -> str:
    """Engine names in a run: patched-sync, feature-off-sync, stock-async, ..."""
    return f"{role}-{mode}"


# A fleet: K limiter-on engines behind a load balancer (ratebench/balancer.py). Its phases name the
# fleet (fleet<K>-<mode>); each member is an engine of its own (patched-<mode>.e<k>: its folder, log
# and event file), and each phase is recorded once per member, with the requests that member served.
# Its baseline, the same requests on K limiter-off engines behind a balancer of their own, is the
# fleet fleet<K>-off-<mode> (members feature-off-<mode>.e<k>).
ROLE_FLEET = "fleet"
FAILOVER_THINK_S = 0.05  # a failover phase's client: its next request this long after the last one ended
FLEET_STAGGER_S = 0.025  # a fleet phase's streams are sent this far apart, in order
_FLEET_NAME = re.compile(rf"{ROLE_FLEET}([0-9]+)(-off)?-(sync|async)")


def fleet_name(engines: int, mode: str, *, off: bool = False) -> str:
    """fleet2-sync (limiter on), fleet2-off-sync (its limiter-off baseline)."""
    return f"{ROLE_FLEET}{engines}{'-off' if off else ''}-{mode}"


def fleet_members(name: str) -> list[str] | None:
    """The member engines of a fleet's name (None: not a fleet)."""
    m = _FLEET_NAME.fullmatch(name)
    if m is None:
        return None
    role = ROLE_FEATURE_OFF if m.group(2) else ROLE_FEATURE_ON
    return [f"{engine_name(role, m.group(3))}.e{k}" for k in range(int(m.group(1)))]


def member_base(name: str) -> str:
    """The engine a fleet member is a copy of (patched-sync.e1 -> patched-sync); other names unchanged."""
    return name.split(".", 1)[0]


@dataclass
class EngineRef:
    """What a scenario needs to know of a running engine."""

    name: str
    endpoint: str
    model: str  # served model name
    feature: bool
    kind: str  # "patched" | "stock"
    pgid: int | None = None  # the engine's process group (None: attached to a server of someone else's)
    # a fleet: its balancer's frontend per routing policy, its members, the header naming the serving engine
    routes: dict[str, str] = field(default_factory=dict)
    members: list[str] = field(default_factory=list)
    served_by_header: str | None = None
    member_endpoints: dict[str, str] = field(default_factory=dict)  # each member's own endpoint (its /metrics)


@dataclass
class ScenarioContext:
    profile: Profile
    spec: ScenarioSpec
    driver: Driver
    on_phase: Callable[[PhaseRecord], None]  # called as each phase ends
    model_dir: Path | None = None  # the model folder, when local (for the EOS token id)
    # () -> (CPU-seconds the machine has been busy, CPU-seconds this run's processes used), both so far
    cpu_probe: Callable[[], tuple[float, float]] | None = None
    # (fleet, member) -> stop that member engine now, as if it died (a fleet's failover phase)
    stop_member: Callable[[str, str], None] | None = None

    def limit_of(self, engine: EngineRef, user: str | None) -> int | None:
        return self.profile.limits.limit_of(user) if engine.feature else None

    def room_tokens(self, prompt_tokens: int) -> int:
        """The most output tokens a prompt of this length leaves room for."""
        max_len = self.profile.model.max_model_len or 4096
        return max(1, max_len - prompt_tokens - 1)

    async def _until_bursts_are_full(self, engine: EngineRef, limits: dict[str, int | None]) -> None:
        """Wait until each limited user of the phase has been idle on this engine for its
        burst plus one token plus a margin since its last phase there ended.

        GCRA's TAT runs at most ``burst + 1/N`` ahead of the user's last charge, so after
        that the whole burst is available again: the phase starts from the state the rate
        figures assume (``analysis.rates``), not from what the last phase left (a user's
        phases back to back, e.g. cancellation then long-prompt, otherwise start with part
        of the burst spent and read as under-delivery). The margin covers the engine steps
        that still charge after a phase's last client event (cancelled streams)."""
        wait_until = 0
        for user, limit in limits.items():
            last = self.driver.user_last_phase_end_ns.get((engine.endpoint, user))
            if limit and last is not None:
                wait_until = max(wait_until, last + BURST_NS + -(-NS_PER_S // limit) + _BURST_REFILL_MARGIN_NS)
        delay_ns = wait_until - time.monotonic_ns()
        if delay_ns > 0:
            await asyncio.sleep(delay_ns / NS_PER_S)

    async def phase(self, engine: EngineRef, phase: str, requests: list[StreamRequest],
                    users: dict[str, dict[str, Any]], *, role: str = "measure", concurrency: int | None = None,
                    params: dict[str, Any] | None = None,
                    extra: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                    route: str | None = None,
                    alongside: Callable[[], Awaitable[dict[str, Any]]] | None = None) -> PhaseRecord:
        """Run one phase on ``engine``; ``route``: a fleet's routing policy, whose balancer frontend the
        requests go through (the phase is then recorded once per member engine); ``alongside``: a task
        run while the phase's requests stream, its result added to the fleet's record."""
        pctx = PhaseContext(scenario=self.spec.name, phase=phase, engine=engine.name,
                            endpoint=engine.routes[route] if route else engine.endpoint, model=engine.model,
                            fleet=engine.name if route else None,
                            served_by_header=engine.served_by_header if route else None)
        limits = {u: self.limit_of(engine, None if u == ANONYMOUS_USER else u) for u in users}
        await self._until_bursts_are_full(engine, limits)
        start_ns = time.monotonic_ns()
        record = PhaseRecord(scenario=self.spec.name, kind=self.spec.kind, phase=phase, engine=engine.name,
                             start_ns=start_ns, end_ns=start_ns, role=role, users={},
                             params={**self.spec.params, **(params or {})})
        for user, info in users.items():
            record.users[user] = {"limit_tps": limits[user], **info}
        cpu_before = self.cpu_probe() if self.cpu_probe is not None else None
        core_before = engine_core_cpu_s(engine.pgid) if engine.pgid is not None else None
        side = asyncio.create_task(alongside()) if alongside is not None else None
        try:
            records = await self.driver.run_phase(pctx, requests, concurrency=concurrency, limits=limits)
            if extra is not None:
                record.params.update(await extra())
            if side is not None:
                record.params["alongside"] = await side
        finally:
            if side is not None and not side.done():
                side.cancel()
            elif side is not None and "alongside" not in record.params and not side.cancelled() \
                    and side.exception() is None:
                record.params["alongside"] = side.result()  # interrupted after it ran: keep what it did
            record.end_ns = time.monotonic_ns()
            record.params["client_loop_lag"] = self.driver.last_loop_lag  # how late the driver's loop read bytes
            for user in users:
                self.driver.user_last_phase_end_ns[(engine.endpoint, user)] = record.end_ns
            if cpu_before is not None:
                record.machine_cpu = _cpu_use(cpu_before, self.cpu_probe(), record.end_ns - record.start_ns)
            core_after = engine_core_cpu_s(engine.pgid) if core_before is not None else None
            if core_after is not None:
                record.engine_core_cpu_s = round(core_after - core_before, 3)
            if route:
                for member_record in _member_records(record, engine, route, self.driver.records):
                    self.on_phase(member_record)
            else:
                self.on_phase(record)
        self.driver.console.print(f"  {phase_summary(record, records)}", highlight=False)
        return record


def _member_records(record: PhaseRecord, fleet: EngineRef, route: str, records: list) -> list[PhaseRecord]:
    """A fleet's phase as each member engine saw it: one record per member, with the users whose
    requests it served (their streams counted there). ``params["fleet"]`` ties them together."""
    mine = [r for r in records if r.fleet == fleet.name and r.scenario == record.scenario and r.phase == record.phase]
    info = {"name": fleet.name, "policy": route, "members": list(fleet.members), "balancer": "haproxy",
            "served_by_header": fleet.served_by_header,
            "requests": len(mine), "unserved": sum(1 for r in mine if r.engine not in fleet.members),
            "failover": record.params.pop("alongside", None)}
    out = []
    for member in fleet.members:
        served = collections.Counter(r.user for r in mine if r.engine == member)
        # streams there: the requests it served (a failover's closed loops: at most the user's streams)
        users = {u: {**entry, "streams": min(served[u], entry.get("streams") or served[u])}
                 for u, entry in record.users.items() if served.get(u)}
        out.append(replace(record, engine=member, users=users, params={**record.params, "fleet": info}))
    return out


@dataclass
class PhaseEstimate:
    """How long a phase lasts at the least, from what it sends and the users' limits."""

    at_least_s: float | None  # None: no limit binds, the engine's speed sets the duration
    basis: str  # how it was derived, in words
    # (user, streams, limit) of the users whose budgets set it: the dry run's reachability
    users: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class PhasePlan:
    """One phase of a scenario: the engine it runs on, what it sends there, how long it should take."""

    scenario: str
    phase: str
    engine: str  # engine name
    run: Callable[[ScenarioContext, EngineRef], Awaitable[None]]
    # the users' limits on that engine (None: limiter off) -> the expected duration
    estimate: Callable[[Limits | None], PhaseEstimate]


def plan_scenario(spec: ScenarioSpec) -> list[PhasePlan]:
    """The phases of one scenario, in order (the runner starts their engines and runs them)."""
    return _KINDS[spec.kind](spec)


# ---- the kinds ---------------------------------------------------------------------


async def _streams(ctx: ScenarioContext, engine: EngineRef, user: str | None, n: int, max_tokens: int, salt: str,
                   *, prompt_tokens: int | None = None, first_index: int = 0, **kw: Any) -> list[StreamRequest]:
    """``n`` streams of one user, each with its own prompt of an exact token length."""
    p = ctx.spec.params
    prompt_tokens = prompt_tokens or p["prompt_tokens"]
    maker = await ctx.driver.prompts(engine.endpoint, engine.model)
    out = []
    for i in range(n):
        s = f"{salt}-{first_index + i}"
        if p["api"] == "chat":
            prompt: list[int] | str = maker.text_prompt(prompt_tokens, s)
            exact = None
        else:
            prompt = await maker.token_prompt(prompt_tokens, s)
            exact = len(prompt)
        out.append(StreamRequest(user=user, prompt=prompt, max_tokens=max_tokens, api=p["api"],
                                 stream_index=first_index + i, prompt_tokens=exact, **kw))
    return out


def _salt(ctx: ScenarioContext, engine: EngineRef, phase: str) -> str:
    return f"{ctx.driver.run_id} {ctx.spec.name} {engine.name} {phase}"


def _main_engine(spec: ScenarioSpec) -> str:
    return engine_name(ROLE_FEATURE_ON, spec.scheduling[0])


def _at_limits(limits: Limits | None, budgets: list[tuple[str | None, int, int]], *, wait_s: float = 0.0,
               wait: str = "") -> PhaseEstimate:
    """Each (user, streams, tokens per stream) takes streams x tokens / the user's limit (its 100 ms
    burst left out); the phase lasts as long as its slowest user, plus ``wait_s`` (``wait`` says what)."""
    if limits is None:
        return PhaseEstimate(None, "limiter off: the engine's speed sets it")
    seconds, parts, users = [], [], []
    for user, streams, tokens in budgets:
        limit = limits.limit_of(user)
        users.append((user or ANONYMOUS_USER, streams, limit))
        seconds.append(streams * tokens / limit)
        parts.append(f"{user or ANONYMOUS_USER} {streams} x {tokens} tok at {limit} tok/s: {seconds[-1]:.1f} s")
    if wait_s:
        parts.append(f"{wait} {wait_s:g} s")
    return PhaseEstimate(max(seconds) + wait_s, "; ".join(parts), users)


def seed_experiment(spec: ScenarioSpec) -> list[PhasePlan]:
    """The seed's experiment: a low-limit user with 1 then 4 streams beside a higher-limit user."""
    p = spec.params

    def phase_of(n: int, mode: str, phase: str):
        async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
            salt = _salt(ctx, engine, phase)
            reqs = await _streams(ctx, engine, p["user"], n, p["max_tokens"], salt + " a")
            reqs += await _streams(ctx, engine, p["neighbour"], p["neighbour_streams"], p["neighbour_max_tokens"],
                                   salt + " b")
            await ctx.phase(engine, phase, reqs, {
                p["user"]: {"streams": n, "backlogged": True},
                p["neighbour"]: {"streams": p["neighbour_streams"], "backlogged": True},
            }, params={"ignore_eos": True, "scheduling": mode})
        return run

    def estimate_of(n: int) -> Callable[[Limits | None], PhaseEstimate]:
        return lambda limits: _at_limits(limits, [(p["user"], n, p["max_tokens"]),
                                                  (p["neighbour"], p["neighbour_streams"], p["neighbour_max_tokens"])])

    plans = []
    for mode in spec.scheduling:
        for n in p["streams"]:
            phase = f"{n}-stream" if n == 1 else f"{n}-streams"
            plans.append(PhasePlan(spec.name, phase, engine_name(ROLE_FEATURE_ON, mode), phase_of(n, mode, phase),
                                   estimate_of(n)))
    return plans


def isolation(spec: ScenarioSpec) -> list[PhasePlan]:
    """A high-limit user alone (baseline), then beside a throttled user with many streams (shared)."""
    p = spec.params
    user, throttled = p["user"], p["throttled_user"]

    async def baseline(ctx: ScenarioContext, engine: EngineRef) -> None:
        solo = await _streams(ctx, engine, user, p["streams"], p["max_tokens"], _salt(ctx, engine, "baseline"))
        await ctx.phase(engine, "baseline", solo, {user: {"streams": p["streams"], "backlogged": False}},
                        role="baseline")

    async def shared(ctx: ScenarioContext, engine: EngineRef) -> None:
        throttled_tokens = min(ctx.room_tokens(p["prompt_tokens"]), 10 * p["max_tokens"])
        salt = _salt(ctx, engine, "shared")
        reqs = await _streams(ctx, engine, throttled, p["throttled_streams"], throttled_tokens, salt + " t",
                              background=True)
        reqs += await _streams(ctx, engine, user, p["streams"], p["max_tokens"], salt + " u", delay_s=p["lead_s"],
                               first_index=p["throttled_streams"])
        await ctx.phase(engine, "shared", reqs, {
            throttled: {"streams": p["throttled_streams"], "backlogged": True},
            user: {"streams": p["streams"], "backlogged": False},
        }, role="shared", params={"throttled_max_tokens": throttled_tokens})

    def estimate(lead_s: float) -> Callable[[Limits | None], PhaseEstimate]:
        # The throttled user's streams run in the background, closed when the user's streams end.
        return lambda limits: _at_limits(limits, [(user, p["streams"], p["max_tokens"])], wait_s=lead_s,
                                         wait="after a lead of")

    main = _main_engine(spec)
    return [PhasePlan(spec.name, "baseline", main, baseline, estimate(0.0)),
            PhasePlan(spec.name, "shared", main, shared, estimate(p["lead_s"]))]


def cancellation(spec: ScenarioSpec) -> list[PhasePlan]:
    """Streams closed mid-answer (after k tokens or t seconds); then new streams of the same user."""
    p = spec.params
    user = p["user"]

    async def cancel(ctx: ScenarioContext, engine: EngineRef) -> None:
        max_tokens = min(p["max_tokens"], ctx.room_tokens(p["prompt_tokens"]))
        reqs = await _streams(ctx, engine, user, p["streams"], max_tokens, _salt(ctx, engine, "cancel"))
        for r in reqs:
            if r.stream_index % 2 == 0:
                r.cancel_after_tokens = p["cancel_after_tokens"]
            else:
                r.cancel_after_s = p["cancel_after_s"]
        await ctx.phase(engine, "cancel", reqs, {user: {"streams": p["streams"], "backlogged": True}},
                        params={"max_tokens": max_tokens})

    async def followup(ctx: ScenarioContext, engine: EngineRef) -> None:
        await asyncio.sleep(p["settle_s"])
        follow = await _streams(ctx, engine, user, p["followup_streams"], p["followup_max_tokens"],
                                _salt(ctx, engine, "followup"))
        await ctx.phase(engine, "followup", follow, {user: {"streams": p["followup_streams"], "backlogged": True}})

    def estimate_cancel(limits: Limits | None) -> PhaseEstimate:
        # Even streams close after cancel_after_tokens tokens, odd ones after cancel_after_s.
        by_tokens = _at_limits(limits, [(user, (p["streams"] + 1) // 2, p["cancel_after_tokens"])])
        if by_tokens.at_least_s is None or by_tokens.at_least_s < p["cancel_after_s"]:
            return PhaseEstimate(p["cancel_after_s"], f"the last streams close after {p['cancel_after_s']:g} s")
        return by_tokens

    def estimate_followup(limits: Limits | None) -> PhaseEstimate:
        return _at_limits(limits, [(user, p["followup_streams"], p["followup_max_tokens"])], wait_s=p["settle_s"],
                          wait="after a pause of")

    main = _main_engine(spec)
    return [PhasePlan(spec.name, "cancel", main, cancel, estimate_cancel),
            PhasePlan(spec.name, "followup", main, followup, estimate_followup)]


def long_prompt(spec: ScenarioSpec) -> list[PhasePlan]:
    """Prompts several times --max-num-batched-tokens, so prefill runs in chunks."""
    p = spec.params

    async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
        reqs = await _streams(ctx, engine, p["user"], p["streams"], p["max_tokens"], _salt(ctx, engine, "long"))
        await ctx.phase(engine, "long-prompt", reqs, {p["user"]: {"streams": p["streams"], "backlogged": True}},
                        params={"max_num_batched_tokens": ctx.profile.engine.max_num_batched_tokens})

    return [PhasePlan(spec.name, "long-prompt", _main_engine(spec), run,
                      lambda limits: _at_limits(limits, [(p["user"], p["streams"], p["max_tokens"])]))]


def prefix_cache(spec: ScenarioSpec) -> list[PhasePlan]:
    """Many requests that share one long prefix: prefix-cache hits."""
    p = spec.params

    async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
        maker = await ctx.driver.prompts(engine.endpoint, engine.model)
        salt = _salt(ctx, engine, "prefix")
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

    return [PhasePlan(spec.name, "prefix-cache", _main_engine(spec), run,
                      lambda limits: _at_limits(limits, [(p["user"], p["requests"], p["max_tokens"])]))]


def eos(spec: ScenarioSpec) -> list[PhasePlan]:
    """Short answers that end with a real EOS token (no ignore_eos)."""
    p = spec.params

    async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
        rng = random.Random(f"{ctx.driver.run_id}-{spec.name}")
        extra_params: dict[str, Any] = {}
        eos_id = None
        if p["eos_logit_bias"]:
            eos_id = eos_token_id(ctx.model_dir)
            extra_params["eos_token_id"] = eos_id
        reqs = []
        for i in range(p["requests"]):
            extra: dict[str, Any] = {}
            if eos_id is not None:
                # min_tokens holds EOS back until the chosen length; the bias then makes it come.
                extra = {"min_tokens": rng.randint(*p["answer_tokens"]) - 1,
                         "logit_bias": {str(eos_id): float(p["eos_logit_bias"])}}
            prompt = f"[{ctx.driver.run_id} {i}] {p['question']}"
            reqs.append(StreamRequest(user=p["user"], prompt=prompt, max_tokens=p["max_tokens"], api=p["api"],
                                      ignore_eos=False, stream_index=i, extra_body=extra))
        await ctx.phase(engine, "eos", reqs, {p["user"]: {"streams": p["concurrency"], "backlogged": False}},
                        concurrency=p["concurrency"], params={"ignore_eos": False, **extra_params})

    def estimate(limits: Limits | None) -> PhaseEstimate:
        # Answers end at EOS: with the logit bias at their chosen length, else anywhere from one token.
        shortest = p["answer_tokens"][0] if p["eos_logit_bias"] else 1
        est = _at_limits(limits, [(p["user"], p["requests"], shortest)])
        return PhaseEstimate(est.at_least_s, f"answers end at EOS, at the shortest: {est.basis}")

    # On every engine of the scenario's scheduling: with async scheduling a request of a throttled
    # user can sample EOS in one step and be refused (parked) in the next, before the EOS arrives.
    return [PhasePlan(spec.name, "eos", engine_name(ROLE_FEATURE_ON, mode), run, estimate)
            for mode in spec.scheduling]


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
        reqs = await _streams(ctx, engine, probe_user, len(at), p["probe_max_tokens"], salt)
        for r, t in zip(reqs, at):
            r.delay_s = t
        return reqs

    async def idle(ctx: ScenarioContext, engine: EngineRef) -> None:
        spacing = [0.3 * k for k in range(p["probes"])]
        reqs = await probes(ctx, engine, _salt(ctx, engine, "idle probe"), spacing)
        await ctx.phase(engine, "idle", reqs, {probe_user: {"streams": p["probes"], "backlogged": False}},
                        role=ROLE_IDLE)

    async def busy(ctx: ScenarioContext, engine: EngineRef) -> None:
        reqs = await _streams(ctx, engine, probe_user, p["streams"], p["busy_max_tokens"],
                              _salt(ctx, engine, "busy"))
        await ctx.phase(engine, "busy", reqs, {probe_user: {"streams": p["streams"], "backlogged": False}},
                        role=ROLE_STEPS)

    async def throttled(ctx: ScenarioContext, engine: EngineRef) -> None:
        salt = _salt(ctx, engine, "waiting")
        reqs = await _streams(ctx, engine, user, p["streams"], p["max_tokens"], salt)
        closed = await _streams(ctx, engine, user, p["cancels"], p["max_tokens"], salt + " closed",
                                first_index=p["streams"])
        for r, t in zip(closed, cancel_at):
            r.cancel_after_s = t
        reqs += closed
        reqs += await probes(ctx, engine, salt + " probe", probe_at)
        await ctx.phase(engine, "waiting", reqs, {
            user: {"streams": p["streams"] + p["cancels"], "backlogged": True},
            probe_user: {"streams": p["probes"], "backlogged": False},
        }, role=ROLE_WAITING, params={"probe_at_s": [round(t, 3) for t in probe_at],
                                   "cancel_at_s": [round(t, 3) for t in cancel_at]})

    def estimate_idle(limits: Limits | None) -> PhaseEstimate:
        return PhaseEstimate(0.3 * (p["probes"] - 1), f"{p['probes']} probes 0.3 s apart")

    def estimate_waiting(limits: Limits | None) -> PhaseEstimate:
        return _at_limits(limits, [(user, p["streams"], p["max_tokens"])])

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


# Every channel a client controls that a careless gateway or patch might take for the rate-limit user:
# (what the record says, the API, StreamRequest fields). Only vllm_xargs.output_rate_user may count.
def _spoof_channels(as_user: str) -> list[tuple[str, str, dict[str, Any]]]:
    user_field = {"openai_user": as_user}
    headers = {"headers": {"X-User": as_user, "X-Output-Rate-User": as_user, "X-Forwarded-User": as_user,
                           "X-Api-User": as_user}}
    xargs = {"extra_xargs": {"user": as_user, "outputRateUser": as_user, "output-rate-user": as_user,
                             "OUTPUT_RATE_USER": as_user, "output_rate_user_id": as_user}}
    # a request's priority (accepted by vLLM 0.32.0 under either policy): a limiter that keeps a budget
    # per user and priority would give one user a budget for every priority it sends
    return [
        (f"the OpenAI user field naming {as_user}", "completions", user_field),
        (f"X-User-style headers naming {as_user}", "completions", headers),
        (f"other vllm_xargs keys naming {as_user}", "completions", xargs),
        (f"the user field, headers and vllm_xargs keys naming {as_user}, and priority -1, on chat", "chat",
         {**user_field, **headers, **xargs, "extra_body": {"priority": -1}}),
        ("priority 1", "completions", {"extra_body": {"priority": 1}}),
    ]


def anonymous_and_spoofing(spec: ScenarioSpec) -> list[PhasePlan]:
    """Requests without output_rate_user share __anonymous__; a user named in any other channel (the
    OpenAI user field, headers, other vllm_xargs keys, on both APIs) is charged nothing, and a request's
    priority changes nothing."""
    p = spec.params
    named = p["named_user"]
    total = p["streams"] + p["spoof_streams"]

    async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
        salt = _salt(ctx, engine, "anonymous")
        maker = await ctx.driver.prompts(engine.endpoint, engine.model)
        channels = _spoof_channels(p["spoof_as"])
        reqs = await _streams(ctx, engine, None, p["streams"], p["max_tokens"], salt + " anon")

        async def spoofing(user: str | None, n: int, first: int, tag: str, last_first: bool = False
                           ) -> list[StreamRequest]:
            out = []
            for k in range(n):
                # the named user's spoofs take the channels from the last (its few streams send priorities)
                what, api, fields = channels[(-1 - k if last_first else k) % len(channels)]
                s = f"{salt} {tag}-{first + k}"
                if api == "chat":
                    prompt, exact = maker.text_prompt(p["prompt_tokens"], s), None
                else:
                    prompt = await maker.token_prompt(p["prompt_tokens"], s)
                    exact = len(prompt)
                out.append(StreamRequest(user=user, prompt=prompt, max_tokens=p["max_tokens"], api=api,
                                         stream_index=first + k, prompt_tokens=exact,
                                         spoof=what, **fields))
            return out

        reqs += await spoofing(None, p["spoof_streams"], p["streams"], "spoof")
        users = {ANONYMOUS_USER: {"streams": total, "backlogged": True}}
        if named:
            reqs += await spoofing(named, p["named_streams"], total, "named", last_first=True)
            users[named] = {"streams": p["named_streams"], "backlogged": True}
        await ctx.phase(engine, "anonymous", reqs, users,
                        params={"spoof_as": p["spoof_as"], "spoof_channels": [c[0] for c in channels]})

    def estimate(limits: Limits | None) -> PhaseEstimate:
        budgets = [(None, total, p["max_tokens"])]
        if named:
            budgets.append((named, p["named_streams"], p["max_tokens"]))
        return _at_limits(limits, budgets)

    return [PhasePlan(spec.name, "anonymous", _main_engine(spec), run, estimate)]


def overhead(spec: ScenarioSpec) -> list[PhasePlan]:
    """Limits never reached, the same without engine events, feature off and stock vLLM (those the
    profile's ``against`` names), interleaved round by round in a rotating order: output throughput
    of each.

    The events-off engine runs in the first scheduling mode only (one engine more per mode costs
    memory, or restarts where ``profile.max_engines`` is small)."""
    p = spec.params
    # engine role -> the phase role the overhead analysis pairs by
    role_names = {ROLE_FEATURE_ON: overhead_analysis.ROLE_ON, ROLE_NO_EVENTS: overhead_analysis.ROLE_NO_EVENTS,
                  ROLE_FEATURE_OFF: overhead_analysis.ROLE_OFF, ROLE_STOCK: overhead_analysis.ROLE_STOCK}

    def phase_of(phase: str, role: str, rnd: int, mode: str):
        async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
            reqs = await _streams(ctx, engine, p["user"], p["streams"], p["max_tokens"], _salt(ctx, engine, phase))
            await ctx.phase(engine, phase, reqs, {p["user"]: {"streams": p["streams"], "backlogged": False}},
                            role=role_names[role], params={"round": rnd + 1, "scheduling": mode})
        return run

    def estimate(limits: Limits | None) -> PhaseEstimate:
        return PhaseEstimate(None, f"limits never reached: {p['streams']} x {p['max_tokens']} tok")

    against = p.get("against", ["feature-off", "stock", "no-events"])
    plans = []
    for mode in spec.scheduling:
        roles = [ROLE_FEATURE_ON]
        if mode == spec.scheduling[0] and "no-events" in against:
            roles.append(ROLE_NO_EVENTS)
        roles += [role for role, name in ((ROLE_FEATURE_OFF, "feature-off"), (ROLE_STOCK, "stock")) if name in against]
        for rnd in range(p["rounds"]):
            # Rotate the order each round so no engine always goes first.
            order = roles[rnd % len(roles):] + roles[: rnd % len(roles)]
            for role in order:
                phase = f"{role_names[role]}-{mode}-{rnd + 1}"
                plans.append(PhasePlan(spec.name, phase, engine_name(role, mode), phase_of(phase, role, rnd, mode),
                                       estimate))
    return plans


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
        reqs = await _streams(ctx, engine, user, p["requests"], p["max_tokens"], salt,
                              prompt_tokens=p["user_prompt_tokens"], first_index=first_index)
        for k, r in enumerate(reqs):
            r.delay_s = lead_s + k * p["interval_s"]
        return reqs

    async def baseline(ctx: ScenarioContext, engine: EngineRef) -> None:
        reqs = await user_requests(ctx, engine, _salt(ctx, engine, "kv-baseline"), 0.0)
        await ctx.phase(engine, "kv-baseline", reqs, {user: {"streams": user_streams, "backlogged": False}},
                        role="baseline")

    async def shared(ctx: ScenarioContext, engine: EngineRef) -> None:
        salt = _salt(ctx, engine, "kv-shared")
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
        reqs = await _streams(ctx, engine, throttled, streams, throttled_tokens, salt + " t", background=True)
        reqs += await user_requests(ctx, engine, salt + " u", p["lead_s"], first_index=p["throttled_streams"])
        before = await engine_metrics(engine.endpoint)
        seen: dict[str, float] = {}
        sampler = asyncio.create_task(_sample_pressure(engine.endpoint, seen))

        async def figures() -> dict[str, Any]:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            after = await engine_metrics(engine.endpoint)
            out: dict[str, Any] = {"kv_usage_max": round(seen["kv_usage_max"], 4) if "kv_usage_max" in seen else None}
            if "num_preemptions" in before and "num_preemptions" in after:
                out["preemptions"] = int(after["num_preemptions"] - before["num_preemptions"])
            return out

        try:
            await ctx.phase(engine, "kv-shared", reqs, {
                throttled: {"streams": streams, "backlogged": True},
                user: {"streams": user_streams, "backlogged": False},
            }, role="shared", params={"throttled_max_tokens": throttled_tokens, "stream_wait": [throttled], **sizing},
                extra=figures)
        finally:
            sampler.cancel()

    def estimate(lead_s: float) -> Callable[[Limits | None], PhaseEstimate]:
        span = lead_s + (p["requests"] - 1) * p["interval_s"]
        return lambda limits: _at_limits(limits, [(user, 1, p["max_tokens"])], wait_s=span,
                                         wait="the last request arriving at")

    main = _main_engine(spec)
    return [PhasePlan(spec.name, "kv-baseline", main, baseline, estimate(0.0)),
            PhasePlan(spec.name, "kv-shared", main, shared, estimate(p["lead_s"]))]


def active_cap_fairness(spec: ScenarioSpec) -> list[PhasePlan]:
    """More streams than --max-num-active-seqs places, every user's limit above what the places
    deliver, so the places decide each user's share. "cap-equal": users with equal limits and
    several streams each, all at once. "cap-high": the same users with one stream each, then one
    user with a higher limit arriving last. The verdict compares each user's tokens while all are
    running with its max-min fair share (place-share)."""
    p = spec.params
    low, high = active_cap_users(p)

    async def equal(ctx: ScenarioContext, engine: EngineRef) -> None:
        salt = _salt(ctx, engine, "cap-equal")
        reqs: list[StreamRequest] = []
        for i, u in enumerate(low):
            reqs += await _streams(ctx, engine, u, p["streams"], p["max_tokens"], f"{salt} {u}",
                                   first_index=i * p["streams"])
        await ctx.phase(engine, "cap-equal", reqs, {u: {"streams": p["streams"], "backlogged": False} for u in low},
                        params={"place_share": True})

    async def with_high(ctx: ScenarioContext, engine: EngineRef) -> None:
        salt = _salt(ctx, engine, "cap-high")
        reqs: list[StreamRequest] = []
        for i, u in enumerate(low):
            reqs += await _streams(ctx, engine, u, 1, p["max_tokens"], f"{salt} {u}", first_index=i)
        reqs += await _streams(ctx, engine, high, p["high_streams"], p["max_tokens"], f"{salt} {high}",
                               first_index=len(low), delay_s=p["lead_s"])
        users = {u: {"streams": 1, "backlogged": False} for u in low}
        users[high] = {"streams": p["high_streams"], "backlogged": False}
        await ctx.phase(engine, "cap-high", reqs, users, params={"place_share": True})

    def estimate(limits: Limits | None) -> PhaseEstimate:
        return PhaseEstimate(None, "the active places set it: users' limits are above what they deliver")

    main = _main_engine(spec)
    return [PhasePlan(spec.name, "cap-equal", main, equal, estimate),
            PhasePlan(spec.name, "cap-high", main, with_high, estimate)]


async def _trace_streams(ctx: ScenarioContext, engine: EngineRef, requests: list[TraceRequest],
                         salt: str) -> list[StreamRequest]:
    """The stream requests of a trace: each at its arrival offset, with a fresh prompt of its length
    (or its text), after its group's shared prefix (token ids on completions, text on chat or beside
    a text prompt)."""
    maker = await ctx.driver.prompts(engine.endpoint, engine.model)
    prefix_ids: dict[str, list[int]] = {}
    for r in requests:
        if r.prefix_group is not None and r.prefix_group not in prefix_ids:
            prefix_ids[r.prefix_group] = await maker.token_prompt(r.prefix_tokens, f"{salt} prefix {r.prefix_group}")
    gate = asyncio.Semaphore(8)  # /tokenize calls in flight

    async def one(i: int, r: TraceRequest) -> StreamRequest:
        prefix_text = ""
        if r.prefix_group is not None:
            prefix_text = maker.text_prompt(r.prefix_tokens, f"{salt} prefix {r.prefix_group}") + " "
        exact = None
        if isinstance(r.prompt, str):
            prompt: list[int] | str = prefix_text + r.prompt
        elif r.api == "chat":
            prompt = prefix_text + maker.text_prompt(r.prompt, f"{salt} {i}")
        else:
            async with gate:
                prompt = await maker.token_prompt(r.prompt, f"{salt} {i}", prefix=prefix_ids.get(r.prefix_group))
            exact = len(prompt)
        return StreamRequest(user=r.user, prompt=prompt, max_tokens=r.max_tokens, api=r.api, ignore_eos=not r.eos,
                             delay_s=r.at_s, cancel_after_tokens=r.cancel_after_tokens,
                             cancel_after_s=r.cancel_after_s, stream_index=i, prompt_tokens=exact,
                             loop_group=r.user if r.loop_streams else None, loop_streams=r.loop_streams or 1,
                             # answers that run to max_tokens are greedy: the same request gets the same
                             # answer on every engine (answers-intact holds it against the limiter-off
                             # one); those that end with EOS sample (the tiny model's greedy answers end
                             # after 2 to 4 tokens). Not a per-request seed: the CPU build's engine dies
                             # on a seeded request's partial prefill ("CPU Generator does not use offset").
                             extra_body={} if r.eos else {"temperature": 0.0})

    return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))


def _trace_users(requests: list[TraceRequest], backlogged: list[str]) -> dict[str, dict[str, Any]]:
    """The phase's users: every user of the trace, backlogged only where the profile says so."""
    counts: dict[str, int] = {}
    for r in requests:
        counts[r.user or ANONYMOUS_USER] = counts.get(r.user or ANONYMOUS_USER, 0) + 1
    return {u: {"streams": n, "backlogged": u in backlogged} for u, n in counts.items()}


def _trace_estimate(requests: list[TraceRequest], limits: Limits | None) -> PhaseEstimate:
    """At least until the last arrival, and each user's tokens at its limit from its first arrival
    (a request that may end at EOS counts one token, one closed after a time none)."""
    last = max(r.at_s for r in requests)
    basis = f"{len(requests)} requests, the last arriving at {last:.1f} s"
    if limits is None:
        return PhaseEstimate(last, basis + "; limiter off")
    first: dict[str | None, float] = {}
    tokens: dict[str | None, int] = {}
    for r in requests:
        first.setdefault(r.user, r.at_s)
        expected = r.expected_tokens()
        tokens[r.user] = tokens.get(r.user, 0) + (0 if r.cancel_after_s is not None else expected or 1)
    ends = sorted(((first[u] + tokens[u] / limits.limit_of(u), u) for u in tokens), reverse=True)
    parts = [f"{u or ANONYMOUS_USER} {tokens[u]} tok at {limits.limit_of(u)} tok/s from {first[u]:.1f} s: {end:.1f} s"
             for end, u in ends[:3]]
    return PhaseEstimate(max(last, ends[0][0]), "; ".join([basis, *parts]))


def trace(spec: ScenarioSpec) -> list[PhasePlan]:
    """Replay a trace file (docs/trace.md): each request sent at its arrival offset."""
    p = spec.params
    requests = read_trace(p["trace_path"], sha256=p["trace_sha256"])

    async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
        reqs = await _trace_streams(ctx, engine, requests, _salt(ctx, engine, "trace"))
        await ctx.phase(engine, "trace", reqs, _trace_users(requests, p["backlogged"]),
                        params={"trace_duration_s": max(r.at_s for r in requests)})

    return [PhasePlan(spec.name, "trace", _main_engine(spec), run, lambda limits: _trace_estimate(requests, limits))]


def _mix_users(p: dict[str, Any], requests: list[TraceRequest]) -> dict[str, dict[str, Any]]:
    """The mix's users, each tier user with its tier; backlogged: the users of closed-loop tiers that say so."""
    tier_of = tier_of_users(p["tiers"])
    backlogged_tiers = {t["name"] for t in p["tiers"] if t.get("backlogged", False)}
    isolated_tiers = {t["name"] for t in p["tiers"] if t.get("isolated", False)}
    users = _trace_users(requests, [u for u, tier in tier_of.items() if tier in backlogged_tiers])
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
            reqs = await _trace_streams(ctx, engine, requests, f"{ctx.driver.run_id} {ctx.spec.name} mix")

            async def score() -> dict[str, Any]:
                # the baseline's answers are in: score the limiter-on answers that parted from them here
                # (ratebench/answerscore.py), so answers-intact can tell a tie broken either way from a
                # request that lost its context
                on = [r for r in ctx.driver.records if r.scenario == ctx.spec.name and r.phase == "mix"]
                off = [r for r in ctx.driver.records if r.scenario == ctx.spec.name and r.phase == phase
                       and r.engine == engine.name]
                return await score_parted_answers(engine.endpoint, engine.model, on, off,
                                                  {q.stream_index: q for q in reqs}, engine.name)

            await ctx.phase(engine, phase, reqs, _mix_users(p, requests), role=role,
                            params={"trace_duration_s": max(r.at_s for r in requests), GREEDY_PARAM: True},
                            extra=score if role == "baseline" else None)
        return run

    plans = [PhasePlan(spec.name, "mix", engine_name(ROLE_FEATURE_ON, m), phase_of("mix", "measure"),
                       lambda limits: _trace_estimate(requests, limits)) for m in spec.scheduling]
    if p["baseline"]:
        plans.append(PhasePlan(spec.name, "mix-baseline", engine_name(ROLE_FEATURE_OFF, mode),
                               phase_of("mix-baseline", "baseline"), lambda limits: _trace_estimate(requests, limits)))
    return plans


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
        return {"fleet_user_counters": out}
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
        backlogged stream was sent (so that round-robin has placed those first)."""
        out: list[StreamRequest] = []
        start = heavy * FLEET_STAGGER_S + p["light_every_s"] / 2
        for j, user in enumerate(p["light_users"]):
            reqs = await _streams(ctx, engine, user, p["light_requests"], p["light_max_tokens"],
                                  f"{salt} {user}", first_index=heavy + j * p["light_requests"],
                                  headers={p["user_header"]: user})
            for k, req in enumerate(reqs):
                req.delay_s = start + k * p["light_every_s"] + j * FLEET_STAGGER_S
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
                reqs += await _streams(ctx, engine, user, p["streams"], p["max_tokens"], f"{salt} {user}",
                                       first_index=i * p["streams"], headers={p["user_header"]: user})
            # sent 25 ms apart, so that they reach the balancer in this order (sent at once, they arrive in any
            # order, and round-robin can give both streams of a user to one engine)
            for k, req in enumerate(reqs):
                req.delay_s = k * FLEET_STAGGER_S
            users = {u: {"streams": p["streams"], "backlogged": True} for u in p["users"]}
            if p["light_users"]:
                reqs += await light_requests(ctx, engine, salt, len(reqs))
                users.update({u: {"streams": 1, "backlogged": False, "light": True} for u in p["light_users"]})
            await ctx.phase(engine, phase, reqs, users, role="baseline" if baseline else "measure",
                            params={"ignore_eos": True, "policy": policy}, route=policy,
                            extra=None if baseline else await _user_counters_over_phase(engine))
        return run

    def estimate(limits: Limits | None) -> PhaseEstimate:
        est = _at_limits(limits, [(u, p["streams"], p["max_tokens"]) for u in p["users"]])
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
        salt = _salt(ctx, engine, "failover")
        reqs: list[StreamRequest] = []
        n = p["streams"] * p["failover_requests"]
        for i, user in enumerate(p["users"]):
            reqs += await _streams(ctx, engine, user, n, p["failover_max_tokens"], f"{salt} {user}",
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
            return {"engine": victim, "stopped_ns": t_ns, "stopped_after_s": round((t_ns - phase_start) / 1e9, 3),
                    "users_before": sorted(served.get(victim, ()))}

        # not backlogged: a stopped engine's users are cut off mid-answer (delivery is not the question here)
        await ctx.phase(engine, "failover", reqs, {u: {"streams": p["streams"], "backlogged": False}
                                                   for u in p["users"]},
                        params={"ignore_eos": True, "policy": "user-hash"}, route="user-hash", alongside=stop_one)

    def failover_estimate(limits: Limits | None) -> PhaseEstimate:
        return _at_limits(limits, [(u, p["streams"], p["failover_requests"] * p["failover_max_tokens"])
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


_KINDS: dict[str, Callable[[ScenarioSpec], list[PhasePlan]]] = {
    "fleet": fleet,
    "seed-experiment": seed_experiment,
    "isolation": isolation,
    "cancellation": cancellation,
    "long-prompt": long_prompt,
    "prefix-cache": prefix_cache,
    "eos": eos,
    "anonymous-and-spoofing": anonymous_and_spoofing,
    "waiting": waiting,
    "overhead": overhead,
    "trace": trace,
    "mix": mix,
    "kv-pressure": kv_pressure,
    "active-cap-fairness": active_cap_fairness,
}


# ---- helpers -----------------------------------------------------------------------


def _cpu_use(before: tuple[float, float], after: tuple[float, float], wall_ns: int) -> dict[str, float]:
    """CPUs in use on average between two probes: all processes, this run's, the others'."""
    wall_s = max(wall_ns, 1) / 1e9
    busy, run = (after[0] - before[0]) / wall_s, (after[1] - before[1]) / wall_s
    return {"busy": round(busy, 3), "run": round(run, 3), "other": round(max(busy - run, 0.0), 3)}


SUMMARY_MAX_USERS = 12  # a phase of more users is summed up by tier (a mix's, else the users at one limit)


def phase_summary(phase: PhaseRecord, records: list) -> str:
    """One line per phase: each user's tokens and client-side rate (first to last token); for a phase
    of many users, each tier's users, tokens, and slowest and fastest user."""
    by_user: dict[str, list] = {user: [] for user in phase.users}
    for r in records:
        by_user.setdefault(r.user or ANONYMOUS_USER, []).append(r)
    figures: dict[str, tuple[int, float, int]] = {}  # user -> tokens, rate, errors
    for user in phase.users:
        recs = by_user[user]
        times = sorted(t for r in recs for t in r.chunk_ns)
        tokens = sum(r.streamed_tokens for r in recs)
        rate = (tokens - 1) / ((times[-1] - times[0]) / 1e9) if len(times) > 1 and times[-1] > times[0] else 0.0
        figures[user] = (tokens, rate, sum(1 for r in recs if r.error))

    def limit_of(user: str) -> str:
        limit = phase.users[user].get("limit_tps")
        return f"limit {limit if limit is not None else 'off'}"

    def errors(users: list[str]) -> str:
        n = sum(figures[u][2] for u in users)
        return f" [{n} errors]" if n else ""

    if len(phase.users) <= SUMMARY_MAX_USERS:
        parts = [f"{u} {figures[u][0]} tok {figures[u][1]:.1f} tok/s ({limit_of(u)}){errors([u])}" for u in phase.users]
        return f"{phase.phase} on {phase.engine}: " + "; ".join(parts)
    tiers: dict[str, list[str]] = {}
    for user, info in phase.users.items():
        tier = info.get("tier") or (user if user == ANONYMOUS_USER else limit_of(user))
        tiers.setdefault(tier, []).append(user)
    parts = []
    for tier, users in tiers.items():
        slow, fast = min(users, key=lambda u: figures[u][1]), max(users, key=lambda u: figures[u][1])
        label = tier if tier.startswith("limit ") else f"{tier} ({limit_of(users[0])})"
        rates = (f"{figures[slow][1]:.1f} tok/s" if len(users) == 1 else
                 f"{figures[slow][1]:.1f} ({slow}) to {figures[fast][1]:.1f} tok/s ({fast})")
        parts.append(f"{label}: {len(users)} user{'s' if len(users) > 1 else ''} "
                     f"{sum(figures[u][0] for u in users)} tok, {rates}{errors(users)}")
    return f"{phase.phase} on {phase.engine}: {len(phase.users)} users by tier: " + "; ".join(parts)


def eos_token_id(model_dir: Path | None) -> int:
    """The EOS token the model's generation config stops on (its first one)."""
    if model_dir is None:
        raise WorkloadError("eos_logit_bias needs a local model folder to find the EOS token id; "
                            "set eos_logit_bias = 0 for a model that ends answers by itself")
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if isinstance(value, list) and value:
                value = value[0]
            if isinstance(value, int):
                return value
    raise WorkloadError(f"{model_dir}: no eos_token_id in generation_config.json or config.json")


_GAUGE_RE = re.compile(r"^vllm:(num_preemptions|kv_cache_usage_perc)(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)
_CACHE_INFO_RE = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)
_LABEL_RE = re.compile(r'(\w+)="([^"]*)"')


async def engine_metrics(endpoint: str) -> dict[str, float]:
    """The engine's preemptions so far, its KV cache use now (a fraction) and its KV cache size in
    tokens (``kv_cache_tokens``), from /metrics; empty when not exported or not reachable."""
    text = await _metrics_text(endpoint)
    return parse_engine_metrics(text) if text is not None else {}


async def _metrics_text(endpoint: str) -> str | None:
    """The engine's /metrics page; None when it cannot be read."""
    try:
        async with httpx.AsyncClient(timeout=10.0, verify=ssl_context()) as client:
            r = await client.get(f"{endpoint}/metrics")
    except httpx.HTTPError:
        return None
    return r.text


def parse_engine_metrics(text: str) -> dict[str, float]:
    """:func:`engine_metrics` from the text of /metrics."""
    out: dict[str, float] = {}
    for name, value in _GAUGE_RE.findall(text):
        out[name] = out.get(name, 0.0) + float(value)
    info = _CACHE_INFO_RE.search(text)
    if info:
        labels = dict(_LABEL_RE.findall(info.group(1)))
        try:
            out["kv_cache_tokens"] = float(int(labels["num_gpu_blocks"]) * int(labels["block_size"]))
        except (KeyError, ValueError):
            pass
    return out


_USER_COUNTER_RE = re.compile(
    r'^vllm:output_rate_(tokens_granted|charges_refused)_total\{([^}]*)\}\s+([0-9.eE+-]+)$', re.M)


def parse_user_counters(text: str) -> dict[str, dict[str, float]] | None:
    """The limiter's per-user counters on /metrics (``--output-rate-metrics-users``): user ->
    {"granted", "refused"}; None when the page has none (not asked for, or not this patch)."""
    out: dict[str, dict[str, float]] = {}
    found = False
    for kind, labels, value in _USER_COUNTER_RE.findall(text):
        found = True
        user = dict(_LABEL_RE.findall(labels)).get("user")
        if user is None:
            continue
        entry = out.setdefault(user, {"granted": 0.0, "refused": 0.0})
        entry["granted" if kind == "tokens_granted" else "refused"] += float(value)
    return out if found or "vllm:output_rate_tokens_granted" in text else None


async def fleet_user_counters(members: dict[str, str]) -> dict[str, dict[str, dict[str, float]] | None]:
    """Each member's per-user counters (member -> user -> counts; None where not exported)."""
    out = {}
    for name, endpoint in members.items():
        text = await _metrics_text(endpoint)
        out[name] = parse_user_counters(text) if text is not None else None
    return out


_METRIC_RE = re.compile(r"^(vllm:prefix_cache_(?:hits|queries)(?:_total)?)\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


async def prefix_cache_counters(endpoint: str) -> dict[str, float]:
    """vLLM's prefix-cache counters from /metrics (empty when not exported)."""
    text = await _metrics_text(endpoint)
    out: dict[str, float] = {}
    for name, value in _METRIC_RE.findall(text or ""):
        key = name.removeprefix("vllm:").removesuffix("_total") + "_tokens"
        out[key] = out.get(key, 0.0) + float(value)
    return out
