"""Promise 7, feature off = upstream: the run's step-by-step comparison of the installed scheduler with
the limiter off against upstream's (``feature-off.json``, written by :mod:`ratebench.upstream_replay`
before the run's engines started), judged as ``feature-off-upstream``.

Every configuration (policy, scheduling mode, seed) must agree at every step; one that parts, or a
comparison that could not be made (the child failed: the installed tree neither pristine nor patched,
a limiter-off path that crashes), fails the check. A run folder without the file (an older run, or a
run attached to someone else's server with ``--endpoint``) has no such check, and the verdict names
promise 7 as exercised only by the engines' own checks."""

from __future__ import annotations

import json

from ratebench.analysis.load import RunData
from ratebench.analysis.verdict import Check

FILE = "feature-off.json"  # ratebench.upstream_replay.FILE (not imported: that module drives vLLM)


def feature_off_checks(run: RunData) -> list[Check]:
    path = run.run_dir / FILE
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
        configs = list(data.get("configs") or [])
        error = data.get("error")
    except (OSError, ValueError, AttributeError) as exc:
        configs, error = [], f"{FILE} unreadable: {exc}"
    if error or not configs:
        return [Check("feature-off-upstream", "*", "*", "scheduler", None, None, 0, "<=", "configurations", False,
                      f"the limiter-off scheduler could not be compared with upstream's: {error or 'no configuration'}")]
    parted = [c for c in configs if not c.get("identical")]
    steps = sum(int(c.get("steps") or 0) for c in configs)
    preempting = sum(int(c.get("preempting_steps") or 0) for c in configs)
    what = (f"{len(configs)} configurations (FCFS and PRIORITY, sync and async, {len({c.get('seed') for c in configs})} "
            f"seeds), {steps} steps ({preempting} with preemptions), the installed scheduler with the limiter off "
            "against upstream's on the same requests")
    if not parted:
        text = f"{what}: every step and every update the same"
    else:
        c = parted[0]
        d = c.get("first_difference") or {}
        text = (f"{what}: {len(parted)} parted; first {c.get('policy')}, "
                f"{'async' if c.get('async_scheduling') else 'sync'}, seed {c.get('seed')}, at step {d.get('step')}: "
                f"{d.get('what')}: installed {d.get('installed')}, upstream {d.get('upstream')}")
    return [Check("feature-off-upstream", "*", "*", "scheduler", None, len(parted), 0, "<=", "configurations",
                  not parted, text)]
