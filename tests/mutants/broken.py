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


class BudgetPerRequest(Mutant):
    """One budget per request: every request is charged to a user named after itself."""

    name = "per-request"

    def on_request(self, request) -> None:
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
    """Charges of requests that were not scheduled (KV allocation failed, preempted) are never given back."""

    name = "no-refund"

    def apply(self, scheduler) -> None:
        def settle_without_refund(charged, num_scheduled_tokens, now_ns):
            events = scheduler.output_rate_events
            for request_id, request in charged.items():
                if request_id in num_scheduled_tokens:
                    scheduler._output_rate_last_served[(request.output_rate_user, request.priority)] = request
                    if events is not None:
                        events.dispatch(now_ns, request_id, request.output_rate_user)

        scheduler._settle_output_rate_charges = settle_without_refund


class ChargeEveryPrefillChunk(Mutant):
    """Every prefill chunk is charged, the middle ones too (they sample nothing).

    A refused middle chunk waits (gets no tokens this step); the last chunk and
    decode steps behave as shipped.
    """

    name = "charge-every-chunk"

    def apply(self, scheduler) -> None:
        shipped = scheduler._limit_output_rate_tokens

        def limit_every_chunk(request, num_computed_tokens, num_new_tokens, now_ns, charged, refused_users):
            if num_computed_tokens + num_new_tokens >= request.num_tokens or request.request_id in charged:
                return shipped(request, num_computed_tokens, num_new_tokens, now_ns, charged, refused_users)
            user = request.output_rate_user
            if user not in refused_users and scheduler.output_rate_limiter.try_take(user, now_ns):
                charged[request.request_id] = request
                return num_new_tokens
            refused_users.add(user)
            return 0

        scheduler._limit_output_rate_tokens = limit_every_chunk


class ThrottledCountActive(Mutant):
    """Admission as upstream: a throttled request still counts toward max_num_active_seqs.

    The patched waiting loop admits while ``len(running) < max_num_running_reqs``
    and ``len(running) - throttled < max_num_active_reqs``; with
    ``max_num_running_reqs`` equal to the active cap the first test is
    upstream's ``len(running) >= max_num_active_reqs`` and implies the second.
    """

    name = "throttled-count-active"

    def apply(self, scheduler) -> None:
        scheduler.max_num_running_reqs = scheduler.max_num_active_reqs


class NeverThrottle(Mutant):
    name = "never-throttle"

    def apply(self, scheduler) -> None:
        scheduler.output_rate_limiter.try_take = lambda user, now_ns: True


class HalfRate(Mutant):
    """GCRA at N/2 for every user (the configured limits, in the flags and events, say N)."""

    name = "half-rate"

    def apply(self, scheduler) -> None:
        limiter = scheduler.output_rate_limiter
        limiter.default_tokens_per_second = max(1, limiter.default_tokens_per_second // 2)
        limiter.user_tokens_per_second = {u: max(1, n // 2) for u, n in limiter.user_tokens_per_second.items()}


MUTANTS: dict[str, type[Mutant]] = {
    m.name: m
    for m in (Burst1s, BudgetPerRequest, RollingWindow1s, NoRefund, ChargeEveryPrefillChunk, ThrottledCountActive,
              NeverThrottle, HalfRate)
}
