"""The ``request-options`` scenario kind. One user's streams, each carrying an option of the request body
that users send (structured outputs, logprobs, penalties, stop strings, logit bias, ...): every one is
charged to the user like a plain request.

The limiter charges in the scheduler, where each option is a field of the request's sampling
parameters (``structured_output_request``, ``logprobs``, ``logits_processors``, ...). A limiter that
let one kind of request through uncharged, skipped requests the structured-output manager holds
back, or lost the user of requests whose parameters the frontend rebuilds (a JSON schema is
compiled into a grammar, bad words into token ids), passes every other scenario, whose requests are
plain. Here one user (whose limit binds) sends one stream per option, all at once, greedy
(temperature 0, so the options that shape the distribution still give one answer) and run to
``max_tokens``: the bound, even spacing, stream turns, reconciliation and identity judge them as
the user's streams, so a stream that was not charged shows as the user's excess.

Each option is sent on the API where users send it (``OPTIONS``: chat for ``response_format``,
completions for vLLM's ``structured_outputs``); every option keeps the answer running to ``max_tokens``
(a stop string that never matches, ``min_tokens`` equal to it, structured outputs with
``ignore_eos``), so each stream is backlogged the whole phase.
"""

from __future__ import annotations

from typing import Any

from ratebench.analysis.structured import BAN_BIAS, constraint_of
from ratebench.answerscore import (
    PENALTY_TOP_K, REPETITION_PROBE_BIAS, penalty_rows, probe_token, repetition_probe_body,
)
from ratebench.profiles import (
    REQUIRED, EngineFlags, Kind, Limits, ModelSpec, ProfileError, ScenarioSpec, Validator, register,
)
from ratebench.scenarios.base import (
    EngineRef, PhasePlan, ScenarioContext, at_limits, on_every_mode, phase_salt, post_probe,
)
from ratebench.workload import StreamRequest, WorkloadError

_SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"}}},
           "required": ["words"]}

