"""Promise 7, feature off = upstream: the installed vLLM scheduler with the limiter off, step by step
against upstream's, on the same requests.

The end-to-end comparisons of a run (throughput against stock vLLM, no charge on the limiter-off
engine) cannot see a limiter-off path that schedules the same work in another order, or another
request first. So before its engines start, ``ratebench run`` drives two real schedulers through the
same deterministic workloads, with no model (each step that samples is answered with one token, as
vLLM's own scheduler tests do) and one clock:

* the installed ``Scheduler`` / ``AsyncScheduler``, patched, built with no limiter flag; and
* upstream's, compiled in memory from the pristine sources the patch series reverts to (nothing on
  disk changes).

Each workload: 60 requests of three users and of none, prompts of 5 to 300 tokens with shared
prefixes, 1 to 59 output tokens, two priorities, a quarter aborted after a few steps, arriving over
150 steps, on 12 resident slots, 128 tokens a step and 40 KV blocks of 16 tokens with prefix caching
(so requests are preempted), 250 steps. FCFS and PRIORITY, synchronous and asynchronous scheduling,
:data:`SEEDS`. Compared at every step, in order: the tokens scheduled per request (the order the
worker builds its batch in), the new requests with their computed tokens and blocks, the cached ones,
the preempted and finished ones, the total; and what ``update_from_output`` hands the engine core
(new tokens, finish reasons).

It runs in a child process with the limiter-off engine's environment (``[engine] env``: its
``PYTHONPATH`` included), so what is imported there is what that engine imports. The result is
``feature-off.json`` in the run folder; verify-bound's ``feature-off-upstream`` check judges it.

    python -m ratebench.upstream_replay OUT.json
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

FILE = "feature-off.json"
SEEDS = (1, 2, 3)
POLICIES = ("fcfs", "priority")
STEPS = 250
REQUESTS = 60
ARRIVAL_STEPS = 150
STEP_NS = 10_000_000
OUTPUT_TOKEN = 7  # what the "model" samples (never EOS)
TIMEOUT_S = 600


def pristine_scheduler_classes() -> tuple[type, type]:
    """Upstream Scheduler and AsyncScheduler, compiled in memory from the pristine sources that
    ratebench's patch series reverts to (the installed tree is left as it is)."""
    import types

    import vllm

    from ratebench.patching import read_pristine_files

    pristine = read_pristine_files()
    source = pristine["vllm/v1/core/sched/scheduler.py"]
    if source is None:
        raise RuntimeError("the patch series has no pristine vllm/v1/core/sched/scheduler.py")
    mod = types.ModuleType("ratebench_pristine_scheduler")
    mod.__file__ = "<pristine vllm/v1/core/sched/scheduler.py>"
    sys.modules[mod.__name__] = mod
    exec(compile(source.decode(), mod.__file__, "exec"), mod.__dict__)
    async_path = Path(vllm.__file__).parent / "v1/core/sched/async_scheduler.py"
    async_source = pristine.get("vllm/v1/core/sched/async_scheduler.py") or async_path.read_bytes()
    async_text = async_source.decode().replace("from vllm.v1.core.sched.scheduler import Scheduler",
                                               "from ratebench_pristine_scheduler import Scheduler")
    amod = types.ModuleType("ratebench_pristine_async_scheduler")
    amod.__file__ = "<pristine vllm/v1/core/sched/async_scheduler.py>"
    exec(compile(async_text, amod.__file__, "exec"), amod.__dict__)
    return mod.Scheduler, amod.AsyncScheduler


def workload(seed: int) -> list[dict[str, Any]]:
    """The requests of one seed: when each arrives (step), its user, prompt, answer, priority and abort."""
    rng = random.Random(seed)
    out = []
    for i in range(REQUESTS):
        out.append(dict(step=rng.randrange(0, ARRIVAL_STEPS), id=f"q{i}", user=rng.choice(["a", "b", "c", None]),
                        prompt_len=rng.choice([5, 16, 40, 100, 300]), max_tokens=rng.randrange(1, 60),
                        priority=rng.randrange(0, 2),
                        abort_after=rng.choice([None, None, None, rng.randrange(1, 30)])))
    return out


