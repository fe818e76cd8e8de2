"""Deliberately broken limiters: test fixtures that the verifier must reject.

Each is applied to one in-process scheduler by monkeypatching that instance (or
its limiter); nothing here edits vLLM or the patch, and none of it is shipped.
"""

from __future__ import annotations

from collections import deque

from vllm.v1.core.sched.output_rate import OutputRateLimiter

from mutants.runfolder import Mutant

NS_PER_S = 1_000_000_000


class Burst1s(Mutant):
    """GCRA with a burst of 1 s instead of 100 ms."""

    name = "burst-1s"

    def apply(self, scheduler) -> None:
        scheduler.output_rate_limiter.burst_ns = NS_PER_S


class CleanupForgetsDebt(Mutant):
    """The idle clean-up (once a second) drops every user's state, not only users whose TAT is past:
    a backlogged user's debt (its TAT up to the burst ahead of now) is forgiven each second, so it
    gets a fresh burst on top of its rate."""

    name = "cleanup-forgets-debt"

    def apply(self, scheduler) -> None:
        limiter = scheduler.output_rate_limiter

        def cleanup_idle_users(now_ns: int) -> None:
            limiter.next_cleanup_ns = now_ns + NS_PER_S
            limiter._tat_scaled.clear()

        limiter.cleanup_idle_users = cleanup_idle_users


class NoClampToNow(Mutant):
    """GCRA without ``max(TAT, now)``: a TAT left in the past stays there, so a user that pauses banks
    credit (until the idle clean-up drops it, at most a second later) and spends it in one burst."""

    name = "no-clamp-to-now"

    def apply(self, scheduler) -> None:
        limiter = scheduler.output_rate_limiter

        def try_take(user: str, now_ns: int) -> bool:
            rate = limiter.user_tokens_per_second.get(user, limiter.default_tokens_per_second)
            tat = limiter._tat_scaled.get(user)
            if tat is None:
                limiter._tat_scaled[user] = now_ns * rate + NS_PER_S
                return True
            if tat > (now_ns + limiter.burst_ns) * rate:
                return False
            limiter._tat_scaled[user] = tat + NS_PER_S
            return True

        limiter.try_take = try_take


class RefusalAdvancesTat(Mutant):
    """A refused charge still costs the user: each refusal moves its TAT a quarter of a token ahead, so a
    backlogged user, refused again and again while it waits, falls further behind its rate."""

    name = "refusal-advances-tat"

    def apply(self, scheduler) -> None:
        limiter = scheduler.output_rate_limiter
        take = limiter.try_take

        def try_take(user: str, now_ns: int) -> bool:
            if take(user, now_ns):
                return True
            limiter._tat_scaled[user] += NS_PER_S // 4
            return False

        limiter.try_take = try_take


class BudgetPerRequest(Mutant):
    """One budget per request: every request is charged to a user named after itself."""

    name = "per-request"

    def on_request(self, request) -> None:
        request.output_rate_user = request.request_id


class AnswersBeyondTheFirstFree(Mutant):
    """A request of n answers is n engine requests (``<index>_<id>``); only the first is charged to the
    request's user, every other answer to a budget of its own (as a limiter keyed by the parent request, or
    one that lost the user on the answers vLLM's frontend makes, would). The events name the user."""

    name = "answers-beyond-the-first-free"

    def on_request(self, request) -> None:
        if not request.request_id.startswith(("0_", "cmpl-")):
            request.output_rate_user = request.request_id


class RollingWindowLimiter(OutputRateLimiter):
    """The seed's first version: up to N tokens in any trailing second.

    A whole second's budget goes at once, then the user stalls until the
    window slides past its first tokens.
    """

    def __init__(self, base: OutputRateLimiter) -> None:
        super().__init__(base.default_tokens_per_second, base.user_tokens_per_second, base.burst_ns,
                         base.clock_ns)
        self._sent: dict[str, deque[int]] = {}

    def _window(self, user: str, now_ns: int) -> deque[int]:
        sent = self._sent.setdefault(user, deque())
        while sent and sent[0] <= now_ns - NS_PER_S:
            sent.popleft()
        return sent

    def try_take(self, user: str, now_ns: int) -> bool:
        sent = self._window(user, now_ns)
        if len(sent) >= self.rate_of(user):
            return False
        sent.append(now_ns)
        return True

    def refund(self, user: str) -> None:
        sent = self._sent.get(user)
        if sent:
            sent.pop()

    def ready_at_ns(self, user: str) -> int:
        sent = self._sent.get(user)
        return sent[0] + NS_PER_S if sent and len(sent) >= self.rate_of(user) else 0

    def cleanup_idle_users(self, now_ns: int) -> None:
        for user in [u for u in self._sent if not self._window(u, now_ns)]:
            del self._sent[user]


