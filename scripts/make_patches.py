#!/usr/bin/env python3
"""Maintainer tool: regenerate patches/vllm-0.32.0/ from a working copy of vLLM.

    python scripts/make_patches.py --pristine DIR --work DIR

Both DIRs hold a ``vllm/`` package folder (e.g. a copy of site-packages): the
pristine release and the one with ratebench's changes. Writes one unified diff
per entry of SERIES (paths relative to site-packages, ``a/`` and ``b/``
prefixes, new files from /dev/null) and the ``series`` file. Then run
``ratebench patch refresh-hashes --from DIR`` with the pristine DIR.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

PATCH_DIR = Path(__file__).resolve().parent.parent / "patches" / "vllm-0.32.0"

# patch file -> the files it changes, in application order.
SERIES: dict[str, list[str]] = {
    "0001-output-rate-limiter.patch": [
        "vllm/v1/core/sched/output_rate.py",
        "vllm/v1/core/sched/output_rate_events.py",
        "vllm/v1/request.py",
    ],
    "0002-scheduler-charge-refund-throttle.patch": [
        "vllm/v1/core/sched/interface.py",
        "vllm/v1/core/sched/scheduler.py",
    ],
    "0003-engine-core-wait-for-budget.patch": [
        "vllm/v1/engine/core.py",
    ],
    "0004-config-and-flags.patch": [
        "vllm/config/scheduler.py",
        "vllm/config/vllm.py",
        "vllm/engine/arg_utils.py",
    ],
    "0005-api-refuse-beam-search.patch": [
        "vllm/entrypoints/generate/beam_search/utils.py",
        "vllm/entrypoints/generate/beam_search/offline.py",
        "vllm/entrypoints/openai/completion/serving.py",
        "vllm/entrypoints/openai/chat_completion/serving.py",
    ],
    "0006-per-user-metrics.patch": [
        "vllm/v1/metrics/stats.py",
        "vllm/v1/metrics/loggers.py",
    ],
    "0007-worker-readd-prompt-copy.patch": [
        "vllm/v1/worker/gpu_input_batch.py",
    ],
}


def diff_file(pristine: Path, work: Path, rel: str) -> str:
    old_path, new_path = pristine / rel, work / rel
    old = old_path.read_text().splitlines(keepends=True) if old_path.exists() else []
    new = new_path.read_text().splitlines(keepends=True)
    for lines in (old, new):
        if lines and not lines[-1].endswith("\n"):
            raise SystemExit(f"{rel}: no newline at end of file; add one")
    from_name = f"a/{rel}" if old_path.exists() else "/dev/null"
    text = "".join(difflib.unified_diff(old, new, from_name, f"b/{rel}", n=3))
    if not text:
        raise SystemExit(f"{rel}: no change between pristine and work")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pristine", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    args = ap.parse_args()
    PATCH_DIR.mkdir(parents=True, exist_ok=True)
    for old in PATCH_DIR.glob("*.patch"):
        if old.name not in SERIES:
            old.unlink()
    for name, files in SERIES.items():
        body = "".join(diff_file(args.pristine, args.work, rel) for rel in files)
        (PATCH_DIR / name).write_text(body)
        print(f"wrote {name}: {body.count(chr(10))} lines")
    (PATCH_DIR / "series").write_text(
        "# ratebench's per-user output-rate limiter for vLLM 0.32.0, applied in this order\n"
        + "".join(f"{name}\n" for name in SERIES)
    )


if __name__ == "__main__":
    main()
