"""Two witnesses: the client's timestamps held against the engine's event file.

A recorder that lies about its times passes every check made on its file alone; the client, on the
same host clock, contradicts it. Each lying recorder here rewrites a correct synthetic run's event
file after the fact, so the client records (chunks 1 ms after the real emits) stay the truth.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ratebench.events import KIND_DISPATCH, KIND_EMIT, KIND_FINISH
from synth import SimRequest, standard_run
from ratebench.verify import analyse_run
from synthetic_runs import edit_client_records, one_phase_run, rewrite_events

NS = 1_000_000_000
WITNESS = {"witness-order", "witness-emits", "bound-client"}


def events_path(run_dir: Path) -> Path:
    return run_dir / "engines" / "patched-sync" / "events.rbev"


def failed(verdict) -> set[tuple[str, str | None]]:
    return {(c.name, c.user) for c in verdict.failures}


def check(verdict, name: str, user: str = "user-a", phase: str = "main"):
    (found,) = [c for c in verdict.checks if (c.name, c.phase, c.user) == (name, phase, user)]
    return found


# ---- lying recorders ------------------------------------------------------------------------------


def smoothing_recorder(limit_tps: int):
    """Re-times each user's tokens onto an even 1/N schedule from its first emit: the m-th token's emit at
    first + m / N, its dispatch the same step length before it, each request's finish at its last emit.
    A one-second burst the client received becomes, in the file, a user served at exactly N tok/s."""
    def edit(recs: np.ndarray, strings) -> np.ndarray:
        recs = recs[np.argsort(recs["t_ns"], kind="stable")]
        kind, req = recs["kind"], recs["req"]
        for u in np.unique(recs["user"]):
            mine = recs["user"] == u
            emits = np.flatnonzero(mine & (kind == KIND_EMIT))
            assert (recs["count"][emits] == 1).all()
            t0 = int(recs["t_ns"][emits[0]])
            new_emit = t0 + (np.arange(len(emits), dtype=np.int64) * NS + limit_tps - 1) // limit_tps
            for r in np.unique(req[emits]):
                e = emits[req[emits] == r]
                d = np.flatnonzero(mine & (kind == KIND_DISPATCH) & (req == r))
                assert len(d) == len(e)  # one charge per token: no cancellations here
                lag = recs["t_ns"][e] - recs["t_ns"][d]
                ne = new_emit[np.searchsorted(emits, e)]
                recs["t_ns"][d] = ne - lag
                recs["t_ns"][e] = ne
                f = np.flatnonzero((kind == KIND_FINISH) & (req == r))
                recs["t_ns"][f] = np.maximum(recs["t_ns"][f], ne.max())
        return recs
    return edit


def flush_time_recorder(flush_ns: int = 100_000_000):
    """Stamps emits (and finishes) when its buffer is flushed, every 100 ms: up to 100 ms late, after the
    client already had the tokens."""
    def edit(recs: np.ndarray, strings) -> np.ndarray:
        late = np.isin(recs["kind"], (KIND_EMIT, KIND_FINISH))
        t = recs["t_ns"][late]
        recs["t_ns"][late] = (t // flush_ns + 1) * flush_ns
        return recs
    return edit


def dropping_recorder(every: int = 7):
    """Loses every ``every``-th emit event of the file (a buffer overwritten, a block never written)."""
    def edit(recs: np.ndarray, strings) -> np.ndarray:
        emits = np.flatnonzero(recs["kind"] == KIND_EMIT)
        return np.delete(recs, emits[every - 1::every])
    return edit


def backdating_recorder(shift_ns: int = NS):
    """Stamps every event of the file a second early, as if the tokens had been spread over the second
    before they came: causally possible for the chunks (they still come after), but the engine then
    handles requests before they were sent."""
    def edit(recs: np.ndarray, strings) -> np.ndarray:
        recs["t_ns"] -= shift_ns
        return recs
    return edit


def lying_run(tmp_path: Path, edit, *, limiter: str = "gcra", limit_tps: int = 20, streams: int = 2,
              max_tokens: int = 60):
    run = one_phase_run(tmp_path / "run", limiter=limiter, limit_tps=limit_tps, streams=streams,
                        max_tokens=max_tokens)
    if edit is not None:
        rewrite_events(events_path(run), edit)
    return analyse_run(run).verdict


# ---- a truthful file -------------------------------------------------------------------------------


@pytest.mark.parametrize("limiter", ["gcra", "burst-1s", "half-rate", "never"])
def test_a_truthful_event_file_passes_the_witness_checks(tmp_path, limiter):
    """Whatever the limiter does, a recorder that tells the truth agrees with the client."""
    verdict = lying_run(tmp_path, None, limiter=limiter)
    order = check(verdict, "witness-order")
    assert order.passed is True and order.figure < 0, order.explanation
    assert check(verdict, "witness-emits").passed is True
    assert check(verdict, "witness-emits").figure == 0
    # the synthetic client reads each chunk 1 ms after its emit: no spread, only the step widens its windows
    assert "delivery latency (client arrival - engine emit) 1.00..1.00 ms" in check(verdict, "bound-client").explanation


def test_the_correct_standard_run_passes_with_bound_client_judged(tmp_path):
    verdict = analyse_run(standard_run(tmp_path / "run")).verdict
    assert verdict.passed, verdict.summary()
    judged = [c for c in verdict.checks if c.name == "bound-client"]
    # judged wherever the engine recorded emits; the engine without an event file: information, and it says why
    assert any(c.passed is True for c in judged)
    no_events = [c for c in judged if c.engine == "patched-noevents-sync"]
    assert no_events and all(c.passed is None and "no engine emit events" in c.explanation for c in no_events)
    names = {c.name for c in verdict.checks}
    assert {"witness-order", "witness-emits"} <= names
    # every phase on an engine with events is witnessed, cancellations (their end is not compared) included
    cancel = [c for c in verdict.checks if c.name == "witness-order" and c.phase == "cancel"]
    assert cancel and cancel[0].passed


def test_a_one_second_burst_fails_the_client_bound_on_a_truthful_file(tmp_path):
    """The client's side now judges: the burst the engine really sent is the burst the client received."""
    verdict = lying_run(tmp_path, None, limiter="burst-1s")
    assert ("bound-client", "user-a") in failed(verdict)
    assert check(verdict, "bound-client").figure < -10
    assert check(verdict, "witness-order").passed


