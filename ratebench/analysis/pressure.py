"""The limiter under pressure: figures of the kv-pressure and active-cap-fairness phases.

* **Stream wait** (every backlogged user with a limit and more than one stream, and the
  users a phase's ``params.stream_wait`` names): for each stream of such a user, the longest time it went without a dispatch event (a token sampled for
  it): to its first token from when it was sent or, if later, from the user's first
  token in the phase (the phase's first prefills are not the limiter's doing), between
  two tokens, and from its last token to when the driver closed it if it was still
  waiting then. The wait for a first token leaves out the engine's full steps in it (steps that
  scheduled the whole ``--max-num-batched-tokens`` budget, from the event file's step records and
  header) that began while another request also waited for its first token (the client's clock):
  those steps were prefilling other prompts, which the streams sent at once queue for in
  their order, the limiter on or off (six 1,280-token prompts of one user at 256 tokens a step are
  thirty full steps, about 1.5 s on a slow CPU; a stream's wait behind its siblings' decodes is in
  steps that are not full, and counts). A user at ``N``
  tok/s whose ``S`` streams take turns gives each stream a token every ``S / N``
  seconds; a stream that lost its KV to a neighbour and was left behind while its
  siblings kept the budget waits far longer, and so does a new stream left in the
  queue while its running siblings take every token as it comes due.
  On an engine that ran vLLM's PRIORITY policy (its event file's header), a user's streams take
  turns within a priority and higher priorities go first, as upstream orders them: a stream's wait
  does not count the time while one of its user's streams of a higher priority (a lower value)
  was open (sent and not yet ended), which its shared budget serves first.

* **Place share** (phases with ``params.place_share``): every user's streams run at
  once and every limit is above what the ``--max-num-active-seqs`` places deliver, so
  the places decide each user's share. The window runs from the moment the last user
  sent its first request (plus :data:`SETTLE_NS`) to the first moment a user got its
  last token: every user wanted tokens throughout. Each user's rate in the window is
  its dispatch events over the window; its *fair share* is the max-min share of the
  window's total rate under the users' limits (water filling: no user above its
  limit, the rest split evenly). The figures are each user's rate / fair share, their
  Jain's index and their minimum. A user the places left out from its arrival has a
  figure near 0 even if it was served once the others were done.

Figures only; :mod:`ratebench.analysis.checks` applies the thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ratebench.analysis.fairness import jain_index
from ratebench.analysis.load import RunData
from ratebench.events import KIND_DISPATCH
from ratebench.runrecords import PhaseRecord
from ratebench.analysis.runsummary import client_user

# The first steps after the last user's first request: its prefill, before it can take a place.
SETTLE_NS = 200_000_000


@dataclass
class StreamWait:
    client_id: str
    stream_index: int
    wait_ns: int  # the longest time without a token
    where: str  # "first token", "between tokens", "after its last token until closed"
    at_ns: int  # when that wait began
    tokens: int
    excused_ns: int = 0  # of a first token's wait: the engine's full steps in it, left out of wait_ns


@dataclass
class StreamWaits:
    """The streams of one user in one phase."""

    user: str
    limit_tps: int
    streams: int
    waits: list[StreamWait]
    # PRIORITY policy with the user's streams at several priorities: the waits leave out the time while a
    # stream of a higher priority of the same user was open (its streams' priorities, lowest value first)
    priorities: list[int] = field(default_factory=list)

    @property
    def expected_ns(self) -> float:
        """The time between two tokens of one stream when the streams take turns: S / N."""
        return self.streams / self.limit_tps * 1e9

    @property
    def worst(self) -> StreamWait | None:
        return max(self.waits, key=lambda w: w.wait_ns) if self.waits else None


@dataclass
class PlaceShares:
    """The users' shares of the active places in one phase."""

    window_start_ns: int
    window_end_ns: int
    rates_tps: dict[str, float]
    fair_tps: dict[str, float]
    ratios: dict[str, float] = field(default_factory=dict)  # rate / fair share
    # Users whose requests had all ended before the last user arrived (plus SETTLE_NS): the users
    # never all wanted tokens at once, so the phase measured nothing (sized too short).
    done_early: list[str] = field(default_factory=list)
    # PRIORITY policy, users at several priorities: each user's priority (its highest, the lowest value)
    # and the engine's places (the fair shares go by priority, each user's capped by its streams)
    priorities: dict[str, int] = field(default_factory=dict)
    places: int | None = None

    @property
    def window_s(self) -> float:
        return (self.window_end_ns - self.window_start_ns) / 1e9

    @property
    def jain(self) -> float | None:
        return jain_index(np.array(list(self.ratios.values()))) if self.ratios else None

    @property
    def worst(self) -> tuple[str, float] | None:
        return min(self.ratios.items(), key=lambda kv: kv[1]) if self.ratios else None

    @property
    def best(self) -> tuple[str, float] | None:
        return max(self.ratios.items(), key=lambda kv: kv[1]) if self.ratios else None

    @property
    def worst_above_lowest(self) -> tuple[str, float] | None:
        """PRIORITY policy: the worst ratio among the users above the lowest priority (their places
        come first, so they are owed their whole fair share, not place-share's half of it)."""
        if not self.priorities or not self.ratios:
            return None
        lowest = max(self.priorities.values())
        above = {u: r for u, r in self.ratios.items() if self.priorities.get(u, lowest) < lowest}
        return min(above.items(), key=lambda kv: kv[1]) if above else None


