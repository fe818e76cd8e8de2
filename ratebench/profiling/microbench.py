"""The in-process scheduler microbenchmark: the real patched ``Scheduler``, no model.

Four schedulers live side by side in one process, one per variant:

    off             the feature off (no limiter flags): upstream vLLM's code path
    never-reached   feature on, every user's limit far above what a step can take
    all-throttled   feature on, every user at 1 tok/s: after its first token no user
                    is served again (the limiter's clock stands still), so every
                    resident request is refused at every step
    half-throttled  feature on, even users at 1 tok/s (refused, as above), odd users
                    unlimited

Each holds R requests of U users (``streams_per_user`` each, interleaved in arrival
order) with ``--max-num-seqs R`` and a small ``--max-num-active-seqs A``, as an
engine that keeps many throttled streams resident would. A step is ``schedule()``
(timed with ``time.perf_counter_ns``), a controlled model output (one token per
sampling request) and ``update_from_output()`` (not timed, but run so that the state
stays realistic); a request that finishes is replaced by a new one of the same user,
so R stay in the system. The limiter's clock is held still: a user at 1 tok/s that
has spent its burst stays throttled for the whole measurement, the steady state of
the seed's slow users (with a real 10 ms step, 1 tok/s lets 1 % of steps through).

Rounds interleave the variants (off, never-reached, all-throttled, half-throttled,
off, ...) with ``calls_per_round`` steps each, so slow drifts of the machine hit all
four alike; every ratio is taken within a round against that round's ``off``.

This module measures; :mod:`ratebench.profiling.statistics` summarises, :mod:`ratebench.profiling.tables`
presents.
"""

from __future__ import annotations

import gc
import itertools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

NS_PER_S = 1_000_000_000
OUTPUT_TOKEN = 7  # what the controlled "model" samples (never EOS)
THROTTLED_TPS = 1
UNLIMITED_TPS = 1_000_000_000

VARIANT_OFF = "off"
VARIANT_NEVER_REACHED = "never-reached"
VARIANT_ALL_THROTTLED = "all-throttled"
VARIANT_HALF_THROTTLED = "half-throttled"
VARIANTS = (VARIANT_OFF, VARIANT_NEVER_REACHED, VARIANT_ALL_THROTTLED, VARIANT_HALF_THROTTLED)
VARIANT_LETTERS = dict(zip(VARIANTS, "abcd"))