# ---- lying recorders fail ------------------------------------------------------------------------------


def test_a_recorder_that_smooths_a_burst_fails_both_witness_checks(tmp_path):
    """(a) A one-second burst, recorded as even 1/N spacing: the file alone passes the bound on dispatch and
    emit events, the client received the burst before the file says it was made."""
    verdict = lying_run(tmp_path, smoothing_recorder(20), limiter="burst-1s")
    names = {name for name, _ in failed(verdict)}
    assert {"witness-order", "bound-client"} <= names, verdict.summary()
    # the lie works on every check made on the file alone
    for name in ("bound-dispatch", "bound-emit", "bound-dispatch-run", "bound-emit-run"):
        assert check(verdict, name, phase="main" if not name.endswith("-run") else "*").passed, name
    assert names <= WITNESS | {"even-spacing-dispatch", "even-spacing-emit", "delivery"}, verdict.summary()
    order = check(verdict, "witness-order")
    # the burst: about a second of tokens (20) at once, the last of them a second before the file's stamp
    assert order.figure > 500, order.explanation
    client = check(verdict, "bound-client")
    assert client.figure < -10, client.explanation
    # a negative latency earns no allowance: the windows widen by the step and the positive latency only
    assert "delivery spread 1.0 ms" in client.explanation, client.explanation


def test_a_recorder_that_stamps_at_flush_time_fails_witness_order(tmp_path):
    """(b) Emits stamped when the buffer is flushed, up to 100 ms after the client had the tokens."""
    verdict = lying_run(tmp_path, flush_time_recorder(), limit_tps=50)
    assert ("witness-order", "user-a") in failed(verdict), verdict.summary()
    order = check(verdict, "witness-order")
    assert 50 < order.figure < 100, order.explanation
    assert "before its emit event" in order.explanation
    assert check(verdict, "witness-emits").passed


def test_a_recorder_that_drops_emits_fails_witness_emits(tmp_path):
    """(c) Emit events missing from the file: the client holds tokens the engine never recorded. A failure
    of its own, whose message names the tokens, beside reconciliation's (the totals differ)."""
    verdict = lying_run(tmp_path, dropping_recorder(7))
    names = {name for name, _ in failed(verdict)}
    assert {"witness-emits", "reconciliation"} <= names, verdict.summary()
    emits = check(verdict, "witness-emits")
    assert emits.figure == 120 // 7  # 2 streams x 60 tokens, every 7th emit lost
    assert "have no emit event" in emits.explanation and "reached the client with no emit event" in emits.explanation
    assert emits.explanation != check(verdict, "reconciliation").explanation


def test_a_recorder_that_backdates_fails_witness_order_on_the_send(tmp_path):
    """Backdated stamps keep every token after its emit, but put the engine at work before the request was sent."""
    verdict = lying_run(tmp_path, backdating_recorder())
    assert ("witness-order", "user-a") in failed(verdict), verdict.summary()
    order = check(verdict, "witness-order")
    assert order.figure > 900 and "before the client sent it" in order.explanation, order.explanation


