"""Two witnesses: the client's timestamps held against the engine's event file (figures only).

The engine's event file is the patch's own account of itself: a recorder that stamped each user's
tokens on an even 1/N schedule would pass every check made on it alone. The client is the second
witness. Both stamp with ``time.monotonic_ns()``, CLOCK_MONOTONIC, one clock for every process of
a host, so their times compare directly. The checks (``analysis/checks/witness.py``: ``witness-order``,
``witness-emits``, ``bound-client``) judge these figures.

Order (``witness-order``)
-------------------------
The patch stamps a step's emit events once, at the start of ``update_from_output()``, before the
step's outputs leave the engine core (IPC to the API server, detokenization, an SSE chunk on a
socket, the client's read). So for every request, joined to its engine request by
``runrecords.client_id_of``::

    client arrival of its k-th token  >=  time of the emit event that brought its emitted count to k

The client's k-th token: ``ClientRecord.chunk_tokens`` cumulated (the deltas of the chunks'
``usage.completion_tokens``, which count what the engine emitted); a chunk carrying tokens a..b is
held against the emit of its last token b (the latest of its emits). Two more comparisons of the
same kind, per request:

* the end of the stream (``done_ns``, the client's ``[DONE]``) not before the engine's finish
  event, when the engine ended the request itself (finish reason stop or length: it frees the
  request inside ``update_from_output()``, before the last output leaves; a stop *string* is found
  by the API server, which then aborts the request in the engine after the client's ``[DONE]``,
  and a cancelled stream's ``done_ns`` is its cancel, so neither is compared);
* no event of the request in the engine's file before the client sent it (``sent_ns`` is stamped
  before the request's bytes are written): a recorder that backdates its stamps shows here.

The figure is the largest (engine time - client time) over all of them: negative on a truthful
file (the smallest causal margin), positive where the client had something before the engine
says it made it. ``Thresholds.witness_clock_ns`` (5 us) is the slack for reading the clock:
CLOCK_MONOTONIC read through the vDSO has 1 ns resolution and one timekeeper for all CPUs
(invariant TSC); the real causal margin, engine to API server to socket to client, is hundreds
of microseconds.

Tokens the client received for which the engine's file has no emit event (the request's emitted
count never reaches k, or no event names the request at all) are counted apart
(``witness-emits``): reconciliation may fail on the same request, but it says "the totals differ",
this says "the client holds tokens the engine's file never emitted".

Delivery latency and the bound on client chunks (``bound-client``)
------------------------------------------------------------------
Per token, L = client arrival - the engine's emit of that token; per user and phase, ``Lmin`` and
``Lmax`` over its joined tokens (a chunk of tokens a..b gives ``c - e_b`` and ``c - e_a``). Every
token of a client window ``[c_i, c_j]`` was emitted inside ``[c_i - Lmax, c_j - Lmin]``, a window
``Lmax - Lmin`` longer; bound-emit holds there with tolerance T (its step tolerance), so the
client window holds at most::

    (W + B + T + (Lmax - Lmin)) * N + 1

tokens: bound-client is the bound on client chunk times with the windows widened by
``T + Lmax - max(Lmin, 0)``, every term measured on the run. ``max(Lmin, 0)``: a file that puts
emits after the client's arrivals (witness-order broken) earns no allowance for its negative
latencies, so a recorder that smooths a burst the client received gets no wider windows for it.
The maximum, not a quantile, because the derivation needs the whole spread: one token held 200 ms
by a busy API server widens every window of that user and phase by 200 ms, which is what it takes
for a delay the limiter did not cause to never fail the client's bound.

Steps the client could see (``witness-steps``)
----------------------------------------------
T, the step tolerance of bound-emit and bound-client, is itself read from the file: the phase's longest
dispatch-to-emit latency. A recorder that stamps one charge a phase a second early makes every window of
the phase a second wider, and a burst of that size passes both bounds. The client bounds every step: on
a synchronous engine a step runs from its dispatch to its emit and no other step emits meanwhile (the
next one is scheduled after this one's outputs are handled), so no chunk of the engine's requests reaches
the client for the step's length, less what delivery latency varies (the phase's spread ``S``, over all
its users). With ``--async-scheduling`` a step's dispatch comes while the step before it runs: its
dispatch to emit spans two steps, and the client hears from the engine once in between. So for every
step the file records, with ``Q`` the longest stretch between two chunk arrivals of the phase's requests
on that engine (the phase's start and end count as arrivals) that overlaps the step's dispatch-to-emit::

    latency  <=  2 (Q + S) + slack

(``Thresholds.step_witness_slack_ns``, 20 ms: waking the engine's and the API server's threads on a
busy machine). Silences the engine's other work causes (probes, requests not the client's) only make
``Q`` longer, so the rule never fails a truthful file for them; a step stamped a second long while the
engine's other requests kept reaching the client fails it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ratebench.events import KIND_FINISH

if TYPE_CHECKING:  # pragma: no cover
    from ratebench.analysis.load import RunData

FINISH_BY_ENGINE = (1, 2)  # events.FINISH_REASONS: stop, length (the engine ended the request itself)


@dataclass
class Early:
    """The comparison of one witness-order kind with the largest engine time - client time."""

    early_ns: int  # engine time - client time; > 0: the client had it first
    client_id: str
    token: int | None = None  # the k-th token of the request (token comparisons)


@dataclass
class WitnessResult:
    """One user in one phase: its client records held against the engine's events."""

    requests: int = 0  # client records with tokens (or an end) held against an engine request
    tokens: int = 0  # tokens the client received in those requests with an emit event to hold them against
    unjoined_requests: int = 0  # client records with tokens whose request no engine event names
    worst_token: Early | None = None  # a token's arrival against its emit
    worst_end: Early | None = None  # a stream's end against the engine's finish (stop, length)
    ends: int = 0  # streams whose end was compared
    worst_sent: Early | None = None  # the request's first engine event against its send
    sent: int = 0  # requests whose send was compared
    unemitted_tokens: int = 0  # tokens the client received with no emit event for them
    unemitted_requests: int = 0
    unemitted_example: str | None = None  # the request with the most, in words
    unemitted_most: int = 0  # that request's tokens with no emit event
    # client arrival - emit, per token: the extremes over the row's joined tokens
    latency_min_ns: int | None = None
    latency_max_ns: int | None = None
    latency_p50_ns: int | None = None  # per chunk, its last token (information)
    emit_tolerance_ns: int = 0  # T: the windows' widening of bound-emit
    # T measured on the engine's file (its longest dispatch-to-emit step), not given on the command line
    tolerance_from_file: bool = False
    # witness-steps: the phase's recorded step longest against what the client heard (step_silences: its
    # dispatch-to-emit latency, the longest stretch overlapping it without a chunk of any of the phase's
    # requests on that engine, its dispatch into the phase), and the phase's delivery spread over all its
    # users (None: not measured)
    step_ns: int | None = None
    step_silence_ns: int | None = None
    step_at_ns: int | None = None
    phase_spread_ns: int | None = None
    # T + Lmax - max(Lmin, 0): bound-client's widening (None: no latency measured, not judged)
    client_tolerance_ns: int | None = None

    @property
    def worst(self) -> tuple[str, Early] | None:
        """The comparison closest to (or furthest past) the client being first: (what, it)."""
        cands = [(what, e) for what, e in (("token", self.worst_token), ("end", self.worst_end),
                                           ("sent", self.worst_sent)) if e is not None]
        return max(cands, key=lambda x: x[1].early_ns) if cands else None

    @property
    def spread_ns(self) -> int | None:
        """Lmax - max(Lmin, 0): what the delivery adds to bound-client's windows beyond T."""
        if self.latency_max_ns is None:
            return None
        return max(0, self.latency_max_ns - max(self.latency_min_ns, 0))


