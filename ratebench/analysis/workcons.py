"""Work conservation (promise 4): throttled users never hold a batch place, a resident slot or KV
that a user with budget is waiting for. Figures from the engine's per-step records (version 2
of the event file, :data:`ratebench.events.STEP_DTYPE`).

Over the steps of a phase (their clock within the phase's start and end), a step **violates**
when a request of a user with budget waits (``waiting_ready > 0``), the step left token budget
unused (``tokens < max_num_batched_tokens``) and an active place unused (``reqs <
max_num_active_seqs``), and either a throttled resident could have given way (``throttled >
0``: its slot, its KV) or there was plainly room (``resident < max_num_seqs and 0 < ready_blocks
<= kv_free``: a free slot, and free KV for the whole of the smallest waiting request of a user with
budget, prefix-cache hits not counted, the admission watermark added). With nothing throttled and the
KV cache short the limiter is not to blame; with every place used the waiting request could not
have run in this step whoever held the slots. Violating steps are counted as

* **place**: every violating step; and of them
* **slot**: ``throttled > 0 and resident >= max_num_seqs``: every resident slot was taken, one
  or more by a throttled request (the collapse of a crowd: parked requests hold the slots and
  the places idle).

**Resident steps**, judged apart (``work-conservation-places``): a step that left token budget and
a place unused while a resident request of a user with budget got no tokens (``resident -
throttled > reqs``: a stream waiting on the bench for a place, its user not out of budget). The
limiter-off engine never leaves one out so; the patch did until that check (it kept a place for
the head of the waiting queue when no slot could take it). Runs of up to two steps are excepted:
a budget flip, and a stream sitting out one step because its user's token is kept for a sibling
whose turn it is. Judged on synchronously scheduling engines only: under asynchronous scheduling a
request whose step is in flight may sit out the next step.

The step in which a budget flips is excepted: the records are written after the step's
refunds, which can make a user ready after its queued request was skipped, so a single
violating step between non-violating ones proves nothing. The figure judged is the longest
run of consecutive violating steps (a run's length in time: from its first step's clock to
the clock of the engine's next step, or to its own last step's when none followed).

``max_num_seqs``, ``max_num_active_seqs``, ``max_num_batched_tokens`` and ``num_kv_blocks``
come from the event file's header. An engine with the limiter off (``waiting_ready`` = all
waiting, nothing throttled) gets the same figures, as the reference.

**The verifier's own witness** (event file version 3, whose ``arrive`` records say when each request
entered the scheduler). ``waiting_ready`` is the patch's account of whose user had budget; a limiter
whose readiness test is wrong (a user kept blocked past its budget, every user blocked when one is
refused) would count its own mistake as "nobody ready" and pass. So the verifier also replays each
user's GCRA from its dispatch events (the charges kept: TAT = max(TAT, t) + 1/N per charge, the
engine header's burst as the tolerance) and, at each step, looks at the requests that arrived and
were not yet dispatched for the first time nor finished (never-started requests: preempted ones
are not seen), whose user the replay finds with budget by a margin of one token period and 1 ms
(TAT <= t + burst - 1/N - 1 ms: it could take a whole token more). A step in which the record
counted nobody ready, a throttled resident held a slot (``throttled > 0``), a place and token
budget were left, and the replay finds such a request, violates too (**witness**), named with its
first such request. The same runs and threshold apply to all violating steps.

Figures only; :mod:`ratebench.analysis.checks` applies the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.analysis.load import RunData
from ratebench.analysis.segments import group_by, time_order
from ratebench.events import KIND_ARRIVE, KIND_DISPATCH, KIND_FINISH

WITNESS_MARGIN_NS = 1_000_000  # beyond one token period: the replay's clock against the step's

NOT_RECORDED = "no step records (engine event file version 1 or recorder without steps)"


@dataclass(frozen=True)
class StepLimits:
    """The engine's capacities, from its event file's header."""

    max_num_seqs: int  # resident slots
    max_num_active_seqs: int  # places: requests given tokens in one step
    max_num_batched_tokens: int  # tokens in one step
    num_kv_blocks: int  # KV cache blocks in all
    # asynchronous scheduling: a resident request whose step is in flight may sit out the next one, so
    # a resident left out of an idle place proves nothing there (resident steps judged on sync engines)
    async_scheduling: bool = False

    @classmethod
    def from_meta(cls, meta: dict) -> StepLimits | str:
        """The limits, or why they cannot be had (str)."""
        missing = [k for k in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks") if meta.get(k) is None]
        if missing:
            return f"the event file's header lacks {', '.join(missing)}"
        try:
            seqs = int(meta["max_num_seqs"])
            active = meta.get("max_num_active_seqs")
            return cls(seqs, seqs if active is None else int(active), int(meta["max_num_batched_tokens"]),
                       int(meta["num_kv_blocks"]), bool(meta.get("async_scheduling")))
        except (TypeError, ValueError) as exc:
            return f"the event file's header has unreadable capacities ({exc})"


def violations(steps: np.ndarray, lim: StepLimits) -> tuple[np.ndarray, np.ndarray]:
    """(slot, place): per step record, whether it violates work conservation in each way (the steps
    that left a resident of a user with budget out of an idle place: :func:`left_out`, judged apart)."""
    def col(name: str) -> np.ndarray:
        return steps[name].astype(np.int64)

    reqs, tokens, resident, throttled = col("reqs"), col("tokens"), col("resident"), col("throttled")
    ready, kv_free, ready_blocks = col("waiting_ready"), col("kv_free"), col("ready_blocks")
    spare = (tokens < lim.max_num_batched_tokens) & (reqs < lim.max_num_active_seqs)
    owed = (ready > 0) & spare
    room = (resident < lim.max_num_seqs) & (ready_blocks > 0) & (ready_blocks <= kv_free)
    place = owed & ((throttled > 0) | room)
    slot = place & (throttled > 0) & (resident >= lim.max_num_seqs)
    return slot, place


def left_out(steps: np.ndarray, lim: StepLimits) -> np.ndarray:
    """Per step record: a place and token budget left while a resident request of a user with budget
    (resident, not parked for its budget) was given no tokens."""
    def col(name: str) -> np.ndarray:
        return steps[name].astype(np.int64)

    reqs, tokens, resident, throttled = col("reqs"), col("tokens"), col("resident"), col("throttled")
    if lim.async_scheduling:
        return np.zeros(len(steps), dtype=bool)
    return ((resident - throttled > reqs) & (tokens < lim.max_num_batched_tokens)
            & (reqs < lim.max_num_active_seqs))


def runs_of(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of consecutive True in ``mask``."""
    m = np.asarray(mask, dtype=np.int8)
    edges = np.diff(np.concatenate(([0], m, [0])))
    starts = np.flatnonzero(edges == 1)
    return starts, np.flatnonzero(edges == -1) - starts


