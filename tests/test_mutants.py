"""A verifier that never says no proves nothing: broken limiters must be rejected, by the right check.

Each mutant (tests/mutants/broken.py) is applied to the real patched vLLM
scheduler (sync and async) driven by a hand-driven clock (tests/sched_harness.py)
with a workload that exposes it; the run becomes a run folder
(tests/mutants/runfolder.py) and ``verify_run`` must reject it, naming the check
that the broken promise belongs to, while the limiter as shipped passes the
same workload.
"""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from mutants import Mutant, Phase, Stream, Workload, run_workload
from mutants.broken import (
    AnswersBeyondTheFirstFree,
    BudgetPerRequest,
    Burst1s,
    Burst150ms,
    CleanupForgetsDebt,
    ChargesPromptTokens,
    ChargesAnotherUser,
    ClumpedRelease,
    LateReady,
    ChargeEveryPrefillChunk,
    HalfRate,
    HeadPlaceWithoutSlot,
    HeadSlotFromAnyThrottled,
    NoClampToNow,
    RefusalAdvancesTat,
    StreamsKeepTheirPlaces,
    NeverThrottle,
    NoRefund,
    RefundTwice,
    FirstTokenFree,
    FivePercentOver,
    FivePercentUnder,
    KeptKVNeverGiven,
    NoClaims,
    NoWaitingPreemption,
    NewStreamsHeldAfterPrefills,
    PenaltyAfterRefusal,
    QueueWaitsAtFullCap,
    QueuedWhileRefused,
    PlacesIgnorePriority,
    PlacesInListOrder,
    PlacesTiesToTheOldestStream,
    RunningLoopUpstreamVictim,
    RollingWindow1s,
    ThrottledCountActive,
    ThrottledKeepSlots,
)
from ratebench.analysis import load_run
from ratebench.events import KIND_DISPATCH, KIND_EMIT
from ratebench.verify import verify_run

pytestmark = pytest.mark.usefixtures("patched_vllm")

SYNC_AND_ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


# ---- workloads ---------------------------------------------------------------------------------


def seed_experiment() -> Workload:
    """The seed's experiment, shortened: user-a at 20 tok/s with 1 and with 4 streams beside user-b at 100."""
    both = {"user-a", "user-b"}
    return Workload(default_tps=100, user_tps={"user-a": 20}, phases=[
        Phase("1-stream", [Stream("user-a", 40), Stream("user-b", 200)], backlogged=both),
        Phase("4-streams", [Stream("user-a", 20) for _ in range(4)] + [Stream("user-b", 100) for _ in range(2)],
              backlogged=both),
    ])


def default_user_streams() -> Workload:
    """One user at the default rate, with 1 and with 4 streams (a budget per request shows with 4)."""
    return Workload(default_tps=20, user_tps={}, phases=[
        Phase("1-stream", [Stream("user-a", 40)], backlogged={"user-a"}),
        Phase("4-streams", [Stream("user-a", 20) for _ in range(4)], backlogged={"user-a"}),
    ])


def kv_pressure() -> Workload:
    """user-a's one-token requests (66 a second, over its 50 tok/s) queue beside a KV hog that fills the
    whole cache for 6 steps at a time.

    While the hog runs, user-a's next request is charged and then fails KV allocation: a refund per
    step, which user-a spends once the hog is gone. Separate requests, not closed-loop streams (a
    user's waiting requests are served first come, first served; turns are for running streams), and
    no chunked prefill: with it, a refused request is admitted one token short of sampling and waits
    in running, holding its block, so the charge comes in the running loop and rarely fails.
    """
    user_a = [Stream("user-a", 1, prompt_len=8, start_s=k * 0.015) for k in range(200)]
    hog = Stream("hog", 6, prompt_len=122, requests=40, pause_s=0.07)  # 122 + 6 tokens: all 8 blocks
    return Workload(default_tps=100, user_tps={"user-a": 50, "hog": 100_000}, phases=[
        Phase("kv-pressure", user_a + [hog], backlogged={"user-a"}, scenario="kv-pressure", kind="kv-pressure"),
    ], scheduler_kw=dict(num_blocks=9, block_size=16, enable_chunked_prefill=False))


def long_prompts() -> Workload:
    """Four streams with 640-token prompts in 64-token chunks: nine free middle chunks each."""
    return Workload(default_tps=100, user_tps={"user-a": 20}, phases=[
        Phase("long-prompt", [Stream("user-a", 20, prompt_len=640) for _ in range(4)], backlogged={"user-a"},
              scenario="long-prompt", kind="long-prompt"),
    ], scheduler_kw=dict(max_num_batched_tokens=64))


def parallel_sampling() -> Workload:
    """Two requests of user-a (20 tok/s) of three answers each ("n": 3): six engine requests of one budget,
    beside user-b's one stream."""
    return Workload(default_tps=100, user_tps={"user-a": 20}, phases=[
        Phase("parallel-sampling", [Stream("user-a", 20, n=3) for _ in range(2)] + [Stream("user-b", 60)],
              backlogged={"user-a", "user-b"}, scenario="parallel-sampling", kind="parallel-sampling"),
    ])


def streams_over_places() -> Workload:
    """user-a (100 tok/s) with 6 streams on 2 active places: more streams than places, so even spacing
    counts its waiting streams up to the places; at 5 ms steps the places give 400 tok/s and the budget
    still binds."""
    return Workload(default_tps=100, user_tps={"user-a": 100}, phases=[
        Phase("6-streams", [Stream("user-a", 40) for _ in range(6)], backlogged={"user-a"}),
    ], scheduler_kw=dict(max_num_seqs=8, max_num_active_seqs=2))


def long_prompt_closed_loop() -> Workload:
    """One stream of user-a (100 tok/s) sending three 640-token prompts one after the other."""
    return Workload(default_tps=100, user_tps={"user-a": 100}, phases=[
        Phase("long-prompt", [Stream("user-a", 40, prompt_len=640, requests=3)], backlogged={"user-a"},
              scenario="long-prompt", kind="long-prompt"),
    ], scheduler_kw=dict(max_num_batched_tokens=128))


def isolation() -> Workload:
    """user-b (unlimited in practice) alone, then beside user-a's three throttled streams, 4 active places of 16."""
    return Workload(default_tps=100, user_tps={"user-a": 20, "user-b": 100_000}, phases=[
        Phase("baseline", [Stream("user-b", 100) for _ in range(4)], role="baseline", scenario="isolation",
              kind="isolation"),
        Phase("shared", [Stream("user-a", 40) for _ in range(3)] + [Stream("user-b", 100, start_s=0.3)
                                                                     for _ in range(4)],
              backlogged={"user-a"}, role="shared", scenario="isolation", kind="isolation"),
    ], scheduler_kw=dict(max_num_seqs=16, max_num_active_seqs=4))


def kv_isolation() -> Workload:
    """user-b alone, then arriving 0.3 s after user-a's eight 100-token prompts fill the KV cache
    (chunked prefill on, as vLLM's default). A stream of user-a preempted for user-b keeps its claim
    on user-a's turns (test_a_throttled_users_streams_keep_turns_under_kv_pressure below)."""
    return Workload(default_tps=100, user_tps={"user-a": 20, "user-b": 100_000}, phases=[
        Phase("baseline", [Stream("user-b", 50, prompt_len=32)], role="baseline", scenario="isolation",
              kind="isolation"),
        Phase("shared", [Stream("user-a", 20, prompt_len=100) for _ in range(8)]
              + [Stream("user-b", 50, prompt_len=32, start_s=0.3)],
              backlogged={"user-a"}, role="shared", scenario="isolation", kind="isolation",
              params={"stream_wait": ["user-a"]}),
    ], scheduler_kw=dict(num_blocks=58, block_size=16, max_num_seqs=16))


def kv_recompute() -> Workload:
    """user-a (100 tok/s) with two streams of 900-token prompts in 128-token chunks, beside user-b's
    512-token requests that need KV a stream of user-a holds. The preempted stream recomputes its
    prompt in eight chunks and has its user's turn only in the step where it can sample: during the
    others its sibling spends the budget (the e2e small profile once found the user 4 tokens short)."""
    return Workload(default_tps=100, user_tps={"user-a": 100, "user-b": 100_000}, phases=[
        Phase("shared", [Stream("user-a", 150, prompt_len=900) for _ in range(2)]
              + [Stream("user-b", 20, prompt_len=512, requests=4, start_s=0.2, pause_s=0.15)],
              backlogged={"user-a"}, params={"stream_wait": ["user-a"]}),
    ], scheduler_kw=dict(num_blocks=150, block_size=16, max_num_seqs=16, max_num_batched_tokens=128))


def kv_growth() -> Workload:
    """user-b (100 tok/s, one stream, a 1,200-token prompt in 128-token chunks) starts alone; then
    user-a's eight 100-token streams (20 tok/s) fill the rest of the KV cache and are throttled.
    Every 16 tokens user-b's running request needs a block: throttled requests must give it theirs
    (upstream preempts the last of running, which is user-b itself, and its prompt is recomputed)."""
    return Workload(default_tps=100, user_tps={"user-a": 20, "user-b": 100}, phases=[
        Phase("shared", [Stream("user-b", 240, prompt_len=1200)]
              + [Stream("user-a", 30, prompt_len=100, start_s=0.2) for _ in range(8)],
              backlogged={"user-a", "user-b"}, params={"stream_wait": ["user-a"]}),
    ], scheduler_kw=dict(num_blocks=140, block_size=16, max_num_seqs=16, max_num_batched_tokens=128))


def kv_tiny() -> Workload:
    """cpu-tiny's kv-pressure phase, on the scheduler: user-a (20 tok/s) with six 1,280-token
    streams on 4 active places and 256 KV blocks of 32 tokens, 256-token chunks; user-c's four
    512-token requests 0.8 s apart need the KV that user-a's streams hold, and user-a's own
    streams outgrow it. (It found three faults of the first version of the bench: prompt chunks
    held with a throttled user's requests, a stream with its user's token kept never taken from
    the bench, and new prompts starving behind refused streams.)"""
    return Workload(default_tps=100, user_tps={"user-a": 20, "user-c": 200}, phases=[
        Phase("kv-shared", [Stream("user-a", 50, prompt_len=1280) for _ in range(6)]
              + [Stream("user-c", 60, prompt_len=512, start_s=0.6 + 0.8 * k) for k in range(4)],
              backlogged={"user-a"}, params={"stream_wait": ["user-a"]}),
    ], scheduler_kw=dict(num_blocks=256, block_size=32, max_num_seqs=16, max_num_active_seqs=4,
                         max_num_batched_tokens=256, enable_prefix_caching=True))


