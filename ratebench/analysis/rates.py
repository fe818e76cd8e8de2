"""Rates: the seed's method and a steady-state rate that leaves out the first burst.

Definitions (stated in every report):

* seed rate: tokens / (time of the last token - time of the first token), the
  seed article's method.
* steady rate: from the moment the user's budget was first spent, the tokens
  after it over the time to the last. The events themselves say when: the first
  event ``j`` at which some window ``[t_i, t_j]`` holds ``N x burst_s`` tokens or
  more above ``N x (t_j - t_i)`` (the bound allows ``N x burst_s + 1``: at most
  one token of the burst is left there, and what is left, ``N x burst_s + 1 -
  head``, is taken out of the count). An ideal limiter serving a
  backlogged user sends the burst at the first instant and then one token every
  1/N s, which gives exactly N; the bound says it is never above N. When the
  user's budget was never spent that way: ``(tokens - b) / (last - first)``
  with ``b = floor(burst_s * N) + 1``, what GCRA lets through at once,
  the burst taken out of the whole span (the same N for the ideal limiter).
  Counting from where the budget was spent, rather than from the first token,
  leaves out a start where the engine, not the budget, held the user back: a
  long prompt's prefill chunks in the same steps, so that the user's one
  decoding stream got one token every 60 ms while its budget filled (a slow
  machine; the bound's own windows say when it stopped filling). Only such a
  start: the user's events before that point must be no further apart than
  the engine's longest step there (plus 2 ms for where in a step an event is
  stamped), i.e. the user got a token at every step; a pause of the user's own (a limiter
  that holds it back before its budget binds) keeps the whole span judged,
  as does a rate without the engine's steps (the client's). (Counting
  from the b-th token instead overstates the rate when the engine spends the
  burst over several steps: the budget refills meanwhile.) The driver starts a
  user's phase only once its burst is full again after its last phase on that
  engine (``ScenarioContext._until_bursts_are_full``). For a user without a
  limit: tokens after the first 0.5 s / time from there to the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.analysis.bound import BURST_NS, NS_PER_S

UNLIMITED_WARMUP_NS = 500_000_000
# how much further apart than the engine's longest step two of a user's events may be and still have come
# at consecutive steps (where in a step an event is stamped)
STEP_STAMP_NS = 2_000_000


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


def window_heads(t: np.ndarray, cum: np.ndarray | None, limit_tps: int) -> np.ndarray:
    """For each of a user's time-sorted events j, the most a window ending there holds above N x its
    length: ``head_j = C_j - N t_j + max over i <= j of (N t_i - C_{i-1})`` (``cum``: cumulative tokens,
    None: one per event), times relative to the first event to keep the floats small. O(n)."""
    c = np.arange(1, len(t) + 1) if cum is None else cum
    before = np.concatenate(([0], c[:-1]))
    nt = limit_tps * (t - t[0]) / NS_PER_S
    return c - nt + np.maximum.accumulate(nt - before)


def budget_spent_index(t: np.ndarray, cum: np.ndarray | None, limit_tps: int, burst_ns: int
                       ) -> tuple[int, float] | None:
    """The first event at which a window ending there holds N x burst tokens or more above N x its length
    (the user's budget spent but for at most one token of the bound's N x burst + 1), and what was left
    of it there (N x burst + 1 - head, 0 to 1 token); None if never (``window_heads``)."""
    if not len(t):
        return None
    heads = window_heads(t, cum, limit_tps)
    allowed = limit_tps * burst_ns / NS_PER_S + 1  # the bound's tokens above N x W
    hit = np.flatnonzero(heads >= allowed - 1 - 1e-9)
    if not len(hit):
        return None
    j = int(hit[0])
    return j, float(min(1.0, max(0.0, allowed - heads[j])))


def _engine_held_back(t: np.ndarray, steps: tuple[np.ndarray, np.ndarray] | None) -> bool:
    """Whether the user's events ``t`` (before its budget was spent) came at every engine step: no two
    further apart than the longest step that started among them (plus ``STEP_STAMP_NS``)."""
    if steps is None or len(t) < 2:
        return False
    starts, periods = steps
    a, b = np.searchsorted(starts, [t[0] - STEP_STAMP_NS, t[-1]], side="left")
    if b <= a:
        return False
    return int(np.diff(t).max()) <= int(periods[a:b].max()) + STEP_STAMP_NS


def rate_figures(
    t_ns: np.ndarray,
    counts: np.ndarray | None = None,
    limit_tps: int | None = None,
    burst_ns: int = BURST_NS,
    steps: tuple[np.ndarray, np.ndarray] | None = None,
) -> RateFigures:
    """Seed and steady rates of time-sorted events (``counts`` tokens each, default 1). ``steps``: the
    engine's step starts and periods in the phase, which let a start the engine held back be left out
    (module docstring)."""
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
        spent = budget_spent_index(t, cum, limit_tps, burst_ns)
        if spent is not None and spent[0] > 0 and not _engine_held_back(t[:spent[0] + 1], steps):
            spent = None  # a start the user was held back in by more than the engine's steps: judged whole
        if spent is not None and last > int(t[spent[0]]):
            j, left = spent
            steady_start = int(t[j])
            steady_tokens = tokens - (j + 1 if cum is None else int(cum[j]))
            if steady_tokens > left:  # what was left of the burst at j is not the steady rate's
                steady = (steady_tokens - left) * NS_PER_S / (last - steady_start)
            else:
                steady_start, steady_tokens = None, 0
        elif tokens > b and last > first:
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
