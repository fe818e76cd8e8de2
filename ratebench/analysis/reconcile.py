"""completion_tokens reconciliation and cancellations, request by request.

Finished request (not cancelled, no error): ``usage.completion_tokens`` =
tokens streamed (sum of ``chunk_tokens``) = tokens the engine emitted (sum of
its emit counts) = the count on its finish event; under ``ignore_eos`` also
finish_reason "length" and ``= max_tokens``. Exact, no tolerance. And it was
not cut short: a "stop" ends at one of the model's stop tokens, a "length" at
``max_tokens`` or ``max_model_len`` (:func:`cut_short`).

Cancelled request: the engine's finish event says abort (or the request had
already finished before the cancel, or ended by itself in the step the cancel
raced: every token it may have emitted, or its EOS emitted and never streamed;
or in the steps under way when the abort arrived), nothing happens for it after its finish
event, and at most ``cancel_max_steps`` emit events of it come after the
client's ``cancel_ns`` (each emit event is one engine step of that request).
The tokens the engine charged it are its dispatch events.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.events import FINISH_REASONS, KIND_DISPATCH, KIND_EMIT, KIND_FINISH
from ratebench.runrecords import ERROR_INTERRUPTED, ClientRecord

NO_TIME = np.iinfo(np.int64).max


@dataclass
class EngineRequestTotals:
    """Per engine request, indexed by the event file's string code of the request id."""

    emitted: np.ndarray  # tokens: sum of emit counts
    emit_events: np.ndarray
    dispatched: np.ndarray  # tokens charged: dispatch events
    finish_count: np.ndarray  # -1: no finish event
    finish_reason: np.ndarray  # FINISH_REASONS code, -1: no finish event
    finish_ns: np.ndarray  # NO_TIME: no finish event


def engine_request_totals(records: np.ndarray, n_codes: int, *, columns=None) -> EngineRequestTotals:
    """Vectorized per-request totals of one engine event file (RECORD_DTYPE).

    ``columns``: (dispatch request codes, emit request codes, emit counts or None when all are 1)
    when the caller has them already (emits of no tokens left out)."""
    kind, req = records["kind"], records["req"]
    if columns is None:
        em = kind == KIND_EMIT
        e_req, e_c = req[em], records["count"][em]
        d_req = req[kind == KIND_DISPATCH]
        emit_events = np.bincount(e_req, minlength=n_codes)
    else:
        d_req, e_req, e_c = columns
        emit_events = np.bincount(req[kind == KIND_EMIT], minlength=n_codes)
    if e_c is None or (len(e_c) and e_c.max() == 1):
        emitted = np.bincount(e_req, minlength=n_codes)
    else:
        emitted = np.bincount(e_req, weights=e_c, minlength=n_codes).astype(np.int64)
    dispatched = np.bincount(d_req, minlength=n_codes)
    fin = np.flatnonzero(kind == KIND_FINISH)
    finish_count = np.full(n_codes, -1, dtype=np.int64)
    finish_reason = np.full(n_codes, -1, dtype=np.int64)
    finish_ns = np.full(n_codes, NO_TIME, dtype=np.int64)
    # the first finish event of a request wins (assigning in reverse order)
    fin = fin[::-1]
    fin_req = req[fin]
    finish_count[fin_req] = records["count"][fin]
    finish_reason[fin_req] = records["reason"][fin]
    finish_ns[fin_req] = records["t_ns"][fin]
    return EngineRequestTotals(emitted.astype(np.int64, copy=False), emit_events, dispatched, finish_count,
                               finish_reason, finish_ns)