def stream_wait_prefill() -> Workload:
    """user-a (20 tok/s) has two streams running when user-b, whose limit never binds, sends six
    1,024-token prompts (24 full steps of 256 tokens: 0.72 s at 30 ms a step), and user-a's third
    stream comes 10 ms after them. Light users' requests go before a throttled user's (rule 4), so the
    new stream waits for its first token behind every full step of user-b's prompts: longer than
    stream-wait's allowance for a stream of a user at 20 tok/s with three streams, which counts no
    engine work. The check leaves those steps out of the wait (another request also waited for its
    first token as each began), and judges what remains."""
    return Workload(default_tps=100, user_tps={"user-a": 20, "user-b": 100_000}, phases=[
        Phase("prefills", [Stream("user-a", 60), Stream("user-a", 60), Stream("user-a", 30, start_s=0.45)]
              + [Stream("user-b", 4, prompt_len=1024, start_s=0.4) for _ in range(6)],
              backlogged={"user-a"}, params={"stream_wait": ["user-a"]}),
    ], scheduler_kw=dict(max_num_seqs=16, max_num_batched_tokens=256))


def kv_tiny_isolation() -> Workload:
    """kv_tiny with user-c's four requests alone first (its baseline): for isolation, on an engine whose
    steps grow with their tokens (run with ``step_s_per_token``, as cpu-tiny's CPU engine)."""
    shared = kv_tiny().phases[0]
    solo = [s for s in shared.streams if s.user == "user-c"]
    return Workload(default_tps=100, user_tps={"user-a": 20, "user-c": 200}, phases=[
        Phase("kv-baseline", solo, role="baseline", scenario="isolation", kind="isolation"),
        Phase("kv-shared", shared.streams, backlogged={"user-a"}, role="shared", scenario="isolation",
              kind="isolation", params={"stream_wait": ["user-a"]}),
    ], scheduler_kw=kv_tiny().scheduler_kw)


def kv_pressure_cpu() -> Workload:
    """cpu-tiny's kv-pressure as its scenario runs it, for the main job's one lasting failure: user-a's six
    streams of 1,300-token prompts (41 blocks each: 246 of 256 once each has sampled) are in before user-c's
    first request comes, 2 s into the phase; then user-c's four 512-token requests 0.8 s apart, each needing
    18 blocks, beside user-a's streams (30 tokens each at 20 tok/s: they outlast user-c's requests). user-c
    alone first (its baseline). Run on steps priced like cpu-tiny's CPU engine (``step_s_per_token``)."""
    shared = ([Stream("user-a", 30, prompt_len=1300) for _ in range(6)]
              + [Stream("user-c", 60, prompt_len=512, start_s=2.0 + 0.8 * k) for k in range(4)])
    solo = [Stream("user-c", 60, prompt_len=512, start_s=0.8 * k) for k in range(4)]
    return Workload(default_tps=100, user_tps={"user-a": 20, "user-c": 200}, phases=[
        Phase("kv-baseline", solo, role="baseline", scenario="isolation", kind="isolation"),
        Phase("kv-shared", shared, backlogged={"user-a"}, role="shared", scenario="isolation", kind="isolation",
              params={"stream_wait": ["user-a"]}),
    ], scheduler_kw=kv_tiny().scheduler_kw)


def active_places() -> Workload:
    """No limit binds; 2 active places of 16. cap-equal: 6 users with 2 streams each at once, 10 of
    the 12 queued at first. cap-high: the 6 users with one stream each, then cap-high's 2 streams."""
    users = [f"cap-{i:02d}" for i in range(6)]
    fast = {u: 100_000 for u in [*users, "cap-high"]}
    return Workload(default_tps=100, user_tps=fast, phases=[
        Phase("cap-equal", [Stream(u, 100) for u in users for _ in range(2)], scenario="active-cap-fairness",
              kind="active-cap-fairness", params={"place_share": True}),
        Phase("cap-high", [Stream(u, 100) for u in users] + [Stream("cap-high", 100, start_s=0.2) for _ in range(2)],
              scenario="active-cap-fairness", kind="active-cap-fairness", params={"place_share": True}),
    ], scheduler_kw=dict(max_num_seqs=16, max_num_active_seqs=2))


def unbound_crowd() -> Workload:
    """No limit binds, and more streams than resident slots: six users with four 24-token streams each
    on 8 slots and 4 active places. The limiter-off engine keeps every place busy; so must the limiter
    (its streams take turns on the bench, and the queue's head must not be kept a place no slot can
    take)."""
    users = [f"fast-{i}" for i in range(6)]
    return Workload(default_tps=100_000, user_tps={}, phases=[
        Phase("overload", [Stream(u, 24, requests=2) for u in users for _ in range(4)], scenario="unbound"),
    ], scheduler_kw=dict(max_num_seqs=8, max_num_active_seqs=4))


def unbound_places() -> Workload:
    """No limit binds and every stream has a slot: two users with three streams of three 16-token
    answers each on 8 slots and 2 places. The places are the limiter's (the limiter-off engine has
    none): a user's resident streams must take turns on them, between two of its requests too."""
    return Workload(default_tps=100_000, user_tps={}, phases=[
        Phase("places", [Stream(u, 16, requests=3) for u in ("fast-a", "fast-b") for _ in range(3)],
              scenario="unbound"),
    ], scheduler_kw=dict(max_num_seqs=8, max_num_active_seqs=2))


def crowd_slots() -> Workload:
    """cpu-tiny's crowd on the scheduler: 24 users at 5 tok/s with two streams of three 7-token answers
    each (48 streams on 16 slots and 4 places: throttled residents hold most slots, and their queued
    streams claim their turns back), beside 8 users whose limits never bind, each sending 20 short
    answers 0.2 s apart. The queue's head is given a place only when a slot will be there for it."""
    crowd = [f"crowd-{i:02d}" for i in range(24)]
    steady = [f"steady-{i}" for i in range(8)]
    return Workload(default_tps=100, user_tps={**{u: 5 for u in crowd}, **{u: 2000 for u in steady}}, phases=[
        Phase("shared", [Stream(u, 7, prompt_len=24, requests=3) for u in crowd for _ in range(2)]
              + [Stream(u, 7, prompt_len=24, requests=20, pause_s=0.2, start_s=0.01 * i)
                 for i, u in enumerate(steady)],
              role="shared", scenario="crowd", kind="crowd", params={"stream_wait": crowd})],
        scheduler_kw=dict(max_num_seqs=16, max_num_active_seqs=4, max_num_batched_tokens=256, num_blocks=256,
                          block_size=32, enable_prefix_caching=True))


def crowd() -> Workload:
    """More throttled users than resident slots (cpu-tiny's mix in small): ten users at 5 tok/s with
    two streams each fill all 8 slots and are parked most of the time; four users whose limits never
    bind send short requests one after the other, alone (baseline) and then beside the crowd (shared).
    Throttled residents must give their slots to them (the patch before work conservation kept them:
    the four users queued until the crowd's answers ended). The crowd's streams outnumber the slots,
    so the engine's slots, not only their budgets, pace them: their streams' turns are judged
    (stream-wait, stream-fairness), not their even spacing."""
    free = [f"free-{i}" for i in range(10)]
    pro = [f"pro-{i}" for i in range(4)]
    limits = {**{u: 5 for u in free}, **{u: 100_000 for u in pro}}

    def pro_streams(start_s: float) -> list[Stream]:
        return [Stream(u, 8, requests=12, start_s=start_s, pause_s=0.05) for u in pro]

    return Workload(default_tps=100, user_tps=limits, phases=[
        Phase("baseline", pro_streams(0.0), role="baseline", scenario="crowd", kind="crowd"),
        Phase("shared", [Stream(u, 16) for u in free for _ in range(2)] + pro_streams(0.3),
              role="shared", scenario="crowd", kind="crowd", params={"stream_wait": free}),
    ], scheduler_kw=dict(max_num_seqs=8))


def crowd_mix() -> Workload:
    """The crowd as a mix with tiers: ten free users at 5 tok/s with two streams each hold the 8
    slots; four pro users at 100 tok/s each open with a 60-token answer, which runs them out of
    budget (refused: bound users), then send 6-token answers one after the other from 1 s on, sent
    clear of their limits; the same pro requests alone are the baseline."""
    free = [f"free-{i}" for i in range(10)]
    pro = [f"pro-{i}" for i in range(4)]
    tiers = {**{u: "free" for u in free}, **{u: "pro" for u in pro}}

    def pro_streams(start_s: float) -> list[Stream]:
        return [Stream(u, 60, start_s=start_s) for u in pro] + [
            Stream(u, 6, requests=12, start_s=start_s + 1.0, pause_s=0.05) for u in pro]

    return Workload(default_tps=100, user_tps={u: 5 for u in free}, phases=[
        Phase("mix-baseline", pro_streams(0.0), role="baseline", scenario="mix", kind="mix", tiers=tiers),
        Phase("mix", [Stream(u, 16) for u in free for _ in range(2)] + pro_streams(0.3),
              role="measure", scenario="mix", kind="mix", tiers=tiers, params={"stream_wait": free}),
    ], scheduler_kw=dict(max_num_seqs=8))


def kv_kept() -> Workload:
    """Throttled requests out of their slots keep their KV (no recompute when they resume) only until
    a user with budget needs it. User s (2 tok/s) has three 96-token streams on 2 slots of 32 KV
    blocks of 16 tokens: two resident (7 blocks each), one queued. User b's short requests take a
    slot each time (a resident of s gives way, keeping its blocks);
    then b sends a 416-token prompt (26 blocks), which fits only with the blocks a request out of its
    slot keeps."""
    return Workload(default_tps=100, user_tps={"s": 2, "b": 100_000}, phases=[
        Phase("kept", [Stream("s", 4, prompt_len=96) for _ in range(3)]
              + [Stream("b", 4, prompt_len=10, requests=3, start_s=0.3, pause_s=0.05),
                 Stream("b", 4, prompt_len=416, start_s=0.6)],
              scenario="kv-kept", kind="kv-pressure", params={"stream_wait": ["s"]}, max_s=15.0),
    ], scheduler_kw=dict(num_blocks=32, block_size=16, max_num_seqs=2, max_num_active_seqs=2))


