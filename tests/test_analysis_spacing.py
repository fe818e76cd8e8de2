"""Even spacing (the lower side of the bound): exact on small cases, never failing the real GCRA
under a simulated engine at any cadence, and failing limiters that release tokens late or in clumps."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratebench.analysis.spacing import check_spacing, worst_deficit
from ratebench.analysis.steps import step_periods
from ratebench.analysis.verdict import Thresholds
from ratebench.events import KIND_DISPATCH, KIND_EMIT, KIND_FINISH
from ratebench.verify import verify_run
from synth import SimRequest
from synthetic_runs import one_phase_run, rewrite_events

NS = 1_000_000_000
MS = 1_000_000
SLACK_NS = Thresholds().spacing_slack_ns

pytestmark = pytest.mark.usefixtures("patched_vllm")


def test_evenly_spaced_tokens_fall_short_by_exactly_one_in_the_emptiest_open_window():
    t = np.arange(0, 50) * (NS // 20)  # 20 tok/s, perfectly even
    i, j, d = worst_deficit(t, np.ones(50, dtype=np.int64), 20)
    assert d == NS  # the open window between two tokens: 50 ms, 1 token due, none inside


def test_a_gap_shows_as_its_length_times_the_rate():
    t = np.r_[np.arange(0, 10) * 10 * MS, 90 * MS + 60 * MS + np.arange(0, 10) * 10 * MS]  # 60 ms hole
    i, j, d = worst_deficit(t, np.ones(len(t), dtype=np.int64), 100)
    assert t[j] == 150 * MS and d == 6 * NS  # the 60 ms hole at 100 tok/s (any window ending there)


def test_tokens_at_one_time_count_once_at_that_time():
    i, j, d = worst_deficit(np.array([0, 30 * MS]), np.array([3, 3]), 100)
    assert d == 3 * NS  # 30 ms at 100 tok/s, nothing strictly inside


def test_windows_where_the_engine_limits_the_user_are_not_judged():
    # one request at 100 tok/s and 20 ms steps: it can take 50 tok/s, the budget is not what limits it
    starts = np.arange(0, 100) * 20 * MS
    res = check_spacing(starts, np.zeros(100, dtype=np.int64), 100, starts, np.full(100, 20 * MS),
                        np.ones(100, dtype=bool))
    assert res.worst is None and res.intervals == 0


def test_a_user_with_more_streams_than_places_is_held_by_the_engine_not_its_budget():
    """6 streams at 200 tok/s on an engine of 2 places and 20 ms steps (a prefill beside them): the
    engine gives the user 2 tokens a step, 100 tok/s, whatever its budget. Counting every waiting
    stream (6 >= ceil(200 x 0.02) = 4) judged those windows and failed a correct limiter; counted up
    to the places (2 < 4) they are the engine's. With 10 ms steps (2 tokens due a step) the budget
    limits again: a limiter that then holds the user to 1 token a step fails."""
    starts = np.arange(0, 100) * 20 * MS
    t = np.repeat(starts, 2)
    req = np.tile([0, 1], 100)
    t = np.r_[t, starts[0], starts[0], starts[0], starts[0], starts[-1], starts[-1], starts[-1], starts[-1]]
    req = np.r_[req, 2, 3, 4, 5, 2, 3, 4, 5]  # four more streams waiting from the first step to the last
    order = np.argsort(t, kind="stable")
    args = (t[order], req[order], 200, starts, np.full(100, 20 * MS), np.ones(100, dtype=bool))
    uncapped = check_spacing(*args)
    assert uncapped.worst is not None and uncapped.worst.deficit_tokens > uncapped.allowance_tokens(SLACK_NS)
    capped = check_spacing(*args, places=2)
    assert capped.worst is None and capped.intervals == 0
    # 10 ms steps, 1 token a step on 2 places: the budget (2 a step), not the engine, was the bound
    starts = np.arange(0, 200) * 10 * MS
    t = np.r_[starts, starts[0], starts[-1]]
    req = np.r_[np.zeros(200, dtype=np.int64), 1, 1]
    order = np.argsort(t, kind="stable")
    held = check_spacing(t[order], req[order], 200, starts, np.full(200, 10 * MS), np.ones(200, dtype=bool),
                         places=2)
    assert held.intervals >= 1 and held.worst.deficit_tokens > held.allowance_tokens(SLACK_NS)


def test_a_long_step_outside_the_judged_runs_does_not_widen_the_allowance():
    """Tokens released in clumps of 3 every 60 ms at 50 tok/s (3 tokens short in each gap) on 5 ms
    steps, after one 80 ms step before the user's first token (a long prefill, say). The allowance is
    1 + N x P: with P taken over the whole phase (80 ms: 5.25 tokens) the clumps passed; over the
    judged steps only (5 ms) they fail."""
    starts = np.r_[0, 80 * MS + np.arange(0, 400) * 5 * MS]
    periods = np.r_[80 * MS, np.full(400, 5 * MS)]
    worked = np.ones(len(starts), dtype=bool)
    # 4 streams waiting throughout; every 60 ms, at a step start, 3 tokens at once
    clump_at = 80 * MS + np.arange(0, 30) * 60 * MS
    t = np.repeat(clump_at, 3)
    req = np.tile(np.arange(3), len(clump_at))
    # a 4th stream's first and last tokens keep it waiting over the whole span
    t = np.r_[t, clump_at[0], clump_at[-1]]
    req = np.r_[req, 3, 3]
    order = np.argsort(t, kind="stable")
    res = check_spacing(t[order], req[order], 50, starts, periods, worked)
    assert res.step_ns == 5 * MS
    allowance = res.allowance_tokens(SLACK_NS)
    assert allowance == pytest.approx(1.5)
    assert res.worst.deficit_tokens > allowance  # 3 short in each 60 ms gap
    assert res.worst.deficit_tokens < 1 + 50 * (80 * MS + SLACK_NS) / NS  # what the phase-wide P allowed


# ---- a simulated engine around the real GCRA --------------------------------------------------


def simulate(limiter_kind: str, limit_tps: int, streams: int, tokens: int, step_ms: tuple[float, float],
             long_step: tuple[float, float], wake_ns: int, neighbour_busy: bool, seed: int):
    """Steps an engine: each step dispatches at its start every token the limiter gives (one per
    waiting stream), the model runs for a drawn time, emits at the end. When nothing ran (the user out
    of budget and no neighbour), the engine blocks until the user's ready time plus a wake-up latency
    (the ``late`` limiter tells a ready time 40 ms late). With a busy neighbour every step runs a model.

    Returns (dispatch times, their stream, step starts, step ends)."""
    from vllm.v1.core.sched.output_rate import OutputRateLimiter

    rng = random.Random(seed)
    now = [10 * NS]
    limiter = OutputRateLimiter(limit_tps, clock_ns=lambda: now[0])
    left = [tokens] * streams
    held_until = 0
    d_t, d_req, s_start, s_end = [], [], [], []
    turn = 0
    while any(left):
        t = now[0]
        took = 0
        for k in range(streams):
            s = (turn + k) % streams
            if not left[s]:
                continue
            if limiter_kind == "clumped" and t < held_until:
                break
            if limiter.try_take("u", t):
                left[s] -= 1
                took += 1
                d_t.append(t)
                d_req.append(s)
            else:
                if limiter_kind == "clumped":
                    held_until = t + 60 * MS
                break
        turn += 1
        if took or neighbour_busy:
            lo, hi = step_ms
            d = rng.uniform(lo, hi) * MS
            if rng.random() < long_step[0]:
                d = long_step[1] * MS
            d = int(d)
            s_start.append(t)
            s_end.append(t + d)
            now[0] = t + d + rng.randrange(0, 500_000)  # hand-off to the next step
        else:
            ready = limiter.ready_at_ns("u")
            if limiter_kind == "late":
                ready += 40 * MS
            if limiter_kind == "clumped":
                ready = max(ready, held_until)
            now[0] = max(t + 1, ready) + rng.randrange(0, wake_ns + 1)
    return (np.array(d_t, dtype=np.int64), np.array(d_req, dtype=np.int64), np.array(s_start, dtype=np.int64),
            np.array(s_end, dtype=np.int64))


def judge(limit_tps: int, d_t, d_req, s_start, s_end) -> tuple[float, float, bool]:
    starts, periods, worked = step_periods(s_end, s_end - s_start)
    res = check_spacing(d_t, d_req, limit_tps, starts, periods, worked)
    if res.worst is None:
        return 0.0, res.allowance_tokens(SLACK_NS), False
    return res.worst.deficit_tokens, res.allowance_tokens(SLACK_NS), True


SCENARIO = dict(
    limit_tps=st.sampled_from([5, 20, 50, 100, 200, 400]),
    streams=st.integers(1, 6),
    tokens=st.integers(20, 80),
    step_ms=st.sampled_from([(1, 2), (3, 6), (4, 9), (10, 15), (20, 30)]),
    long_step=st.sampled_from([(0.0, 0), (0.02, 60), (0.05, 120)]),
    wake_ns=st.sampled_from([0, 1 * MS, SLACK_NS]),
    neighbour_busy=st.booleans(),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=80, deadline=None)
@given(**SCENARIO)
def test_the_real_gcra_is_never_failed_at_any_cadence(limit_tps, streams, tokens, step_ms, long_step, wake_ns,
                                                     neighbour_busy, seed):
    d_t, d_req, s_start, s_end = simulate("correct", limit_tps, streams, tokens, step_ms, long_step, wake_ns,
                                          neighbour_busy, seed)
    deficit, allowance, judged = judge(limit_tps, d_t, d_req, s_start, s_end)
    assert deficit <= allowance + 1e-9, (deficit, allowance)


# A late ready time delays only an engine that waits: beside a busy neighbour the engine keeps stepping.
BROKEN = [("late", False), ("clumped", False), ("clumped", True)]


@pytest.mark.parametrize("kind, neighbour_busy", BROKEN, ids=["late", "clumped-alone", "clumped-busy"])
@pytest.mark.parametrize("limit_tps, streams", [(20, 1), (20, 4), (100, 2), (100, 4)])
def test_limiters_that_release_late_or_in_clumps_fail(kind, neighbour_busy, limit_tps, streams):
    d_t, d_req, s_start, s_end = simulate(kind, limit_tps, streams, 60, (3, 6), (0.0, 0), 1 * MS,
                                          neighbour_busy, 7)
    deficit, allowance, judged = judge(limit_tps, d_t, d_req, s_start, s_end)
    assert judged and deficit > allowance, (deficit, allowance)


def _drop_the_last_emit_of_stream_0(run_dir, *, cancelled: bool) -> None:
    """Stream 0's last charge gets no emit: its client cancelled it between the two (finish reason
    abort, the design's accepted over-charge) or, without the cancel, the engine lost an emit."""
    path = run_dir / "engines" / "patched-sync" / "events.rbev"

    def edit(recs, strings):
        req0 = next(i for i, s in enumerate(strings) if "rb-5e1f0001-0" in s)
        emits = np.flatnonzero((recs["req"] == req0) & (recs["kind"] == KIND_EMIT))
        last = emits[np.argmax(recs["t_ns"][emits])]
        fin = (recs["req"] == req0) & (recs["kind"] == KIND_FINISH)
        recs["count"][fin] -= 1
        if cancelled:
            recs["reason"][fin] = 3
        return np.delete(recs, last)

    rewrite_events(path, edit)


@pytest.mark.parametrize("cancelled", [True, False], ids=["cancelled", "lost"])
def test_a_charge_the_clients_cancel_left_without_an_emit_counts_at_its_dispatch(tmp_path, cancelled):
    """even-spacing-emit: a stream closed between a charge and its emit spent the budget at the charge
    (accepted over-charge); the same missing emit without the cancel is the engine's loss and fails."""
    reqs = [SimRequest("rb-5e1f0001-0", "user-a", 0, 30), SimRequest("rb-5e1f0001-1", "user-a", 1, 90)]
    run_dir = one_phase_run(tmp_path / "run", limit_tps=50, streams=2, requests=reqs)
    _drop_the_last_emit_of_stream_0(run_dir, cancelled=cancelled)
    verdict = verify_run(run_dir, plots=False)
    emit = next(c for c in verdict.checks if c.name == "even-spacing-emit" and c.user == "user-a")
    dispatch = next(c for c in verdict.checks if c.name == "even-spacing-dispatch" and c.user == "user-a")
    assert dispatch.passed, dispatch.explanation
    assert emit.passed is cancelled, emit.explanation
