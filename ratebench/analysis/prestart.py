"""The checks ``ratebench run`` makes before its engines start, with no engine: judged from the files
they leave in the run folder.

* ``feature-off-upstream`` (promise 7): ``feature-off.json`` (:mod:`ratebench.upstream_replay`), the
  installed scheduler with the limiter off against upstream's, step by step. Every configuration
  (policy, scheduling mode, seed) must agree at every step; one that parts, or a comparison that could
  not be made (the child failed: the installed tree neither pristine nor patched, a limiter-off path
  that crashes), fails the check.
* ``flags-refused`` (the flags of docs/promise.md section 1): ``flags.json``
  (:mod:`ratebench.flagcheck`), malformed limiter flags through ``vllm serve``'s parser and engine
  config: each refused naming its flag, valid ones in the scheduler's config as given.
* ``config-refused`` (docs/promise.md section 3's refused configurations), from the same file: each
  configuration the limiter does not support refused with the limiter on, naming the flag and the
  configuration, and accepted with it off.

A run folder without the file (an older run, or a run attached to someone else's server with
``--endpoint``) has no such check, and the verdict names the promise it guards as not exercised (or, for
promise 7, exercised by the engines' own checks only)."""

from __future__ import annotations

import json

from ratebench.analysis.load import RunData
from ratebench.analysis.verdict import Check

FILE = "feature-off.json"  # written by ratebench.upstream_replay (the run stage); read here


def _read(run: RunData, file: str, items: str) -> tuple[list[dict], str | None] | None:
    """(the file's items, its error) of a prestart file in the run folder; None without the file."""
    path = run.run_dir / file
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return list(data.get(items) or []), data.get("error")
    except (OSError, ValueError, AttributeError) as exc:
        return [], f"{file} unreadable: {exc}"


def feature_off_checks(run: RunData) -> list[Check]:
    got = _read(run, FILE, "configs")
    if got is None:
        return []
    configs, error = got
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


FLAGS_FILE = "flags.json"  # written by ratebench.flagcheck (the run stage); read here


def flag_checks(run: RunData) -> list[Check]:
    """``flags-refused``: every case of ``flags.json`` (ratebench.flagcheck) as expected; none without the
    file (a run attached with ``--endpoint``, or an older run)."""
    got = _read(run, FLAGS_FILE, "cases")
    if got is None:
        return []
    cases, error = got
    if error or not cases:
        return [Check("flags-refused", "*", "*", "vllm serve", None, None, 0, "<=", "cases", False,
                      f"the limiter's flags could not be checked: {error or 'no case'}")]
    config = [c for c in cases if c.get("group") == "config"]
    out = _config_check(config) if config else []
    cases = [c for c in cases if c.get("group") != "config"]
    refused = sum(1 for c in cases if c.get("must_name"))
    return [_cases_check("flags-refused", cases, f"({refused} malformed, {len(cases) - refused} valid)",
                         "every malformed one refused naming its flag, the valid ones in the scheduler's config"),
            *out]


def _config_check(cases: list[dict]) -> list[Check]:
    """``config-refused``: each unsupported configuration refused with the limiter on (naming the flag and
    the configuration) and accepted with it off."""
    return [_cases_check("config-refused", cases, "(each unsupported configuration with the limiter on and off)",
                         "each refused with the limiter on, naming the flag and the configuration, and accepted "
                         "with it off")]


def _cases_check(name: str, cases: list[dict], kinds: str, all_ok: str) -> Check:
    """One check over cases of ``flags.json``: the cases not as promised (0 allowed), the first three named."""
    bad = [c for c in cases if not c.get("ok")]
    what = f"{len(cases)} cases through vllm serve's argument parser and engine config {kinds}"
    text = f"{what}: {all_ok}" if not bad else f"{what}: {len(bad)} not as promised; " + "; ".join(
        f"{c.get('name')} ({' '.join(c.get('flags') or [])}): {c.get('why')}" for c in bad[:3])
    return Check(name, "*", "*", "vllm serve", None, len(bad), 0, "<=", "cases", not bad, text)
