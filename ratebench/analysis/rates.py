"""Rates: the seed's method and a steady-state rate that leaves out the first burst.

Definitions (stated in every report):

* seed rate: tokens / (time of the last token - time of the first token), the
  seed article's method.
* steady rate: the tokens beyond the initial burst, over the whole span:
  ``(tokens - b) / (last - first)`` with ``b = floor(burst_s * N) + 1``, what
  GCRA lets through at once. An ideal limiter serving a backlogged user sends
  the burst at the first instant and then one token every 1/N s, which gives
  exactly N; the bound on the window [first, last] says it is never above N.
  (Counting from the b-th token instead overstates the rate when the engine
  cannot take the burst in one step and spends it over several.) The driver
  starts a user's phase only once its burst is full again after its last
  phase on that engine (``ScenarioContext._until_bursts_are_full``). For a user
  without a limit: tokens after the first 0.5 s / time from there to the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.analysis.bound import BURST_NS, NS_PER_S

UNLIMITED_WARMUP_NS = 500_000_000


@dataclass
class RateFigures:
    tokens: int
    first_ns: int | None
    last_ns: int | None
    seed_rate_tps: float | None  # tokens / (last - first)
    steady_rate_tps: float | None  # None: too few tokens past the burst
    steady_start_ns: int | None
    steady_tokens: int  # tokens counted by the steady rate


def burst_tokens(limit_tps: int, burst_ns: int = BURST_NS) -> int:
    """Tokens GCRA lets through at once: floor(burst * N) + 1."""
    return (int(limit_tps) * burst_ns) // NS_PER_S + 1


def rate_figures(
    t_ns: np.ndarray,
    counts: np.ndarray | None = None,
    limit_tps: int | None = None,
    burst_ns: int = BURST_NS,
) -> RateFigures:
    """Seed and steady rates of time-sorted events (``counts`` tokens each, default 1)."""
    t = np.asarray(t_ns, dtype=np.int64)
    if len(t) == 0:
        return RateFigures(0, None, None, None, None, None, 0)
    cum = None if counts is None else np.cumsum(counts, dtype=np.int64)
    tokens = len(t) if cum is None else int(cum[-1])
    first, last = int(t[0]), int(t[-1])
    seed = tokens * NS_PER_S / (last - first) if last > first else None
    steady = None
    steady_start = None
    steady_tokens = 0
    if limit_tps:
        b = burst_tokens(limit_tps, burst_ns)
        if tokens > b and last > first:
            steady_start, steady_tokens = first, tokens - b
            steady = steady_tokens * NS_PER_S / (last - first)
        return RateFigures(tokens, first, last, seed, steady, steady_start, steady_tokens)
    k = int(np.searchsorted(t, first + UNLIMITED_WARMUP_NS, side="left"))
    if k < len(t) - 1:
        steady_start = int(t[k])
        steady_tokens = tokens - (k + 1 if cum is None else int(cum[k]))
        if last > steady_start:
            steady = steady_tokens * NS_PER_S / (last - steady_start)
    return RateFigures(tokens, first, last, seed, steady, steady_start, steady_tokens)