@dataclass
class WorkConservation:
    """One phase on one engine."""

    scenario: str
    phase: str
    engine: str
    limiter_on: bool
    not_judged: str | None = None  # why there are no figures (no step records, no capacities)
    steps: int = 0  # step records within the phase
    violating: int = 0
    slot: int = 0  # steps violating as "slot" (a step may be both)
    place: int = 0  # steps violating as "place"
    resident: int = 0  # steps that left a resident of a user with budget out of an idle place (sync only)
    resident_longest_run: int = 0  # the longest run of them
    resident_judged: bool = True  # False: asynchronous scheduling (not judged)
    runs: int = 0  # runs of consecutive violating steps
    long_runs: int = 0  # of them, runs of 2 or more steps
    longest_run_steps: int = 0
    longest_run_ns: int = 0
    longest_run_start_ns: int | None = None  # from the phase's start
    limits: StepLimits | None = None
    # the verifier's own witness (arrive records): None when the file has none
    witness: int | None = None  # steps violating only by the witness (the record counted nobody ready)
    witness_first: str | None = None  # the first such step: its request, user and time into the phase

    @property
    def violating_pct(self) -> float:
        return 100.0 * self.violating / self.steps if self.steps else 0.0


def phase_figures(steps: np.ndarray, lim: StepLimits, start_ns: int, next_t_ns: int | None = None,
                  witness: np.ndarray | None = None) -> dict:
    """The figures of :class:`WorkConservation` for the time-sorted ``steps`` of one phase (which
    starts at ``start_ns``); ``next_t_ns``: the clock of the engine's step after them, if any;
    ``witness``: per step, whether it violates by the verifier's own witness alone."""
    slot, place = violations(steps, lim)
    bad = slot | place
    if witness is not None:
        bad = bad | witness
    starts, lengths = runs_of(bad)
    out = dict(steps=len(steps), violating=int(bad.sum()), slot=int(slot.sum()), place=int(place.sum()),
               runs=len(starts), long_runs=int((lengths >= 2).sum()))
    out_mask = left_out(steps, lim)
    _, out_lengths = runs_of(out_mask)
    out.update(resident=int(out_mask.sum()), resident_longest_run=int(out_lengths.max()) if len(out_lengths) else 0,
               resident_judged=not lim.async_scheduling)
    if witness is not None:
        out["witness"] = int((witness & ~(slot | place)).sum())
    if len(starts):
        t = steps["t_ns"].astype(np.int64)
        ends = starts + lengths  # the step after each run
        after = np.where(ends < len(t), t[np.minimum(ends, len(t) - 1)], t[ends - 1])
        if next_t_ns is not None and ends[-1] == len(t):
            after[-1] = next_t_ns
        dur = after - t[starts]
        i = int(np.lexsort((-dur, -lengths))[0])  # the most steps; of those, the longest in time
        out.update(longest_run_steps=int(lengths[i]), longest_run_ns=int(dur[i]),
                   longest_run_start_ns=int(t[starts[i]] - start_ns))
    return out


