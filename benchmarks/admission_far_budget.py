"""Benchmark: should a throttled user's queued requests be admitted while its budget is far away?

    .venv/bin/python benchmarks/admission_far_budget.py [--seconds 20]

The real patched scheduler on the fake clock (``tests/sched_harness.py``), 10 ms steps,
chunked prefill in 128-token chunks, 16-token blocks. User s (2 tok/s) keeps 4 closed-loop
streams of 256-token prompts; user b (unlimited) sends a 64-token prompt for 20 tokens every
100 ms. Two admission rules for s's queued requests:

    A  (the patch) admitted when they fit, a prefill held one short of sampling, parked
       with its KV until s's turn comes
    B  kept in the queue while s is refused until more than 100 ms from now (a
       monkeypatch of ``_limit_output_rate_tokens``: not admitted, not even a free chunk)

Prints, per setting and rule: b's first-token delay (mean, p90, max), s's rate, tokens per
stream of s, s's first-token delay (p50, max), prefill tokens s recomputed after
preemptions, preemptions of s, and KV blocks held by parked requests (mean per step).
Figures and the choice: patches/vllm-0.32.0/README.md ("Admission of throttled users'
queued requests").
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from sched_harness import Engine, FakeClock, create_scheduler, make_request  # noqa: E402

HORIZON_NS = 100_000_000


def keep_far_requests_queued(scheduler) -> None:
    """Rule B: a queued request of a user refused until more than HORIZON_NS from now is not admitted."""
    limit = scheduler._limit_output_rate_tokens

    def limit_or_keep_queued(request, num_computed_tokens, num_new_tokens, now_ns, charged):
        ready_at_ns = scheduler._output_rate_blocked_until.get(request.output_rate_user, 0)
        if ready_at_ns - now_ns > HORIZON_NS:
            return 0
        return limit(request, num_computed_tokens, num_new_tokens, now_ns, charged)

    scheduler._limit_output_rate_tokens = limit_or_keep_queued


def run(rule: str, *, seconds: float, s_streams: int = 4, s_tokens: int = 6, num_blocks: int = 72,
        async_scheduling: bool = False, policy: str = "fcfs") -> dict:
    clock = FakeClock()
    scheduler = create_scheduler(default_tps=2, user_tps={"b": 100_000}, num_blocks=num_blocks, block_size=16,
                                 max_num_batched_tokens=128, async_scheduling=async_scheduling, policy=policy,
                                 clock=clock)
    if rule == "B":
        keep_far_requests_queued(scheduler)
    engine = Engine(scheduler, clock, step_s=0.01)
    start_ns = clock()
    sent: dict[str, int] = {}
    s_requests, b_requests = [], []
    current = [None] * s_streams
    next_b_ns = start_ns
    scheduled: dict[str, int] = {}
    parked_blocks = steps = s_preempted = n = 0
    while clock() - start_ns < seconds * 1e9:
        now = clock()
        for i in range(s_streams):
            if current[i] is None or current[i].is_finished():
                n += 1
                current[i] = make_request(f"s{i}-{n}", user="s", prompt_len=256, max_tokens=s_tokens,
                                          prompt_token=100 + n)
                s_requests.append(current[i])
                sent[current[i].request_id] = now
                engine.add(current[i])
        if now >= next_b_ns:
            n += 1
            request = make_request(f"b-{n}", user="b", prompt_len=64, max_tokens=20, prompt_token=100 + n)
            b_requests.append(request)
            sent[request.request_id] = now
            engine.add(request)
            next_b_ns = now + 100_000_000
        out = engine.step()
        steps += 1
        for request_id, tokens in out.num_scheduled_tokens.items():
            scheduled[request_id] = scheduled.get(request_id, 0) + tokens
        s_preempted += sum(1 for request_id in out.preempted_req_ids if request_id.startswith("s"))
        parked_blocks += sum(len(scheduler.kv_cache_manager.get_blocks(r.request_id).blocks[0])
                             for requests in scheduler._output_rate_parked.values() for r in requests)
    engine.drain()

    def first_token_ms(requests):
        return sorted((engine.token_times[r.request_id][0] - sent[r.request_id]) / 1e6
                      for r in requests if r.request_id in engine.token_times)

    b_ms, s_ms = first_token_ms(b_requests), first_token_ms(s_requests)
    needed = sum(r.num_prompt_tokens + max(r.num_output_tokens - 1, 0) for r in s_requests)
    return {
        "b_first_token_ms": (round(statistics.mean(b_ms), 1), b_ms[int(0.9 * len(b_ms))], b_ms[-1]),
        "s_tps": round(sum(len(engine.token_times.get(r.request_id, [])) for r in s_requests) / seconds, 2),
        "s_tokens_per_stream": [sum(len(engine.token_times.get(r.request_id, [])) for r in s_requests
                                    if r.request_id.startswith(f"s{i}-")) for i in range(s_streams)],
        "s_first_token_ms": (statistics.median(s_ms), s_ms[-1]),
        "s_recomputed_tokens": sum(scheduled.get(r.request_id, 0) for r in s_requests) - needed,
        "s_preempted": s_preempted,
        "parked_blocks": round(parked_blocks / steps, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    settings = {
        "72 blocks": {},
        "400 blocks": {"num_blocks": 400},
        "72 blocks, 40-token answers": {"s_tokens": 40},
        "72 blocks, async": {"async_scheduling": True},
    }
    for label, kw in settings.items():
        for rule in ("A", "B"):
            print(f"{label:28s} {rule}  {run(rule, seconds=args.seconds, **kw)}")


if __name__ == "__main__":
    main()
