"""The limiter's flags (docs/promise.md section 1): a malformed rate, malformed per-user rates, or
per-user rates without a default are refused at start-up with a message that names the flag; valid
flags reach the scheduler's config as given. And the configurations the limiter does not support
(section 3: speculative decoding, data or pipeline parallel, a custom scheduler class, KV connectors and
offloading, EC connectors, pooling models): refused with the limiter on, naming the flag and the
configuration; accepted with it off.

Before its engines start, ``ratebench run`` puts each case through what ``vllm serve`` runs first: the
real ``vllm serve`` argument parser (a refusal is argparse's exit 2 with its message on stderr), then,
for what parses, the engine config built from those arguments on the tiny model (what the server
builds before it loads weights: a refusal is the exception it raises). It runs in a child process with
the engines' environment, as :mod:`ratebench.upstream_replay` does, and writes ``flags.json``;
verify-bound's ``flags-refused`` check judges it (every case as expected).

    python -m ratebench.flagcheck OUT.json
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from pathlib import Path
from typing import Any

FILE = "flags.json"
DEFAULT_FLAG = "--default-user-output-tokens-per-second"
USER_FLAG = "--user-output-tokens-per-second"
TIMEOUT_S = 300

# (name, flags, the flag its refusal must name; None: must be accepted, with these rates in the config)
CASES: list[tuple[str, list[str], str | None]] = [
    ("a rate of zero", [DEFAULT_FLAG, "0"], DEFAULT_FLAG),
    ("a negative rate", [f"{DEFAULT_FLAG}=-3"], DEFAULT_FLAG),
    ("a fractional rate", [DEFAULT_FLAG, "1.5"], DEFAULT_FLAG),
    ("a rate that is no number", [DEFAULT_FLAG, "fast"], DEFAULT_FLAG),
    ("per-user rates that are no JSON", [DEFAULT_FLAG, "10", USER_FLAG, '{"a": 1'], USER_FLAG),
    ("per-user rates that are no object", [DEFAULT_FLAG, "10", USER_FLAG, "[1, 2]"], USER_FLAG),
    ("a per-user rate of zero", [DEFAULT_FLAG, "10", USER_FLAG, '{"a": 0}'], USER_FLAG),
    ("a fractional per-user rate", [DEFAULT_FLAG, "10", USER_FLAG, '{"a": 2.5}'], USER_FLAG),
    ("a per-user rate given as a string", [DEFAULT_FLAG, "10", USER_FLAG, '{"a": "5"}'], USER_FLAG),
    ("per-user rates without a default", [USER_FLAG, '{"a": 5}'], USER_FLAG),
    ("valid flags", [DEFAULT_FLAG, "10", USER_FLAG, '{"a": 5, "b": 2000}'], None),
]
VALID_RATES = (10, {"a": 5, "b": 2000})

# Configurations the limiter does not support (docs/promise.md section 3): with the limiter on, each must
# be refused at start-up with a message naming the limiter's flag and the configuration; with it off,
# each is accepted as upstream accepts it. (name, flags, the words the refusal must contain)
CONFIG_CASES: list[tuple[str, list[str], str]] = [
    ("speculative decoding", ["--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'],
     "speculative decoding"),
    ("data parallel", ["--data-parallel-size", "2"], "data_parallel_size > 1"),
    ("pipeline parallel", ["--pipeline-parallel-size", "2"], "pipeline_parallel_size > 1"),
    ("a custom scheduler class", ["--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler"],
     "scheduler_cls"),
    ("a KV connector", ["--kv-transfer-config", '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}'],
     "KV connectors"),
    ("KV offloading", ["--kv-offloading-size", "1"], "KV offloading"),
    ("an EC connector", ["--ec-transfer-config", '{"ec_connector": "ECExampleConnector", "ec_role": "ec_both"}'],
     "EC connectors"),
    ("a pooling runner", ["--runner", "pooling"], "pooling models"),
]


def _try(parser, model: str, flags: list[str]) -> dict[str, Any]:
    """What ``vllm serve MODEL FLAGS`` does with the flags before it loads weights."""
    from vllm.engine.arg_utils import EngineArgs

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parser.parse_args(["--model", model, "--skip-tokenizer-init", "--dtype", "float32",
                                      "--max-model-len", "1024", *flags])
    except SystemExit as exc:
        return dict(refused=True, stage="arguments", exit_code=exc.code, message=stderr.getvalue().strip()[-600:])
    try:
        config = EngineArgs.from_cli_args(args).create_engine_config()
    except Exception as exc:  # noqa: BLE001 - any refusal at start-up counts; its message is judged
        return dict(refused=True, stage="engine config", exit_code=None,
                    message=f"{type(exc).__name__}: {exc}"[-600:])
    sc = config.scheduler_config
    return dict(refused=False, stage=None, exit_code=None, message=None,
                default_tps=getattr(sc, "default_user_output_tokens_per_second", None),
                user_tps=getattr(sc, "user_output_tokens_per_second", None))


def check_all() -> dict[str, Any]:
    """Every case through the parser and the config: the content of ``flags.json``."""
    import logging

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ratebench.tinymodel import ensure_tiny_model

    for name in ("vllm", "vllm.config"):
        logging.getLogger(name).setLevel(logging.ERROR)
    t0 = time.monotonic()
    model = str(ensure_tiny_model())
    parser = make_arg_parser(FlexibleArgumentParser())
    cases = []
    for name, flags, names in CASES:
        got = _try(parser, model, flags)
        if names is None:
            ok = (not got["refused"] and got.get("default_tps") == VALID_RATES[0]
                  and got.get("user_tps") == VALID_RATES[1])
            why = ("accepted, the rates in the scheduler's config as given" if ok else
                   f"refused: {got['message']}" if got["refused"] else
                   f"accepted, but the config holds default {got.get('default_tps')!r} and per-user "
                   f"{got.get('user_tps')!r}, where {VALID_RATES[0]} and {VALID_RATES[1]} were given")
        else:
            ok = got["refused"] and names in (got["message"] or "")
            why = (f"refused ({got['stage']}), naming {names}" if ok else
                   f"refused ({got['stage']}) without naming {names}: {got['message']}" if got["refused"] else
                   f"accepted (default {got.get('default_tps')!r}, per-user {got.get('user_tps')!r})")
        cases.append(dict(name=name, flags=flags, must_name=names, ok=ok, why=why, **got))
    for name, config, words in CONFIG_CASES:
        flags = [DEFAULT_FLAG, "10", *config]
        got = _try(parser, model, flags)
        message = got["message"] or ""
        ok = got["refused"] and DEFAULT_FLAG in message and words in message
        why = (f"refused ({got['stage']}), naming {DEFAULT_FLAG} and {words}" if ok else
               f"refused ({got['stage']}) without naming {DEFAULT_FLAG} and {words}: {message}" if got["refused"]
               else "accepted with the limiter on")
        cases.append(dict(name=f"{name}, limiter on", flags=flags, group="config", must_name=[DEFAULT_FLAG, words],
                          ok=ok, why=why, **got))
        got = _try(parser, model, list(config))
        ok = not got["refused"] and got.get("default_tps") is None
        why = ("accepted, as upstream accepts it" if ok else f"refused with the limiter off: {got['message']}"
               if got["refused"] else f"accepted, but the limiter is on (default {got.get('default_tps')!r})")
        cases.append(dict(name=f"{name}, limiter off", flags=list(config), group="config", must_name=None,
                          ok=ok, why=why, **got))
    return dict(version=1, cases=cases, seconds=round(time.monotonic() - t0, 2), error=None)


def run_flag_check(run_dir: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Check in a child process with the engines' environment; ``flags.json`` in ``run_dir``
    (:func:`ratebench.childproc.run_child`)."""
    from ratebench.childproc import run_child

    return run_child("ratebench.flagcheck", run_dir, FILE, env, TIMEOUT_S, "cases")


def main(argv: list[str] | None = None) -> int:
    from ratebench.childproc import child_main

    return child_main(argv, "ratebench.flagcheck", check_all)


if __name__ == "__main__":
    sys.exit(main())
