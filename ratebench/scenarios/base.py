"""What every scenario kind shares: engine roles and names, the engine a phase runs on
(:class:`EngineRef`), what a phase may use while it runs (:class:`ScenarioContext`), a phase's plan
(:class:`PhasePlan`, :class:`PhaseEstimate`), and the helpers the kinds build their phases from."""

from __future__ import annotations

import asyncio
import collections
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

from ratebench.analysis.bound import BURST_NS, NS_PER_S
from ratebench.runrecords import PhaseRecord
from ratebench.phasefacts import KEY_ALONGSIDE, KEY_CLIENT_LOOP_LAG, KEY_FLEET, BeamProbe, Failover, FleetInfo
from ratebench.procstats import engine_core_cpu_s
from ratebench.profiles import ANONYMOUS_USER, Limits, Profile, ScenarioSpec
from ratebench.roles import ENGINE_FEATURE_OFF, ENGINE_FEATURE_ON, ENGINE_NO_EVENTS, ENGINE_STOCK, PHASE_MEASURE
from ratebench.workload import Driver, PhaseContext, StreamRequest


# Engine roles (ratebench/roles.py): the limiter on, the same with engine events off, the limiter off,
# stock vLLM.
ROLE_FEATURE_ON, ROLE_NO_EVENTS, ROLE_FEATURE_OFF, ROLE_STOCK = (ENGINE_FEATURE_ON, ENGINE_NO_EVENTS,
                                                                 ENGINE_FEATURE_OFF, ENGINE_STOCK)
# Engine steps that may still charge a user after its phase's last client event.
BURST_REFILL_MARGIN_NS = 100_000_000


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
_FLEET_NAME = re.compile(rf"{ROLE_FLEET}([0-9]+)(-off)?-(sync|async|priority)")


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
                wait_until = max(wait_until, last + BURST_NS + -(-NS_PER_S // limit) + BURST_REFILL_MARGIN_NS)
        delay_ns = wait_until - time.monotonic_ns()
        if delay_ns > 0:
            await asyncio.sleep(delay_ns / NS_PER_S)

    async def phase(self, engine: EngineRef, phase: str, requests: list[StreamRequest],
                    users: dict[str, dict[str, Any]], *, role: str = PHASE_MEASURE, concurrency: int | None = None,
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
                            served_by_header=engine.served_by_header if route else None,
                            stall_timeout_s=self.profile.stall_timeout_s)
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
                record.params[KEY_ALONGSIDE] = await side
        finally:
            if side is not None and not side.done():
                side.cancel()
            elif side is not None and KEY_ALONGSIDE not in record.params and not side.cancelled() \
                    and side.exception() is None:
                record.params[KEY_ALONGSIDE] = side.result()  # interrupted after it ran: keep what it did
            record.end_ns = time.monotonic_ns()
            record.params[KEY_CLIENT_LOOP_LAG] = self.driver.last_loop_lag  # how late the driver's loop read bytes
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
    info = FleetInfo(fleet.name, route, list(fleet.members), balancer="haproxy",
                     served_by_header=fleet.served_by_header, requests=len(mine),
                     unserved=sum(1 for r in mine if r.engine not in fleet.members),
                     failover=Failover.read(record.params.pop(KEY_ALONGSIDE, None))).to_json()
    out = []
    for member in fleet.members:
        served = collections.Counter(r.user for r in mine if r.engine == member)
        # streams there: the requests it served (a failover's closed loops: at most the user's streams)
        users = {u: {**entry, "streams": min(served[u], entry.get("streams") or served[u])}
                 for u, entry in record.users.items() if served.get(u)}
        out.append(replace(record, engine=member, users=users, params={**record.params, KEY_FLEET: info}))
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


async def streams_of_user(ctx: ScenarioContext, engine: EngineRef, user: str | None, n: int, max_tokens: int, salt: str,
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


async def post_probe(ctx: ScenarioContext, engine: EngineRef, api: str, text: str | list[int],
                     fields: dict[str, Any], *, whole: bool = False, headers: dict[str, str] | None = None,
                     ids: list[str] | None = None) -> tuple[int, str]:
    """One plain (not streamed) request of ``text`` on ``api`` ("completions" or "chat") with ``fields``,
    before a phase: its HTTP status and the start of its body (``whole``: all of it; ``text`` may be token
    ids on the completions API; ``headers``: more HTTP headers; ``ids``: its X-Request-Id is appended).
    Its id says it is a probe (ratebench.analysis.load.is_warmup_request): no phase's, and no client
    record names it (each engine request it makes, a beam or an answer, carries that id)."""
    body: dict[str, Any] = {"model": engine.model, **fields}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = text
        path = "/v1/completions"
    ctx.driver.probes_sent += 1
    request_id = f"probe-{engine.name}-{ctx.driver.probes_sent}"
    if ids is not None:
        ids.append(request_id)
    return await ctx.driver.post_json(engine.endpoint + path, body, {**(headers or {}), "X-Request-Id": request_id},
                                      whole=whole)


async def beam_search_probes(ctx: ScenarioContext, engine: EngineRef, user: str | None, salt: str
                             ) -> list[dict[str, Any]]:
    """With the limiter on, a beam search request is refused at the API (HTTP 400): its beams would be
    charged as the user's tokens and its answer is not what the client is charged for; with it off, it
    is served as upstream serves it (HTTP 200). One plain request on each API, before the phase's
    streams; what the server answered (checks beam-search-refused, beam-search-off-served)."""
    xargs = {"vllm_xargs": {"output_rate_user": user}} if user else {}
    text = f"[{salt} beam] Name three colours."
    out = []
    for api in ("completions", "chat"):
        # served (limiter off), each beam is an engine request of its own, each named a probe
        status, message = await post_probe(ctx, engine, api, text,
                                           {"max_tokens": 4, "use_beam_search": True, "n": 2, **xargs})
        out.append(BeamProbe(api, "use_beam_search, n 2", status, message).to_json())
    return out


def phase_salt(ctx: ScenarioContext, engine: EngineRef, phase: str) -> str:
    return f"{ctx.driver.run_id} {ctx.spec.name} {engine.name} {phase}"


def on_every_mode(spec: ScenarioSpec, plans: Callable[[str], list[PhasePlan]]) -> list[PhasePlan]:
    """A scenario's phases on the limiter-on engine of each of its scheduling modes, mode after mode
    (``plans``: the phases on one engine, by its name)."""
    return [plan for mode in spec.scheduling for plan in plans(engine_name(ROLE_FEATURE_ON, mode))]


def at_limits(limits: Limits | None, budgets: list[tuple[str | None, int, int]], *, wait_s: float = 0.0,
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