def burst_mix(seed: int = 4) -> Workload:
    """cpu-tiny's mix in small, open loop (each request its own stream, sent at its time): 36 free
    users at 15 tok/s (80 requests a second for the tier), 12 pro users at 100 tok/s (65 a second)
    and 4 team users at 2000 tok/s (40 a second), answers of 2 to 10 tokens; at 1 s six burst
    users at 50 tok/s send three 8-to-16-token requests each at once. 16 slots, 4 places, a few
    hundred requests queued. The burst users' streams must take turns (stream-fairness): one of
    them queued, out of its slot, whose turn has come, takes its user's next token and its user's
    next place, before light users' requests and before its siblings (the patch before: 4 tokens
    apart in 1 of 12 sync seeds, 4 and 5 in 2 of 6 async)."""
    import random

    rng = random.Random(seed)
    duration_s, tiers, limits, streams = 3.0, {}, {}, []

    def open_loop(users: list[str], limit: int, rate: float, tier: str) -> None:
        for u in users:
            tiers[u], limits[u] = tier, limit
        t = rng.expovariate(rate)
        while t < duration_s:
            streams.append(Stream(rng.choice(users), rng.randint(2, 10),
                                  prompt_len=min(200, int(rng.lognormvariate(3.18, 0.5))), start_s=t))
            t += rng.expovariate(rate)

    open_loop([f"free-{i:02d}" for i in range(36)], 15, 80, "free")
    open_loop([f"pro-{i:02d}" for i in range(12)], 100, 65, "pro")
    open_loop([f"team-{i}" for i in range(4)], 2000, 40, "team")
    for i in range(6):
        tiers[f"burst-{i}"], limits[f"burst-{i}"] = "burst", 50
        streams += [Stream(f"burst-{i}", rng.randint(8, 16), prompt_len=24, start_s=1.0) for _ in range(3)]
    return Workload(default_tps=100, user_tps=limits, phases=[
        Phase("mix", streams, scenario="mix", kind="mix", tiers=tiers)],
        scheduler_kw=dict(max_num_seqs=16, max_num_active_seqs=4, num_blocks=512, block_size=32,
                          max_num_batched_tokens=512))


def _under_priority(make, priorities: dict[str, int], name: str | None = None):
    """``make``'s workload under the PRIORITY policy, each user's streams at ``priorities[user]`` (0
    if absent; lower goes first): the policy's own paths of the patch (running sorted by turn, not
    the bench; victims and preemption rights by priority)."""
    def workload() -> Workload:
        w = make()
        w.scheduler_kw = {**w.scheduler_kw, "policy": "priority"}
        for phase in w.phases:
            for stream in phase.streams:
                stream.priority = priorities.get(stream.user, 0)
        return w

    workload.__name__ = name or f"{make.__name__}_priority"
    workload.__doc__ = f"{make.__name__}, under the PRIORITY policy ({priorities or 'one priority'})."
    return workload


seed_experiment_priority = _under_priority(seed_experiment, {"user-b": 1})
isolation_priority = _under_priority(isolation, {"user-b": 1})  # the throttled user first
active_places_priority = _under_priority(active_places, {})
# cap-high's streams go first
active_places_high_first = _under_priority(active_places, {"cap-high": -1}, "active_places_high_first")


def active_places_four() -> Workload:
    """active_places on 4 places, as cpu-tiny's active-cap-fairness runs it (6 users at 1,000 tok/s and
    cap-high at 5,000, none bound): 7 users take 4 places a step, so users tie on their turns."""
    w = active_places()
    w.user_tps = {**{f"cap-{i:02d}": 1000 for i in range(6)}, "cap-high": 5000}
    w.scheduler_kw = {**w.scheduler_kw, "max_num_active_seqs": 4}
    return w


active_places_four_priority = _under_priority(active_places_four, {})
kv_tiny_priority = _under_priority(kv_tiny, {})
crowd_priority = _under_priority(crowd, {})

# the clean runs: every check must pass on these with the limiter as shipped
WORKLOADS = {f.__name__: f for f in (seed_experiment, default_user_streams, kv_pressure, long_prompts, isolation,
                                     long_prompt_closed_loop, active_places, kv_tiny, seed_experiment_priority,
                                     isolation_priority, active_places_priority, active_places_high_first,
                                     active_places_four_priority,
                                     kv_tiny_priority, kv_growth,
                                     crowd, crowd_priority, crowd_mix, kv_kept, parallel_sampling,
                                     streams_over_places)}
def prefill_beside_decodes() -> Workload:
    """user-a (20 tok/s) decodes on two streams; a third stream of it with a 1,280-token prompt comes at
    0.5 s and is computed in five 256-token chunks. Judged at 45 ms steps, the length of a 256-token
    chunk's step on the slow CPU machine, where each chunk step is about a token of user-a's rate."""
    return Workload(default_tps=100, user_tps={"user-a": 20}, phases=[
        Phase("prefill", [Stream("user-a", 40), Stream("user-a", 40),
                          Stream("user-a", 20, prompt_len=1280, start_s=0.5)], backlogged={"user-a"}),
    ], scheduler_kw=dict(num_blocks=256, block_size=32, max_num_seqs=16, max_num_active_seqs=4,
                         max_num_batched_tokens=256, enable_prefix_caching=True))


def prefill_of_another_user() -> Workload:
    """user-a (20 tok/s) decodes on four streams, all four active places; user-c's 1,280-token prompt
    comes at 1 s (five 256-token chunks), so running holds more than the places and the places go in
    turn. Judged at 45 ms steps, as prefill_beside_decodes."""
    return Workload(default_tps=100, user_tps={"user-a": 20, "user-c": 200}, phases=[
        Phase("prefill", [Stream("user-a", 30) for _ in range(4)]
              + [Stream("user-c", 20, prompt_len=1280, start_s=1.0)], backlogged={"user-a"}),
    ], scheduler_kw=dict(num_blocks=256, block_size=32, max_num_seqs=16, max_num_active_seqs=4,
                         max_num_batched_tokens=256, enable_prefix_caching=True))


prefill_of_another_user_priority = _under_priority(prefill_of_another_user, {})


ALL_WORKLOADS = {**WORKLOADS, "stream_wait_prefill": stream_wait_prefill, "kv_tiny_isolation": kv_tiny_isolation,
                 "kv_pressure_cpu": kv_pressure_cpu, "kv_isolation": kv_isolation, "kv_recompute": kv_recompute, "unbound_crowd": unbound_crowd,
                 "crowd_slots": crowd_slots, "unbound_places": unbound_places,
                 "prefill_beside_decodes": prefill_beside_decodes,
                 "prefill_of_another_user": prefill_of_another_user,
                 "prefill_of_another_user_priority": prefill_of_another_user_priority}


# ---- running and judging --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """Run a workload (with a mutant) on the scheduler and verify it; each combination once per module."""
    cache: dict[tuple, tuple] = {}

    def judge(workload: str, mutant: type[Mutant] | None = None, *, async_scheduling: bool = False,
              step_s: float = 0.005, step_jitter: float = 0.0, seed: int = 0, step_s_per_token: float = 0.0):
        key = (workload, mutant, async_scheduling, step_s, step_jitter, seed, step_s_per_token)
        if key not in cache:
            name = mutant.name if mutant else "correct"
            run_dir = tmp_path_factory.mktemp(f"{workload}-{name}") / "run"
            run = run_workload(run_dir, ALL_WORKLOADS[workload](), mutant=mutant() if mutant else None,
                               async_scheduling=async_scheduling, step_s=step_s, step_jitter=step_jitter,
                               seed=seed, step_s_per_token=step_s_per_token)
            cache[key] = (run.run_dir, verify_run(run.run_dir, plots=False))
        return cache[key]

    return judge


def failures(verdict) -> set[tuple[str, str, str | None]]:
    """(check, phase, user) of every failed check; phase "*" for whole-engine-file checks."""
    return {(c.name, c.phase, c.user) for c in verdict.failures}


def check(verdict, name: str, phase: str, user: str):
    (found,) = [c for c in verdict.checks if (c.name, c.phase, c.user) == (name, phase, user)]
    return found


def assert_rejected_by(verdict, expected: set[tuple[str, str, str | None]], *, only: set[str]) -> None:
    """The expected checks failed, and every failure is one of the ``only`` checks."""
    assert not verdict.passed
    assert expected <= failures(verdict), verdict.summary()
    assert {name for name, _, _ in failures(verdict)} <= only, verdict.summary()


def assert_correct_passes(judged, workload: str, async_scheduling: bool) -> None:
    _, verdict = judged(workload, async_scheduling=async_scheduling)
    assert verdict.passed, verdict.summary()


# the client's chunks are judged too (witness.py): on the harness's truthful emits, bound-client fails only where
# bound-emit does (its windows widen by the emit tolerance and the delivery spread)
BOUND = {"bound-dispatch", "bound-dispatch-run", "bound-emit", "bound-emit-run", "bound-client"}
SPACING = {"even-spacing-dispatch", "even-spacing-emit"}
# isolation (analysis/isolation.py): first token, end to end and gaps at p50/p90/p99, and the rate
ISOLATION = {"isolation-rate", "isolation-ttft", "isolation-ttft-p90", "isolation-ttft-p99",
             *(f"isolation-{m}-p{q}" for m in ("e2e", "gap") for q in (50, 90, 99))}


# ---- the mutants ----------------------------------------------------------------------------------


@SYNC_AND_ASYNC
def test_a_one_second_burst_breaks_the_bound(judged, async_scheduling):
    _, verdict = judged("seed_experiment", Burst1s, async_scheduling=async_scheduling)
    expected = {(name, phase, user) for name in ("bound-dispatch", "bound-emit") for phase in ("1-stream", "4-streams")
                for user in ("user-a", "user-b")}
    assert_rejected_by(verdict, expected | {("bound-dispatch-run", "*", "user-a")}, only=BOUND)
    # a whole second's budget at the start: 21 tokens where 0.1 s * 20 + 1 = 3 may go at once
    assert check(verdict, "bound-dispatch", "1-stream", "user-a").figure <= -15
    assert_correct_passes(judged, "seed_experiment", async_scheduling)


@SYNC_AND_ASYNC
def test_answers_beyond_a_requests_first_with_a_budget_of_their_own_break_the_bound(judged, async_scheduling):
    """A request of three answers is three engine requests; a limiter that charges only the first to the
    user (each other answer keyed to a budget of its own, its events still naming the user) hands user-a
    three times its rate. Judged per answer, joined to its own engine request: the bound fails at once;
    before requests of several answers were read per answer, no scenario sent one."""
    _, verdict = judged("parallel_sampling", AnswersBeyondTheFirstFree, async_scheduling=async_scheduling)
    assert {("bound-dispatch", "parallel-sampling", "user-a"), ("bound-emit", "parallel-sampling", "user-a"),
            ("bound-client", "parallel-sampling", "user-a")} <= failures(verdict), verdict.summary()
    assert {c.user for c in verdict.failures} <= {"user-a", None}, verdict.summary()
    assert check(verdict, "bound-dispatch", "parallel-sampling", "user-a").figure <= -20
    _, correct = judged("parallel_sampling", async_scheduling=async_scheduling)
    assert correct.passed, correct.summary()
    assert check(correct, "stream-fairness", "parallel-sampling", "user-a").passed
    assert "6 finished requests" in check(correct, "reconciliation", "parallel-sampling", "user-a").explanation