def _dispatch_by_record(run: RunData, phase: PhaseRecord) -> dict[int, np.ndarray]:
    """Dispatch event times of the phase's requests, by client record index."""
    trace = run.traces.get(phase.engine)
    if trace is None:
        return {}
    recs = trace.records
    sel = recs[(recs["kind"] == KIND_DISPATCH)]
    rec_idx = trace.req_record[sel["req"]]
    in_phase = (trace.req_phase[sel["req"]] == phase.index) & (rec_idx >= 0)
    sel, rec_idx = sel[in_phase], rec_idx[in_phase]
    out: dict[int, np.ndarray] = {}
    if not len(sel):
        return out
    order = np.argsort(rec_idx, kind="stable")
    rec_idx, t = rec_idx[order], sel["t_ns"][order]
    bounds = np.flatnonzero(np.diff(rec_idx)) + 1
    for chunk_t, chunk_i in zip(np.split(t, bounds), np.split(rec_idx, bounds)):
        out[int(chunk_i[0])] = np.sort(chunk_t)
    return out


def _first_token_spans(run: RunData, engine: str) -> tuple[np.ndarray, np.ndarray]:
    """(sent, first token) client times of every request sent to ``engine``; a request that got no token
    counts until it ended (done or cancelled), else to the end of time."""
    big = np.iinfo(np.int64).max
    sent, first = [], []
    for r in run.records:
        if r.engine != engine or r.sent_ns is None:
            continue
        end = r.first_token_ns if r.first_token_ns is not None else (r.done_ns or r.cancel_ns or big)
        sent.append(r.sent_ns)
        first.append(end)
    return np.array(sent, dtype=np.int64), np.array(first, dtype=np.int64)


def stream_wait_users(phase: PhaseRecord) -> list[str]:
    """Whose streams' waits are judged: the users ``params.stream_wait`` names, and every
    backlogged user with a limit and more than one stream (its streams share one budget, so
    one of them can be left behind while the others spend it)."""
    named = [u for u in phase.facts.stream_wait if u in phase.users]
    shared = [u for u, spec in phase.users.items()
              if u not in named and spec.backlogged and spec.limit_tps and spec.streams > 1]
    return named + shared


def stream_waits(run: RunData, phase: PhaseRecord) -> list[StreamWaits]:
    """The longest wait of every stream of the phase's :func:`stream_wait_users`: one grouping of the
    phase's dispatch events by client record, every record's waits computed at once."""
    users = stream_wait_users(phase)
    if not users:
        return []
    wanted = set(users)
    records_of: dict[str, list[int]] = {}  # one pass over the records, not one per user
    for i, r in enumerate(run.records):
        if (r.engine == phase.engine and r.scenario == phase.scenario and r.phase == phase.phase
                and r.sent_ns is not None):
            u = client_user(r.user)
            if u in wanted:
                records_of.setdefault(u, []).append(i)
    users = [u for u in users if phase.users[u].limit_tps]
    rec = np.array([i for u in users for i in records_of.get(u, [])], dtype=np.int64)
    owner = np.repeat(np.arange(len(users)), [len(records_of.get(u, [])) for u in users])
    n, first, last, top, top_at = _dispatch_figures(run, phase, rec)
    records = [run.records[i] for i in rec.tolist()]
    sent = np.array([r.sent_ns for r in records], dtype=np.int64)
    cancel = np.array([r.cancel_ns if r.cancelled and r.cancel_ns is not None else -1 for r in records],
                      dtype=np.int64)
    max_tokens = np.array([r.max_tokens for r in records], dtype=np.int64)
    full = full_step_time(run.traces.get(phase.engine), *_first_token_spans(run, phase.engine))
    best, best_at, where, start, measured = longest_waits(n, first, last, top, top_at, sent, cancel, max_tokens,
                                                          owner, len(users), full)
    priority = np.array([r.priority for r in records], dtype=np.int64)
    trace = run.traces.get(phase.engine)
    by_priority = trace is not None and trace.runs_priority_policy
    mixed: set[int] = set()
    if by_priority and len(records):
        mixed = _excuse_higher_priorities(run, phase, rec, records, owner, priority, start, cancel, max_tokens,
                                          best, best_at, where, measured, full)
    out = []
    ends = np.cumsum([len(records_of.get(u, [])) for u in users]).tolist()  # owner is in user order
    for k, user in enumerate(users):
        waits = []
        for j in range(ends[k - 1] if k else 0, ends[k]):
            if not measured[j]:
                continue  # no token and not closed: nothing to measure
            r, at = records[j], int(best_at[j])
            excused = 0
            if where[j] == 2:
                what = "after its last token until closed"
            else:
                what = "first token" if at == int(start[j]) else "between tokens"
                if what == "first token" and full is not None:
                    excused = int(full(start[j:j + 1], first[j:j + 1])[0])
            waits.append(StreamWait(r.client_id, r.stream_index, int(best[j]), what, at, int(n[j]), excused))
        spec = phase.users[user]
        levels = sorted({int(priority[j]) for j in range(ends[k - 1] if k else 0, ends[k])}) if k in mixed else []
        out.append(StreamWaits(user, spec.limit_tps, spec.streams, waits, levels))
    return out