class RollingWindow1s(Mutant):
    name = "rolling-1s"

    def apply(self, scheduler) -> None:
        scheduler.output_rate_limiter = RollingWindowLimiter(scheduler.output_rate_limiter)


class NoRefund(Mutant):
    """Charges of requests that were not scheduled (KV allocation failed, preempted) are never given back.

    The scheduler refunds at one point only (the end of ``schedule()``), so a
    limiter whose ``refund`` does nothing is exactly that bug, whatever the
    scheduler's internals.
    """

    name = "no-refund"

    def apply(self, scheduler) -> None:
        scheduler.output_rate_limiter.refund = lambda user: None


class RefundTwice(Mutant):
    """Every refund gives back two tokens: each charge of a request that was not scheduled (KV allocation
    failed, preempted) leaves its user one token ahead of its budget (the other side of NoRefund)."""

    name = "refund-twice"

    def apply(self, scheduler) -> None:
        limiter = scheduler.output_rate_limiter
        refund = limiter.refund

        def refund_twice(user):
            refund(user)
            refund(user)

        limiter.refund = refund_twice


class FirstTokenFree(Mutant):
    """A request's first token costs its user nothing when the step that admits it from the queue samples
    it: the charge is given back at once (its dispatch event still written), as a limiter that charged
    only tokens sampled in running would. A user's short requests get past its budget by one token each."""

    name = "first-token-free"

    def apply(self, scheduler) -> None:
        limit = scheduler._limit_output_rate_tokens
        limiter = scheduler.output_rate_limiter

        def limit_all_but_the_first(request, num_computed_tokens, num_new_tokens, now_ns, charged):
            before = request.request_id in charged
            granted = limit(request, num_computed_tokens, num_new_tokens, now_ns, charged)
            if not before and request.request_id in charged and request.num_output_tokens == 0:
                limiter.refund(request.output_rate_user)
            return granted

        scheduler._limit_output_rate_tokens = limit_all_but_the_first


class ScaledRate(Mutant):
    """GCRA at ``factor`` times every user's limit (the flags and events still say the limit): how fine
    the verifier's resolution is, above (the bound) and below (delivery, even spacing)."""

    factor = 1.0

    def apply(self, scheduler) -> None:
        limiter = scheduler.output_rate_limiter
        limiter.default_tokens_per_second = max(1, int(limiter.default_tokens_per_second * self.factor))
        limiter.user_tokens_per_second = {
            u: max(1, int(n * self.factor)) for u, n in limiter.user_tokens_per_second.items()}


class FivePercentOver(ScaledRate):
    """GCRA at 1.05 N."""

    name = "five-percent-over"
    factor = 1.05


class FivePercentUnder(ScaledRate):
    """GCRA at 0.95 N."""

    name = "five-percent-under"
    factor = 0.95


class Burst150ms(Mutant):
    """GCRA with a burst of 150 ms instead of 100 ms (half again: 0.05 N tokens more at once)."""

    name = "burst-150ms"

    def apply(self, scheduler) -> None:
        scheduler.output_rate_limiter.burst_ns = 150 * NS_PER_S // 1000