def test_a_clean_up_that_forgets_backlogged_users_breaks_the_bound(judged):
    # the idle clean-up must drop only users whose TAT is past; dropping a backlogged user's state each
    # second hands it another burst: the bound's worst window holds more than (W + 0.1) * N + 1
    _, verdict = judged("default_user_streams", CleanupForgetsDebt)
    expected = {(name, phase, "user-a") for name in ("bound-dispatch", "bound-emit", "bound-client")
                for phase in ("1-stream", "4-streams")}
    assert expected <= failures(verdict), verdict.summary()
    assert {name for name, _, _ in failures(verdict)} <= BOUND | {"bound-client", "even-spacing-dispatch",
                                                                 "even-spacing-emit"}, verdict.summary()
    assert_correct_passes(judged, "default_user_streams", False)


@SYNC_AND_ASYNC
def test_a_gcra_that_lets_credit_pile_up_while_a_user_pauses_breaks_the_bound(judged, async_scheduling):
    # without max(TAT, now) a user whose requests pause (kv_pressure's user-a: one-token requests,
    # refused and refunded while the hog holds the KV) banks the pause and spends it at once
    _, verdict = judged("kv_pressure", NoClampToNow, async_scheduling=async_scheduling)
    assert_rejected_by(verdict, {(name, "kv-pressure", "user-a") for name in ("bound-dispatch", "bound-emit")},
                       only=BOUND | {"bound-client", "delivery", "refusal-witness"})
    assert_correct_passes(judged, "kv_pressure", async_scheduling)


def test_a_refusal_that_costs_the_user_under_delivers(judged):
    # each refusal moves the user's TAT a quarter token on: the backlogged user, refused in most steps
    # while it waits, gets well under its rate, unevenly (never over the bound: the bound checks pass)
    _, verdict = judged("default_user_streams", RefusalAdvancesTat)
    assert {("delivery", phase, "user-a") for phase in ("1-stream", "4-streams")} <= failures(verdict), \
        verdict.summary()
    assert not {name for name, _, _ in failures(verdict)} & BOUND, verdict.summary()
    assert check(verdict, "delivery", "4-streams", "user-a").figure < 0.9


@SYNC_AND_ASYNC
def test_a_budget_per_request_breaks_the_bound_with_several_streams(judged, async_scheduling):
    _, verdict = judged("default_user_streams", BudgetPerRequest, async_scheduling=async_scheduling)
    # one stream spends its own budget exactly as a per-user budget would: only 4 streams show it
    assert_rejected_by(verdict, {("bound-dispatch", "4-streams", "user-a"), ("bound-emit", "4-streams", "user-a"),
                                 ("bound-dispatch-run", "*", "user-a")}, only=BOUND)
    assert not [c for c in verdict.failures if c.phase == "1-stream"], verdict.summary()
    # four budgets at once: four 3-token bursts in one step, then 4 x 20 tok/s
    assert check(verdict, "bound-dispatch", "4-streams", "user-a").figure <= -40
    assert_correct_passes(judged, "default_user_streams", async_scheduling)


@SYNC_AND_ASYNC
def test_a_rolling_one_second_window_breaks_the_bound_and_stalls(judged, async_scheduling):
    _, verdict = judged("seed_experiment", RollingWindow1s, async_scheduling=async_scheduling)
    # a whole second's budget at once breaks the bound; the stall after it breaks even spacing (and
    # stream-wait: every stream waits out the window)
    assert_rejected_by(verdict, {("bound-dispatch", "1-stream", "user-a"), ("bound-dispatch", "4-streams", "user-a"),
                                 ("bound-dispatch", "1-stream", "user-b"),
                                 ("even-spacing-dispatch", "4-streams", "user-a")},
                      only=BOUND | SPACING | {"stream-wait", "refusal-witness"})
    # a whole second's budget (20 tokens) within 0.1 s, where 0.1 * 20 + 1 = 3 are allowed at once
    assert check(verdict, "bound-dispatch", "4-streams", "user-a").figure <= -12
    # and then a stall: user-a's tokens, all its streams merged (GCRA sends one every 50 ms, the window
    # nothing for most of a second), many tokens short of 20 tok/s in the emptiest window
    _, correct = judged("seed_experiment", async_scheduling=async_scheduling)
    gaps = {v: next(r for r in verdict_.rows if (r.phase, r.user) == ("4-streams", "user-a")).gaps_emit_user
            for v, verdict_ in (("rolling", verdict), ("correct", correct))}
    assert gaps["correct"].max_ns <= 55_000_000
    assert gaps["rolling"].max_ns >= 800_000_000
    assert check(verdict, "even-spacing-dispatch", "4-streams", "user-a").figure >= 10
    assert_correct_passes(judged, "seed_experiment", async_scheduling)


class CountRefunds(Mutant):
    """The limiter as shipped, counting the refunds the scheduler asks of it."""

    name = "correct-counting-refunds"
    refunds = 0

    def apply(self, scheduler) -> None:
        limiter = scheduler.output_rate_limiter
        refund = limiter.refund

        def counting_refund(user):
            CountRefunds.refunds += 1
            refund(user)

        limiter.refund = counting_refund


@SYNC_AND_ASYNC
def test_no_refund_under_kv_pressure_under_delivers(judged, async_scheduling):
    _, verdict = judged("kv_pressure", NoRefund, async_scheduling=async_scheduling)
    # (its refusals come while the refunds it never made leave the user inside its budget: refusal-witness)
    assert_rejected_by(verdict, {("delivery", "kv-pressure", "user-a")}, only={"delivery", "refusal-witness"})
    assert check(verdict, "delivery", "kv-pressure", "user-a").figure < 0.9
    assert_correct_passes(judged, "kv_pressure", async_scheduling)
    # the workload does what it says: the limiter as shipped refunds, many times
    CountRefunds.refunds = 0
    _, counted = judged("kv_pressure", CountRefunds, async_scheduling=async_scheduling)
    assert counted.passed and CountRefunds.refunds >= 50


@SYNC_AND_ASYNC
def test_refunds_of_two_tokens_break_the_bound_under_kv_pressure(judged, async_scheduling):
    """The other side of no-refund: each of kv_pressure's refunds (one a step while the hog holds the
    cache) leaves user-a a token ahead of its budget, which it spends once the hog is gone."""
    _, verdict = judged("kv_pressure", RefundTwice, async_scheduling=async_scheduling)
    assert_rejected_by(verdict, {("bound-dispatch", "kv-pressure", "user-a")}, only=BOUND)
    assert check(verdict, "bound-dispatch", "kv-pressure", "user-a").figure < 0
    assert_correct_passes(judged, "kv_pressure", async_scheduling)


@SYNC_AND_ASYNC
def test_a_first_token_left_uncharged_breaks_the_bound(judged, async_scheduling):
    """kv_pressure's user-a sends one-token requests, 66 a second against its 50 tok/s: with each request's
    first token free (its dispatch still recorded) none of them costs it anything."""
    _, verdict = judged("kv_pressure", FirstTokenFree, async_scheduling=async_scheduling)
    assert_rejected_by(verdict, {("bound-dispatch", "kv-pressure", "user-a")}, only=BOUND)
    assert_correct_passes(judged, "kv_pressure", async_scheduling)


@SYNC_AND_ASYNC
def test_a_limiter_five_percent_over_its_limits_breaks_the_bound(judged, async_scheduling):
    """The bound's resolution: 21 tok/s where 20 are allowed (user-a), 105 where 100 (user-b)."""
    _, verdict = judged("seed_experiment", FivePercentOver, async_scheduling=async_scheduling)
    failed = failures(verdict)
    assert {name for name, _, _ in failed} <= BOUND, verdict.summary()
    assert {user for name, _, user in failed if name == "bound-dispatch"} == {"user-a", "user-b"}, verdict.summary()
    assert_correct_passes(judged, "seed_experiment", async_scheduling)


@SYNC_AND_ASYNC
def test_a_limiter_five_percent_under_its_limits_fails_delivery(judged, async_scheduling):
    """Delivery's resolution (0.97 of the limit at least): 19 tok/s where user-a asks 20, 95 where user-b
    asks 100; never the bound."""
    _, verdict = judged("seed_experiment", FivePercentUnder, async_scheduling=async_scheduling)
    failed = failures(verdict)
    assert not {name for name, _, _ in failed} & BOUND, verdict.summary()
    assert {user for name, _, user in failed if name == "delivery"} == {"user-a", "user-b"}, verdict.summary()
    assert all(0.93 <= c.figure <= 0.97 for c in verdict.failures if c.name == "delivery"), verdict.summary()
    assert_correct_passes(judged, "seed_experiment", async_scheduling)


@SYNC_AND_ASYNC
def test_a_burst_of_150_ms_breaks_the_bound(judged, async_scheduling):
    """The burst's resolution: half again the 100 ms tolerance, 1 token more at once for user-a at 20 tok/s
    and 5 for user-b at 100."""
    _, verdict = judged("seed_experiment", Burst150ms, async_scheduling=async_scheduling)
    failed = failures(verdict)
    assert {name for name, _, _ in failed} <= BOUND, verdict.summary()
    assert ("bound-dispatch", "1-stream", "user-b") in failed, verdict.summary()
    assert_correct_passes(judged, "seed_experiment", async_scheduling)


def _dispatches_without_tokens(run_dir) -> int:
    """Charges (dispatch events) beyond the tokens the engine emitted, over the whole run."""
    recs = load_run(run_dir).traces["patched-sched"].records
    return int(np.count_nonzero(recs["kind"] == KIND_DISPATCH) - recs["count"][recs["kind"] == KIND_EMIT].sum())


