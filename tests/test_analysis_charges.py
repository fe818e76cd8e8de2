"""Charge parity: every charge (dispatch event) samples a token; the engine step is not stretched by extra charges."""

from __future__ import annotations

import numpy as np

from ratebench.analysis import estimate_engine_step
from ratebench.verify import analyse_run
from synthetic_runs import one_phase_run


def charge_checks(run_dir):
    verdict = analyse_run(run_dir).verdict
    return verdict, {c.name: c for c in verdict.checks if c.name in ("charge-parity", "delivery")}


def test_every_charge_of_a_correct_limiter_samples_a_token(tmp_path):
    verdict, checks = charge_checks(one_phase_run(tmp_path / "run", streams=2))
    assert checks["charge-parity"].passed and checks["charge-parity"].figure == 0
    assert verdict.passed, verdict.summary()


def test_charges_that_sample_nothing_fail_charge_parity_per_user_and_phase(tmp_path):
    run = one_phase_run(tmp_path / "run", streams=2, engine_kw={"prefill_charges": 3})
    verdict, checks = charge_checks(run)
    parity = checks["charge-parity"]
    assert parity.passed is False and parity.figure == 2 * 3
    assert (parity.phase, parity.user) == ("main", "user-a")
    assert "finished by length" in parity.explanation
    row = next(r for r in verdict.rows if r.user == "user-a")
    assert row.charge_excess_tokens == 6 and row.charge_requests == 2
    # the extra charges come before the first token: the step estimate still sees one engine step
    assert verdict.engine_steps["patched-sync"].longest_ns <= 6_000_000


def test_delivery_is_measured_on_emitted_tokens_as_well_as_on_charges(tmp_path):
    # half the charges sample nothing: dispatch events come at the full rate, tokens at half of it
    run = one_phase_run(tmp_path / "run", streams=1, max_tokens=40, limit_tps=50,
                        engine_kw={"prefill_charges": 40})
    verdict, checks = charge_checks(run)
    assert checks["delivery"].passed is False
    assert "steady dispatch rate" in checks["delivery"].explanation
    assert "steady emit rate" in checks["delivery"].explanation


def test_step_estimate_pairs_each_emit_with_the_latest_dispatch_at_or_before_it():
    # request 0: three charges that sample nothing, then tokens dispatched at 10, 20 and emitted 5 ns later
    d_t = np.array([0, 1, 2, 10, 20], dtype=np.int64)
    e_t = np.array([15, 25], dtype=np.int64)
    step = estimate_engine_step(d_t, np.zeros(5, dtype=np.int64), e_t, np.zeros(2, dtype=np.int64),
                                np.ones(2, dtype=np.int64))
    assert step.longest_ns == 5 and step.samples == 2


def test_step_estimate_does_not_pair_an_async_look_ahead_dispatch():
    # async: token k+1 is dispatched (t = 10k + 1) before token k is emitted (t = 10k + 9); no extra charges
    k = np.arange(5, dtype=np.int64)
    d_t, e_t = 10 * k + 1, 10 * k + 9
    # request 1 interleaved, with one extra look-ahead charge after its stop
    d_t2, e_t2 = 10 * k + 2, 10 * k[:4] + 9
    d_t_all = np.concatenate([d_t, d_t2])
    d_req = np.concatenate([np.zeros(5, np.int64), np.ones(5, np.int64)])
    e_t_all = np.concatenate([e_t, e_t2])
    e_req = np.concatenate([np.zeros(5, np.int64), np.ones(4, np.int64)])
    o, p = np.argsort(d_t_all, kind="stable"), np.argsort(e_t_all, kind="stable")
    step = estimate_engine_step(d_t_all[o], d_req[o], e_t_all[p], e_req[p], np.ones(9, dtype=np.int64))
    assert step.longest_ns == 8 and step.samples == 9