class ChargeEveryPrefillChunk(Mutant):
    """Middle prefill chunks (they sample nothing) are charged like sampling steps, and wait when refused.

    Applied around ``schedule()``, so it does not depend on where the scheduler
    makes its own charges: before each step, every running request whose next
    chunk cannot finish its prompt (more tokens left than the step's token
    budget) is charged; a refused one sits this step out (hidden from
    ``running`` while the scheduler runs). After the step, a charge is recorded
    as a dispatch event if the chunk ran, and refunded if it did not. (The
    first chunk, scheduled from the waiting queue, stays free.)
    """

    name = "charge-every-chunk"

    def apply(self, scheduler) -> None:
        shipped = scheduler.schedule
        limiter = scheduler.output_rate_limiter

        def schedule_charging_every_chunk():
            now_ns = limiter.clock_ns()
            charged, refused_users, hidden = [], set(), []
            for index, request in enumerate(scheduler.running):
                middle = (request.num_computed_tokens < request.num_prompt_tokens
                          and request.num_tokens - request.num_computed_tokens > scheduler.max_num_scheduled_tokens)
                if not middle:
                    continue
                user = request.output_rate_user
                if user not in refused_users and limiter.try_take(user, now_ns):
                    charged.append(request)
                else:
                    refused_users.add(user)
                    hidden.append((index, request))
            for _, request in hidden:
                scheduler.running.remove(request)
            try:
                out = shipped()
            finally:
                for index, request in hidden:
                    scheduler.running.insert(min(index, len(scheduler.running)), request)
            for request in charged:
                if request.request_id in out.num_scheduled_tokens:
                    if scheduler.output_rate_events is not None:
                        scheduler.output_rate_events.dispatch(now_ns, request.request_id, request.output_rate_user)
                else:
                    limiter.refund(request.output_rate_user)
            return out

        scheduler.schedule = schedule_charging_every_chunk


class ThrottledCountActive(Mutant):
    """Admission as upstream: a throttled request still counts toward max_num_active_seqs.

    The patched waiting loop admits while ``len(running) < max_num_running_reqs``
    and ``len(running) - throttled < max_num_active_reqs``; with
    ``max_num_running_reqs`` equal to the active cap the first test is
    upstream's ``len(running) >= max_num_active_reqs`` and implies the second,
    and no throttled resident gives its slot to a user with budget.
    """

    name = "throttled-count-active"

    def apply(self, scheduler) -> None:
        scheduler.max_num_running_reqs = scheduler.max_num_active_reqs
        # ... and, as upstream, nobody gives a slot back (ThrottledKeepSlots)
        victim = scheduler._output_rate_victim
        scheduler._output_rate_victim = (
            lambda request, benched=False, for_slot=False: None if for_slot else victim(request, benched)
        )


class NeverThrottle(Mutant):
    name = "never-throttle"

    def apply(self, scheduler) -> None:
        scheduler.output_rate_limiter.try_take = lambda user, now_ns: True


class HalfRate(ScaledRate):
    """GCRA at N/2 for every user (the configured limits, in the flags and events, say N)."""

    name = "half-rate"
    factor = 0.5


class NoWaitingPreemption(Mutant):
    """The waiting loop never preempts, as upstream's: a neighbour's new request that needs KV
    waits while a throttled user's parked requests keep theirs idle. (The running loop still
    preempts parked requests first.)"""

    name = "no-waiting-preemption"

    def apply(self, scheduler) -> None:
        from vllm.v1.request import RequestStatus

        pick = scheduler._output_rate_victim
        # The waiting loop asks on behalf of a waiting request, the running loop of a running one.
        scheduler._output_rate_victim = (
            lambda request, **kw: pick(request, **kw) if request.status == RequestStatus.RUNNING else None)


class ClumpedLimiter(OutputRateLimiter):
    """GCRA that, once it refuses a user, keeps refusing it for ``hold_ns``: the budget and the bound
    are kept (the credit piles up, within the 100 ms burst, and goes at once), the spacing is not."""

    def __init__(self, base: OutputRateLimiter, hold_ns: int) -> None:
        super().__init__(base.default_tokens_per_second, base.user_tokens_per_second, base.burst_ns,
                         base.clock_ns)
        self.hold_ns = hold_ns
        self._held_until: dict[str, int] = {}

    def try_take(self, user: str, now_ns: int) -> bool:
        if now_ns < self._held_until.get(user, 0):
            return False
        if super().try_take(user, now_ns):
            return True
        self._held_until[user] = now_ns + self.hold_ns
        return False

    def ready_at_ns(self, user: str) -> int:
        return max(super().ready_at_ns(user), self._held_until.get(user, 0))


