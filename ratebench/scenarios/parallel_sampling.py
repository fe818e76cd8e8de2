"""The ``parallel-sampling`` scenario kind. Requests of ``n`` > 1 answers each: every answer is charged to
the request's user.

vLLM serves a request of ``n`` answers (``"n": 4`` in its body; not beam search, which the limiter refuses)
as ``n`` engine requests, ``<index>_<id>``, each decoding a token a step. Each answer's tokens are the
user's: a user with two requests of four answers has eight streams sharing one budget, and the bound,
even spacing and stream turns judge them as eight. A limiter that charged a request once per step, or
its first answer only, would hand such a user ``n`` times its limit; one that lost the user of the
answers it made (the request's ``vllm_xargs`` copied to each) would charge them to the anonymous user.
The client reads each answer's chunks apart (each chunk carries one answer, its ``usage`` that answer's
tokens; the final usage their sum) and the analysis joins each answer to its own engine request
(``ClientRecord.answers``).
"""

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
    "requests": ("pos_int", 2),  # sent at once
    "n": ("pos_int", 3),  # answers per request
    "max_tokens": ("pos_int", 40),  # per answer
}


def parallel_sampling(spec: ScenarioSpec) -> list[PhasePlan]:
    """``requests`` requests of ``n`` answers each, of one user, sent at once and run to max_tokens."""
    p = spec.params

    async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
        reqs = await streams_of_user(ctx, engine, p["user"], p["requests"], p["max_tokens"],
                                     phase_salt(ctx, engine, "parallel"), extra_body={"n": p["n"]})
        # each answer is a stream of the user: its streams are requests x n (the records are joined per
        # answer, ClientRecord.answers)
        await ctx.phase(engine, "parallel-sampling", reqs,
                        {p["user"]: {"streams": p["requests"] * p["n"], "backlogged": True}},
                        params={"n": p["n"]})

    def estimate(limits):
        return at_limits(limits, [(p["user"], p["requests"] * p["n"], p["max_tokens"])])

    return on_every_mode(spec, lambda main: [PhasePlan(spec.name, "parallel-sampling", main, run, estimate)])


def validate(v: Validator, p: dict, where: str, limits: Limits, engine: EngineFlags, model: ModelSpec
             ) -> dict[str, int] | None:
    """Two answers a request at least (one answer is any other scenario's request); the answers of all
    requests fit the engine's resident slots, so every answer is a stream the whole phase."""
    if p["n"] < 2:
        raise ProfileError(v.path, f"{where}.n", "at least 2 answers a request (n = 1 is a plain request)", p["n"])
    seqs = engine.max_num_seqs
    if seqs is not None and p["requests"] * p["n"] > seqs:
        raise ProfileError(v.path, f"{where}.requests", f"requests x n at most engine.max_num_seqs ({seqs}): "
                           "each answer takes a resident slot", p["requests"])
    return None


KIND = register(Kind("parallel-sampling", PARAMS, parallel_sampling, validate=validate))
