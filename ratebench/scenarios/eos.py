"""The ``eos`` scenario kind. Short answers that end with a real EOS (no ignore_eos), sampled, each with
a seed of its own (``seeded``)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from ratebench.profiles import (
    REQUIRED, EngineFlags, Kind, Limits, ModelSpec, ProfileError, ScenarioSpec, Validator, register,
)
from ratebench.scenarios.base import (
    ROLE_FEATURE_ON, EngineRef, PhaseEstimate, PhasePlan, ScenarioContext, at_limits, engine_name,
)
from ratebench.workload import StreamRequest, WorkloadError


PARAMS: dict[str, tuple[str, Any]] = {
    "user": ("user", REQUIRED),
    "requests": ("pos_int", 12),
    "concurrency": ("pos_int", 4),
    "answer_tokens": ("int_range", [2, 20]),
    "max_tokens": ("pos_int", 64),
    # Tiny random-weight models never choose EOS: a logit bias on the EOS token,
    # released by min_tokens, makes it come at a chosen length. 0: natural EOS.
    "eos_logit_bias": ("num", 0),
    # Each answer sampled with a seed of its own (SamplingParams.seed): the model runner keeps a
    # generator per seeded request and rewinds it after a partial prefill, which a throttled request's
    # prompt may get (it runs up to the token that samples while its user is out of budget).
    "seeded": ("bool", True),
    "question": ("str", "Answer with one word: what colour is the sky on a clear day?"),
}


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
            if p["seeded"]:
                extra["seed"] = rng.randrange(2**31)
            prompt = f"[{ctx.driver.run_id} {i}] {p['question']}"
            reqs.append(StreamRequest(user=p["user"], prompt=prompt, max_tokens=p["max_tokens"], api=p["api"],
                                      ignore_eos=False, stream_index=i, extra_body=extra))
        await ctx.phase(engine, "eos", reqs, {p["user"]: {"streams": p["concurrency"], "backlogged": False}},
                        concurrency=p["concurrency"],
                        params={"ignore_eos": False, "seeded": p["seeded"], **extra_params})

    def estimate(limits: Limits | None) -> PhaseEstimate:
        # Answers end at EOS: with the logit bias at their chosen length, else anywhere from one token.
        shortest = p["answer_tokens"][0] if p["eos_logit_bias"] else 1
        est = at_limits(limits, [(p["user"], p["requests"], shortest)])
        return PhaseEstimate(est.at_least_s, f"answers end at EOS, at the shortest: {est.basis}")

    # On every engine of the scenario's scheduling: with async scheduling a request of a throttled
    # user can sample EOS in one step and be refused (parked) in the next, before the EOS arrives.
    return [PhasePlan(spec.name, "eos", engine_name(ROLE_FEATURE_ON, mode), run, estimate)
            for mode in spec.scheduling]


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


def validate(v: Validator, p: dict, where: str, limits: Limits, engine: EngineFlags, model: ModelSpec
             ) -> dict[str, int] | None:
    """Answers shorter than max_tokens."""
    if p["answer_tokens"][1] >= p["max_tokens"]:
        raise ProfileError(v.path, f"{where}.answer_tokens", f"answers shorter than max_tokens ({p['max_tokens']})",
                           p["answer_tokens"])
    return None


KIND = register(Kind("eos", PARAMS, eos, validate=validate))
