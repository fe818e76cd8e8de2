"""A seeded synthetic population: the ``mix`` scenario's requests, made as a trace.

Users come in tiers (``<tier>-00``, ``<tier>-01``, ... at the tier's limit), plus anonymous
requests. Arrivals are open loop (Poisson or evenly spaced, at a rate per user or, with
``tier_rate``, for the whole tier, each arrival then from one of its users at random), all at
once for a tier marked ``burst``, or a closed loop for a tier with ``arrival = "closed"`` (each
user keeps ``streams`` requests open, sending the next ``think_s`` after one ends, ``requests``
in all; the driver starts them, see ``TraceRequest.loop_streams``). Prompt and output lengths
are fixed, uniform or lognormal; a fraction may end at a real EOS, a fraction is cancelled, a
fraction shares a prefix, a fraction goes to the chat API. :func:`mix_requests` is a pure
function of the parameters and the seed; the scenario then replays its result like a trace
(``ratebench.trace``).
"""

from __future__ import annotations

import math
import random
from typing import Any

from ratebench.trace import TraceRequest

ARRIVALS = ("poisson", "constant")
CLOSED = "closed"
TIER_ARRIVALS = (*ARRIVALS, CLOSED)  # a tier's own ``arrival``: the scenario's ``arrivals`` by default
LENGTH_DISTS = ("fixed", "uniform", "lognormal")


def tier_users(tier: dict[str, Any]) -> list[str]:
    """The user names of a tier: ``<name>-00`` .. (two digits at least)."""
    width = max(2, len(str(tier["users"] - 1)))
    return [f"{tier['name']}-{i:0{width}d}" for i in range(tier["users"])]


def tier_of_users(tiers: list[dict[str, Any]]) -> dict[str, str]:
    """Each tier user's tier name."""
    return {user: tier["name"] for tier in tiers for user in tier_users(tier)}


def _length(rng: random.Random, spec: int | dict[str, Any]) -> int:
    if isinstance(spec, int):
        return spec
    if spec["dist"] == "fixed":
        return int(spec["value"])
    if spec["dist"] == "uniform":
        return rng.randint(int(spec["low"]), int(spec["high"]))
    return max(1, min(int(spec.get("max", 1 << 30)), round(rng.lognormvariate(math.log(spec["median"]),
                                                                               spec["sigma"]))))


def _arrivals(rng: random.Random, rate: float, duration_s: float, kind: str) -> list[float]:
    """Arrival times in [0, duration_s) at ``rate`` per second: Poisson, or evenly spaced from a random phase."""
    if rate <= 0:
        return []
    if kind == "constant":
        step = 1.0 / rate
        t = rng.uniform(0, step)
        out = []
        while t < duration_s:
            out.append(t)
            t += step
        return out
    out, t = [], rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def mix_requests(p: dict[str, Any]) -> list[TraceRequest]:
    """The requests of a mix scenario, in arrival order: the same parameters and seed give the same list."""
    rng = random.Random(p["seed"])
    # (user, arrival offsets, closed loop's open requests or None)
    senders: list[tuple[str | None, list[float], int | None]] = []
    for tier in p["tiers"]:
        arrival = tier.get("arrival", p["arrivals"])
        users = tier_users(tier)
        if tier.get("tier_rate") is not None:  # the tier's arrivals, each from one of its users at random
            by_user: dict[str, list[float]] = {u: [] for u in users}
            for at in _arrivals(rng, tier["tier_rate"], p["duration_s"], arrival):
                by_user[rng.choice(users)].append(at)
            senders.extend((u, by_user[u], None) for u in users)
            continue
        for user in users:
            if arrival == CLOSED:  # at_s: the think time after one of the user's requests ends
                senders.append((user, [tier.get("think_s", 0)] * tier["requests"], tier.get("streams", 1)))
                continue
            if tier.get("burst", False):
                times = [p["burst_at_s"]] * tier.get("burst_requests", 1)
            else:
                times = _arrivals(rng, tier["rate"], p["duration_s"], arrival)
            senders.append((user, times, None))
    senders.append((None, _arrivals(rng, p["anonymous_rate"], p["duration_s"], p["arrivals"]), None))
    out = []
    for user, times, loop_streams in senders:
        for at in times:
            max_tokens = _length(rng, p["output_tokens"])
            prompt = _length(rng, p["prompt_tokens"])
            eos = rng.random() < p["eos_fraction"]
            cancel = max(1, round(max_tokens * rng.uniform(0.2, 0.8))) if rng.random() < p["cancel_fraction"] \
                else None
            group = f"g{rng.randrange(p['prefix_groups'])}" if rng.random() < p["prefix_fraction"] else None
            api = "chat" if rng.random() < p["chat_fraction"] else "completions"
            out.append(TraceRequest(at_s=round(at, 4), user=user, prompt=prompt, max_tokens=max_tokens,
                                    cancel_after_tokens=cancel, eos=eos, prefix_group=group,
                                    prefix_tokens=p["prefix_tokens"] if group else None, api=api,
                                    loop_streams=loop_streams))
    out.sort(key=lambda r: r.at_s)  # stable: ties keep the tiers' order, and each closed loop its own
    return out
