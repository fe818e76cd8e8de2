"""Score a limiter-on engine's greedy answers on the limiter-off engine, where the two answers part.

A mix sends the same greedy requests (temperature 0, ``ignore_eos``) to the limiter-on engine and,
as its baseline, to the limiter-off engine; answers-intact (``ratebench.analysis.answers``) holds
each pair together token for token. Two correct engines may still part: the batch a request shares
changes the kernels' rounding (bfloat16 logits), and where two tokens are that close in probability
the greedy choice falls either way. cpu-tiny's random model is flat (its five likeliest tokens within
about half a nat), and 1 of 885 answers parted at such a tie in each of two mix runs (tokens of the
same bfloat16 logit: -4.6996 and -4.6996).

So, once the baseline's answers are in, every pair that parts is scored: the limiter-on answer is sent
to the limiter-off engine as a prompt after its own prompt (``prompt_logprobs``, one output token), and
each of its tokens gets the logprob the limiter-off engine gives it in that context beside the logprob
of that engine's own likeliest token. A correct engine's answer is greedy there, up to ties; an answer
resumed on the wrong context is not. Asking every greedy answer for its logprobs while it streams would
say the same without the extra requests, but costs a CPU engine more per step (60 concurrent requests:
0.57 s against 0.46 to 0.52 s without): enough to turn cpu-tiny's mix, near this machine's capacity,
into an overload in which first tokens waited 2 s on both engines.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from ratebench.runrecords import ClientRecord, greedy_pair_comparable
from ratebench.workload import StreamRequest, WorkloadError

SCORE_CONCURRENCY = 4  # scoring requests in flight


def parted_pairs(on: list[ClientRecord], off: list[ClientRecord]) -> list[tuple[ClientRecord, ClientRecord]]:
    """The (limiter-on, baseline) record pairs of greedy answers, paired by user and stream index, whose
    tokens differ where both have them (the pairs answers-intact compares and would fail)."""
    by_key = {(r.user, r.stream_index): r for r in off}
    out = []
    for a in on:
        b = by_key.get((a.user, a.stream_index))
        if b is None or not greedy_pair_comparable(a, b) or not a.token_ids or not b.token_ids:
            continue
        n = min(len(a.token_ids), len(b.token_ids))
        if a.token_ids[:n] != b.token_ids[:n]:
            out.append((a, b))
    return out


async def prompt_ids(client: httpx.AsyncClient, endpoint: str, model: str, req: StreamRequest) -> list[int]:
    """The token ids the engine put before the answer: the prompt's own, or its tokenization (a chat
    prompt with its template and the generation prompt, as the chat endpoint builds it)."""
    if isinstance(req.prompt, list):
        return list(req.prompt)
    body: dict[str, Any] = {"model": model}
    if req.api == "chat":
        body.update(messages=[{"role": "user", "content": req.prompt}], add_generation_prompt=True)
    else:
        body["prompt"] = req.prompt
    r = await client.post(f"{endpoint}/tokenize", json=body)
    if r.status_code != 200:
        raise WorkloadError(f"{endpoint}/tokenize answered HTTP {r.status_code}: {r.text[:300]}")
    return list(r.json()["tokens"])


async def score_answer(client: httpx.AsyncClient, endpoint: str, model: str, prompt: list[int],
                       answer: list[int]) -> list[list[float]]:
    """Per token of ``answer`` after ``prompt``: [its logprob, the logprob of the engine's likeliest token
    there], as the engine at ``endpoint`` computes them."""
    body = {"model": model, "prompt": prompt + answer, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1}
    r = await client.post(f"{endpoint}/v1/completions", json=body)
    if r.status_code != 200:
        raise WorkloadError(f"scoring an answer on {endpoint} answered HTTP {r.status_code}: {r.text[:300]}")
    rows = answer_rows(r.json()["choices"][0].get("prompt_logprobs"), len(prompt), answer,
                       f"scoring an answer on {endpoint}")
    return [[row[str(token)], max(row.values())] for token, row in zip(answer, rows)]


def answer_rows(rows: list | None, prompt_len: int, answer: list[int], what: str) -> list[dict[str, float]]:
    """From a scoring reply's ``prompt_logprobs`` (the answer sent after a prompt of ``prompt_len``
    tokens): per token of ``answer``, ``{token id: logprob}`` of the tokens the engine listed there, the
    answer's own among them. Raises WorkloadError (starting with ``what``) where one is missing."""
    if not rows or len(rows) < prompt_len + len(answer):
        raise WorkloadError(f"{what}: no prompt_logprobs for every token")
    out = []
    for j, token in enumerate(answer):
        row = rows[prompt_len + j] or {}
        if str(token) not in row:
            raise WorkloadError(f"{what}: token {token} missing from its prompt_logprobs")
        out.append({t: float(v["logprob"]) for t, v in row.items()})
    return out