def _excuse_higher_priorities(run, phase, rec, records, owner, priority, start, cancel, max_tokens,
                              best, best_at, where, measured, full=None) -> set[int]:
    """Under the PRIORITY policy: for every stream of a user whose streams have several priorities, its
    longest wait again, each wait less the time while one of its user's streams of a higher priority
    (a lower value) was open, from when it was sent to its end (the client's, else its last token); a
    first token's wait less the larger of that and its full steps (``full``, as :func:`longest_waits`).
    The arrays are updated in place; returns the owners (users) whose waits were so measured."""
    mixed = {int(u) for u in np.unique(owner) if len(np.unique(priority[owner == u])) > 1}
    if not mixed:
        return mixed
    dispatch = _dispatch_by_record(run, phase)
    times = [dispatch.get(int(i), np.empty(0, dtype=np.int64)) for i in rec.tolist()]
    opened = []
    for j, r in enumerate(records):
        ends = [t for t in (r.done_ns, r.cancel_ns if r.cancelled else None) if t is not None]
        if len(times[j]):
            ends.append(int(times[j][-1]))
        opened.append((r.sent_ns, max(ends) if ends else None))
    for j in np.flatnonzero(np.isin(owner, list(mixed))).tolist():
        if not measured[j]:
            continue
        busy = sorted((opened[i][0], opened[i][1]) for i in np.flatnonzero(
            (owner == owner[j]) & (priority < priority[j])).tolist() if opened[i][1] is not None)
        t = times[j]
        marks = [int(start[j]), *t.tolist()]
        gaps = [(marks[i], marks[i + 1], 0 if i == 0 else 1) for i in range(len(marks) - 1)]
        if cancel[j] >= 0 and len(t) < max_tokens[j]:
            gaps.append((int(t[-1]) if len(t) else int(start[j]), int(cancel[j]), 2))
        worst = None
        for a, b, kind in gaps:
            covered, reach = 0, a
            for lo, hi in busy:  # the union of the higher priorities' open spans within (a, b), by start
                lo, hi = max(lo, reach), min(hi, b)
                if hi > lo:
                    covered += hi - lo
                    reach = hi
            if kind == 0 and full is not None:
                covered = max(covered, int(full(np.array([a]), np.array([b]))[0]))
            wait = b - a - covered
            if worst is None or wait > worst[0]:
                worst = (wait, a, kind)
        if worst is not None:
            best[j], best_at[j], where[j] = worst
    return mixed