def test_a_stream_that_ends_before_the_engine_finished_fails_witness_order(tmp_path):
    run = one_phase_run(tmp_path / "run", limit_tps=50, streams=1, max_tokens=30)

    def early_done(records):
        records[0].done_ns -= 10_000_000  # [DONE] 9 ms before the engine's finish

    edit_client_records(run, early_done)
    verdict = analyse_run(run).verdict
    order = check(verdict, "witness-order")
    assert order.passed is False and 8.9 < order.figure < 9.1, order.explanation
    assert "stream ends (1)" in order.explanation


def test_the_clock_slack_is_a_threshold(tmp_path):
    """A token 3 us ahead of its emit passes at the default 5 us, fails at 1 us."""
    from ratebench.analysis.thresholds import from_options

    run = one_phase_run(tmp_path / "run", limit_tps=50, streams=1, max_tokens=30)

    def ahead(records):
        r = records[0]
        r.chunk_ns = [t - 1_003_000 for t in r.chunk_ns]  # 3 us before the emits (the client reads 1 ms after)
        r.done_ns = r.chunk_ns[-1]
        r.first_token_ns = r.chunk_ns[0]

    edit_client_records(run, ahead)
    base = dict(delivery_min=0.97, isolation_min=0.9, isolation_ttft_factor=1.5, isolation_ttft_slack_ms=20,
                max_overhead=None, max_event_overhead=None, cancel_max_steps=1, stream_spread_max=2, jain_min=0.95,
                emit_tolerance_ms=None, spacing_slack_ms=5, wait_cpu_max=0.2, wake_max_ms=10)
    loose = analyse_run(run, from_options(base)).verdict
    assert check(loose, "witness-order").passed, check(loose, "witness-order").explanation
    assert check(loose, "witness-order").figure == pytest.approx(0.003)
    strict = analyse_run(run, from_options({**base, "witness_clock_us": 1})).verdict
    assert not check(strict, "witness-order").passed


def test_coalesced_chunks_are_held_against_the_emit_of_their_last_token(tmp_path):
    """A chunk carrying tokens a..b (HTTP coalesced them) is bound by the emit of b; its latency spread
    runs from the emit of a."""
    run = one_phase_run(tmp_path / "run", limit_tps=50, streams=1, max_tokens=30)

    def coalesce(records):
        r = records[0]
        # tokens 1..10 arrive together with the 10th; the rest as they came
        r.chunk_ns = [r.chunk_ns[9]] + r.chunk_ns[10:]
        r.chunk_tokens = [10] + r.chunk_tokens[10:]
        r.first_token_ns = r.chunk_ns[0]

    edit_client_records(run, coalesce)
    verdict = analyse_run(run).verdict
    assert check(verdict, "witness-order").passed, check(verdict, "witness-order").explanation
    client = check(verdict, "bound-client")
    # token 1 waited for token 10 (the burst's 6 tokens at once, then 4 at 50 tok/s: about 80 ms), and
    # that widens the client's windows
    from ratebench.analysis import load_run

    recs = load_run(run).traces["patched-sync"].records
    emits = recs["t_ns"][recs["kind"] == KIND_EMIT]
    expected_ms = (emits[9] - emits[0]) / 1e6 + 1.0
    lat = client.explanation.split("delivery latency (client arrival - engine emit) ")[1]
    lo, hi = (float(x) for x in lat.split(" ms")[0].split(".."))
    assert lo == pytest.approx(1.0) and hi == pytest.approx(expected_ms, abs=0.01) and hi > 50, client.explanation
    assert f"delivery spread {hi - lo:.1f} ms" in client.explanation
    assert client.passed, client.explanation


def test_tokens_of_a_request_the_engine_never_named_fail_witness_emits(tmp_path):
    run = one_phase_run(tmp_path / "run", limit_tps=50, streams=2, max_tokens=20,
                        requests=[SimRequest(f"rb-5e1f0001-{i}", "user-a", i, 20) for i in range(2)])
    rid = [None]

    def forget(recs, strings):
        code = next(i for i, s in enumerate(strings) if "rb-5e1f0001-1-" in s)
        rid[0] = strings[code]
        return recs[recs["req"] != code]

    rewrite_events(events_path(run), forget)
    verdict = analyse_run(run).verdict
    emits = check(verdict, "witness-emits")
    assert emits.figure == 20 and "no event of the engine's file names the request" in emits.explanation


