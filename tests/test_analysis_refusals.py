"""A refusal must be earned: refuse events against the engine's own dispatch events
(ratebench/analysis/refusals.py). An engine that wrote refuse events for users far from their
limits would take them out of the isolation checks."""

from __future__ import annotations

import numpy as np
import pytest

from ratebench.analysis.refusals import refusal_heads
from ratebench.events import KIND_REFUSE
from ratebench.verify import verify_run
from synthetic_runs import one_phase_run, rewrite_events

NS = 1_000_000_000
MS = 1_000_000


def test_a_refusal_right_after_the_burst_is_spent_is_earned_exactly():
    """N = 10 tok/s, burst 100 ms: from idle, two charges at t = 0 put the TAT 200 ms ahead, 100 ms past
    the burst, so a take at t = 0 is refused; head = 2 = N x burst + 1."""
    heads = refusal_heads(np.array([0, 0]), np.array([0]), 10)
    assert heads.tolist() == [2.0]
    # evenly at the rate, the next take comes due at the next 1/N: a refusal halfway has head 1.5
    d = np.arange(20) * 100 * MS
    assert refusal_heads(d, np.array([19 * 100 * MS + 50 * MS]), 10)[0] == pytest.approx(0.5)
    # a refusal with no charge before it explains nothing
    assert refusal_heads(np.array([5 * NS]), np.array([NS]), 10)[0] == -np.inf


def test_a_refusal_the_users_charges_do_not_explain_fails(tmp_path):
    """user-a at 1,000 tok/s, one stream: the simulated engine gives it a token a step, far below its
    limit, so the limiter never refuses it. A refuse event in the middle of its answer says the limit
    bound where it could not have; refusal-witness fails it (it would have taken the user out of the
    isolation checks)."""
    run_dir = one_phase_run(tmp_path / "run", limit_tps=1000, streams=1, max_tokens=60, backlogged=False)
    path = run_dir / "engines" / "patched-sync" / "events.rbev"
    assert not [c for c in verify_run(run_dir, plots=False).checks if c.name == "refusal-witness"]

    def invent_a_refusal(recs, strings):
        d = recs[recs["kind"] == 1]
        fake = d[30:31].copy()
        fake["kind"], fake["count"] = KIND_REFUSE, 1
        return np.concatenate([recs, fake])

    rewrite_events(path, invent_a_refusal)
    verdict = verify_run(run_dir, plots=False)
    [c] = [c for c in verdict.checks if c.name == "refusal-witness"]
    assert c.passed is False and c.figure > 50, c.explanation  # the burst alone is 100 tokens
    assert "1 refuse event(s)" in c.explanation