class ClumpedRelease(Mutant):
    """Tokens released in clumps every 60 ms instead of one by one as they come due."""

    name = "clumped-release"

    def apply(self, scheduler) -> None:
        scheduler.output_rate_limiter = ClumpedLimiter(scheduler.output_rate_limiter, 60_000_000)


class LateReady(Mutant):
    """A refused user is told to come back 50 ms after its next token is due: parked requests wake late
    (the engine loop waits until the same time), and the tokens due meanwhile go at once."""

    name = "late-ready"

    def apply(self, scheduler) -> None:
        limiter = scheduler.output_rate_limiter
        ready_at = limiter.ready_at_ns
        limiter.ready_at_ns = lambda user: ready_at(user) + 50_000_000


class ChargesAnotherUser(Mutant):
    """user-a's requests are charged to another user (as a patch or gateway that trusted the OpenAI
    ``user`` field would): user-a's own budget sees none of them, and its rows look clean."""

    name = "charges-another-user"
    events_name_charged_user = True

    def on_request(self, request) -> None:
        if request.output_rate_user == "user-a":
            request.output_rate_user = "user-a-from-the-user-field"


class ChargesPromptTokens(Mutant):
    """Prompt tokens charged too: each new request puts its prompt's tokens on its user's account
    (its TAT moves ahead by prompt tokens / N) without a dispatch event, so the user's next tokens,
    this request's first among them, wait for the prompt to be paid off."""

    name = "charges-prompt-tokens"

    def apply(self, scheduler) -> None:
        limiter = scheduler.output_rate_limiter
        add = scheduler.add_request

        def add_charging_the_prompt(request):
            user = request.output_rate_user
            now_scaled = limiter.clock_ns() * limiter.rate_of(user)
            tat = max(limiter._tat_scaled.get(user, now_scaled), now_scaled)
            limiter._tat_scaled[user] = tat + request.num_prompt_tokens * NS_PER_S
            add(request)

        scheduler.add_request = add_charging_the_prompt


MUTANTS: dict[str, type[Mutant]] = {
    m.name: m
    for m in (Burst1s, BudgetPerRequest, RollingWindow1s, NoRefund, ChargeEveryPrefillChunk, ThrottledCountActive,
              NeverThrottle, HalfRate, NoWaitingPreemption, ClumpedRelease, LateReady, ChargesAnotherUser,
              ChargesPromptTokens)
}



class QueueWaitsAtFullCap(Mutant):
    """The active places go round the users only once running holds more requests than places;
    while running is exactly full, the queue waits for a running request to end (upstream's
    admission, and the patch before the queue's head took its turn at a full cap). Users whose
    streams all queued behind others' get no place until those end."""

    name = "queue-waits-at-full-cap"

    def apply(self, scheduler) -> None:
        from vllm.v1.core.sched.request_queue import create_request_queue

        schedule = scheduler.schedule

        def schedule_without_the_queue(*args, **kwargs):
            if len(scheduler.running) != scheduler.max_num_active_reqs or not scheduler.waiting:
                return schedule(*args, **kwargs)
            # the step sees an empty queue; requests preempted during it go back in front
            queue, scheduler.waiting = scheduler.waiting, create_request_queue(scheduler.policy)
            try:
                return schedule(*args, **kwargs)
            finally:
                preempted, scheduler.waiting = scheduler.waiting, queue
                if preempted:
                    queue.prepend_requests(preempted)

        scheduler.schedule = schedule_without_the_queue


class HeadPlaceWithoutSlot(Mutant):
    """The head of the waiting queue is given a place in its turn even when no resident slot can take
    it (the patch before this was found): with every slot held by streams of users with budget
    waiting on the bench for a place, that place idles each step, a quarter of them with four places
    (no limit binds)."""

    name = "head-place-without-slot"

    def apply(self, scheduler) -> None:
        scheduler._output_rate_head_may_take_slot = lambda queued_taking: True