def test_verify_bound_takes_the_clock_slack_in_microseconds(tmp_path):
    from typer.testing import CliRunner

    from ratebench.cli import app

    run = one_phase_run(tmp_path / "run", limit_tps=50, streams=1, max_tokens=30)

    def ahead(records):
        r = records[0]
        r.chunk_ns = [t - 1_003_000 for t in r.chunk_ns]  # 3 us before the emits
        r.done_ns = r.chunk_ns[-1]

    edit_client_records(run, ahead)
    assert CliRunner().invoke(app, ["verify-bound", str(run), "--no-plots"]).exit_code == 0
    strict = CliRunner().invoke(app, ["verify-bound", str(run), "--no-plots", "--witness-clock-us", "1"])
    assert strict.exit_code == 1, strict.output


# ---- an output path that holds tokens back ------------------------------------------------------------


def test_tokens_held_back_and_delivered_in_clumps_fail_witness_delivery(tmp_path):
    """The engine's emits are even and true, but what reaches the client comes in clumps every half second
    (an output path that holds tokens back): the client gets ten tokens at once where the limit allows a
    burst of three. bound-client alone cannot see it (its windows widen by the delivery spread it
    measures); the spread itself is judged."""
    run = one_phase_run(tmp_path / "run", limit_tps=20, streams=2, max_tokens=60)
    step = 500_000_000

    def clump(records):
        for r in records:
            r.chunk_ns = [-(-t // step) * step for t in r.chunk_ns]  # held until the next half second
            if r.chunk_ns:
                r.first_token_ns = r.chunk_ns[0]
                r.done_ns = max(r.done_ns or 0, r.chunk_ns[-1])

    edit_client_records(run, clump)
    verdict = analyse_run(run).verdict
    assert {name for name, _ in failed(verdict)} == {"witness-delivery"}, verdict.summary()
    delivery = check(verdict, "witness-delivery")
    assert 400 < delivery.figure <= 500, delivery.explanation
    assert check(verdict, "bound-client").passed  # the spread it widens by hides the clumps
    assert check(verdict, "witness-order").passed


def test_a_truthful_run_delivers_within_the_spread(tmp_path):
    verdict = lying_run(tmp_path, None)
    delivery = check(verdict, "witness-delivery")
    assert delivery.passed and delivery.figure == 0, delivery.explanation  # 1 ms after every emit


# ---- the step tolerance the file sets itself (witness-steps) ------------------------------------------


def stretching_recorder(shift_ns: int = NS // 2):
    """Stamps the charges of user-a's first request from its 30th on ``shift_ns`` early (each still after
    the request's first event). The verifier pairs a request's k-th emit with its k-th charge in time, so
    its steps read half a second long: every window of bound-emit and bound-client widens by that, while
    the client kept receiving the user's tokens all along."""
    def edit(recs: np.ndarray, strings) -> np.ndarray:
        recs = recs[np.argsort(recs["t_ns"], kind="stable")]
        first_req = recs["req"][np.flatnonzero(recs["kind"] == KIND_DISPATCH)[0]]
        d = np.flatnonzero((recs["kind"] == KIND_DISPATCH) & (recs["req"] == first_req))
        first_event = int(recs["t_ns"][recs["req"] == first_req].min())
        assert int(recs["t_ns"][d[30]]) - shift_ns > first_event
        recs["t_ns"][d[30:]] -= shift_ns
        return recs[np.argsort(recs["t_ns"], kind="stable")]
    return edit


def test_a_step_the_client_could_not_have_seen_fails_witness_steps(tmp_path):
    # truthful: every step far shorter than twice what the client heard nothing for (a chunk every 50 ms)
    verdict = lying_run(tmp_path / "true", None, limit_tps=20, streams=2, max_tokens=60)
    steps = check(verdict, "witness-steps")
    assert steps.passed is True and steps.figure < steps.threshold, steps.explanation
    # charges stamped half a second early: the phase's longest step reads half a second, the bound's
    # tolerance on emits and client chunks with it; the client heard the engine every 50 ms across it
    verdict = lying_run(tmp_path / "stretched", stretching_recorder(), limit_tps=20, streams=2, max_tokens=60)
    steps = check(verdict, "witness-steps")
    assert steps.passed is False and steps.figure > 400 and steps.threshold < 130, steps.explanation
    assert "the engine's file records a step of" in steps.explanation
    assert "longest silence from the engine across it (no chunk of any of the phase's requests) was 52.2 ms" \
        in steps.explanation, steps.explanation
    assert ("witness-steps", "user-a") in failed(verdict)


def test_witness_steps_is_not_made_when_the_step_tolerance_is_given(tmp_path):
    from ratebench.analysis.verdict import Thresholds

    run = one_phase_run(tmp_path / "run", limit_tps=20, streams=2, max_tokens=60)
    rewrite_events(events_path(run), stretching_recorder())
    verdict = analyse_run(run, Thresholds(emit_tolerance_ns=5_000_000)).verdict
    assert not [c for c in verdict.checks if c.name == "witness-steps"]