class ReadinessWitness:
    """The verifier's own account of who waited with budget on one engine (module docstring)."""

    def __init__(self, trace, limit_of, burst_ns: int) -> None:
        recs = trace.records
        strings = trace.events.strings
        n = len(strings)
        self.has_arrivals = bool(len(recs) and (recs["kind"] == KIND_ARRIVE).any())
        if not self.has_arrivals:
            return
        big = np.iinfo(np.int64).max

        def first_of(kind: int) -> np.ndarray:
            out = np.full(n, big, dtype=np.int64)
            m = recs["kind"] == kind
            np.minimum.at(out, recs["req"][m].astype(np.int64), recs["t_ns"][m].astype(np.int64))
            return out

        arrive, start, finish = first_of(KIND_ARRIVE), first_of(KIND_DISPATCH), first_of(KIND_FINISH)
        req_user = np.full(n, -1, dtype=np.int64)
        req_user[recs["req"].astype(np.int64)] = recs["user"].astype(np.int64)
        ok = arrive < big
        codes = np.flatnonzero(ok)
        self.arrive, self.until = arrive[codes], np.minimum(start, finish)[codes]
        self.req, self.user = codes, req_user[codes]
        self.strings = strings
        self.burst_ns = burst_ns
        # per user: its charges' times and the TAT after each (GCRA replay)
        self.tat: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
        d = recs["kind"] == KIND_DISPATCH
        t, u = recs["t_ns"][d].astype(np.int64), recs["user"][d].astype(np.int64)
        if len(t):
            g = group_by(u)
            t_g = t[g.order]
            for k, a, b in zip(g.keys.tolist(), g.starts.tolist(), g.ends.tolist()):
                limit = limit_of(strings[k])
                if not limit:
                    continue
                period = -(-1_000_000_000 // int(limit))
                times = np.sort(t_g[a:b])
                # TAT_k = max(TAT_k-1, t_k) + p = (k + 1) p + max over i <= k of (t_i - i p): one pass
                steps_p = np.arange(len(times), dtype=np.int64) * period
                tat = np.maximum.accumulate(times - steps_p) + steps_p + period
                self.tat[k] = (times, tat, period)
        self.limit_of = limit_of

    def ready_waiting(self, t: np.ndarray, candidates: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """Per step (clocks ``t``; only where ``candidates``): whether a never-started request of a user
        with budget waited; and for each such step, "request (user)" of its first such request."""
        found = np.zeros(len(t), dtype=bool)
        who = [""] * len(t)
        idx = np.flatnonzero(candidates)
        if not self.has_arrivals or not len(idx):
            return found, who
        tc = t[idx]
        lo = np.searchsorted(tc, self.arrive, "left")  # candidate steps at or after its arrival
        hi = np.searchsorted(tc, self.until, "left")  # ... and before its first dispatch or finish
        for r in np.flatnonzero(hi > lo).tolist():
            user = int(self.user[r])
            limit = self.limit_of(self.strings[user]) if user >= 0 else None
            if not limit:
                continue  # no limit: not the limiter's to hold (or a user the header does not know)
            steps = idx[lo[r]:hi[r]]
            times, tat, period = self.tat.get(user, (np.empty(0, np.int64), np.empty(0, np.int64),
                                                     -(-1_000_000_000 // int(limit))))
            k = np.searchsorted(times, t[steps], "right") - 1
            cur = np.where(k >= 0, tat[np.maximum(k, 0)], np.iinfo(np.int64).min)
            ready = cur <= t[steps] + self.burst_ns - period - WITNESS_MARGIN_NS
            for j in steps[ready].tolist():
                if not found[j]:
                    found[j] = True
                    who[j] = f"{self.strings[int(self.req[r])]} ({self.strings[user]})"
        return found, who


def work_conservation(run: RunData) -> list[WorkConservation]:
    """Per phase on each engine with an event file: its work-conservation figures (or why none)."""
    by_engine: dict[str, tuple[np.ndarray, StepLimits | str]] = {}
    witnesses: dict[str, ReadinessWitness | None] = {}
    out = []
    for p in run.phases:
        trace = run.traces.get(p.engine)
        if trace is None:
            continue
        eng = run.engines[p.engine]
        if p.engine not in by_engine:
            steps = trace.events.steps
            order = time_order(steps["t_ns"]) if len(steps) else None
            by_engine[p.engine] = (steps if order is None else steps[order], StepLimits.from_meta(trace.events.meta))
        steps, lim = by_engine[p.engine]
        if p.engine not in witnesses:
            burst = trace.events.meta.get("burst_ns")
            witnesses[p.engine] = ReadinessWitness(trace, eng.limit_of, int(burst)) \
                if eng.feature and burst else None
        witness = witnesses[p.engine]
        wc = WorkConservation(p.scenario, p.phase, p.engine, limiter_on=eng.feature)
        out.append(wc)
        if len(steps) == 0:
            wc.not_judged = NOT_RECORDED
            continue
        if isinstance(lim, str):
            wc.not_judged = lim
            continue
        wc.limits = lim
        t = steps["t_ns"]
        lo, hi = np.searchsorted(t, p.start_ns, "left"), np.searchsorted(t, p.end_ns, "right")
        if hi <= lo:
            wc.not_judged = (f"no step records within the phase (the engine's {len(steps)} step records "
                             f"lie outside it)")
            continue
        next_t = int(t[hi]) if hi < len(t) else None
        mine = steps[lo:hi]
        extra = None
        if witness is not None and witness.has_arrivals:
            # steps the record did not count against the limiter: nobody ready by its account, a
            # throttled resident holding a slot, a place and token budget left
            cand = ((mine["waiting_ready"] == 0) & (mine["throttled"] > 0)
                    & (mine["reqs"].astype(np.int64) < lim.max_num_active_seqs)
                    & (mine["tokens"].astype(np.int64) < lim.max_num_batched_tokens))
            extra, who = witness.ready_waiting(mine["t_ns"].astype(np.int64), cand)
            first = np.flatnonzero(extra)
            if len(first):
                j = int(first[0])
                wc.witness_first = f"{who[j]}, {(int(mine['t_ns'][j]) - p.start_ns) / 1e9:.3f} s into the phase"
        for k, v in phase_figures(mine, lim, p.start_ns, next_t, extra).items():
            setattr(wc, k, v)
    return out


__all__ = ["NOT_RECORDED", "StepLimits", "WorkConservation", "phase_figures", "runs_of",
           "violations", "work_conservation"]
