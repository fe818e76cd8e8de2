"""One builder for the profiles the end-to-end tests write: the generated tiny model on CPU vLLM, small
engines, a few users. A test gives what its run needs (its users and limits, engine sizes, more
flags) and its ``[[scenarios]]`` tables; everything else is this header's. Test fixture, not shipped."""

from __future__ import annotations

import json
from typing import Any


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")


def e2e_profile(description: str, users: dict[str, int], scenarios: str, *, scheduling: tuple[str, ...] = ("sync",),
                max_engines: int = 1, max_num_seqs: int = 16, max_num_active_seqs: int = 4,
                max_num_batched_tokens: int = 256, extra_args: tuple[str, ...] = ("--enforce-eager",),
                env: dict[str, str] | None = None, cpu_async_overlay: bool = False, default_tps: int = 100,
                max_model_len: int = 1024) -> str:
    """A profile's TOML: this header, then ``scenarios`` (its [[scenarios]] tables, verbatim). ``env``
    is added to the engines' KV cache space (1 GiB)."""
    engine_env = {"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    lines = [
        "[profile]",
        f"description = {_toml(description)}",
        'device = "cpu"',
        f"scheduling = {_toml(list(scheduling))}",
        "startup_timeout_s = 300",
        "shutdown_grace_s = 15",
        f"max_engines = {max_engines}",
        "",
        "[model]",
        'source = "tiny"',
        'served_name = "tiny-qwen3"',
        f"max_model_len = {max_model_len}",
        "",
        "[engine]",
        f"max_num_seqs = {max_num_seqs}",
        f"max_num_active_seqs = {max_num_active_seqs}",
        f"max_num_batched_tokens = {max_num_batched_tokens}",
        "enable_chunked_prefill = true",
        "enable_prefix_caching = true",
        f"extra_args = {_toml(list(extra_args))}",
        f"env = {_toml(engine_env)}",
        *([f"cpu_async_overlay = {_toml(True)}"] if cpu_async_overlay else []),
        "",
        "[limits]",
        f"default_tps = {default_tps}",
        "[limits.users]",
        *(f"{user} = {rate}" for user, rate in users.items()),
        "",
    ]
    return "\n".join(lines) + "\n" + scenarios.lstrip("\n")