@SYNC_AND_ASYNC
def test_charging_every_prefill_chunk_is_named_by_a_charge_check(judged, async_scheduling):
    """Eight charged middle chunks per prompt: 32 dispatch events that emit nothing. charge-parity names
    them request by request; stream-fairness fails too (it counts dispatch events per stream, and the
    chunk charges land on the streams still in prefill), and so may stream-wait (the charged chunks
    hold the streams that sample back: 1.25 s between two tokens against 0.7 s allowed). Delivery, now measured on emitted tokens as well
    as on dispatch events, still passes here: from the first token on, the tokens come at the full rate."""
    run_dir, verdict = judged("long_prompts", ChargeEveryPrefillChunk, async_scheduling=async_scheduling)
    assert_rejected_by(verdict, {("charge-parity", "long-prompt", "user-a"),
                                 ("stream-fairness", "long-prompt", "user-a")},
                       only={"charge-parity", "stream-fairness", "stream-wait"})
    assert _dispatches_without_tokens(run_dir) == 4 * 8
    assert check(verdict, "charge-parity", "long-prompt", "user-a").figure == 4 * 8
    assert check(verdict, "delivery", "long-prompt", "user-a").passed
    # the engine-step estimate pairs each emit with the latest dispatch of its request at or before it:
    # the early extra charges no longer inflate it (it was 2.655 s when emits were paired by ordinal)
    assert verdict.engine_steps["patched-sched"].longest_ns == 5_000_000
    correct_dir, correct = judged("long_prompts", async_scheduling=async_scheduling)
    assert correct.passed, correct.summary()
    assert _dispatches_without_tokens(correct_dir) == 0
    assert check(correct, "charge-parity", "long-prompt", "user-a").figure == 0
    assert correct.engine_steps["patched-sched"].longest_ns == 5_000_000


@SYNC_AND_ASYNC
def test_a_throttled_request_counted_as_active_starves_the_neighbour(judged, async_scheduling):
    _, verdict = judged("isolation", ThrottledCountActive, async_scheduling=async_scheduling)
    # ... and user-b's later streams wait for a place before their first token: isolation-ttft names that
    assert_rejected_by(verdict, {("isolation-rate", "shared", "user-b"), ("isolation-ttft", "shared", "user-b"),
                                 ("work-conservation", "shared", None)},
                       only=ISOLATION | {"work-conservation"})
    # user-a's three throttled streams hold three of the four active places: user-b runs one stream at a time
    assert check(verdict, "isolation-rate", "shared", "user-b").figure < 0.5
    assert_correct_passes(judged, "isolation", async_scheduling)


@SYNC_AND_ASYNC
def test_a_limiter_that_never_throttles_breaks_the_bound(judged, async_scheduling):
    _, verdict = judged("seed_experiment", NeverThrottle, async_scheduling=async_scheduling)
    expected = {("bound-dispatch", phase, user) for phase in ("1-stream", "4-streams") for user in ("user-a", "user-b")}
    assert_rejected_by(verdict, expected, only=BOUND)
    assert_correct_passes(judged, "seed_experiment", async_scheduling)


@SYNC_AND_ASYNC
def test_a_limiter_at_half_the_rate_fails_delivery_not_the_bound(judged, async_scheduling):
    _, verdict = judged("seed_experiment", HalfRate, async_scheduling=async_scheduling)
    expected = {("delivery", phase, user) for phase in ("1-stream", "4-streams") for user in ("user-a", "user-b")}
    # half the tokens in every window too: even spacing (the lower side of the bound) says it as well
    # and the user it holds back has budget by the promise's own GCRA: the verifier's replay of the charges
    # finds its queued requests waiting beside idle places (work-conservation's witness, arrive records)
    assert_rejected_by(verdict, expected | {("even-spacing-dispatch", "4-streams", "user-b")},
                       only={"delivery", "refusal-witness", "work-conservation"} | SPACING)
    assert all(0.45 <= check(verdict, *key).figure <= 0.55 for key in expected)
    assert_correct_passes(judged, "seed_experiment", async_scheduling)


@SYNC_AND_ASYNC
def test_tokens_released_in_clumps_keep_the_bound_and_fail_even_spacing(judged, async_scheduling):
    _, verdict = judged("seed_experiment", ClumpedRelease, async_scheduling=async_scheduling)
    expected = {(name, phase, user) for name in SPACING for phase in ("1-stream", "4-streams")
                for user in ("user-a", "user-b")}
    assert_rejected_by(verdict, expected, only=SPACING)
    # the bound and the rate hold: only the spacing is broken (60 ms without a token, then the credit at once)
    assert all(c.passed for c in verdict.checks if c.name in BOUND | {"delivery"}), verdict.summary()
    short = check(verdict, "even-spacing-dispatch", "4-streams", "user-b")
    assert short.figure >= 5 > short.threshold  # about 100 tok/s x 60 ms short, against 1 + 100 x 10 ms
    assert_correct_passes(judged, "seed_experiment", async_scheduling)


@SYNC_AND_ASYNC
def test_clumps_fail_even_spacing_for_a_user_with_more_streams_than_places(judged, async_scheduling):
    """Even spacing counts a step's waiting streams up to the engine's places (a step gives a token to no
    more requests than that); where the places can carry the budget, clumps still fail."""
    _, verdict = judged("streams_over_places", ClumpedRelease, async_scheduling=async_scheduling)
    assert ("even-spacing-dispatch", "6-streams", "user-a") in failures(verdict), verdict.summary()
    assert {name for name, _, _ in failures(verdict)} <= SPACING, verdict.summary()
    short = check(verdict, "even-spacing-dispatch", "6-streams", "user-a")
    assert short.figure >= 4 > short.threshold, short.explanation
    assert_correct_passes(judged, "streams_over_places", async_scheduling)


@SYNC_AND_ASYNC
def test_a_limiter_that_wakes_users_late_fails_even_spacing(judged, async_scheduling):
    _, verdict = judged("seed_experiment", LateReady, async_scheduling=async_scheduling)
    assert ("even-spacing-dispatch", "4-streams", "user-b") in failures(verdict), verdict.summary()
    assert {name for name, _, _ in failures(verdict)} <= SPACING | {"delivery"}, verdict.summary()
    assert all(c.passed for c in verdict.checks if c.name in BOUND), verdict.summary()
    assert_correct_passes(judged, "seed_experiment", async_scheduling)


@SYNC_AND_ASYNC
def test_a_request_charged_to_another_user_fails_identity_and_nothing_else(judged, async_scheduling):
    _, verdict = judged("seed_experiment", ChargesAnotherUser, async_scheduling=async_scheduling)
    assert_rejected_by(verdict, {("identity", phase, "user-a") for phase in ("1-stream", "4-streams")},
                       only={"identity"})
    assert check(verdict, "identity", "4-streams", "user-a").figure == 4
    assert "charged to user-a-from-the-user-field" in check(verdict, "identity", "1-stream", "user-a").explanation
    assert check(verdict, "identity", "4-streams", "user-b").passed
    assert_correct_passes(judged, "seed_experiment", async_scheduling)


@SYNC_AND_ASYNC
def test_a_limiter_refusing_below_the_configured_rate_fails_refusal_witness(judged, async_scheduling):
    """GCRA at N/2 refuses users whose charges at N leave them well inside the configured budget: the
    event file's refusals are not the configured limiter's (isolation would have skipped those users)."""
    _, verdict = judged("seed_experiment", HalfRate, async_scheduling=async_scheduling)
    # user-b (100 tok/s, a 10-token burst) is refused 9 tokens short of its burst; user-a (20 tok/s)
    # has a 2-token burst, too small to tell from the refunds allowed
    assert ("refusal-witness", "1-stream", "user-b") in failures(verdict), verdict.summary()
    assert check(verdict, "refusal-witness", "1-stream", "user-b").figure > 5
    _, correct = judged("seed_experiment", async_scheduling=async_scheduling)
    assert check(correct, "refusal-witness", "1-stream", "user-b").passed


@SYNC_AND_ASYNC
def test_charging_prompt_tokens_fails_prompt_free(judged, async_scheduling):
    _, verdict = judged("long_prompt_closed_loop", ChargesPromptTokens, async_scheduling=async_scheduling)
    assert ("prompt-free", "long-prompt", "user-a") in failures(verdict), verdict.summary()
    assert {name for name, _, _ in failures(verdict)} <= {"prompt-free", "delivery", "refusal-witness",
                                                         "work-conservation"} | SPACING, \
        verdict.summary()
    # 640 prompt tokens at 100 tok/s: 6.4 s before each first token, where a quarter of that is allowed
    assert check(verdict, "prompt-free", "long-prompt", "user-a").figure >= 6.0
    _, correct = judged("long_prompt_closed_loop", async_scheduling=async_scheduling)
    assert correct.passed, correct.summary()
    assert check(correct, "prompt-free", "long-prompt", "user-a").figure < 0.2


def test_verify_bound_cli_exits_1_naming_the_bound_and_0_for_the_shipped_limiter(judged):
    from ratebench.cli import app

    runner = CliRunner()
    broken_dir, _ = judged("seed_experiment", Burst1s)
    result = runner.invoke(app, ["verify-bound", str(broken_dir), "--no-plots"])
    assert result.exit_code == 1, result.output
    assert "FAIL bound-dispatch" in " ".join(result.output.split())
    correct_dir, _ = judged("seed_experiment")
    result = runner.invoke(app, ["verify-bound", str(correct_dir), "--no-plots"])
    assert result.exit_code == 0, result.output


# ---- no false alarms ------------------------------------------------------------------------------

# (step_s, step_jitter, seed): fixed 5 ms steps; 2..6 ms; 4.9..9.1 ms
STEP_CONFIGS = [(0.005, 0.0, 0), (0.004, 0.5, 1), (0.007, 0.3, 2)]


@pytest.mark.parametrize("step_s, step_jitter, seed", STEP_CONFIGS[1:], ids=["2-6ms", "5-9ms"])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@SYNC_AND_ASYNC
def test_the_shipped_limiter_passes_every_workload(judged, workload, async_scheduling, step_s, step_jitter, seed):
    """Every workload x sync/async x 2 step-length settings with jittered steps, each a different seed
    and step pattern, plus the runs at fixed 5 ms steps that the mutant tests compare against: every
    check passes on each."""
    _, verdict = judged(workload, async_scheduling=async_scheduling, step_s=step_s, step_jitter=step_jitter,
                        seed=seed)
    assert verdict.passed, verdict.summary()


# ---- what the shipped patch does not keep yet (found with these fixtures) ----------------------------


def test_parked_requests_holding_kv_delaying_another_users_first_token_are_rejected_by_isolation_ttft(judged):
    """With chunked prefill a throttled user's queued requests are admitted one token short and, parked,
    keep their KV blocks. The patch preempts them for a neighbour's charged request; without that (the
    waiting loop never preempting, as upstream's) the neighbour waits 7 ms -> 7 s for its first token.
    isolation-rate and isolation-gap-p99 (both from the first token) miss it; isolation-ttft rejects it."""
    run_dir, verdict = judged("kv_isolation", NoWaitingPreemption)
    from ratebench.runrecords import read_client_records

    ttft = {r.phase: r.first_token_ns - r.sent_ns for r in read_client_records(run_dir / "requests.jsonl")
            if r.user == "user-b"}
    assert ttft["shared"] > ttft["baseline"] + 100_000_000
    assert ("isolation-ttft", "shared", "user-b") in failures(verdict), verdict.summary()
    ttft_check = check(verdict, "isolation-ttft", "shared", "user-b")
    assert ttft_check.figure > ttft_check.threshold


