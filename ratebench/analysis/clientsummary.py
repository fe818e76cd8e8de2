"""The client's side of a run's figures: per phase and user, what the client received (rates, gaps,
time to first token, the bound on chunks) and the client's records held against the engine's events
(:mod:`ratebench.analysis.witness`)."""

from __future__ import annotations

from itertools import chain

import numpy as np

from ratebench.analysis.bound import bound_result
from ratebench.analysis.gaps import gap_stats, gaps_merged
from ratebench.analysis.load import RunData
from ratebench.analysis.rates import rate_figures
from ratebench.analysis.reconcile import AnswerEnds, reconcile_request
from ratebench.analysis.runsummary import Measure, RunSummary, add_request_check, row_of
from ratebench.analysis.segments import time_order
from ratebench.analysis.witness import witness_figures


def witness_rows(run: RunData, summary: RunSummary, measure: Measure, phase_of: dict, chunks: ClientChunks) -> dict:
    """The client's records against the engine's events, per row (``witness.witness_figures``), with each
    row's bound-emit tolerance (the one its bound-client windows widen further)."""
    row_of_record = {}
    for i, r in enumerate(run.records):
        p_index = phase_of.get((r.scenario, r.phase, r.engine))
        if p_index is not None and r.engine in run.traces:
            row_of_record[i] = (p_index, summary.user_of(i, r.user))
    tolerance = {}
    for key in set(row_of_record.values()):
        row = summary.rows.get(key)
        step = summary.engine_steps.get(run.phases[key[0]].engine)
        if row is not None and row.bound_emit is not None:
            tolerance[key] = row.bound_emit.tolerance_ns
        elif measure.emit_tolerance_ns is not None:
            tolerance[key] = measure.emit_tolerance_ns
        elif step is not None:
            tolerance[key] = step.longest_ns
    return witness_figures(run, row_of_record, chunks, tolerance, from_file=measure.emit_tolerance_ns is None,
                           steps=summary.step_latencies)


def summarize_clients(run: RunData, summary: RunSummary, th: Measure, phase_of: dict, ends: AnswerEnds,
                       chunks: ClientChunks | None = None) -> None:
    by_group: dict[tuple[int, str], list] = {}
    for i, r in enumerate(run.records):
        p_index = phase_of.get((r.scenario, r.phase, r.engine))
        if p_index is None:
            if r.fleet is not None and r.engine == r.fleet:
                continue  # sent through a fleet's balancer and served by no engine: the fleet-* checks count it
            summary.warnings.append(f"client record {r.client_id}: phase {r.scenario}/{r.phase}@{r.engine} "
                                    "not in scenarios.json")
            continue
        by_group.setdefault((p_index, summary.user_of(i, r.user)), []).append(i)
    chunks = ClientChunks(run.records) if chunks is None else chunks
    for (p_index, user), indices in by_group.items():
        row = row_of(run, summary, p_index, user)
        row.requests = len(indices)
        row.streamed_tokens = int(chunks.streamed[indices].sum())
        if run.engines[row.engine].events_file is None:
            # no engine events (stock vLLM): reconcile the client side alone
            for i in indices:
                r = run.records[i]
                add_request_check(summary, phase_of, i, r, reconcile_request(r, None, engine_has_events=False,
                                                                              ends=ends))
        cancelled = [i for i in indices if run.records[i].cancelled]
        row.cancelled = len(cancelled)
        checks = summary.request_checks.get((p_index, user), [])
        row.cancelled_charged_tokens = sum(c.charged_tokens or 0 for c in checks if c.cancelled)
        with_chunks = np.array([i for i in indices if chunks.lengths[i]], dtype=np.int64)
        if not len(with_chunks):
            continue
        t, c, record = chunks.of(with_chunks)
        unit = bool(c.min() == 1 and c.max() == 1)
        # per-request gaps: consecutive chunks of one record (records are concatenated whole)
        row.gaps_client_request = gap_stats(np.diff(t)[record[1:] == record[:-1]])
        sent = chunks.sent[with_chunks]
        has_sent = sent >= 0
        if has_sent.any():
            row.ttft_client = gap_stats(chunks.first[with_chunks][has_sent] - sent[has_sent])
        order = time_order(t)
        if order is not None:
            t, c = t[order], c[order]
        c = None if unit else c
        row.client_rate = rate_figures(t, c, row.limit_tps, th.burst_ns)
        if row.limit_tps:
            keep = slice(None) if c is None else c > 0
            # windows widened by the emit tolerance and the delivery latency's spread (witness.py)
            w = summary.witness.get((p_index, user))
            tol = w.client_tolerance_ns if w is not None and w.client_tolerance_ns is not None else 0
            row.bound_client = bound_result(t[keep], None if c is None else c[keep], row.limit_tps, th.burst_ns,
                                            tol)
        row.gaps_client_user = gap_stats(gaps_merged(t))


class ClientChunks:
    """Every client record's chunks as flat arrays, converted from Python lists once."""

    def __init__(self, records) -> None:
        n = len(records)
        self.lengths = np.fromiter((len(r.chunk_ns) for r in records), dtype=np.int64, count=n)
        total = int(self.lengths.sum())
        self.t = np.fromiter(chain.from_iterable(r.chunk_ns for r in records), dtype=np.int64, count=total)
        if sum(sum(r.chunk_tokens) for r in records) == total and not any(0 in r.chunk_tokens for r in records):
            # one token a chunk (none carries 0, so a sum equal to the chunks' number means all are 1)
            self.tokens = np.ones(total, dtype=np.int64)
        else:
            self.tokens = np.fromiter(chain.from_iterable(r.chunk_tokens for r in records), dtype=np.int64,
                                      count=total)
        self.starts = np.cumsum(self.lengths) - self.lengths
        self.streamed = np.zeros(n, dtype=np.int64)
        has = self.lengths > 0
        if total:
            self.streamed[has] = np.add.reduceat(self.tokens, self.starts[has])
        self.first = np.where(has, self.t[np.minimum(self.starts, max(total - 1, 0))] if total else 0, -1)
        self.sent = np.fromiter((-1 if r.sent_ns is None else r.sent_ns for r in records), dtype=np.int64, count=n)

    def of(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(chunk times, tokens, record index of each chunk) of these records, concatenated in order."""
        lengths = self.lengths[indices]
        total = int(lengths.sum())
        record = np.repeat(indices, lengths)
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        pos = self.starts[record] + within
        return self.t[pos], self.tokens[pos], record
