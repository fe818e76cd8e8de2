"""The ``anonymous-and-spoofing`` scenario kind. Requests without output_rate_user share __anonymous__; nothing
else a client sends (the OpenAI `user` field, X-User-style headers, other vllm_xargs keys, a priority, on
both APIs) names spoof_as. named_user's streams send output_rate_user and the same spoofs. On a limiter-on
engine, a beam search request on each API first: it must be refused (HTTP 400); after its streams, on each
API, a request that is not streamed (``"stream": false``, the answer in one body) naming named_user, and one sending every
spoof channel: the engine must charge the first to named_user and the second to __anonymous__ (check
identity-unstreamed). The phase's streams are all streamed: an API server that read the user only on its
streaming path would pass every other check."""

from __future__ import annotations

import json
from typing import Any

from ratebench.phasefacts import KEY_BEAM_SEARCH, KEY_UNSTREAMED
from ratebench.profiles import ANONYMOUS_USER, REQUIRED, Kind, Limits, ScenarioSpec, register
from ratebench.scenarios.base import (
    EngineRef, PhaseEstimate, PhasePlan, ScenarioContext, at_limits, beam_search_probes, on_every_mode, phase_salt,
    post_probe,
    streams_of_user,
)
from ratebench.workload import StreamRequest


PARAMS: dict[str, tuple[str, Any]] = {
    "streams": ("pos_int", 2),
    "spoof_streams": ("pos_int", 5),
    "spoof_as": ("user", REQUIRED),
    "named_user": ("user", None),
    "named_streams": ("pos_int", 2),
    "max_tokens": ("pos_int", 100),
}


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


UNSTREAMED_MAX_TOKENS = 4


def twin_names(user: str) -> list[str]:
    """Names a client may send that are not ``user`` but fold into it: its case changed, a space after it."""
    upper = user.upper() if user.upper() != user else user.lower()
    return [n for n in (upper, user + " ") if n != user]


async def unstreamed_probes(ctx: ScenarioContext, engine: EngineRef, named: str | None,
                            channels: list[tuple[str, str, dict[str, Any]]], salt: str) -> list[dict[str, Any]]:
    """On each API, requests answered in one body (no ``stream``): one naming ``named`` in
    vllm_xargs.output_rate_user (when there is one), one sending every spoof channel of ``channels`` (the
    chat one's: the OpenAI user field, the headers, other vllm_xargs keys, a priority) and no
    output_rate_user; and on the completions API a batch of two prompts naming ``named`` (two engine
    requests of one HTTP request) and requests naming near twins of ``named`` (``twin_names``), each
    charged to the name it sent. Each: its API, X-Request-Id, the user it must be charged to, its HTTP status and
    usage.completion_tokens (None when the reply had none)."""
    _, _, spoofs = next(c for c in channels if c[1] == "chat")
    out = []
    for api in ("completions", "chat", "completions (a batch of 2 prompts)"):
        sends: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        if named:
            sends.append((named, {"vllm_xargs": {"output_rate_user": named}}, {}))
            if api == "completions":
                # near twins of the name: users of their own (a limiter that folds case or trims a name
                # merges them with the named user, whose budget they then spend)
                for twin in twin_names(named):
                    sends.append((twin, {"vllm_xargs": {"output_rate_user": twin}}, {}))
        if api != "completions (a batch of 2 prompts)":
            sends.append((ANONYMOUS_USER, {"user": spoofs["openai_user"], "vllm_xargs": dict(spoofs["extra_xargs"]),
                                           **spoofs["extra_body"]}, dict(spoofs["headers"])))
        for expected, fields, headers in sends:
            ids: list[str] = []
            text_of = f"[{salt} unstreamed {api} {expected}] Name three colours."
            # a batch of prompts on the completions API: one engine request each, all the user's
            prompt: Any = [text_of, text_of + " And two more."] if api.endswith("2 prompts)") else text_of
            status, text = await post_probe(
                ctx, engine, "chat" if api == "chat" else "completions", prompt,
                {"max_tokens": UNSTREAMED_MAX_TOKENS, "ignore_eos": True, "temperature": 0.0, **fields},
                whole=True, headers=headers, ids=ids)
            tokens = None
            try:
                tokens = int(json.loads(text)["usage"]["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                pass
            out.append({"api": api, "request_id": ids[0], "user": expected, "status": status,
                        "completion_tokens": tokens})
    return out


def anonymous_and_spoofing(spec: ScenarioSpec) -> list[PhasePlan]:
    """Requests without output_rate_user share __anonymous__; a user named in any other channel (the
    OpenAI user field, headers, other vllm_xargs keys, on both APIs) is charged nothing, and a request's
    priority changes nothing."""
    p = spec.params
    named = p["named_user"]
    total = p["streams"] + p["spoof_streams"]

    async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
        salt = phase_salt(ctx, engine, "anonymous")
        maker = await ctx.driver.prompts(engine.endpoint, engine.model)
        channels = _spoof_channels(p["spoof_as"])
        reqs = await streams_of_user(ctx, engine, None, p["streams"], p["max_tokens"], salt + " anon")

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
        params: dict[str, Any] = {"spoof_as": p["spoof_as"], "spoof_channels": [c[0] for c in channels]}
        extra = None
        if engine.feature:
            params[KEY_BEAM_SEARCH] = await beam_search_probes(ctx, engine, named, salt)

            async def extra() -> dict[str, Any]:
                # after the phase's streams (their charges would take the users' bursts before it)
                return {KEY_UNSTREAMED: await unstreamed_probes(ctx, engine, named, channels, salt)}
        await ctx.phase(engine, "anonymous", reqs, users, params=params, extra=extra)

    def estimate(limits: Limits | None) -> PhaseEstimate:
        budgets = [(None, total, p["max_tokens"])]
        if named:
            budgets.append((named, p["named_streams"], p["max_tokens"]))
        return at_limits(limits, budgets)

    return on_every_mode(spec, lambda main: [PhasePlan(spec.name, "anonymous", main, run, estimate)])


KIND = register(Kind("anonymous-and-spoofing", PARAMS, anonymous_and_spoofing))