def test_a_neighbours_first_token_is_on_time_under_kv_pressure_from_parked_requests(judged):
    run_dir, verdict = judged("kv_isolation")
    from ratebench.runrecords import read_client_records

    ttft = {r.phase: r.first_token_ns - r.sent_ns for r in read_client_records(run_dir / "requests.jsonl")
            if r.user == "user-b"}
    assert ttft["shared"] < ttft["baseline"] + 20_000_000
    isolation = {key for key in failures(verdict) if key[0].startswith("isolation")}
    assert not isolation, verdict.summary()
    assert check(verdict, "isolation-ttft", "shared", "user-b").passed


def test_a_throttled_users_streams_keep_turns_under_kv_pressure(judged):
    _, verdict = judged("kv_isolation")
    assert verdict.passed, verdict.summary()


@SYNC_AND_ASYNC
def test_queued_users_left_without_places_fail_place_share(judged, async_scheduling):
    """While running is exactly full, the queue waits (the patch before its head took a turn at a full
    cap): the first users in take both places until their answers end. place-share names a user left
    out in each phase; nothing else fails."""
    _, verdict = judged("active_places", QueueWaitsAtFullCap, async_scheduling=async_scheduling)
    failed = failures(verdict)
    assert {phase for name, phase, _ in failed if name == "place-share"} == {"cap-equal", "cap-high"}, \
        verdict.summary()
    assert {name for name, _, _ in failed} <= {"place-share", "place-share-jain", "place-share-max"}, verdict.summary()
    share = [c for c in verdict.checks if c.name == "place-share" and c.phase == "cap-equal"][0]
    assert share.figure < 0.2
    assert_correct_passes(judged, "active_places", async_scheduling)


@SYNC_AND_ASYNC
def test_a_stream_left_queued_while_its_siblings_spend_the_budget_fails_stream_wait(judged, async_scheduling):
    """user-a's four streams start together and its burst covers three: the fourth, refused, stays in
    the queue while the three running ones (served before the queue) take every token as it comes
    due, so it waits until one ends (2.9 s, allowed 2 x 4 / 20 + 0.3 = 0.7 s). Bound, spacing and
    delivery hold: the user's budget is spent, only not shared; stream-fairness sees no time when
    all four streams were active. stream-wait judges every backlogged user with a limit and
    several streams, not only the KV phases'."""
    _, verdict = judged("seed_experiment", QueuedWhileRefused, async_scheduling=async_scheduling)
    assert_rejected_by(verdict, {("stream-wait", "4-streams", "user-a")}, only={"stream-wait"})
    assert check(verdict, "stream-wait", "4-streams", "user-a").figure >= 2000
    _, shipped = judged("seed_experiment", async_scheduling=async_scheduling)
    assert check(shipped, "stream-wait", "4-streams", "user-a").figure <= 300  # a turn in four at 20 tok/s
    assert_correct_passes(judged, "seed_experiment", async_scheduling)


@SYNC_AND_ASYNC
def test_under_the_priority_policy_places_in_list_order_fail_place_share(judged, async_scheduling):
    """The PRIORITY policy takes the patch's other path for the places (running sorted by the users'
    turns, not the bench): without the sort, the first users in keep the places."""
    _, verdict = judged("active_places_priority", PlacesInListOrder, async_scheduling=async_scheduling)
    failed = failures(verdict)
    assert "place-share" in {name for name, _, _ in failed}, verdict.summary()
    assert {name for name, _, _ in failed} <= {"place-share", "place-share-jain", "place-share-max", "place-share-priority"}, \
        verdict.summary()
    assert_correct_passes(judged, "active_places_priority", async_scheduling)


@SYNC_AND_ASYNC
def test_under_the_priority_policy_places_whose_ties_go_to_the_oldest_stream_fail_place_share_max(
        judged, async_scheduling):
    """Seven users on 4 places tie on their turns; sorted by their streams' turns first, cap-high (two
    streams, one sat out the last round) wins every tie and takes a place each step: 1.75 x its share,
    the six others 0.87 x (place-share's floor and Jain's index pass). As shipped: 1.0 each."""
    _, verdict = judged("active_places_four_priority", PlacesTiesToTheOldestStream,
                        async_scheduling=async_scheduling, step_s=0.017)
    assert_rejected_by(verdict, {("place-share-max", "cap-high", "cap-high")},
                       only={"place-share-max", "place-share", "place-share-jain"})
    assert check(verdict, "place-share-max", "cap-high", "cap-high").figure > 1.5, verdict.summary()
    _, shipped = judged("active_places_four_priority", async_scheduling=async_scheduling, step_s=0.017)
    assert shipped.passed, shipped.summary()
    (most,) = [c for c in shipped.checks if (c.name, c.phase) == ("place-share-max", "cap-high")]
    assert most.figure < 1.05, most.explanation


@SYNC_AND_ASYNC
def test_under_the_priority_policy_places_that_ignore_priorities_fail_place_share(judged, async_scheduling):
    """cap-high's two streams at priority -1 arrive beside six users at 0 on 2 places: higher priorities
    first gives cap-high both places; places in turn whatever the priority give it two of seven users'
    turns, one stream's worth at most (cap-equal, all at one priority, passes either way)."""
    _, verdict = judged("active_places_high_first", PlacesIgnorePriority, async_scheduling=async_scheduling)
    assert_rejected_by(verdict, {("place-share", "cap-high", "cap-high"), ("place-share-priority", "cap-high", "cap-high")},
                       only={"place-share", "place-share-jain", "place-share-max", "place-share-priority"})
    assert check(verdict, "place-share", "cap-high", "cap-high").figure < 0.4, verdict.summary()
    _, shipped = judged("active_places_high_first", async_scheduling=async_scheduling)
    assert shipped.passed, shipped.summary()
    (share,) = [c for c in shipped.checks if (c.name, c.phase) == ("place-share", "cap-high")]
    assert "cap-high -1" in share.explanation, share.explanation
    (high,) = [c for c in shipped.checks if (c.name, c.phase) == ("place-share-priority", "cap-high")]
    assert high.user == "cap-high" and high.figure >= 0.9, high.explanation
    print(share.explanation)


@SYNC_AND_ASYNC
def test_a_running_loop_that_preempts_upstreams_victim_fails_even_spacing(judged, async_scheduling):
    """user-b's running request needs a block every 16 tokens while throttled user-a's streams hold
    the rest of the cache: preempting the last of running (user-b's own request) instead of a
    throttled one recomputes its 1,200-token prompt, and user-b falls 6.5 tokens behind its rate
    (allowed 2.2). Every other workload passed this mutant."""
    _, verdict = judged("kv_growth", RunningLoopUpstreamVictim, async_scheduling=async_scheduling)
    assert_rejected_by(verdict, {("even-spacing-dispatch", "shared", "user-b")}, only=SPACING | {"delivery"})
    assert check(verdict, "even-spacing-dispatch", "shared", "user-b").figure >= 5
    assert_correct_passes(judged, "kv_growth", async_scheduling)


def test_a_preempted_stream_that_loses_its_turn_fails_stream_fairness_or_stream_wait(judged):
    """Under KV pressure user-a's streams are preempted for user-b; without a claim on the user's
    turns, the preempted stream waits while its siblings keep the budget."""
    _, verdict = judged("kv_isolation", NoClaims)
    failed = {name for name, phase, user in failures(verdict) if phase == "shared" and user == "user-a"}
    assert failed & {"stream-fairness", "stream-wait"}, verdict.summary()
    assert failed <= {"stream-fairness", "stream-wait"}, verdict.summary()


def new_requests_together(requests: int = 8) -> Workload:
    """Six users whose limits never bind decode long answers on 4 places (the bench takes their turns),
    and at 0.1 s ``requests`` users new to the engine, whose limits never bind either, send one short
    request each at the same instant (cpu-tiny's mix: its pro and team requests behind a burst)."""
    steady = [Stream(f"steady-{i}", 200) for i in range(6)]
    new = [Stream(f"new-{i}", 4, start_s=0.1) for i in range(requests)]
    return Workload(default_tps=100_000, user_tps={}, phases=[Phase("together", steady + new)],
                    scheduler_kw=dict(max_num_seqs=16, max_num_active_seqs=4))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@SYNC_AND_ASYNC
def test_new_requests_that_come_together_take_a_place_each(tmp_path, async_scheduling, policy):
    """A burst of new requests of users below their limits is admitted a place each, as the bench's
    streams give them up (the last taken first), not one a step: with one head a step the eighth waited
    eight steps for its first token (cpu-tiny's mix: a team request 72 ms in the queue behind twelve
    burst requests). Here every one has its first token within three steps of 5 ms, and the steady
    users keep decoding meanwhile. The same under PRIORITY, where upstream's queue and the sort of
    running take the places (before: one new request a step there too, the eighth at 42 ms)."""
    from ratebench.runrecords import read_client_records

    workload = new_requests_together()
    workload.scheduler_kw["policy"] = policy
    run = run_workload(tmp_path / "run", workload, async_scheduling=async_scheduling, step_s=0.005)
    verdict = verify_run(run.run_dir, plots=False)
    assert verdict.passed, verdict.summary()
    records = read_client_records(run.run_dir / "requests.jsonl")
    ttft_ms = sorted((r.first_token_ns - r.sent_ns) / 1e6 for r in records if r.user.startswith("new-"))
    assert len(ttft_ms) == 8 and ttft_ms[-1] <= 3 * 5 + (5 if async_scheduling else 0) + 1, ttft_ms


@pytest.mark.parametrize("seed, async_scheduling, policy", [(4, False, "fcfs"), (0, True, "fcfs"),
                                                          (2, True, "fcfs"), (4, False, "priority")],
                         ids=["sync-4", "async-0", "async-2", "priority-4"])
