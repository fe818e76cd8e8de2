"""completion_tokens reconciliation: exact, request by request; cancelled streams stop."""

from __future__ import annotations

from ratebench.analysis import EngineRequestView, reconcile_request
from ratebench.analysis.reconcile import AnswerEnds, cancel_problem
from ratebench.runrecords import ClientRecord


def record(**kw) -> ClientRecord:
    base = dict(client_id="rb-1-1", scenario="s", phase="p", engine="e", user="u", api="completions",
                stream_index=0, max_tokens=3, ignore_eos=True, chunk_ns=[1, 2, 3], chunk_tokens=[1, 1, 1],
                completion_tokens=3, finish_reason="length", http_status=200)
    base.update(kw)
    return ClientRecord(**base)


def engine(**kw) -> EngineRequestView:
    base = dict(emitted=3, dispatched=3, finish_count=3, finish_reason="length", finish_ns=3)
    base.update(kw)
    return EngineRequestView(**base)


def check(rec, eng, max_steps: int = 1, ends: AnswerEnds = AnswerEnds()):
    """The request's figures, and for a cancelled one the judgement analysis/checks/resume.py makes of them."""
    c = reconcile_request(rec, eng, engine_has_events=eng is not None, ends=ends)
    if c is not None and rec.cancelled:
        c.problem = cancel_problem(c, max_steps)
        c.ok = c.problem is None
    return c


def test_usage_streamed_and_emitted_agree():
    assert check(record(), engine()).ok


def test_wrong_completion_tokens_is_caught():
    c = check(record(completion_tokens=4), engine())
    assert not c.ok and "usage.completion_tokens 4 != 3 tokens streamed" in c.problem


def test_engine_emitting_more_than_the_client_saw_is_caught():
    c = check(record(), engine(emitted=4, finish_count=4))
    assert not c.ok and "engine emitted 4" in c.problem


def test_finish_count_must_equal_emitted():
    assert not check(record(), engine(finish_count=2)).ok


def test_ignore_eos_answer_must_be_complete():
    c = check(record(max_tokens=5), engine())
    assert not c.ok and "max_tokens 5" in c.problem
    assert not check(record(finish_reason="stop"), engine()).ok


def test_real_eos_may_stop_early():
    assert check(record(ignore_eos=False, max_tokens=10, finish_reason="stop"), engine(finish_reason="stop")).ok


def test_missing_final_usage_is_caught():
    assert not check(record(completion_tokens=None), engine()).ok


def test_a_request_answered_with_an_error_fails_reconciliation():
    """Promise 3: a request out of budget pauses and resumes, never an error, whether refused at once
    or ended by an error chunk mid-stream (or stalled until the driver's read timeout)."""
    refused = check(record(error="HTTP 429: Too Many Requests", http_status=429, chunk_ns=[], chunk_tokens=[]), None)
    assert not refused.ok and "answered with an error (HTTP 429" in refused.problem
    mid_stream = check(record(error="output rate limit", http_status=200, completion_tokens=None,
                              finish_reason=None), engine(finish_reason="error"))
    assert not mid_stream.ok and "output rate limit" in mid_stream.problem


def test_streams_cut_by_the_run_or_closed_by_the_driver_are_not_reconciled_as_errors():
    from ratebench.runrecords import ERROR_INTERRUPTED

    assert check(record(error=ERROR_INTERRUPTED, completion_tokens=None, finish_reason=None), None) is None
    assert check(record(error="ReadError: closed", cancelled=True, cancel_ns=2, completion_tokens=None,
                        finish_reason=None), None) is None


def test_an_answer_the_client_did_not_close_ends_with_stop_or_length_on_both_sides():
    """A throttled request cut short shows as finish_reason "abort" (or anything but "stop" and
    "length") with usage and tokens that agree; and the engine's finish event must say the same."""
    aborted = check(record(ignore_eos=False, finish_reason="abort"), engine(finish_reason="abort"))
    assert not aborted.ok and "finish_reason 'abort'" in aborted.problem
    disagree = check(record(ignore_eos=False, finish_reason="stop"), engine(finish_reason="length"))
    assert not disagree.ok and "the engine's finish event 'length'" in disagree.problem
    assert check(record(ignore_eos=False, finish_reason="stop"), engine(finish_reason="stop")).ok


def test_cancelled_stream_that_engine_aborted_within_one_step_passes():
    rec = record(cancelled=True, cancel_ns=2, completion_tokens=None, finish_reason=None)
    c = check(rec, engine(emitted=3, dispatched=4, finish_count=3, finish_reason="abort", finish_ns=5,
                          emit_events_after_cancel=1, tokens_after_cancel=1))
    assert c.ok and c.charged_tokens == 4 and c.abort_latency_ns == 3


ENDS = AnswerEnds(frozenset({2, 7}), max_model_len=100)


def test_an_answer_ended_by_the_model_passes():
    rec = record(ignore_eos=False, max_tokens=10, finish_reason="stop", token_ids=[5, 9, 2], prompt_tokens=8)
    assert check(rec, engine(finish_reason="stop"), ends=ENDS).ok
    assert check(record(prompt_tokens=8, token_ids=[5, 9, 4]), engine(), ends=ENDS).ok  # max_tokens