def _worse(a: Early | None, b: Early | None) -> Early | None:
    if a is None:
        return b
    if b is None:
        return a
    return b if b.early_ns > a.early_ns else a


def witness_figures(run: RunData, row_of_record: dict[int, tuple[int, str]], chunks,
                    emit_tolerance_ns: dict[tuple[int, str], int], from_file: bool = True,
                    steps: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
                    ) -> dict[tuple[int, str], WitnessResult]:
    """Per (phase index, user) row: the witness figures of its client records on engines with an event file.

    ``row_of_record``: client record index -> its row (the user the engine charged); ``chunks``: every
    record's chunks as flat arrays (``clientsummary.ClientChunks``: ``t``, ``tokens``, ``lengths``,
    ``starts``, ``of()``); ``emit_tolerance_ns``: per row, the widening of its bound-emit windows.
    """
    out: dict[tuple[int, str], WitnessResult] = {}
    by_engine: dict[str, list[int]] = {}
    for i, key in row_of_record.items():
        r = run.records[i]
        if r.engine in run.traces:
            by_engine.setdefault(r.engine, []).append(i)
    for name, indices in by_engine.items():
        _engine_witness(run, name, indices, row_of_record, chunks, out)
    silence = step_silences(run, row_of_record, chunks, steps or {})
    spread: dict[int, tuple[int, int]] = {}  # phase index -> (Lmin, Lmax) over its rows
    for (p, _), w in out.items():
        if w.latency_max_ns is not None:
            lo, hi = spread.get(p, (w.latency_min_ns, w.latency_max_ns))
            spread[p] = (min(lo, w.latency_min_ns), max(hi, w.latency_max_ns))
    for key, w in out.items():
        w.emit_tolerance_ns = int(emit_tolerance_ns.get(key, 0))
        w.tolerance_from_file = from_file
        if key[0] in silence:
            w.step_ns, w.step_silence_ns, w.step_at_ns = silence[key[0]]
        if key[0] in spread:
            lo, hi = spread[key[0]]
            w.phase_spread_ns = max(0, hi - max(lo, 0))
        if w.latency_max_ns is not None:
            w.client_tolerance_ns = w.emit_tolerance_ns + w.spread_ns
    return out