def test_a_burst_users_streams_keep_turns_in_a_crowded_mix(tmp_path, seed, async_scheduling, policy):
    # Rule 3 with rule 4's queue: a burst user's stream out of its slot, queued behind light users'
    # requests, whose turn has come takes its user's next token and place; its siblings do not pass
    # it with the tokens left of their user's burst. The patch before failed these seeds: streams 4
    # (sync 4) and 4 and 5 (async 0) tokens apart (its claimant, kept a token at every step, was not
    # reached behind light users' requests, and a claim counted a stream that had been resident
    # twice); work-conservation (async 2: a request whose last step was in flight held a place).
    workload = burst_mix(seed)
    workload.scheduler_kw["policy"] = policy
    run = run_workload(tmp_path / "run", workload, async_scheduling=async_scheduling, step_s=0.0035,
                       step_jitter=0.5, seed=seed)
    verdict = verify_run(run.run_dir, plots=False)
    assert verdict.passed, verdict.summary()
    judged_burst = [c for c in verdict.checks if c.name == "stream-fairness" and c.user.startswith("burst")]
    # The check judges a user's streams while all of them are active. FCFS, sync 4 and async 2: every
    # burst user's three streams were, and async 0 since a burst of new requests of light users takes a
    # place each (before, one a step). Under PRIORITY sync 4 too since new requests that come together
    # take a place each there as well: before, the head alone took a place a step, and one burst
    # user's first stream spent its user's burst (8 tokens in 42 ms) before its siblings got a place,
    # queued behind the other burst users' first requests that came at the same instant (5 judged).
    assert len(judged_burst) == 6, [c.user for c in judged_burst]


@SYNC_AND_ASYNC
def test_a_long_prompt_does_not_take_the_token_budget_of_its_users_decoding_streams(judged, async_scheduling):
    """A stream that never sampled computes its 1,280-token prompt in five 256-token chunks while two
    streams of its user decode. On the patch before this test, the rotation of the user's streams put
    the chunk at the front of running, where it took the step's whole token budget and left the decodes
    no token (a 315 ms window with 1 token, 5.3 short where 2.0 are allowed; seen on cpu-tiny's
    kv-pressure on the slow machine, 3.2 to 5.0 short)."""
    _, shipped = judged("prefill_beside_decodes", async_scheduling=async_scheduling, step_s=0.045)
    for name in SPACING:
        assert check(shipped, name, "prefill", "user-a").passed, shipped.summary()
    assert shipped.passed, shipped.summary()


@pytest.mark.parametrize("workload", [
    "prefill_of_another_user",
    "prefill_of_another_user_priority",
])
def test_another_users_long_prompt_does_not_take_the_token_budget_of_the_places(judged, workload):
    """user-c's 1,280-token prompt among user-a's four decoding streams, more requests than places: the
    places go in turn, user-c's first. The bench (FCFS) runs sampling requests first and chunks after,
    and so do the places under PRIORITY (before, a chunk sorted first took the step's whole token budget
    from user-a's decodes: 5.2 tokens short where 2.0 are allowed; seen on cpu-tiny's kv-pressure,
    priority engine: 2.2 tokens short where 2.1 were allowed)."""
    _, shipped = judged(workload, step_s=0.045)
    for name in SPACING:
        assert check(shipped, name, "prefill", "user-a").passed, shipped.summary()
    assert shipped.passed, shipped.summary()


@pytest.mark.xfail(strict=True, reason="known defect (issue 12): a preempted stream recomputing its prompt in "
                   "chunks leaves its user's budget unspent (a claim kept through the chunks; the two streams "
                   "preempting each other for KV)")
@SYNC_AND_ASYNC
def test_a_stream_recomputing_its_prompt_in_chunks_does_not_idle_its_users_budget(judged, async_scheduling):
    """user-a's preempted stream recomputes a 900-token prompt in eight chunks, and user-a falls 18.5
    tokens behind its rate on the patch of today (4.5 when first measured; allowed 2.2). Its claim keeps the user's next token in every chunk that
    cannot sample (refunded at the step's end; its sibling gets none), and the claimant, readmitted,
    preempts its sibling for KV, which then recomputes in turn (5 preemptions of user-a's streams).
    Keeping the token only for the chunk that samples (with KV rights for the claimant) still left
    user-a 4.0 behind, and without the rights it broke stream-fairness on kv_tiny (a spread of 8
    against 2). See patches/vllm-0.32.0/README.md."""
    _, shipped = judged("kv_recompute", async_scheduling=async_scheduling)
    for name in SPACING:
        assert check(shipped, name, "shared", "user-a").passed, shipped.summary()


@pytest.mark.xfail(strict=True, reason="known defect (issue 20): a throttled user whose streams outgrow the KV "
                   "cache takes each turn with a re-prefill (its claimant preempts a parked sibling for KV); at 70 ms "
                   "steps each turn costs four chunk steps and the user gets about two thirds of its limit")
def test_a_users_streams_that_outgrow_the_cache_keep_its_rate_on_a_slow_engine(judged):
    """kv_tiny (cpu-tiny's kv-pressure on the scheduler) at 70 ms steps, as the slow machine's chunk steps
    take: the patch of today gives user-a 0.68 of its limit (delivery), its emptiest window 136 tokens
    short, and places idle three steps running while a claimant waits for KV for its whole prompt
    (work-conservation-places; 0.50, 292 short and a stream spread of 5 before the victim rule below
    chose among near-equal costs by need). The real engine on that machine, one run in two: user-a
    at 0.59, user-c's requests 10 x slower (README, the main job on a slow machine). At 5 and 10 ms steps
    the same workload passes; at 45 ms user-a gets 0.86. See patches/vllm-0.32.0/README.md."""
    _, shipped = judged("kv_tiny", step_s=0.07)
    assert check(shipped, "delivery", "kv-shared", "user-a").passed, shipped.summary()
    assert shipped.passed, shipped.summary()


@SYNC_AND_ASYNC
def test_a_users_streams_that_outgrow_the_cache_are_not_preempted_in_the_order_of_their_turns(judged,
                                                                                               async_scheduling):
    """kv_tiny at 70 ms steps: user-a's streams outgrow the KV cache, so each turn of a stream without KV
    preempts a parked sibling. Chosen by the blocks each holds, the victim was the sibling with the fewest
    tokens (its answer grew the fewest blocks), whose turn comes next: a recompute at every turn, and a
    stream spread of 5 (sync). Costs within a quarter count as equal, and among them the sibling needed
    last goes (the one that just had its token): user-a's streams stay within 2 of each other and the
    user gets 0.68 of its limit where it got 0.50 (its rate is still short: the strict xfail above)."""
    _, shipped = judged("kv_tiny", step_s=0.07, async_scheduling=async_scheduling)
    assert check(shipped, "stream-fairness", "kv-shared", "user-a").passed, shipped.summary()
    assert check(shipped, "delivery", "kv-shared", "user-a").figure > 0.6, shipped.summary()


@SYNC_AND_ASYNC
def test_throttled_residents_keeping_their_slots_fail_work_conservation(judged, async_scheduling):
    """The crowd on the patch before work conservation: parked requests of throttled users hold every
    resident slot, the places idle, and the users with budget queue behind them (one pro request
    waited 8.7 s for its first token against 7.5 ms alone). work-conservation names the phase; the
    crowd's own streams lose their turns too (stream-wait)."""
    _, verdict = judged("crowd", ThrottledKeepSlots, async_scheduling=async_scheduling)
    # refusal-witness too (sync): with no slot given way, a stream whose turn came waits behind a
    # request of a user below its limit that cannot enter either, its token kept and given back
    # every step while its resident siblings are refused: users refused with budget left.
    assert_rejected_by(verdict, {("work-conservation", "shared", None)},
                       only={"work-conservation", "stream-wait", "stream-fairness",
                             "refusal-witness"} | ISOLATION)
    assert check(verdict, "work-conservation", "shared", None).figure > 100
    assert check(verdict, "work-conservation", "baseline", None).passed
    assert_correct_passes(judged, "crowd", async_scheduling)


@SYNC_AND_ASYNC
def test_kv_kept_out_of_a_slot_while_a_user_with_budget_waits_for_it_is_rejected(judged, async_scheduling):
    """A request that gave its slot keeps its KV whoever needs it: b's long prompt waits with a free
    slot and idle places until s's budget returns. The step records count KV kept out of a slot as
    free (the scheduler takes it back on demand), so work-conservation sees the room."""
    _, verdict = judged("kv_kept", KeptKVNeverGiven, async_scheduling=async_scheduling)
    assert_rejected_by(verdict, {("work-conservation", "kept", None)},
                       only={"work-conservation", "stream-wait", "stream-fairness", "reconciliation", "delivery"}
                       | ISOLATION)
    assert_correct_passes(judged, "kv_kept", async_scheduling)


def _resident_steps(verdict) -> tuple[int, int]:
    """(longest run, steps) of the one work-conservation-places check of a verdict."""
    (wc,) = [c for c in verdict.checks if c.name == "work-conservation-places"]
    return wc.figure, int(wc.explanation.split(" of ")[0])


@SYNC_AND_ASYNC
def test_a_crowd_whose_limits_never_bind_passes_the_verifier(judged, async_scheduling):
    """No limit binds and 24 streams share 8 slots: a stream between two of its requests waits in the
    queue for a slot while its siblings run, as on the limiter-off engine (counted from the first
    token of the last stream, one user's streams were 23 to 24 tokens apart). Such a user shares no
    budget, so stream-fairness counts two streams' tokens only while both were in service; among
    resident streams the places are the limiter's, and there they take turns."""
    _, verdict = judged("unbound_crowd", async_scheduling=async_scheduling)
    assert verdict.passed, verdict.summary()
    fairness = [c for c in verdict.checks if c.name == "stream-fairness"]
    assert len(fairness) == 6 and all(c.passed for c in fairness), [(c.user, c.figure) for c in fairness]
    assert all("in service" in c.explanation for c in fairness)


@SYNC_AND_ASYNC
def test_an_unbound_users_resident_streams_that_keep_their_places_fail_stream_fairness(judged, async_scheduling):
    """No limit binds; two users' three streams of three answers each are all resident on 8 slots and
    share 2 places. The places are the limiter's: a bench that forgets which of a user's streams
    sampled last gives its first stream the user's place step after step (15 and 16 tokens ahead of a
    sibling while both were in service), where as shipped they take strict turns (1)."""
    _, verdict = judged("unbound_places", StreamsKeepTheirPlaces, async_scheduling=async_scheduling)
    failed = {name for name, _, _ in failures(verdict)}
    assert "stream-fairness" in failed, verdict.summary()
    assert failed <= {"stream-fairness", "stream-wait", "place-share", "place-share-jain", "place-share-max"}, verdict.summary()
    worst = max(c.figure for c in verdict.checks if c.name == "stream-fairness")
    assert worst >= 8, worst
    _, correct = judged("unbound_places", async_scheduling=async_scheduling)
    assert correct.passed, correct.summary()
    fairness = [c for c in correct.checks if c.name == "stream-fairness"]
    assert len(fairness) == 2 and all(c.figure <= 1 and "in service" in c.explanation for c in fairness), fairness