# option -> (API, what it adds to the request's body)
OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "json-schema": ("chat", {"response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "words", "schema": _SCHEMA}}}),
    "json-object": ("chat", {"response_format": {"type": "json_object"}}),
    "regex": ("completions", {"structured_outputs": {"regex": "[a-z]+( [a-z]+)*"}}),
    "choice": ("completions", {"structured_outputs": {"choice": ["yes", "no"]}}),
    "logprobs": ("completions", {"logprobs": 5}),
    "top-logprobs": ("chat", {"logprobs": True, "top_logprobs": 5}),
    # additive penalties, which the verifier can apply to the model's raw scores (penalty_scores); the
    # repetition penalty scales logits, which prompt logprobs do not give: a stream of its own, whose answer
    # the engine is asked again token by token (repetition_probes)
    "penalties": ("completions", {"presence_penalty": 0.5, "frequency_penalty": 0.5}),
    "repetition-penalty": ("completions", {"repetition_penalty": 1.2}),
    "stop": ("completions", {"stop": ["\u241e never \u241e"]}),
    "logit-bias": ("completions", {"logit_bias": {"100": 5.0, "101": -5.0}}),
    "allowed-token-ids": ("completions", {"allowed_token_ids": list(range(100, 400))}),
    "bad-words": ("completions", {"bad_words": ["the"]}),
    "min-tokens": ("completions", {"min_tokens": None}),  # None: the stream's max_tokens
    "chat": ("chat", {}),
}

PARAMS: dict[str, tuple[str, Any]] = {
    "user": ("user", REQUIRED),  # a user whose limit binds on its streams (one per option)
    "options": ("str_list", list(OPTIONS)),  # one stream each, sent at once
    "max_tokens": ("pos_int", 30),
    "prompt_tokens": ("pos_int", 32),
    # the bad-words option's words: ones the served model says, so that the ban binds and an answer that
    # breaks it shows (structured-answers); a model that never says them makes that stream a plain one
    "bad_words": ("str_list", ["the"]),
    # the logit-bias option also biases these token ids of the served model by -100, vLLM's lowest: a ban
    # greedy sampling never breaks, which structured-answers holds the answer to. Ones the model says, so
    # that the ban binds; none: the option's mild biases only, which no answer can be held to alone
    "banned_token_ids": ("token_ids", []),
}


def option_body(option: str, max_tokens: int, bad_words: list[str] | None = None,
                banned_token_ids: list[int] | None = None) -> tuple[str, dict[str, Any]]:
    """The API and body fields of one option's request (``bad_words``: the bad-words option's words, its
    default when None; ``banned_token_ids``: the logit-bias option's token ids biased by -100)."""
    api, body = OPTIONS[option]
    body = {k: (max_tokens if v is None else v) for k, v in body.items()}
    if bad_words is not None and "bad_words" in body:
        body["bad_words"] = list(bad_words)
    if banned_token_ids and "logit_bias" in body:
        body["logit_bias"] = {**body["logit_bias"], **{str(t): BAN_BIAS for t in banned_token_ids}}
    return api, body


def request_options(spec: ScenarioSpec) -> list[PhasePlan]:
    """One greedy stream per option, of one user, sent at once and run to ``max_tokens``."""
    p = spec.params

    async def run(ctx: ScenarioContext, engine: EngineRef) -> None:
        maker = await ctx.driver.prompts(engine.endpoint, engine.model)
        salt = phase_salt(ctx, engine, "options")
        reqs = []
        for i, option in enumerate(p["options"]):
            api, body = option_body(option, p["max_tokens"], p["bad_words"], p["banned_token_ids"])
            if api == "chat":
                prompt: list[int] | str = maker.text_prompt(p["prompt_tokens"], f"{salt}-{i}")
                exact = None
            else:
                prompt = await maker.token_prompt(p["prompt_tokens"], f"{salt}-{i}")
                exact = len(prompt)
            reqs.append(StreamRequest(user=p["user"], prompt=prompt, max_tokens=p["max_tokens"], api=api,
                                      stream_index=i, prompt_tokens=exact,
                                      extra_body={"temperature": 0.0, **body}))
        # An engine compiles its structured-output backend on the first request that needs it (about 2 s
        # of one step on cpu-tiny, the limiter on or off): one short request per option first, a probe
        # (its id says so: no phase's), so the phase's streams meet a warm engine.
        warm = []
        for i, option in enumerate(p["options"]):
            api, body = option_body(option, 2, p["bad_words"], p["banned_token_ids"])
            status, _ = await post_probe(ctx, engine, api, f"[{salt} warm {i}] Name three colours.",
                                         {"max_tokens": 2, "ignore_eos": True, "temperature": 0.0, **body})
            warm.append(f"{option} {status}")
        # each stream's option and the body fields it sent, by stream index: structured-answers holds the
        # constrained answers to their constraints (ratebench/analysis/structured.py)
        bodies = [{"option": option, "api": api, "body": body} for option in p["options"]
                  for api, body in [option_body(option, p["max_tokens"], p["bad_words"], p["banned_token_ids"])]]

        async def score_answers() -> dict[str, Any]:
            # Greedy answers under penalties, held by structured-answers to what the engine itself computes
            # when asked again (probes, after the phase). Additive penalties: each answer sent after its prompt
            # (prompt_logprobs, one token), so the verifier can apply the penalties to the model's raw scores
            # (penalty_scores). The repetition penalty scales a logit by its sign, which logprobs do not give:
            # the engine is asked for one greedy token after the prompt and the answer's first j tokens, under
            # the request's repetition penalty (it counts prompt and answer tokens alike, so the probe's prompt
            # carries the same history) and a small bias towards the answer's token j (repetition_probes). A
            # request that came back without its penalties, or without the history they count, answers with
            # tokens the probes do not pick.
            scores: dict[str, Any] = {}
            probes: dict[str, Any] = {}
            problems: list[str] = []
            for r in ctx.driver.records:
                if (r.scenario, r.phase, r.engine) != (ctx.spec.name, "request-options", engine.name):
                    continue
                body = bodies[r.stream_index]["body"]
                constraint = constraint_of(body)
                if constraint is None or constraint[0] not in ("penalties", "repetition") or not r.token_ids \
                        or r.error:
                    continue
                prompt = reqs[r.stream_index].prompt
                if not isinstance(prompt, list):
                    problems.append(f"{r.client_id}: a penalised answer of a text prompt (the {bodies[r.stream_index]['api']}"
                                    " API) cannot be sent again token for token")
                    continue
                answer = list(r.token_ids)
                try:
                    if constraint[0] == "penalties":
                        status, text = await post_probe(ctx, engine, "completions", list(prompt) + answer,
                                                        {"max_tokens": 1, "temperature": 0.0,
                                                         "prompt_logprobs": PENALTY_TOP_K}, whole=True)
                        scores[str(r.stream_index)] = penalty_rows(status, text, len(prompt), answer)
                    else:
                        picked = []
                        for j, token in enumerate(answer):
                            status, text = await post_probe(ctx, engine, "completions", list(prompt) + answer[:j],
                                                            repetition_probe_body(body, token), whole=True)
                            picked.append(probe_token(status, text))
                        probes[str(r.stream_index)] = picked
                except WorkloadError as exc:
                    problems.append(f"{r.client_id}: {exc}")
            out: dict[str, Any] = {"penalty_scores": scores}
            if probes:
                out["repetition_probes"] = {"bias": REPETITION_PROBE_BIAS, "tokens": probes}
            if problems:
                out["penalty_scores_unscored"] = {"count": len(problems), "first": problems[0][:300]}
            return out

        await ctx.phase(engine, "request-options", reqs,
                        {p["user"]: {"streams": len(reqs), "backlogged": True}},
                        params={"option_probes": warm, "option_bodies": bodies}, extra=score_answers)

    def estimate(limits):
        return at_limits(limits, [(p["user"], len(p["options"]), p["max_tokens"])])

    return on_every_mode(spec, lambda main: [PhasePlan(spec.name, "request-options", main, run, estimate)])


def validate(v: Validator, p: dict, where: str, limits: Limits, engine: EngineFlags, model: ModelSpec
             ) -> dict[str, int] | None:
    """Known options, each once; two at least (the user's streams share its budget)."""
    for i, option in enumerate(p["options"]):
        if option not in OPTIONS:
            raise ProfileError(v.path, f"{where}.options[{i}]", f"one of {list(OPTIONS)}".replace("'", '"'), option)
    if len(set(p["options"])) != len(p["options"]):
        raise ProfileError(v.path, f"{where}.options", "each option once", p["options"])
    if len(p["options"]) < 2:
        raise ProfileError(v.path, f"{where}.options", "two options at least: the user's streams share its "
                           "budget, so an uncharged one shows as the user's excess", p["options"])
    words = p["bad_words"]
    if not words or any(not isinstance(w, str) or not w.strip() for w in words):
        raise ProfileError(v.path, f"{where}.bad_words", "one word at least, none empty (vLLM refuses an empty "
                           "bad word)", words)
    return None


KIND = register(Kind("request-options", PARAMS, request_options, validate=validate, common=False))