def step_silences(run: RunData, row_of_record: dict[int, tuple[int, str]], chunks,
                  steps: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[int, tuple[int, int, int]]:
    """Per phase index: the engine's recorded step (``steps``: per engine, its steps' emit times and
    dispatch-to-emit latencies, ``steps.step_latencies``) that started in the phase and is longest against
    what the client heard, as (its latency, the longest stretch without a chunk of the phase's requests on
    that engine overlapping it, its dispatch relative to the phase's start); the one with the largest
    latency - 2 x stretch. The stretches run between consecutive chunk arrivals, from the phase's start to
    its end (``witness-steps``)."""
    by_phase: dict[int, list[int]] = {}
    for i, (p, _) in row_of_record.items():
        by_phase.setdefault(p, []).append(i)
    out = {}
    by_dispatch: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # engine -> steps sorted by dispatch
    for p, indices in by_phase.items():
        phase = run.phases[p]
        if phase.engine not in by_dispatch:
            if phase.engine not in steps:
                continue
            emit_t, lat = steps[phase.engine]
            order = np.argsort(emit_t - lat, kind="stable")
            by_dispatch[phase.engine] = ((emit_t - lat)[order], emit_t[order], lat[order])
        d_all, e_all, l_all = by_dispatch[phase.engine]
        a, b = np.searchsorted(d_all, [phase.start_ns, phase.end_ns], side="left")
        if b <= a:
            continue
        e, lt, dd = e_all[a:b], l_all[a:b], d_all[a:b]
        t, _, _ = chunks.of(np.array(sorted(indices), dtype=np.int64))
        t = np.sort(t[(t > phase.start_ns) & (t < phase.end_ns)])
        edges = np.concatenate(([phase.start_ns], t, [max(phase.end_ns, phase.start_ns + 1)]))
        gaps = np.diff(edges)
        # the gaps overlapping [dispatch, emit]: the one holding the dispatch to the one holding the emit
        lo = np.clip(np.searchsorted(edges, dd, side="right") - 1, 0, len(gaps) - 1)
        hi = np.clip(np.searchsorted(edges, e, side="left") - 1, lo, len(gaps) - 1)
        q = _range_max(gaps, lo, hi)
        k = int(np.argmax(lt - 2 * q))
        out[p] = (int(lt[k]), int(q[k]), int(dd[k] - phase.start_ns))
    return out


def _range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max(values[lo[i]:hi[i] + 1]) for every i (a sparse table: O(n log n) once, O(1) a query)."""
    table = [values]
    width = 1
    while 2 * width <= len(values):
        prev = table[-1]
        table.append(np.maximum(prev[:-width], prev[width:]))
        width *= 2
    span = hi - lo + 1
    level = np.floor(np.log2(span)).astype(np.int64)
    out = np.empty(len(lo), dtype=values.dtype)
    for j in np.unique(level).tolist():
        m = level == j
        row = table[j]
        out[m] = np.maximum(row[lo[m]], row[hi[m] - (1 << j) + 1])
    return out


def _engine_witness(run: RunData, name: str, indices: list[int], row_of_record, chunks, out) -> None:
    trace = run.traces[name]
    n_codes = max(len(trace.events.strings), 1)
    # the emits that carry tokens, grouped by request (stable: each request's in time order); shared
    by, t_r = trace.by_request("emits")
    e_c = trace.emits()["count"]
    unit = not len(e_c) or int(e_c.max()) == 1  # one token per emit: the k-th token is the k-th emit
    c_r = np.ones(len(t_r), dtype=np.int64) if unit else e_c[by.order].astype(np.int64)
    cum_all = np.cumsum(c_r)  # strictly increasing: every count > 0
    before = (cum_all - c_r)[by.starts] if len(by) else np.zeros(0, dtype=np.int64)  # tokens of earlier groups
    total = cum_all[by.ends - 1] - before if len(by) else np.zeros(0, dtype=np.int64)
    group_of_code = np.full(n_codes, -1, dtype=np.int64)
    group_of_code[by.keys.astype(np.int64)] = np.arange(len(by), dtype=np.int64)
    emitted_of_code = np.zeros(n_codes, dtype=np.int64)
    emitted_of_code[by.keys.astype(np.int64)] = total
    # the first event of any kind per request code, and its first finish event (time, reason)
    first_ns = np.full(n_codes, -1, dtype=np.int64)
    first_any = trace.first_event_ns()
    first_ns[:min(n_codes, len(first_any))] = first_any[:n_codes]
    fin = trace.of_kind(KIND_FINISH, ("t_ns", "req", "reason"))
    rev = slice(None, None, -1)  # assigning in reverse time order: the earliest wins
    finish_ns = np.full(n_codes, -1, dtype=np.int64)
    finish_reason = np.full(n_codes, -1, dtype=np.int64)
    finish_ns[fin["req"][rev]] = fin["t_ns"][rev]
    finish_reason[fin["req"][rev]] = fin["reason"][rev]
    code_of_record = {int(i): int(c) for c, i in enumerate(trace.req_record.tolist()) if i >= 0}

    # records in row order, so each row's chunks are one slice
    rows = sorted({row_of_record[i] for i in indices})
    row_no = {k: n for n, k in enumerate(rows)}
    idx = np.array(sorted(indices, key=lambda i: (row_no[row_of_record[i]], i)), dtype=np.int64)
    codes = np.array([code_of_record.get(int(i), -1) for i in idx], dtype=np.int64)
    row_of = np.array([row_no[row_of_record[int(i)]] for i in idx], dtype=np.int64)
    strings = trace.events.strings

    # per record: the send and the end against the engine, and tokens beyond what the engine emitted
    records = [run.records[i] for i in idx.tolist()]
    n = len(records)
    joined = codes >= 0
    cc = np.maximum(codes, 0)
    streamed = chunks.streamed[idx]
    sent = chunks.sent[idx]
    done = np.fromiter((-1 if r.done_ns is None else r.done_ns for r in records), dtype=np.int64, count=n)
    ended = np.fromiter((not r.cancelled and r.error is None for r in records), dtype=bool, count=n) & (done >= 0)
    emitted = np.where(joined, emitted_of_code[cc], 0)
    missing = np.maximum(streamed - emitted, 0)
    held = joined & ((streamed > 0) | (done >= 0))
    send_ok = joined & (sent >= 0) & (first_ns[cc] >= 0)
    early_sent = sent - first_ns[cc]  # the engine's first event before the send: > 0
    end_ok = joined & ended & (finish_ns[cc] >= 0) & np.isin(finish_reason[cc], FINISH_BY_ENGINE)
    early_end = finish_ns[cc] - done
    bounds = np.flatnonzero(np.diff(row_of)) + 1
    for a, b in zip([0, *bounds.tolist()], [*bounds.tolist(), n]):
        w = out.setdefault(rows[int(row_of[a])], WitnessResult())
        sl = slice(a, b)
        w.requests += int(held[sl].sum())
        w.unjoined_requests += int((~joined[sl] & (streamed[sl] > 0)).sum())
        w.unemitted_tokens += int(missing[sl].sum())
        w.unemitted_requests += int((missing[sl] > 0).sum())
        m = a + int(np.argmax(missing[sl]))
        if missing[m] > w.unemitted_most:
            w.unemitted_most = int(missing[m])
            r = records[m]
            w.unemitted_example = (
                f"{r.client_id} ({strings[codes[m]]}): the client received {int(streamed[m])} tokens, the engine's "
                f"file emitted {int(emitted[m])}: tokens {int(emitted[m]) + 1}..{int(streamed[m])} have no emit "
                "event" if joined[m] else
                f"{r.client_id}: the client received {int(streamed[m])} tokens, no event of the engine's file names "
                "the request")
        for ok, early, count_attr, worst_attr in ((send_ok, early_sent, "sent", "worst_sent"),
                                                  (end_ok, early_end, "ends", "worst_end")):
            sel = np.flatnonzero(ok[sl]) + a
            if len(sel):
                m = int(sel[np.argmax(early[sel])])
                setattr(w, count_attr, getattr(w, count_attr) + len(sel))
                setattr(w, worst_attr, _worse(getattr(w, worst_attr), Early(int(early[m]), records[m].client_id)))

    # per chunk: its tokens' arrival against their emits
    has = chunks.lengths[idx] > 0
    idx_c, codes_c, row_c = idx[has], codes[has], row_of[has]
    if not len(idx_c):
        return
    t, tok, rec = chunks.of(idx_c)
    lengths = chunks.lengths[idx_c]
    cs = np.cumsum(tok)
    first_chunk = np.cumsum(lengths) - lengths
    cum = cs - np.repeat((cs - tok)[first_chunk], lengths)  # the chunk's last token, k within its request
    first_tok = cum - tok + 1
    g = np.repeat(group_of_code[np.maximum(codes_c, 0)], lengths)
    g[np.repeat(codes_c < 0, lengths)] = -1
    row_chunk = np.repeat(row_c, lengths)
    tot = np.where(g >= 0, total[np.maximum(g, 0)] if len(total) else 0, 0)
    k_last = np.minimum(cum, tot)  # tokens beyond what was emitted are counted as unemitted
    ok = (g >= 0) & (first_tok <= tot) & (tok > 0)
    base = np.where(ok, before[np.maximum(g, 0)] if len(before) else 0, 0)
    e_last = np.zeros(len(t), dtype=np.int64)
    e_first = np.zeros(len(t), dtype=np.int64)
    if ok.any() and unit:  # cum_all is 1, 2, 3, ...: token j is emit j - 1
        e_last[ok] = t_r[base[ok] + k_last[ok] - 1]
        e_first[ok] = t_r[base[ok] + first_tok[ok] - 1]
    elif ok.any():
        e_last[ok] = t_r[np.searchsorted(cum_all, base[ok] + k_last[ok], side="left")]
        e_first[ok] = t_r[np.searchsorted(cum_all, base[ok] + first_tok[ok], side="left")]
    early = e_last - t  # engine - client: > 0 is the client first
    lat_min = t - e_last
    lat_max = t - e_first
    counted = np.where(ok, k_last - first_tok + 1, 0)
    row_bounds = np.flatnonzero(np.diff(row_chunk)) + 1
    for a, b in zip(np.concatenate(([0], row_bounds)).tolist(), np.concatenate((row_bounds, [len(t)])).tolist()):
        w = out[rows[int(row_chunk[a])]]
        sel = np.flatnonzero(ok[a:b]) + a
        if not len(sel):
            continue
        w.tokens += int(counted[sel].sum())
        m = int(sel[np.argmax(early[sel])])
        w.worst_token = _worse(w.worst_token, Early(int(early[m]), run.records[int(rec[m])].client_id,
                                                     int(k_last[m])))
        w.latency_min_ns = int(lat_min[sel].min())
        w.latency_max_ns = int(lat_max[sel].max())
        w.latency_p50_ns = int(np.median(lat_min[sel]))