def test_a_place_kept_for_a_queued_request_no_slot_can_take_fails_work_conservation(judged):
    """No limit binds; 24 streams on 8 slots and 4 places. Given a place in its turn while every slot
    is held by streams waiting on the bench for a place, the queue's head cannot take it and the place
    idles: the step records show residents of users with budget left out of idle places
    (work-conservation-places), where the limiter as shipped keeps every place busy.
    (Judged on synchronous engines: an asynchronous one's in-flight step makes a request sit out.)"""
    _, verdict = judged("unbound_crowd", HeadPlaceWithoutSlot)
    assert "work-conservation-places" in {name for name, _, _ in failures(verdict)}, verdict.summary()
    run, resident = _resident_steps(verdict)
    assert run >= 3 and resident >= 20, (run, resident)
    _, correct = judged("unbound_crowd")
    run, resident = _resident_steps(correct)
    assert run <= 2 and resident <= 4, (run, resident)


@pytest.mark.xfail(strict=True, reason="verifier gap since rule 4 keeps light users in order of arrival: over "
                   "crowd_slots seeds 0 to 11 this mutant's idle places come one step at a time (0 to 3 steps a "
                   "run, against none as shipped), and work-conservation-places allows runs of 2")
def test_a_place_kept_for_a_queued_request_whose_slot_a_claimant_took_fails_work_conservation(judged):
    """cpu-tiny's crowd on the scheduler (jittered 4 ms steps). A throttled resident's slot goes to the
    queued claimant placed ahead of the queue's head; counting that slot for the head too kept it a
    place it could not take, which idled while streams of users with budget waited on the bench (the
    patch before: 34 such steps in 12 seeds, a run of 3 in seed 0; as shipped, 12 steps, runs of 1)."""
    _, verdict = judged("crowd_slots", HeadSlotFromAnyThrottled, step_s=0.004, step_jitter=0.3)
    assert "work-conservation-places" in {name for name, _, _ in failures(verdict)}, verdict.summary()
    run, _ = _resident_steps(verdict)
    assert run >= 3, run
    _, correct = judged("crowd_slots", step_s=0.004, step_jitter=0.3)
    (places,) = [c for c in correct.checks if c.name == "work-conservation-places"]
    assert places.passed and places.figure <= 1, places.explanation


@pytest.mark.parametrize("seed", range(6))
def test_the_crowds_streams_take_turns_on_the_slots(judged, seed):
    """crowd_slots: 24 users at their limits with two streams each of three requests, on 16 slots. The
    patch before failed stream-fairness (3 tokens apart, 2 allowed) in 9 of 12 seeds, three ways: a
    new request whose prompt ran unserved went back to the front of its user's bench, ahead of the
    user's stream that sampled before it came; a claimant already resident counted twice among the
    streams ahead of a new claim (one turn too many); the queue's head took the place of the last
    stream taken from the bench when that stream was its own user's older one."""
    _, verdict = judged("crowd_slots", step_s=0.004, step_jitter=0.3, seed=seed)
    assert verdict.passed, verdict.summary()
    judged_users = {c.user for c in verdict.checks if c.name == "stream-fairness" and c.passed is not None}
    assert len(judged_users) >= 20, judged_users


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_penalty_that_outlives_the_budget_is_rejected(judged, async_scheduling):
    """A user refused once stays blocked a second past its ready time. It counts as bound, so the tier
    checks skip it. In the harness its baseline runs on the same (broken) scheduler, so the clear
    requests' first tokens (isolation-ttft-clear, which the synthetic isolation tests show alone) are
    late on both sides; what rejects it here is the turns of the throttled users' streams (a free
    stream waits 2.2 s for its first token, 1.1 s allowed) and of the bound users' own streams, and
    work-conservation's own witness: the engine's step record counts the penalised user blocked, the
    verifier's replay of its charges finds it with budget while its queued requests wait."""
    _, verdict = judged("crowd_mix", PenaltyAfterRefusal, async_scheduling=async_scheduling)
    names = {name for name, _, _ in failures(verdict)}
    assert names & {"stream-wait", "stream-fairness"}, verdict.summary()
    # work-conservation's witness: by the replay of its charges the penalised user has budget while its
    # requests queue beside idle places (the engine's record counts it blocked)
    assert "work-conservation" in names, verdict.summary()
    assert names <= {"stream-wait", "stream-fairness", "isolation-ttft-clear", "isolation-ttft-clear-p90",
                     "work-conservation"}, verdict.summary()
    (wc,) = [c for c in verdict.failures if c.name == "work-conservation" and c.phase == "mix"]
    # nearly every violating step is the witness's (the record's own count finds one: it counts the user blocked)
    assert "the verifier's replay of each user's charges (arrive records) found" in wc.explanation
    found = int(wc.explanation.split("(arrive records) found ")[1].split(" ")[0])
    violating = int(wc.explanation.split(" of ")[0])
    assert found > 100 and violating - found <= 2 and wc.figure > 10, wc.explanation
    assert_correct_passes(judged, "crowd_mix", async_scheduling)


class NewStreamsHeldOnlyForPrefills(NewStreamsHeldAfterPrefills):
    """The same gate without the quiet spell: a new stream waits only while another user's prompts are
    prefilled (as the limiter-off engine, first come first served, queues it behind prompts sent before it)."""

    name = "new-streams-held-for-prefills"
    HOLD_NS = 0


@SYNC_AND_ASYNC
def test_a_new_stream_held_past_another_users_prefill_steps_fails_stream_wait(judged, async_scheduling):
    """stream-wait leaves out of a first token's wait the engine's full steps that began while another
    request also waited for its first token (other prompts' prefill, which a stream queues behind with the
    limiter on or off). Through the real scheduler: user-a's third stream held while user-b's six 1,024-token
    prompts are prefilled (690 ms of full steps) waits 870 ms for its first token, 180 ms once those steps
    are left out, and passes (it would fail the 600 ms allowance without the rule); held 0.8 s longer, as a
    gate waiting for a quiet spell would, it waits 1.68 s, 960 ms with the steps left out, and fails. The
    shipped patch serves the new stream in its user's turn (its longest wait 150 ms)."""
    ms = 0.03
    _, held = judged("stream_wait_prefill", NewStreamsHeldAfterPrefills, async_scheduling=async_scheduling,
                     step_s=ms)
    assert_rejected_by(held, {("stream-wait", "prefills", "user-a")}, only={"stream-wait"})
    wait = check(held, "stream-wait", "prefills", "user-a")
    assert wait.figure > wait.threshold == 600 and "first token (less 690 ms of full engine steps" in \
        wait.explanation, wait.explanation
    _, excused = judged("stream_wait_prefill", NewStreamsHeldOnlyForPrefills, async_scheduling=async_scheduling,
                        step_s=ms)
    wait = check(excused, "stream-wait", "prefills", "user-a")
    assert wait.passed and "first token (less 690 ms of full engine steps" in wait.explanation, wait.explanation
    assert excused.passed, excused.summary()
    _, shipped = judged("stream_wait_prefill", async_scheduling=async_scheduling, step_s=ms)
    assert shipped.passed, shipped.summary()


# cpu-tiny's CPU engine: a decode step about 6 ms, a 256-token prompt chunk 45 to 70 ms (2026-12-06)
CPU_STEP_S = 0.006


def test_kv_pressure_on_steps_that_grow_with_their_tokens_below_the_cliff(judged):
    """kv_tiny with user-c's solo baseline, each step 6 ms plus 0.15 ms a token (a 256-token chunk 44 ms):
    user-c's requests end before the next comes, and every check passes, isolation included."""
    _, shipped = judged("kv_tiny_isolation", step_s=CPU_STEP_S, step_s_per_token=0.00015)
    assert shipped.passed, shipped.summary()


@pytest.mark.xfail(strict=True, reason="known defect (issue 20): on an engine whose steps grow with their tokens "
                   "(a 256-token chunk 57 ms), the re-prefills of user-a's turns slow user-c's requests until they "
                   "overlap, user-c's own limit binds, and the two throttled users preempt each other's parked "
                   "requests for KV at every turn: user-c 37 x slower end to end, user-a at 0.6 of its limit")
def test_kv_pressure_on_steps_that_grow_with_their_tokens_keeps_the_neighbour_isolated(judged):
    """The same at 0.2 ms a token (a 256-token chunk 57 ms, as on the slow 2-core machine's slower hours):
    the patch of today collapses. user-c's first request shares steps with user-a's re-prefills, its
    requests come to overlap, its 200 tok/s limit binds (28 refusals), and from then on both users are
    throttled: a claimant of either preempts the other's parked requests for KV, each preemption a
    512- or 1,280-token recompute, nearly every step a prompt chunk. user-c's end-to-end p50 17.7 s
    against 0.48 s alone, its p99 gap 1.26 s against 6.6 ms; user-a 0.60 of its limit (sync and async
    alike). At 0.15 ms a token everything passes (above): a cliff, which cpu-tiny's kv-pressure on the
    real engine sits at (one main-job run in two collapses so on a slower hour). See
    patches/vllm-0.32.0/README.md."""
    _, shipped = judged("kv_tiny_isolation", step_s=CPU_STEP_S, step_s_per_token=0.0002)
    assert shipped.passed, shipped.summary()


@pytest.mark.xfail(strict=True, reason="known defect (issue 20): a claimant readmitted in its user's turn "
                   "recomputes the tail of its prompt that user-c's request overwrote (a 256-token chunk) in one "
                   "of user-c's decode steps: user-c's p99 gap 51.7 ms (sync) and 51.4 ms (async) against "
                   "32.9 allowed, as in every main job on this machine (51.5, 47.6 and 54.9 ms)")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_kv_pressure_as_cpu_tiny_runs_it_keeps_the_neighbours_gaps(judged, async_scheduling):
    """The main job's one lasting failure, in seconds: kv-pressure as cpu-tiny's scenario runs it, on steps
    of 8 ms plus 0.17 ms a token (a decode step 8 ms, a 256-token chunk 52 ms: the CPU engine here). Each of
    user-c's requests needs 8 blocks more than are free and preempts a parked stream of user-a; when that
    stream's turn comes it preempts a sibling and recomputes the 8 blocks user-c overwrote, a full chunk
    step in one of user-c's decode steps: two or three gaps of 51 ms per request where it has 8 ms alone
    (p99 51.7 ms sync, 51.4 async, 32.9 allowed); user-a's emptiest dispatch window 2.18 tokens short
    (sync; 2.13 allowed). The same failure as the real engine's (step records: one 255-token recompute per
    user-c request, 2 requests in the step). See patches/vllm-0.32.0/README.md for the mends tried."""
    _, shipped = judged("kv_pressure_cpu", async_scheduling=async_scheduling, step_s=0.008,
                        step_s_per_token=0.00017)
    assert ("isolation-gap-p99", "kv-shared", "user-c") not in failures(shipped), shipped.summary()
    assert shipped.passed, shipped.summary()
