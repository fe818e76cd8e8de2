"""Drive the real vLLM V1 Scheduler and KV cache manager without a model.

The scheduler is built from the tiny model's config; a hand-driven clock is
given to the output-rate limiter, and the "model" answers each scheduled
sampling step with one controlled token. This is how vLLM's own scheduler
tests work, plus the clock.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from ratebench.profiling.microbench import build_scheduler
from ratebench.tinymodel import ensure_tiny_model

NS_PER_S = 1_000_000_000
OUTPUT_TOKEN = 7  # what the controlled "model" samples (never EOS)
EOS_TOKEN = 2

_none_hash_ready = False


class FakeClock:
    """A hand-driven monotonic clock in nanoseconds."""

    def __init__(self, start_ns: int = 1_000 * NS_PER_S) -> None:
        self.now_ns = start_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance_s(self, seconds: float) -> None:
        self.now_ns += round(seconds * NS_PER_S)

    def advance_ns(self, ns: int) -> None:
        self.now_ns += ns


def tiny_model_dir() -> Path:
    return ensure_tiny_model()


def create_scheduler(
    *,
    default_tps: int | None = None,
    user_tps: dict[str, int] | None = None,
    max_num_seqs: int = 16,
    max_num_active_seqs: int | None = None,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 4096,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    async_scheduling: bool = False,
    num_blocks: int = 10_000,
    block_size: int = 16,
    enable_prefix_caching: bool = False,
    policy: str = "fcfs",
    clock: FakeClock | None = None,
    scheduler_cls: type | None = None,
    log_stats: bool = False,
    output_rate_metrics_users: int = 0,
) -> Scheduler:
    """A real Scheduler (or AsyncScheduler) with a small KV cache (the builder
    ratebench's scheduler microbenchmark uses)."""
    return build_scheduler(
        model_dir=tiny_model_dir(),
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        default_tps=default_tps,
        user_tps=user_tps,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        async_scheduling=async_scheduling,
        num_blocks=num_blocks,
        block_size=block_size,
        clock=clock,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_prefix_caching=enable_prefix_caching,
        policy=policy,
        scheduler_cls=scheduler_cls,
        log_stats=log_stats,
        output_rate_metrics_users=output_rate_metrics_users,
    )


def make_request(
    request_id: str,
    *,
    user: str | None = None,
    prompt_len: int = 10,
    max_tokens: int = 16,
    priority: int = 0,
    prompt_token: int | None = None,
    block_size: int = 16,
    arrival_time: float | None = None,
    seed: int | None = None,
) -> Request:
    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    extra_args = {"output_rate_user": user} if user is not None else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args, seed=seed)
    token = prompt_token if prompt_token is not None else 100 + zlib.crc32(request_id.encode()) % 500
    return Request(
        request_id=request_id,
        prompt_token_ids=[token] * prompt_len,
        sampling_params=params,
        pooling_params=None,
        priority=priority,
        arrival_time=arrival_time,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def model_output(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """One sampled token for every scheduled request whose step samples."""
    req_ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        samples = request is not None and not request.is_prefill_chunk
        sampled.append([OUTPUT_TOKEN] if samples else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


@dataclass
class StepLog:
    """What one engine step did: the time, tokens per request, and which sampled."""

    t_ns: int
    output: SchedulerOutput
    sampled: dict[str, int] = field(default_factory=dict)


class Engine:
    """Steps a scheduler like EngineCore: sync (schedule, then update) or with
    one step in flight (async scheduling: update of step N after schedule of
    step N+1)."""

    def __init__(self, scheduler: Scheduler, clock: FakeClock, step_s: float = 0.01) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.step_ns = round(step_s * NS_PER_S)
        self.is_async = hasattr(scheduler, "_spec_token_placeholders")
        self._in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.log: list[StepLog] = []
        # request id -> times at which it was given a sampled token
        self.token_times: dict[str, list[int]] = {}

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        runner_out = model_output(self.scheduler, out)
        log = StepLog(self.clock(), out)
        for req_id, tokens in zip(runner_out.req_ids, runner_out.sampled_token_ids):
            if tokens:
                log.sampled[req_id] = len(tokens)
                self.token_times.setdefault(req_id, []).append(self.clock())
        self.log.append(log)
        if self.is_async:
            if self._in_flight is not None:
                self.scheduler.update_from_output(*self._in_flight)
            self._in_flight = (out, runner_out)
        else:
            self.scheduler.update_from_output(out, runner_out)
        self.clock.advance_ns(self.step_ns)
        return out

    def drain(self) -> None:
        if self._in_flight is not None:
            self.scheduler.update_from_output(*self._in_flight)
            self._in_flight = None

    def run_for_s(self, seconds: float) -> None:
        end = self.clock() + round(seconds * NS_PER_S)
        while self.clock() < end:
            self.step()

    def tokens_of(self, request: Request) -> int:
        return request.num_output_tokens


__all__ = [
    "EOS_TOKEN",
    "Engine",
    "FakeClock",
    "NS_PER_S",
    "OUTPUT_TOKEN",
    "RequestStatus",
    "create_scheduler",
    "make_request",
    "model_output",
]