async def score_parted_answers(endpoint: str, model: str, on: list[ClientRecord], off: list[ClientRecord],
                               requests: dict[int, StreamRequest], engine: str) -> dict[str, Any]:
    """Score the limiter-on answer of every pair that parts on the limiter-off engine at ``endpoint``
    (named ``engine``); the scores go into the limiter-on records (``answer_scores``, ``scored_on``).
    ``requests``: the phase's stream requests by stream index (their prompts). Returns the counts for the
    phase's params: ``answers_scored``, and ``answers_unscored`` with the first reason when a scoring
    request failed (such an answer stays unscored, and answers-intact fails it as it fails any parting)."""
    pairs = parted_pairs(on, off)
    scored = 0
    problems: list[str] = []
    if pairs:
        gate = asyncio.Semaphore(SCORE_CONCURRENCY)
        async with httpx.AsyncClient(timeout=120.0) as client:
            async def one(a: ClientRecord, b: ClientRecord) -> None:
                nonlocal scored
                req = requests.get(a.stream_index)
                if req is None:
                    problems.append(f"{a.client_id}: no request of the phase has stream index {a.stream_index}")
                    return
                async with gate:
                    try:
                        ids = await prompt_ids(client, endpoint, model, req)
                        n = min(len(a.token_ids), len(b.token_ids))
                        a.answer_scores = await score_answer(client, endpoint, model, ids, a.token_ids[:n])
                    except (WorkloadError, httpx.HTTPError, KeyError, ValueError) as exc:
                        problems.append(f"{a.client_id}: {exc}")
                        return
                a.scored_on = engine
                scored += 1

            await asyncio.gather(*(one(a, b) for a, b in pairs))
    out: dict[str, Any] = {"answers_scored": scored}
    if problems:
        out["answers_unscored"] = {"count": len(problems), "first": problems[0][:300]}
    return out


# prompt logprobs asked per position when a penalised answer is scored: vLLM's default --max-logprobs
PENALTY_TOP_K = 20


def penalty_rows(status: int, text: str, prompt_len: int, answer: list[int]) -> list[dict[str, float]]:
    """From a scoring request's reply (the answer sent after its prompt, ``prompt_logprobs`` of
    PENALTY_TOP_K): per token of ``answer``, the raw logprobs the engine gives there to its likeliest
    tokens and to the answer's own token, ``{token id: logprob}`` (raw: before any penalty, so the
    verifier can apply the request's own). Raises WorkloadError on a reply without them."""
    if status != 200:
        raise WorkloadError(f"scoring a penalised answer answered HTTP {status}: {text[:300]}")
    try:
        rows = json.loads(text)["choices"][0].get("prompt_logprobs")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise WorkloadError(f"scoring a penalised answer: a reply without prompt_logprobs ({exc})") from None
    return [{t: round(lp, 5) for t, lp in row.items()}
            for row in answer_rows(rows, prompt_len, answer, "scoring a penalised answer")]


# logit bias (nats) a repetition probe adds to the answer's own token: the tie margin of structured-answers'
# repetition rule. The answer and its probe are computed in different batches (a decode step, a prefill), whose
# bfloat16 rounding moved one token's logprob by up to 0.031 on cpu-tiny (analysis/answers.py); the penalty
# scales a logit by at most its factor (1.2 here), so two tokens' penalised scores move apart by at most about
# 2 x 0.031 x 1.2 = 0.075, and a bias of 0.125 scaled down by the same factor (0.104) still covers that
REPETITION_PROBE_BIAS = 0.125


def repetition_probe_body(body: dict[str, Any], token: int) -> dict[str, Any]:
    """The sampling fields of a repetition probe for an answer of request ``body`` (greedy, a repetition
    penalty): one greedy token, under the request's repetition penalty and logit biases, with
    REPETITION_PROBE_BIAS more on ``token`` (vLLM clamps a bias to [-100, 100])."""
    bias = {str(t): float(b) for t, b in (body.get("logit_bias") or {}).items()}
    bias[str(token)] = min(100.0, bias.get(str(token), 0.0) + REPETITION_PROBE_BIAS)
    return {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "repetition_penalty": float(body["repetition_penalty"]), "logit_bias": bias}


def probe_token(status: int, text: str) -> int:
    """The one token a repetition probe's reply (``return_token_ids``) sampled. Raises WorkloadError on a
    reply without it."""
    if status != 200:
        raise WorkloadError(f"a repetition probe answered HTTP {status}: {text[:300]}")
    try:
        (token,) = json.loads(text)["choices"][0]["token_ids"]
        return int(token)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise WorkloadError(f"a repetition probe's reply without its one token id ({exc!r}): {text[:200]}") from None