class HeadSlotFromAnyThrottled(Mutant):
    """The head of the waiting queue is given a place in its turn whenever any throttled resident holds a
    slot, even when the queued claimants placed ahead of it take every such slot first (the patch before
    this was found): the head then finds no slot and its place idles, with streams of users with budget
    waiting on the bench (cpu-tiny's crowd: runs of 2 such steps on the real engine, 3 in the harness)."""

    name = "head-slot-from-any-throttled"

    def apply(self, scheduler) -> None:
        def head_may_take_slot(queued_taking: int) -> bool:
            resident = (len(scheduler.running) + queued_taking + scheduler._output_rate_num_parked
                        + scheduler.num_waiting_for_streaming_input)
            if resident < scheduler.max_num_running_reqs:
                return True
            return any(True for _ in scheduler._output_rate_throttled_parked())

        scheduler._output_rate_head_may_take_slot = head_may_take_slot


class NoClaims(Mutant):
    """A stream preempted for a neighbour's KV loses its turn: its siblings holding KV keep spending
    the user's budget while it waits in the queue (the patch before preempted streams kept claims)."""

    name = "no-claims"

    def apply(self, scheduler) -> None:
        scheduler._advance_output_rate_claims = lambda *args, **kwargs: None


class QueuedWhileRefused(Mutant):
    """A queued request whose user is out of budget stays in the queue (not admitted one token
    short of sampling, as the patch does with chunked prefill): its user's running streams, served
    before the queue, take every token as it comes due, so a stream that arrived after its user's
    burst was spent waits until a sibling ends."""

    name = "queued-while-refused"

    def apply(self, scheduler) -> None:
        from vllm.v1.request import RequestStatus

        refuse = scheduler._refuse_output_rate_charge

        def refuse_queued(request, num_computed_tokens, now_ns):
            given = refuse(request, num_computed_tokens, now_ns)
            return 0 if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) else given

        scheduler._refuse_output_rate_charge = refuse_queued


class PlacesInListOrder(Mutant):
    """Under the PRIORITY policy (no bench), ``running`` is not ordered by the users' turns when the
    active cap binds and the queue's head never takes a turn: the places go to whoever is first in
    running (the seed's open problem), and users whose streams queued get none until those end."""

    name = "places-in-list-order"

    def apply(self, scheduler) -> None:
        scheduler._order_output_rate_running = lambda now_ns: 0


class PlacesIgnorePriority(Mutant):
    """Under the PRIORITY policy the places go round the users in turn whatever their priorities:
    ``running`` is sorted by the users' turns only, as under FCFS, so a user of a higher priority
    waits its turn behind users of lower ones (the policy says: higher priorities first)."""

    name = "places-ignore-priority"

    def apply(self, scheduler) -> None:
        from vllm.v1.core.sched.request_queue import SchedulingPolicy

        order = scheduler._order_output_rate_running

        def order_by_turns_only(now_ns):
            policy = scheduler.policy
            scheduler.policy = SchedulingPolicy.FCFS
            try:
                return order(now_ns)
            finally:
                scheduler.policy = policy

        scheduler._order_output_rate_running = order_by_turns_only


class PlacesTiesToTheOldestStream(Mutant):
    """Under the PRIORITY policy ``running`` is sorted by the streams' own turns before the places are
    ordered (patch commit e0fb803, withdrawn): users whose turns are equal then go in the order of
    their least recently served streams, and a user with two streams, whose other stream sat out the
    last round, wins every such tie: one place a step, where users take turns."""

    name = "places-ties-to-the-oldest-stream"

    def apply(self, scheduler) -> None:
        order = scheduler._order_output_rate_running

        def order_after_a_stream_sort(now_ns):
            scheduler.running.sort(key=lambda request: request.output_rate_turn)
            return order(now_ns)

        scheduler._order_output_rate_running = order_after_a_stream_sort


class RunningLoopUpstreamVictim(Mutant):
    """When a running request of a user with budget needs a KV block, the running loop preempts
    upstream's victim (the last of running, often that request itself) instead of a throttled
    request holding KV; only the waiting loop still takes throttled victims first."""

    name = "running-loop-upstream-victim"

    def apply(self, scheduler) -> None:
        victim = scheduler._output_rate_victim
        scheduler._output_rate_victim = (
            lambda request, benched=False, for_slot=False: None if benched else victim(request, for_slot=for_slot)
        )


