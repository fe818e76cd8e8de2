"""The ``trace`` scenario kind. Replay a JSONL trace (docs/trace.md): each request at its arrival offset, with
its user, prompt, max_tokens, cancel, EOS, shared prefix and API. Every trace user is a row of the verdict.

A ``trace`` scenario names a JSONL file of requests (``docs/trace.md``), a path
relative to the profile or a built-in trace (``ratebench/profiles/<name>.jsonl``);
the file is read and checked when the profile loads, its mistakes named by line::

    [[scenarios]]
    kind = "trace"
    trace = "example-trace"
    users_at_default_rate = false     # true: trace users not in [limits.users] take default_tps
    backlogged = []                   # users the trace keeps waiting: delivery and even spacing apply
    lateness_ms = 20                  # each request sent within this of its trace time (p99)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ratebench.analysis.thresholds import phase_params
from ratebench.profiles import (
    ANONYMOUS_USER, BUILTIN_DIR, REQUIRED, EngineFlags, Kind, Limits, ModelSpec, ProfileError, ScenarioSpec,
    Validator, register,
)
from ratebench.scenarios.base import EngineRef, PhaseEstimate, PhasePlan, ScenarioContext, on_every_mode, phase_salt
from ratebench.trace import TraceError, TraceRequest, read_trace, resolve_trace, trace_sha256, trace_users
from ratebench.workload import StreamRequest


PARAMS: dict[str, tuple[str, Any]] = {
    "trace": ("str", REQUIRED),  # a path relative to the profile's folder, or a built-in trace name
    "users_at_default_rate": ("bool", False),  # trace users not in [limits.users] take default_tps
    "backlogged": ("user_list", []),  # users the trace keeps waiting for tokens: delivery, even spacing
    # each request sent within this of its trace time (p99: trace-lateness; the thresholds table: default 20 ms,
    # verify-bound's --trace-lateness-ms wins when given)
    **phase_params("trace_lateness_ns"),
}


async def trace_streams(ctx: ScenarioContext, engine: EngineRef, requests: list[TraceRequest],
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
                             # on a seeded request's partial prefill ("CPU Generator does not use offset"),
                             # which upstream's own chunking makes when a step's token budget runs out (the
                             # patch keeps a throttled seeded prompt whole; the eos scenario sends seeds).
                             extra_body={} if r.eos else {"temperature": 0.0})

    return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))


def trace_phase_users(requests: list[TraceRequest], backlogged: list[str]) -> dict[str, dict[str, Any]]:
    """The phase's users: every user of the trace, backlogged only where the profile says so."""
    counts: dict[str, int] = {}
    for r in requests:
        counts[r.user or ANONYMOUS_USER] = counts.get(r.user or ANONYMOUS_USER, 0) + 1
    return {u: {"streams": n, "backlogged": u in backlogged} for u, n in counts.items()}


def trace_estimate(requests: list[TraceRequest], limits: Limits | None) -> PhaseEstimate:
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
        reqs = await trace_streams(ctx, engine, requests, phase_salt(ctx, engine, "trace"))
        await ctx.phase(engine, "trace", reqs, trace_phase_users(requests, p["backlogged"]),
                             params={"trace_duration_s": max(r.at_s for r in requests)})

    return on_every_mode(spec, lambda main: [PhasePlan(spec.name, "trace", main, run,
                                                       lambda limits: trace_estimate(requests, limits))])


def validate(v: Validator, p: dict, where: str, limits: Limits, engine: EngineFlags, model: ModelSpec
             ) -> dict[str, int] | None:
    """The trace file reads (its own errors name its file and line), its users have limits, the
    backlogged users are in it, and each request fits the model. Records the file's resolved path,
    digest and size in the parameters (the scenario reads the file again when it runs)."""
    max_len = model.max_model_len

    try:
        path = resolve_trace(p["trace"], Path(v.path).parent, BUILTIN_DIR)
    except TraceError as exc:
        raise ProfileError(v.path, f"{where}.trace", exc.expected, p["trace"]) from None
    try:
        requests = read_trace(path)
    except TraceError as exc:
        key = f"line {exc.line}" + (f": {exc.field}" if exc.field else "") if exc.line else "(file)"
        raise ProfileError(path, key, exc.expected, exc.got, has_got=exc.has_got) from None
    users = trace_users(requests)
    requests = sorted(requests, key=lambda r: r.line)  # the first mistake in the file is the one named
    if not p["users_at_default_rate"]:
        for r in requests:
            if r.user is not None and r.user not in limits.user_tps:
                raise ProfileError(path, f"line {r.line}: user",
                                   f"a user declared in [limits.users] of {v.path} (known: "
                                   f"{sorted(limits.user_tps)}), or {where}.users_at_default_rate = true",
                                   r.user)
    for user in p["backlogged"]:
        if user not in users:
            raise ProfileError(v.path, f"{where}.backlogged", f"users of the trace ({', '.join(users)})", user)
    if max_len is not None:
        for r in requests:
            need = (r.prefix_tokens or 0) + (r.prompt if isinstance(r.prompt, int) else 0) + r.max_tokens
            if need > max_len:
                raise ProfileError(path, f"line {r.line}: max_tokens",
                                   f"prefix, prompt and max_tokens within model.max_model_len ({max_len}) of "
                                   f"{v.path}", need)
    p["trace_path"] = str(path.resolve())
    p["trace_sha256"] = trace_sha256(path)
    p["trace_requests"] = len(requests)
    return None


KIND = register(Kind("trace", PARAMS, trace, validate=validate, fits_model=False, common=False))