@dataclass
class MicrobenchSettings:
    """What produced a microbenchmark result (written with it)."""

    r_values: list[int] = field(default_factory=lambda: [16, 64, 256, 1024])
    active_seqs: int = 4  # --max-num-active-seqs
    streams_per_user: int = 4  # U = ceil(R / streams_per_user)
    rounds: int = 20
    calls_per_round: int = 50
    warmup_calls: int = 200
    prompt_tokens: int = 16
    max_tokens: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    policy: str = "fcfs"  # vLLM's scheduling policy: "fcfs" (the limiter's bench) or "priority" (its sort)
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    limiter_clock: str = "held still"  # see the module docstring
    gc_between_batches: bool = True  # gc.collect() before each timed batch (not during it)

    def users_for(self, r: int) -> int:
        return max(1, -(-r // self.streams_per_user))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def held_still_clock(now_ns: int = 1_000 * NS_PER_S) -> Callable[[], int]:
    """The limiter's clock for the benchmark: always ``now_ns`` (see the module
    docstring). A C-level callable, as the engine's ``time.monotonic_ns`` is: a
    Python-level clock object would add a function call per step (about 0.2 us
    here) that a real engine does not pay, and count it against the limiter."""
    return itertools.repeat(now_ns).__next__


def user_name(index: int) -> str:
    return f"u{index:05d}"


def variant_limits(variant: str, users: int) -> tuple[int | None, dict[str, int] | None]:
    """(default_tps, user_tps) of a variant; (None, None) is the feature off."""
    if variant == VARIANT_OFF:
        return None, None
    if variant == VARIANT_NEVER_REACHED:
        return UNLIMITED_TPS, None
    if variant == VARIANT_ALL_THROTTLED:
        return THROTTLED_TPS, None
    if variant == VARIANT_HALF_THROTTLED:
        return THROTTLED_TPS, {user_name(i): UNLIMITED_TPS for i in range(1, users, 2)}
    raise ValueError(f"unknown variant {variant!r}; one of {list(VARIANTS)}")


def build_scheduler(
    *,
    model_dir: Path,
    max_num_seqs: int,
    max_num_active_seqs: int | None,
    default_tps: int | None,
    user_tps: dict[str, int] | None,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 4096,
    enable_chunked_prefill: bool = True,
    async_scheduling: bool = False,
    num_blocks: int = 100_000,
    block_size: int = 16,
    clock: Callable[[], int] | None = None,
    long_prefill_token_threshold: int = 0,
    enable_prefix_caching: bool = False,
    policy: str = "fcfs",
    scheduler_cls: type | None = None,
    log_stats: bool = False,
    output_rate_metrics_users: int = 0,
):
    """A real (patched) Scheduler or AsyncScheduler with a KV cache of ``num_blocks``
    blocks, built from the tiny model's config, as vLLM's own scheduler tests do.
    ``log_stats`` and ``output_rate_metrics_users``: the stats the engine would send its
    API server (``make_stats``), with the limiter's per-user counters."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    limiter_kwargs: dict[str, Any] = {}
    if default_tps is not None:
        limiter_kwargs = {"default_user_output_tokens_per_second": default_tps,
                          "user_output_tokens_per_second": user_tps}
        if output_rate_metrics_users:
            limiter_kwargs["output_rate_metrics_users"] = output_rate_metrics_users
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        async_scheduling=async_scheduling,
        policy=policy,
        **limiter_kwargs,
    )
    model_config = ModelConfig(model=str(model_dir), dtype="float32", seed=0, skip_tokenizer_init=True,
                               max_model_len=max_model_len)
    cache_config = CacheConfig(block_size=block_size, cache_dtype="auto",
                               enable_prefix_caching=enable_prefix_caching)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(
            ["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32))],
    )
    cache_config.num_gpu_blocks = num_blocks
    cls = scheduler_cls or (AsyncScheduler if async_scheduling else Scheduler)
    scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                    structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size,
                    log_stats=log_stats)
    limiter = getattr(scheduler, "output_rate_limiter", None)
    if clock is not None and limiter is not None:
        limiter.clock_ns = clock
    return scheduler


_none_hash_ready = False


def make_request(request_id: str, user: str, *, prompt_tokens: int, max_tokens: int, block_size: int):
    """A request of ``user`` (``extra_args.output_rate_user``) with a distinct prompt."""
    global _none_hash_ready
    import zlib

    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    token = 100 + zlib.crc32(request_id.encode()) % 500
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"output_rate_user": user})
    return Request(request_id=request_id, prompt_token_ids=[token] * prompt_tokens, sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(block_size, sha256))


class SchedulerBench:
    """One variant at one R: a scheduler, its clock, R requests kept in the system."""

    def __init__(self, variant: str, r: int, settings: MicrobenchSettings, model_dir: Path) -> None:
        self.variant = variant
        self.r = r
        self.settings = settings
        self.users = settings.users_for(r)
        self.clock = held_still_clock()
        default_tps, user_tps = variant_limits(variant, self.users)
        max_model_len = max(256, settings.prompt_tokens + settings.max_tokens + 16)
        blocks_per_request = -(-max_model_len // settings.block_size) + 1
        self.scheduler = build_scheduler(
            model_dir=model_dir, max_num_seqs=r, max_num_active_seqs=min(settings.active_seqs, r),
            default_tps=default_tps, user_tps=user_tps, max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=max_model_len, enable_chunked_prefill=settings.enable_chunked_prefill,
            async_scheduling=settings.async_scheduling, num_blocks=r * blocks_per_request + 64,
            block_size=settings.block_size, clock=self.clock, policy=settings.policy,
        )
        self.is_async = settings.async_scheduling
        self._in_flight = None
        self._next_id = 0
        self.steps = 0
        self.scheduled_requests = 0  # summed over timed steps
        self.running_sum = 0  # len(running) summed over timed steps
        # given tokens after sitting out the step before (the model runner re-adds them to its
        # persistent batch), summed over timed steps
        self.readded_requests = 0
        self._previous_scheduled: set[str] = set()
        for i in range(r):
            self._add(user_name(i % self.users))

    def _add(self, user: str) -> None:
        s = self.settings
        request = make_request(f"{self.variant}-{self._next_id}", user, prompt_tokens=s.prompt_tokens,
                               max_tokens=s.max_tokens, block_size=s.block_size)
        self._next_id += 1
        self.scheduler.add_request(request)

    def _model_output(self, out):
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(out.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = []
        for req_id in req_ids:
            request = requests.get(req_id)
            sampled.append([OUTPUT_TOKEN] if request is not None and not request.is_prefill_chunk else [])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def _update(self, out, runner_out) -> None:
        requests = self.scheduler.requests
        users = [(rid, requests[rid].output_rate_user) for rid in out.num_scheduled_tokens if rid in requests]
        self.scheduler.update_from_output(out, runner_out)
        for rid, user in users:
            request = requests.get(rid)
            if request is None or request.is_finished():
                self._add(user)

    def step(self, timed: bool = True) -> int:
        """One engine step; returns the nanoseconds ``schedule()`` took."""
        scheduler = self.scheduler
        t0 = time.perf_counter_ns()
        out = scheduler.schedule()
        elapsed_ns = time.perf_counter_ns() - t0
        runner_out = self._model_output(out)
        if self.is_async:
            if self._in_flight is not None:
                self._update(*self._in_flight)
            self._in_flight = (out, runner_out)
        else:
            self._update(out, runner_out)
        self.steps += 1
        if timed:
            self.scheduled_requests += len(out.num_scheduled_tokens)
            self.running_sum += scheduler.get_request_counts()[0]
            previous = self._previous_scheduled
            self.readded_requests += sum(1 for rid in out.scheduled_cached_reqs.req_ids if rid not in previous)
        self._previous_scheduled = set(out.num_scheduled_tokens)
        return elapsed_ns

    def state(self) -> dict[str, Any]:
        """What the scheduler holds now, and what the timed steps did on average."""
        sched = self.scheduler
        timed = max(1, self.steps - warmup_calls_for(self.r, self.settings))
        return {
            "users": self.users,
            "running": sched.get_request_counts()[0],
            "waiting": len(sched.waiting),
            "mean_running": self.running_sum / timed,
            "mean_scheduled_requests": self.scheduled_requests / timed,
            "mean_readded_requests": self.readded_requests / timed,
        }


@dataclass
class VariantRounds:
    """Microseconds per ``schedule()`` call of one variant at one R, per round: the
    median of the round's calls (robust to the other processes of a shared machine
    taking the CPU for a while) and their mean (what the engine pays on average)."""

    variant: str
    r: int
    round_median_us: list[float]
    round_mean_us: list[float]
    state: dict[str, Any]
    warmup_calls: int


def warmup_calls_for(r: int, settings: MicrobenchSettings) -> int:
    """Enough steps for a variant to reach its steady state: admission brings at most
    ``active_seqs`` requests into running per step."""
    return settings.warmup_calls + 2 * -(-r // max(1, settings.active_seqs))


def measure_r(r: int, settings: MicrobenchSettings, model_dir: Path,
              on_round: Callable[[int, int], None] | None = None) -> dict[str, VariantRounds]:
    """Interleaved rounds of every variant at one R."""
    import statistics

    benches = {v: SchedulerBench(v, r, settings, model_dir) for v in settings.variants}
    warmup = warmup_calls_for(r, settings)
    for bench in benches.values():
        for _ in range(warmup):
            bench.step(timed=False)
    medians: dict[str, list[float]] = {v: [] for v in benches}
    means: dict[str, list[float]] = {v: [] for v in benches}
    for k in range(settings.rounds):
        for variant, bench in benches.items():
            if settings.gc_between_batches:
                gc.collect()
            calls_ns = [bench.step() for _ in range(settings.calls_per_round)]
            medians[variant].append(statistics.median(calls_ns) / 1_000)
            means[variant].append(sum(calls_ns) / len(calls_ns) / 1_000)
        if on_round is not None:
            on_round(r, k)
    return {v: VariantRounds(v, r, medians[v], means[v], benches[v].state(), warmup) for v in benches}


def run_microbench(settings: MicrobenchSettings, model_dir: Path | None = None,
                   on_round: Callable[[int, int], None] | None = None) -> dict[int, dict[str, VariantRounds]]:
    """Every R of the settings, in order; R -> variant -> rounds."""
    if model_dir is None:
        from ratebench.tinymodel import ensure_tiny_model

        model_dir = ensure_tiny_model()
    quiet_vllm_logs()
    scheduler_source()
    return {r: measure_r(r, settings, model_dir, on_round) for r in settings.r_values}


@dataclass
class SchedulerSource:
    """The scheduler module this process imported: its path, text and sha256 (the patch
    may be re-applied while a benchmark runs; the figures belong to this text)."""

    path: str
    text: str
    sha256: str

    def changed_on_disk(self) -> bool:
        import hashlib

        try:
            return hashlib.sha256(Path(self.path).read_bytes()).hexdigest() != self.sha256
        except OSError:
            return True

    def line(self, number: int) -> str:
        lines = self.text.splitlines()
        return lines[number - 1] if 0 < number <= len(lines) else ""


_source: SchedulerSource | None = None


def scheduler_source() -> SchedulerSource:
    """Read once, at the first call (call it before building schedulers)."""
    global _source
    if _source is None:
        import hashlib

        import vllm.v1.core.sched.scheduler as sched

        data = Path(sched.__file__).read_bytes()
        _source = SchedulerSource(sched.__file__, data.decode(errors="replace"), hashlib.sha256(data).hexdigest())
    return _source


def quiet_vllm_logs() -> None:
    """vLLM logs config warnings for each scheduler built; they say nothing here."""
    import logging

    for name in ("vllm", "vllm.config"):
        logging.getLogger(name).setLevel(logging.ERROR)