class ThrottledKeepSlots(Mutant):
    """Throttled residents keep their slots (the patch before work conservation): with every slot
    held by parked requests, requests of users with budget queue behind them until the throttled
    answers end, while the active places idle."""

    name = "throttled-keep-slots"

    def apply(self, scheduler) -> None:
        victim = scheduler._output_rate_victim
        scheduler._output_rate_victim = (
            lambda request, benched=False, for_slot=False: None if for_slot else victim(request, benched)
        )


class PenaltyAfterRefusal(Mutant):
    """A user refused a charge stays blocked a second past its ready time (a penalty that outlives its
    budget; no further refuse event is recorded, as for any user known to be blocked): its next
    requests, sent with budget to spare, wait. The user counts as bound (refused in the phase), so
    only its requests sent clear of its limit can show it."""

    name = "penalty-after-refusal"

    def apply(self, scheduler) -> None:
        refuse = scheduler._refuse_output_rate_charge

        def penalise(request, num_computed_tokens, now_ns):
            given = refuse(request, num_computed_tokens, now_ns)
            user = request.output_rate_user
            blocked = scheduler._output_rate_blocked_until
            if blocked.get(user, 0) > now_ns and not getattr(request, "_penalised", False):
                blocked[user] += 1_000_000_000
                request._penalised = True
            return given

        scheduler._refuse_output_rate_charge = penalise


class KeptKVNeverGiven(Mutant):
    """A throttled request that gave its slot keeps its KV until it is readmitted, whoever needs it:
    a request of a user with budget that does not fit without those blocks waits (after the parked
    residents are preempted for it), with a free slot and idle places, until the throttled user's
    budget returns."""

    name = "kept-kv-never-given"

    def apply(self, scheduler) -> None:
        scheduler._drop_output_rate_kept_kv = lambda request: False


class StreamsKeepTheirPlaces(Mutant):
    """FCFS, while the active places bind: the bench forgets which of a user's streams sampled last
    (none counted served, every turn key equal), so each stream goes back to the front of its user's
    bench in its order and a user's first resident stream takes its user's place step after step;
    its siblings sample only when the user has places to spare (users still take turns)."""

    name = "streams-keep-their-places"

    def apply(self, scheduler) -> None:
        bench = scheduler._bench_output_rate_running

        def bench_without_stream_turns(now_ns: int) -> int:
            for request in scheduler.running:
                request.output_rate_turn = 0
            for requests in scheduler._output_rate_parked.values():
                for request in requests:
                    request.output_rate_turn = 0
            scheduler._output_rate_served = {}
            return bench(now_ns)

        scheduler._bench_output_rate_running = bench_without_stream_turns


class NewStreamsHeldAfterPrefills(Mutant):
    """An admission gate that keeps a new request of a user with requests running out of the scheduler
    while another user's prompt is being prefilled, and then for ``HOLD_NS`` more (a gate that waits for the
    engine to go quiet, then for a quiet spell): the stream waits behind the other user's full prefill
    steps, as it may, and then long after them, while its siblings take every token of its user."""

    name = "new-streams-held-after-prefills"
    HOLD_NS = 800_000_000

    def apply(self, scheduler) -> None:
        clock = scheduler.output_rate_limiter.clock_ns
        add, schedule = scheduler.add_request, scheduler.schedule
        held: list = []
        quiet_since: list[int | None] = [None]

        def add_request(request) -> None:
            user = request.output_rate_user
            mine = [r for r in scheduler.requests.values() if r.output_rate_user == user]
            if mine and any(r.output_rate_user != user and r.num_computed_tokens < r.num_prompt_tokens
                            for r in scheduler.requests.values()):
                held.append(request)
            else:
                add(request)

        def gated_schedule():
            now = clock()
            if held:
                users = {r.output_rate_user for r in held}
                busy = any(r.output_rate_user not in users and r.num_computed_tokens < r.num_prompt_tokens
                           for r in scheduler.requests.values())
                if busy:
                    quiet_since[0] = None
                elif quiet_since[0] is None:
                    quiet_since[0] = now
                elif now - quiet_since[0] >= self.HOLD_NS:
                    while held:
                        add(held.pop(0))
            return schedule()

        scheduler.add_request = add_request
        scheduler.schedule = gated_schedule