def events_after(records: np.ndarray, cutoff_ns: np.ndarray, kinds=(KIND_DISPATCH, KIND_EMIT)):
    """Per request code: (events, tokens) of the given kinds strictly after ``cutoff_ns[req]``."""
    n_codes = len(cutoff_ns)
    kind = records["kind"]
    sel = kind == kinds[0]
    for k in kinds[1:]:
        sel |= kind == k
    req = records["req"][sel]
    late = records["t_ns"][sel] > cutoff_ns[req]
    late_req = req[late]
    n = np.bincount(late_req, minlength=n_codes)
    tok = np.bincount(late_req, weights=records["count"][sel][late], minlength=n_codes).astype(np.int64)
    return n, tok


def events_after_grouped(t_grouped: np.ndarray, groups, cutoff_ns: np.ndarray,
                         counts_grouped: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``events_after`` on events already grouped by request (``group_by`` of request codes).

    Only requests whose last event is past their cutoff are looked at: O(requests), plus
    a binary search in each such request (usually none).
    """
    n_codes = len(cutoff_ns)
    n = np.zeros(n_codes, dtype=np.int64)
    tok = np.zeros(n_codes, dtype=np.int64)
    if len(groups) == 0:
        return n, tok
    last = t_grouped[groups.ends - 1]
    for g in np.flatnonzero(last > cutoff_ns[groups.keys]):
        key, lo, hi = int(groups.keys[g]), int(groups.starts[g]), int(groups.ends[g])
        first_late = lo + int(np.searchsorted(t_grouped[lo:hi], cutoff_ns[key], side="right"))
        n[key] = hi - first_late
        tok[key] = hi - first_late if counts_grouped is None else int(counts_grouped[first_late:hi].sum())
    return n, tok


@dataclass
class EngineRequestView:
    """What one engine file says about one request."""

    emitted: int
    dispatched: int
    finish_count: int | None
    finish_reason: str | None
    finish_ns: int | None
    emit_events_after_cancel: int = 0
    tokens_after_cancel: int = 0
    events_after_finish: int = 0


@dataclass
class RequestCheck:
    client_id: str
    cancelled: bool
    ok: bool
    problem: str | None  # one line, the first thing that does not add up
    completion_tokens: int | None
    streamed_tokens: int
    emitted_tokens: int | None
    charged_tokens: int | None  # dispatch events (cancelled: what the user paid)
    emit_events_after_cancel: int | None = None
    tokens_after_cancel: int | None = None
    abort_latency_ns: int | None = None  # cancel_ns to the engine's finish event
    # cancelled: how the engine finished it when that was after the cancel and not by the abort
    # ("length", "stop"), else None; checks.cancel_problem judges it with the step threshold
    finished_after_cancel_as: str | None = None


def view_of(totals: EngineRequestTotals, code: int, after_cancel=None, after_finish=None) -> EngineRequestView:
    reason = int(totals.finish_reason[code])
    return EngineRequestView(
        emitted=int(totals.emitted[code]),
        dispatched=int(totals.dispatched[code]),
        finish_count=int(totals.finish_count[code]) if reason >= 0 else None,
        finish_reason=FINISH_REASONS.get(reason, f"code {reason}") if reason >= 0 else None,
        finish_ns=int(totals.finish_ns[code]) if reason >= 0 else None,
        emit_events_after_cancel=int(after_cancel[0][code]) if after_cancel is not None else 0,
        tokens_after_cancel=int(after_cancel[1][code]) if after_cancel is not None else 0,
        events_after_finish=int(after_finish[0][code]) if after_finish is not None else 0,
    )


# How an answer the client did not close may end: its EOS (or a stop string), or max_tokens. A
# request that is out of budget pauses and resumes: it is never cut short ("abort"), never answered
# with an error (docs/promise.md, promise 3).
COMPLETE_FINISH_REASONS = ("stop", "length")
# A cancelled answer whose tokens were all emitted before the cancel may have its finish event this
# much after it (recorded later in the same engine step; measured 0.4 ms)
CANCEL_RACE_NS = 20_000_000


@dataclass(frozen=True)
class AnswerEnds:
    """Where the served model's answers may end (the run's manifest: ``model_stop_token_ids``,
    ``max_model_len``; None where the run did not know, and the rule that needs it is not applied)."""

    stop_token_ids: frozenset[int] | None = None
    max_model_len: int | None = None

    @classmethod
    def of_manifest(cls, manifest: dict) -> AnswerEnds:
        ids, length = manifest.get("model_stop_token_ids"), manifest.get("max_model_len")
        return cls(frozenset(int(i) for i in ids) if isinstance(ids, list) and ids else None,
                   int(length) if isinstance(length, int) and length > 0 else None)


def cut_short(rec: ClientRecord, ends: AnswerEnds) -> str | None:
    """Why a complete-looking answer (finish "stop" or "length", its usage and tokens in order) was cut
    short, or None. A "stop" is the model's: the last token it streamed is one of the model's stop tokens
    (the driver sends no stop strings or stop token ids of its own). A "length" is ``max_tokens``, or the
    prompt and answer reaching ``max_model_len``. A limiter that ends a throttled answer early, calling it
    either, passes every count and every bound; this is where it shows (promise 3, never truncated)."""
    n = rec.completion_tokens
    # (judged on the token ids the server streamed, when it streamed one per token)
    if (rec.finish_reason == "stop" and ends.stop_token_ids is not None and rec.token_ids
            and len(rec.token_ids) == n):
        last = rec.token_ids[-1]
        if last not in ends.stop_token_ids:
            return (f"finish_reason 'stop' after {n} tokens, but its last token (id {last}) is not one of the "
                    f"model's stop tokens (ids {', '.join(map(str, sorted(ends.stop_token_ids)))}): cut short, "
                    "not ended by the model")
    if rec.finish_reason == "length" and n is not None and n < rec.max_tokens and ends.max_model_len is not None:
        if rec.prompt_tokens is not None and rec.prompt_tokens + n < ends.max_model_len:
            return (f"finish_reason 'length' after {n} of max_tokens {rec.max_tokens} tokens (prompt "
                    f"{rec.prompt_tokens}, max_model_len {ends.max_model_len}): cut short")
    return None


def reconcile_request(rec: ClientRecord, eng: EngineRequestView | None, *, engine_has_events: bool,
                      ends: AnswerEnds = AnswerEnds()) -> RequestCheck | None:
    """Check one request; None when there is nothing to reconcile (a stream the run's interruption
    cut, or one the driver closed after an error of its own). ``ends``: where the model's answers may
    end (:func:`cut_short`)."""
    streamed = rec.streamed_tokens
    out = RequestCheck(
        client_id=rec.client_id, cancelled=rec.cancelled, ok=True, problem=None,
        completion_tokens=rec.completion_tokens, streamed_tokens=streamed,
        emitted_tokens=eng.emitted if eng else None, charged_tokens=eng.dispatched if eng else None,
    )

    def fail(why: str) -> RequestCheck:
        out.ok, out.problem = False, f"{rec.client_id}: {why}"
        return out

    if rec.error is not None or (rec.http_status is not None and rec.http_status != 200):
        if rec.error == ERROR_INTERRUPTED or rec.cancelled:
            return None
        # Refused, failed or stalled until the driver's read timeout: never what a limiter may do.
        status = f"HTTP {rec.http_status}" if rec.http_status is not None else "no HTTP status"
        return fail(f"answered with an error ({status}, {streamed} tokens streamed): {rec.error}")

    if engine_has_events and eng is None:
        return fail("no engine events for this request")
    if eng is not None and eng.events_after_finish:
        return fail(f"{eng.events_after_finish} engine events after its finish event")
    if rec.cancelled:
        if eng is None:
            return out
        if eng.finish_reason is None:
            return fail("cancelled, but the engine never finished it")
        cancel_ns = rec.cancel_ns if rec.cancel_ns is not None else rec.done_ns
        out.emit_events_after_cancel = eng.emit_events_after_cancel
        if eng.finish_ns is not None and cancel_ns is not None:
            out.abort_latency_ns = eng.finish_ns - cancel_ns
        out.tokens_after_cancel = eng.tokens_after_cancel
        finished_before = eng.finish_ns is not None and cancel_ns is not None and eng.finish_ns <= cancel_ns
        # every token it asked for emitted before the cancel, its finish recorded just after (the emits of a step
        # are stamped at the start of update_from_output, its finishes later in the same call): it had ended
        # by itself, the cancel raced its last chunk
        # (its EOS the same: emitted before the cancel, never streamed to the client, which closed first;
        # an abort finishes after the last token the client read, not after one it never got)
        raced = (eng.emit_events_after_cancel == 0 and eng.finish_ns is not None and cancel_ns is not None
                 and eng.finish_ns - cancel_ns <= CANCEL_RACE_NS)
        complete_before = raced and (
            (eng.finish_reason == "length" and eng.emitted == rec.max_tokens)
            or (eng.finish_reason == "stop" and not rec.ignore_eos and eng.emitted > streamed))
        if eng.finish_reason != "abort" and not finished_before and not complete_before:
            out.finished_after_cancel_as = eng.finish_reason
        if eng.finish_count is not None and eng.finish_count != eng.emitted:
            return fail(f"finish event counts {eng.finish_count} tokens, emit events {eng.emitted}")
        return out
    if rec.completion_tokens is None:
        return fail(f"no final usage.completion_tokens ({streamed} tokens streamed, finish_reason "
                    f"{rec.finish_reason!r}, not marked cancelled)")
    if rec.completion_tokens != streamed:
        return fail(f"usage.completion_tokens {rec.completion_tokens} != {streamed} tokens streamed")
    if eng is not None:
        if eng.finish_count is None:
            return fail(f"no engine finish event (engine events show {eng.emitted} tokens emitted, client "
                        f"streamed {streamed}): did the event file lose its last flush?")
        if eng.emitted != streamed:
            return fail(f"engine emitted {eng.emitted} tokens, client streamed {streamed}")
        if eng.finish_count != eng.emitted:
            return fail(f"finish event counts {eng.finish_count} tokens, emit events {eng.emitted}")
    if rec.finish_reason not in COMPLETE_FINISH_REASONS:
        return fail(f"finish_reason {rec.finish_reason!r} after {streamed} tokens: an answer ends with "
                    f"{' or '.join(repr(r) for r in COMPLETE_FINISH_REASONS)}")
    if eng is not None and eng.finish_reason is not None and eng.finish_reason != rec.finish_reason:
        return fail(f"the client's finish_reason {rec.finish_reason!r}, the engine's finish event "
                    f"{eng.finish_reason!r}")
    if rec.ignore_eos:
        if rec.finish_reason != "length":
            return fail(f"ignore_eos but finish_reason {rec.finish_reason!r}, not 'length'")
        if rec.completion_tokens != rec.max_tokens:
            return fail(f"ignore_eos: {rec.completion_tokens} tokens, max_tokens {rec.max_tokens}")
    if (why := cut_short(rec, ends)) is not None:
        return fail(why)
    return out


def cancel_problem(c: RequestCheck, max_steps: int) -> str | None:
    """What is wrong with a cancelled request, judged with ``max_steps`` (emit events allowed after the
    cancel: the steps under way when the abort arrived); None when nothing is."""
    if not c.ok:
        return c.problem
    after = c.emit_events_after_cancel or 0
    if after > max_steps:
        return (f"{c.client_id}: engine emitted {after} steps ({c.tokens_after_cancel} tokens) after the cancel; "
                f"at most {max_steps} allowed")
    # the steps under way when the abort arrived may end a short answer: no failure then
    if c.finished_after_cancel_as is not None and not (c.finished_after_cancel_as in ("length", "stop") and after > 0):
        return f"{c.client_id}: cancelled, but the engine finished it with {c.finished_after_cancel_as!r}, not 'abort'"
    return None