def _request(w: dict[str, Any], step: int, block_size: int):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    n = int(w["id"][1:])
    extra = {"output_rate_user": w["user"]} if w["user"] is not None else None
    params = SamplingParams(max_tokens=w["max_tokens"], ignore_eos=True, extra_args=extra)
    # three prompt tokens: requests share prefixes (prefix-cache hits)
    return Request(request_id=w["id"], prompt_token_ids=[7 + n % 3] * w["prompt_len"], sampling_params=params,
                   pooling_params=None, priority=w["priority"], arrival_time=1000.0 + step * 0.01 + n * 1e-6,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def trace(scheduler_cls: type | None, *, async_scheduling: bool, seed: int, policy: str) -> tuple[list, list]:
    """(what each step scheduled, what each update handed the engine core) of one scheduler class (None:
    the installed one) with the limiter off."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    from ratebench.profiling.microbench import build_scheduler
    from ratebench.tinymodel import ensure_tiny_model

    init_none_hash(sha256)
    clock = [1_000 * 1_000_000_000]
    block_size = 16
    s = build_scheduler(model_dir=ensure_tiny_model(), max_num_seqs=12, max_num_active_seqs=6, default_tps=None,
                        user_tps=None, max_num_batched_tokens=128, num_blocks=40, block_size=block_size,
                        policy=policy, async_scheduling=async_scheduling, enable_prefix_caching=True,
                        clock=lambda: clock[0], scheduler_cls=scheduler_cls)
    steps: list = []
    outputs: list = []
    in_flight = None
    arrivals: dict[int, list[dict]] = {}
    for w in workload(seed):
        arrivals.setdefault(w["step"], []).append(w)
    aborts: dict[int, list[str]] = {}
    try:
        for step in range(STEPS):
            for w in arrivals.get(step, []):
                s.add_request(_request(w, step, block_size))
                if w["abort_after"]:
                    aborts.setdefault(step + w["abort_after"], []).append(w["id"])
            if step in aborts:
                s.finish_requests(aborts[step], RequestStatus.FINISHED_ABORTED)
            out = s.schedule()
            req_ids = list(out.num_scheduled_tokens)
            sampled = []
            for req_id in req_ids:
                request = s.requests.get(req_id)
                sampled.append([OUTPUT_TOKEN] if request is not None and not request.is_prefill_chunk else [])
            runner = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                       sampled_token_ids=sampled)
            cached = out.scheduled_cached_reqs
            steps.append((
                list(out.num_scheduled_tokens.items()),
                [(r.req_id, r.num_computed_tokens, r.block_ids) for r in out.scheduled_new_reqs],
                (list(cached.req_ids), sorted(cached.resumed_req_ids), list(cached.new_block_ids),
                 list(cached.num_computed_tokens), list(cached.num_output_tokens)),
                sorted(out.preempted_req_ids),
                sorted(out.finished_req_ids),
                out.total_num_scheduled_tokens,
            ))
            pending = (out, runner)
            if async_scheduling:
                pending, in_flight = in_flight, pending
            if pending is not None:
                result = s.update_from_output(*pending)
                outputs.append([(o.request_id, list(o.new_token_ids), o.finish_reason, o.stop_reason)
                                for eco in result.values() for o in eco.outputs])
            clock[0] += STEP_NS
    finally:
        s.shutdown()
    return steps, outputs


_PARTS = ("tokens scheduled per request, in batch order", "new requests (computed tokens, blocks)",
          "cached requests", "preempted requests", "finished requests", "total tokens scheduled")


def _short(value: Any, limit: int = 300) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + " ..."


def first_difference(installed: tuple[list, list], upstream: tuple[list, list]) -> dict[str, Any] | None:
    """Where the installed scheduler first did otherwise than upstream's: the step, what differed, both
    values; None when every step and every update agreed."""
    steps_a, outs_a = installed
    steps_b, outs_b = upstream
    for k, (a, b) in enumerate(zip(steps_a, steps_b)):
        if a != b:
            part = next(i for i in range(len(a)) if a[i] != b[i])
            return dict(step=k, what=_PARTS[part], installed=_short(a[part]), upstream=_short(b[part]))
    for k, (a, b) in enumerate(zip(outs_a, outs_b)):
        if a != b:
            return dict(step=k, what="what update_from_output handed the engine core (new tokens, finish)",
                        installed=_short(a), upstream=_short(b))
    if len(steps_a) != len(steps_b) or len(outs_a) != len(outs_b):
        return dict(step=min(len(steps_a), len(steps_b)), what="the number of steps or updates",
                    installed=str(len(steps_a)), upstream=str(len(steps_b)))
    return None


def compare_all() -> dict[str, Any]:
    """Every configuration, installed against upstream: the content of ``feature-off.json``."""
    import vllm

    from ratebench.profiling.microbench import quiet_vllm_logs

    quiet_vllm_logs()
    t0 = time.monotonic()
    pristine_sync, pristine_async = pristine_scheduler_classes()
    configs = []
    for policy in POLICIES:
        for async_scheduling in (False, True):
            for seed in SEEDS:
                upstream_cls = pristine_async if async_scheduling else pristine_sync
                installed = trace(None, async_scheduling=async_scheduling, seed=seed, policy=policy)
                upstream = trace(upstream_cls, async_scheduling=async_scheduling, seed=seed, policy=policy)
                diff = first_difference(installed, upstream)
                configs.append(dict(policy=policy, async_scheduling=async_scheduling, seed=seed,
                                    steps=len(upstream[0]),
                                    preempting_steps=sum(1 for st in upstream[0] if st[3]),
                                    identical=diff is None, first_difference=diff))
    return dict(version=1, vllm=getattr(vllm, "__version__", None), configs=configs,
                seconds=round(time.monotonic() - t0, 2), error=None)


def run_replay(run_dir: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Compare in a child process with the engines' environment; ``feature-off.json`` in ``run_dir``
    (:func:`ratebench.childproc.run_child`)."""
    from ratebench.childproc import run_child

    return run_child("ratebench.upstream_replay", run_dir, FILE, env, TIMEOUT_S, "configs")


def main(argv: list[str] | None = None) -> int:
    from ratebench.childproc import child_main

    return child_main(argv, "ratebench.upstream_replay", compare_all)


if __name__ == "__main__":
    sys.exit(main())
