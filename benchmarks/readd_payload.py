"""What each step sends the model runner when the active places go round.

    .venv/bin/python benchmarks/readd_payload.py [--r 1024] [--active 4,64,256] [--prompt-tokens 512]
        [--steps 200] [--json PATH]

The limiter's places go round the users with budget, so most requests given tokens in
a step sat out the step before, and vLLM's (V1) model runner re-adds them to its
persistent batch. For each such request upstream's ``_make_cached_request_data``
copies the request's every token id into the step's ``SchedulerOutput``, which the
multiprocess executor pickles to the worker (and a one-process executor hands over
as is). A synchronous model runner never reads them; an asynchronous one reads only
the last ``num_output_tokens``. The patch sends none (synchronous) or that tail.

The real scheduler (``ratebench.profiling.microbench``: R resident requests of
``--prompt-tokens`` each, 4 streams a user, limits never reached, a clock held
still) runs ``--steps`` steps per variant; per step this prints how many requests
were re-added, the ``SchedulerOutput``'s pickled size, and the time to pickle and
unpickle it (what the executor and the worker pay, on this machine), for:

* ``off``: the limiter off (first come first served: the same requests each step);
* ``on``: the limiter on, as patched;
* ``on, upstream payload``: the same outputs with the token ids upstream would send
  put back (every re-added request's whole list), the cost the patch removes.

Asynchronous scheduling: ``--async`` (the payload is then the output tokens' tail).

The second table is the worker's side: vLLM's V1 ``InputBatch`` (the V1 model
runner's persistent batch, on the CPU here; the V2 model runner keeps requests that
sat out a step) as installed (patch 0007 copies a request added back from the array
its prompt was copied into at its second add; ``ratebench patch revert`` to time the
pristine one) with A
requests of ``--prompt-tokens`` + 64 output tokens, per step with every request
swapped for another (what places going round every step do) against none swapped
(first come first served): ``remove_request`` of the requests that sat out,
``add_request`` of those back (their token ids, block table row and sampling state
copied in), then ``condense`` and ``refresh_metadata``.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

from ratebench._io import atomic_write_json
from ratebench.profiling.microbench import (
    VARIANT_NEVER_REACHED,
    VARIANT_OFF,
    MicrobenchSettings,
    SchedulerBench,
    quiet_vllm_logs,
)
from ratebench.tinymodel import ensure_tiny_model


def measure(variant: str, r: int, active: int, prompt_tokens: int, steps: int, is_async: bool,
            upstream_payload: bool) -> dict:
    settings = MicrobenchSettings(active_seqs=active, prompt_tokens=prompt_tokens, async_scheduling=is_async)
    bench = SchedulerBench(variant, r, settings, ensure_tiny_model())
    scheduler = bench.scheduler
    if is_async:
        # As a GPU engine (and ratebench's CPU async overlay) keeps it: the CPU platform's hook turns it off.
        scheduler.scheduler_config.async_scheduling = True
    for _ in range(r // max(active // 2, 1) + 2 * r // active + 20):  # all prefilled, the places gone round twice
        bench.step(timed=False)
    readded, sizes, dump_us, load_us = [], [], [], []
    previous: set[str] = set(scheduler.prev_step_scheduled_req_ids)
    schedule = scheduler.schedule
    outputs = []

    def capture():
        out = schedule()
        outputs.append(out)
        return out

    scheduler.schedule = capture
    try:
        for _ in range(steps):
            bench.step(timed=False)
            out = outputs.pop()
            cached = out.scheduled_cached_reqs
            back = [rid for rid in cached.req_ids if rid not in previous]
            if upstream_payload:
                requests = scheduler.requests
                cached.all_token_ids = {rid: list(requests[rid].all_token_ids) for rid in back if rid in requests}
            previous = set(out.num_scheduled_tokens)
            t0 = time.perf_counter_ns()
            blob = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
            t1 = time.perf_counter_ns()
            pickle.loads(blob)
            t2 = time.perf_counter_ns()
            readded.append(len(back))
            sizes.append(len(blob))
            dump_us.append((t1 - t0) / 1e3)
            load_us.append((t2 - t1) / 1e3)
    finally:
        scheduler.schedule = schedule
    return dict(variant=variant, upstream_payload=upstream_payload, r=r, active=active, prompt_tokens=prompt_tokens,
                async_scheduling=is_async, steps=steps, readded_per_step=statistics.fmean(readded),
                pickled_kib=statistics.median(sizes) / 1024, pickle_us=statistics.median(dump_us),
                unpickle_us=statistics.median(load_us))


def worker_readds(active: int, prompt_tokens: int, steps: int) -> dict:
    """Microseconds per step the persistent batch spends re-adding a whole batch of ``active`` requests."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    output_tokens, block_size = 64, 16
    max_model_len = prompt_tokens + output_tokens + block_size
    batch = InputBatch(max_num_reqs=active, max_model_len=max_model_len, max_num_batched_tokens=8192,
                       device=torch.device("cpu"), vocab_size=32000, block_sizes=[block_size],
                       max_num_blocks_per_req=[-(-max_model_len // block_size)])

    def state(i: int) -> CachedRequestState:
        return CachedRequestState(
            req_id=f"r{i}", prompt_token_ids=list(range(prompt_tokens)), mm_features=[],
            sampling_params=SamplingParams(max_tokens=output_tokens * 2, temperature=0.0), generator=None,
            block_ids=(list(range(-(-(prompt_tokens + output_tokens) // block_size))),),
            num_computed_tokens=prompt_tokens + output_tokens, output_token_ids=list(range(output_tokens)))

    sets = [[state(i) for i in range(active)], [state(active + i) for i in range(active)]]
    for request in sets[0]:
        batch.add_request(request)
    batch.condense()
    batch.refresh_metadata()
    swapped, kept = [], []
    for step in range(steps):
        out, back = sets[step % 2], sets[(step + 1) % 2]
        t0 = time.perf_counter_ns()
        for request in out:
            batch.remove_request(request.req_id)
        for request in back:
            batch.add_request(request)
        batch.condense()
        batch.refresh_metadata()
        t1 = time.perf_counter_ns()
        batch.condense()  # the same requests again: what a step with an unchanged batch pays here
        batch.refresh_metadata()
        t2 = time.perf_counter_ns()
        swapped.append((t1 - t0) / 1e3)
        kept.append((t2 - t1) / 1e3)
    return dict(active=active, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                swapped_us=statistics.median(swapped), kept_us=statistics.median(kept))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--r", type=int, default=1024, help="resident requests")
    parser.add_argument("--active", default="4,64,256", help="--max-num-active-seqs values, comma separated")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--async", dest="is_async", action="store_true", help="asynchronous scheduling")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        actives = [int(a) for a in args.active.split(",")]
    except ValueError:
        print(f"--active {args.active!r}: give integers separated by commas, e.g. 4,64,256", file=sys.stderr)
        return 2
    quiet_vllm_logs()
    rows = []
    print(f"R = {args.r}, prompts of {args.prompt_tokens} tokens, {args.steps} steps, "
          f"{'async' if args.is_async else 'sync'} scheduling; per step, medians")
    print(f"{'A':>4} {'variant':<24} {'re-added':>8} {'KiB':>8} {'pickle us':>10} {'unpickle us':>12}")
    for active in actives:
        for variant, upstream in ((VARIANT_OFF, False), (VARIANT_NEVER_REACHED, False), (VARIANT_NEVER_REACHED, True)):
            row = measure(variant, args.r, active, args.prompt_tokens, args.steps, args.is_async, upstream)
            rows.append(row)
            name = "off" if variant == VARIANT_OFF else ("on, upstream payload" if upstream else "on")
            print(f"{active:>4} {name:<24} {row['readded_per_step']:>8.1f} {row['pickled_kib']:>8.1f} "
                  f"{row['pickle_us']:>10.0f} {row['unpickle_us']:>12.0f}")
    print(f"\nthe worker's persistent batch, requests of {args.prompt_tokens} + 64 tokens; per step, medians")
    print(f"{'A':>4} {'every request swapped us':>25} {'none swapped us':>16}")
    for active in actives:
        row = worker_readds(active, args.prompt_tokens, min(args.steps, 50))
        rows.append(dict(row, table="worker"))
        print(f"{active:>4} {row['swapped_us']:>25.0f} {row['kept_us']:>16.0f}")
    if args.json:
        atomic_write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