def full_step_time(trace, sent_ns: np.ndarray | None = None, first_ns: np.ndarray | None = None):
    """``f(a, b)``: per pair of arrays, the time within [a, b) of the engine's full steps, those that
    scheduled its whole token budget (``max_num_batched_tokens`` in the event file's header); a step
    lasts until the next one starts. None without step records or a budget in the header.

    The step records are the engine's account of itself; the client's is held against it: with the
    times every request on the engine was sent (``sent_ns``) and got its first token (``first_ns``;
    no token: when it ended), a step counts only when two requests at least were waiting for their
    first token as it began (the one whose wait is measured and another, whose prompt the step could
    have been prefilling). A recorder that called every step full leaves a stream's wait behind its
    siblings' decodes whole."""
    if trace is None or not len(trace.events.steps):
        return None
    budget = trace.events.meta.get("max_num_batched_tokens")
    if not isinstance(budget, int) or budget <= 0:
        return None
    steps = np.sort(trace.events.steps, order="t_ns", kind="stable")
    t = steps["t_ns"].astype(np.int64)
    if len(t) < 2:
        return None
    is_full = steps["tokens"][:-1].astype(np.int64) >= budget  # the last step's end is unknown: not counted
    if sent_ns is not None and first_ns is not None:
        s, e = np.sort(np.asarray(sent_ns, dtype=np.int64)), np.sort(np.asarray(first_ns, dtype=np.int64))
        pending = np.searchsorted(s, t[:-1], side="right") - np.searchsorted(e, t[:-1], side="right")
        is_full &= pending >= 2
    dur = np.where(is_full, np.diff(t), 0)
    cum = np.concatenate([[0], np.cumsum(dur)])  # full time before step k starts

    def upto(x: np.ndarray) -> np.ndarray:
        """Full-step time before x."""
        k = np.clip(np.searchsorted(t, x, side="right") - 1, 0, len(dur) - 1)  # the step x falls in
        inside = np.where(x >= t[0], np.clip(x - t[k], 0, dur[k]), 0)
        return np.where(x >= t[0], cum[k] + inside, 0)

    def f(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        return np.maximum(upto(b) - upto(a), 0)
    return f


def longest_waits(n, first, last, top, top_at, sent, cancel, max_tokens, owner, n_users, full=None):
    """Every record's longest wait at once (arrays, one entry per record): from its dispatch figures
    (count ``n``, ``first`` and ``last`` time, longest gap between two ``top`` and when it began
    ``top_at``), when it was sent, when the driver closed it (-1: not cancelled), its ``max_tokens``
    and its user's number ``owner`` (of ``n_users``); ``full``: :func:`full_step_time`'s function, whose
    time a first token's wait leaves out (None: nothing left out). Returns (the wait, when it began,
    where: 0 to its first token, 1 between tokens, 2 after its last token until closed; its start,
    whether there was anything to measure): the first longest of those, as :func:`stream_waits` describes."""
    m = len(n)
    has = n > 0
    # the user's first token in the phase (its first prefills are not the limiter's doing)
    big = np.iinfo(np.int64).max
    user_first = np.full(n_users, big, dtype=np.int64)
    np.minimum.at(user_first, owner[has], first[has])
    uf = user_first[owner] if m else np.empty(0, dtype=np.int64)
    start = np.where(uf == big, sent, np.maximum(sent, np.minimum(uf, np.where(has, first, uf))))
    # still waiting when the driver closed it (not when its answer was complete)
    closed = (cancel >= 0) & (n < max_tokens)
    # the first longest of: sent (or start) to the first token, between tokens, the last token to closed
    first_wait = first - start
    if full is not None and m:
        first_wait = first_wait - np.where(has, full(start, np.where(has, first, start)), 0)
    best = np.where(has, first_wait, np.iinfo(np.int64).min)
    best_at = start.copy()
    where = np.zeros(m, dtype=np.int8)  # 0: from the start, 1: between tokens, 2: until closed
    better = (n >= 2) & (top > best)
    best = np.where(better, top, best)
    best_at = np.where(better, top_at, best_at)
    where[better] = 1
    tail = np.where(closed, cancel - np.where(has, last, start), 0)
    better = closed & (tail > best)
    best = np.where(better, tail, best)
    best_at = np.where(better, np.where(has, last, start), best_at)
    where[better] = 2
    return best, best_at, where, start, has | closed


def _dispatch_figures(run: RunData, phase: PhaseRecord, rec: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per client record of ``rec``, from the phase's dispatch events of its request: (count, first
    time, last time, longest time between two, when that began); 0, 0, 0, -1, 0 without events."""
    m = len(rec)
    out = [np.zeros(m, dtype=np.int64) for _ in range(5)]
    out[3][:] = -1
    trace = run.traces.get(phase.engine)
    if trace is None or not m:
        return tuple(out)
    fig = trace.request_gaps(KIND_DISPATCH)
    # each record's request code: the one whose req_record is it, of this phase
    code_of = np.full(len(run.records), -1, dtype=np.int64)
    mine = np.flatnonzero((trace.req_record >= 0) & (trace.req_phase == phase.index))
    code_of[trace.req_record[mine]] = mine
    code = code_of[rec]
    g = np.searchsorted(fig["codes"], code)
    ok = (code >= 0) & (g < len(fig["codes"]))
    ok[ok] = fig["codes"][g[ok]] == code[ok]
    for k, name in enumerate(("count", "first", "last", "gap", "gap_at")):
        out[k][ok] = fig[name][g[ok]]
    return tuple(out)


def fair_shares(total_tps: float, limits: dict[str, float]) -> dict[str, float]:
    """Max-min fair shares of ``total_tps`` under per-user limits (water filling)."""
    left, out = total_tps, {}
    users = sorted(limits, key=lambda u: limits[u])
    for k, u in enumerate(users):
        share = left / (len(users) - k)
        out[u] = min(limits[u], share)
        left -= out[u]
    return out


def fair_shares_by_priority(total_tps: float, limits: dict[str, float], priorities: dict[str, int],
                            streams: dict[str, int], places: int) -> dict[str, float]:
    """Fair shares of ``total_tps`` when higher priorities (lower values) go first: level by level, the
    max-min shares of what the levels before left, each user's capped by its limit and by its streams'
    places (``streams / places`` of the whole rate: a stream takes one place a step)."""
    left, out = total_tps, {}
    for level in sorted(set(priorities.values())):
        group = [u for u in limits if priorities[u] == level]
        caps = {u: min(limits[u], total_tps * min(1.0, streams[u] / places)) for u in group}
        shares = fair_shares(max(left, 0.0), caps)
        out.update(shares)
        left -= sum(shares.values())
    return out


def place_shares(run: RunData, phase: PhaseRecord) -> PlaceShares | None:
    """Each user's rate while every user wanted tokens, against its max-min fair share."""
    if not phase.facts.place_share:
        return None
    by_record = _dispatch_by_record(run, phase)
    first_sent: dict[str, int] = {}
    last_token: dict[str, int] = {}
    ended: dict[str, int] = {}  # when the user's last request ended (done, or its last token)
    times: dict[str, list[np.ndarray]] = {}
    priority: dict[str, int] = {}  # each user's highest priority (the lowest value) and its streams
    streams: dict[str, int] = {}
    for i, r in enumerate(run.records):
        if r.engine != phase.engine or r.scenario != phase.scenario or r.phase != phase.phase or r.sent_ns is None:
            continue
        u = client_user(r.user)
        first_sent[u] = min(first_sent.get(u, r.sent_ns), r.sent_ns)
        priority[u] = min(priority.get(u, r.priority), r.priority)
        streams[u] = streams.get(u, 0) + 1
        t = by_record.get(i)
        # a request never done still wanted tokens
        end_ns = np.iinfo(np.int64).max if r.done_ns is None else r.done_ns
        if t is not None and len(t):
            times.setdefault(u, []).append(t)
            last_token[u] = max(last_token.get(u, 0), int(t[-1]))
            end_ns = max(end_ns, int(t[-1]))
        ended[u] = max(ended.get(u, 0), end_ns)
    users = [u for u in phase.users if u in first_sent]
    if len(users) < 2:
        return None
    start = max(first_sent[u] for u in users) + SETTLE_NS
    done_early = [u for u in users if ended[u] <= start]
    if done_early:
        return PlaceShares(int(start), int(start), {}, {}, {}, done_early)
    end = min(last_token.get(u, 0) for u in users)
    if end <= start:
        # a user had no token after everyone arrived: measure to the end of the phase, where it gets 0
        end = max(last_token.values(), default=start)
    if end <= start:
        return None
    span_s = (end - start) / 1e9
    rates = {}
    for u in users:
        t = np.concatenate(times[u]) if u in times else np.empty(0, dtype=np.int64)
        rates[u] = float(((t > start) & (t <= end)).sum()) / span_s
    limits = {u: float(phase.users[u].limit_tps or np.inf) for u in users}
    trace = run.traces.get(phase.engine)
    places = trace.events.meta.get("max_num_active_seqs") if trace is not None else None
    levels = {u: priority[u] for u in users}
    by_priority = len(set(levels.values())) > 1 and bool(places) and trace.runs_priority_policy
    if by_priority:  # higher priorities first (PRIORITY policy), each user at its highest priority
        fair = fair_shares_by_priority(sum(rates.values()), limits, levels, streams, int(places))
    else:
        fair = fair_shares(sum(rates.values()), limits)
    ratios = {u: (rates[u] / fair[u]) if fair[u] > 0 else 1.0 for u in users}
    return PlaceShares(int(start), int(end), rates, fair, ratios, priorities=levels if by_priority else {},
                       places=int(places) if by_priority else None)