def test_a_stop_not_at_a_stop_token_is_an_answer_cut_short():
    rec = record(ignore_eos=False, max_tokens=10, finish_reason="stop", token_ids=[5, 9, 4], prompt_tokens=8)
    c = check(rec, engine(finish_reason="stop"), ends=ENDS)
    assert not c.ok and "last token (id 4) is not one of the model's stop tokens (ids 2, 7)" in c.problem
    # the run did not know the model's stop tokens, or the server sent no token ids: not judged
    assert check(rec, engine(finish_reason="stop"), ends=AnswerEnds(None, 100)).ok
    assert check(record(ignore_eos=False, max_tokens=10, finish_reason="stop", prompt_tokens=8),
                 engine(finish_reason="stop"), ends=ENDS).ok


def test_a_length_short_of_max_tokens_is_an_answer_cut_short_unless_it_reached_max_model_len():
    rec = record(ignore_eos=False, max_tokens=10, finish_reason="length", token_ids=[5, 9, 4], prompt_tokens=8)
    c = check(rec, engine(), ends=ENDS)
    assert not c.ok and "finish_reason 'length' after 3 of max_tokens 10 tokens (prompt 8, max_model_len 100)" \
        in c.problem
    assert check(record(ignore_eos=False, max_tokens=10, finish_reason="length", token_ids=[5, 9, 4],
                        prompt_tokens=97), engine(), ends=ENDS).ok  # 97 + 3 = max_model_len


def test_cancelled_stream_that_kept_generating_fails():
    rec = record(cancelled=True, cancel_ns=2, completion_tokens=None, finish_reason=None)
    c = check(rec, engine(emitted=9, finish_count=9, finish_reason="abort", finish_ns=50,
                          emit_events_after_cancel=6, tokens_after_cancel=6))
    assert not c.ok and "after the cancel" in c.problem


def test_cancelled_stream_must_be_aborted_not_finished_normally_afterwards():
    rec = record(cancelled=True, cancel_ns=2, completion_tokens=None, finish_reason=None)
    assert not check(rec, engine(finish_ns=10**9)).ok  # finished a second after the cancel
    assert not check(rec, engine(emitted=2, finish_count=2, finish_ns=10)).ok  # 'length' short of max_tokens
    assert not check(rec, engine(finish_reason="stop", finish_ns=10)).ok
    assert check(rec, engine(finish_ns=1)).ok  # it had finished before the cancel


def test_a_cancel_that_raced_the_last_chunk_of_a_complete_answer_passes():
    """Seen on the limiter-off engine of a fresh-clone main job: a 3-token answer, its third token
    emitted 0.83 ms before the client's cancel (after its second chunk), the engine's 'length' finish
    stamped 0.41 ms after it (later in the same step)."""
    rec = record(cancelled=True, cancel_ns=72465087695165, completion_tokens=None, finish_reason=None,
                 chunk_ns=[72465079539209, 72465087687304], chunk_tokens=[1, 1])
    assert check(rec, engine(finish_ns=72465087695165 + 405978)).ok


def test_a_cancel_that_raced_the_eos_of_an_answer_passes():
    """A mix answer that may end at its EOS, closed by the client after its 2nd token: the step under
    way sampled the EOS (emitted before the cancel, never streamed), its 'stop' finish stamped later
    in the same step, after the cancel."""
    rec = record(cancelled=True, cancel_ns=100, completion_tokens=None, finish_reason=None, ignore_eos=False,
                 max_tokens=10, chunk_ns=[1, 2], chunk_tokens=[1, 1])
    assert check(rec, engine(finish_reason="stop", finish_ns=100 + 400_000)).ok
    # an answer under ignore_eos cannot end at an EOS: a 'stop' after the cancel is not the abort
    assert not check(record(cancelled=True, cancel_ns=100, completion_tokens=None, finish_reason=None, max_tokens=10,
                            chunk_ns=[1, 2], chunk_tokens=[1, 1]), engine(finish_reason="stop", finish_ns=100 + 400_000)).ok
    # every token the engine emitted was streamed: the cancel ended it, so it must be the abort
    c = check(rec, engine(emitted=2, dispatched=2, finish_count=2, finish_reason="stop", finish_ns=100 + 400_000))
    assert not c.ok and "not 'abort'" in c.problem
    # long after the cancel: not a race
    assert not check(rec, engine(finish_reason="stop", finish_ns=100 + 10**9)).ok


def test_events_after_the_finish_event_fail():
    assert not check(record(), engine(events_after_finish=1)).ok


def test_a_short_answer_that_ended_in_the_step_under_way_at_the_cancel_passes():
    # the client closed after 2 of 3 tokens; the step already under way sampled the third and the
    # answer ended at max_tokens before the abort reached the engine
    rec = record(cancelled=True, cancel_ns=2, completion_tokens=None, finish_reason=None, chunk_ns=[1, 2],
                 chunk_tokens=[1, 1])
    assert check(rec, engine(finish_ns=4, emit_events_after_cancel=1, tokens_after_cancel=1)).ok
    # more steps than the one under way: the abort was not heeded
    c = check(rec, engine(finish_ns=9, emit_events_after_cancel=2, tokens_after_cancel=2))
    assert not c.ok and "2 steps (2 tokens) after the cancel" in c.problem
    # the step threshold is the check's: two steps in flight allowed (--cancel-max-steps 2)
    assert check(rec, engine(finish_ns=9, emit_events_after_cancel=2, tokens_after_cancel=2), max_steps=2).ok
