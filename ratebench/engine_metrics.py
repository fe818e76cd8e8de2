"""What a running vLLM server says of itself on ``/metrics``: preemptions, KV cache use and size, the
limiter's per-user counters, prefix-cache hits. Empty (or None) when a page cannot be read."""

from __future__ import annotations

import re

import httpx

from ratebench.workload.sse import ssl_context

_GAUGE_RE = re.compile(r"^vllm:(num_preemptions|kv_cache_usage_perc)(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)
_CACHE_INFO_RE = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)
_LABEL_RE = re.compile(r'(\w+)="([^"]*)"')


async def engine_metrics(endpoint: str) -> dict[str, float]:
    """The engine's preemptions so far, its KV cache use now (a fraction) and its KV cache size in
    tokens (``kv_cache_tokens``), from /metrics; empty when not exported or not reachable."""
    text = await _metrics_text(endpoint)
    return parse_engine_metrics(text) if text is not None else {}


async def _metrics_text(endpoint: str) -> str | None:
    """The engine's /metrics page; None when it cannot be read."""
    try:
        async with httpx.AsyncClient(timeout=10.0, verify=ssl_context()) as client:
            r = await client.get(f"{endpoint}/metrics")
    except httpx.HTTPError:
        return None
    return r.text


def parse_engine_metrics(text: str) -> dict[str, float]:
    """:func:`engine_metrics` from the text of /metrics."""
    out: dict[str, float] = {}
    for name, value in _GAUGE_RE.findall(text):
        out[name] = out.get(name, 0.0) + float(value)
    info = _CACHE_INFO_RE.search(text)
    if info:
        labels = dict(_LABEL_RE.findall(info.group(1)))
        try:
            out["kv_cache_tokens"] = float(int(labels["num_gpu_blocks"]) * int(labels["block_size"]))
        except (KeyError, ValueError):
            pass
    return out


_USER_COUNTER_RE = re.compile(
    r'^vllm:output_rate_(tokens_granted|charges_refused)_total\{([^}]*)\}\s+([0-9.eE+-]+)$', re.M)


def parse_user_counters(text: str) -> dict[str, dict[str, float]] | None:
    """The limiter's per-user counters on /metrics (``--output-rate-metrics-users``): user ->
    {"granted", "refused"}; None when the page has none (not asked for, or not this patch)."""
    out: dict[str, dict[str, float]] = {}
    found = False
    for kind, labels, value in _USER_COUNTER_RE.findall(text):
        found = True
        user = dict(_LABEL_RE.findall(labels)).get("user")
        if user is None:
            continue
        entry = out.setdefault(user, {"granted": 0.0, "refused": 0.0})
        entry["granted" if kind == "tokens_granted" else "refused"] += float(value)
    return out if found or "vllm:output_rate_tokens_granted" in text else None


async def fleet_user_counters(members: dict[str, str]) -> dict[str, dict[str, dict[str, float]] | None]:
    """Each member's per-user counters (member -> user -> counts; None where not exported)."""
    out = {}
    for name, endpoint in members.items():
        text = await _metrics_text(endpoint)
        out[name] = parse_user_counters(text) if text is not None else None
    return out


_METRIC_RE = re.compile(r"^(vllm:prefix_cache_(?:hits|queries)(?:_total)?)\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


async def prefix_cache_counters(endpoint: str) -> dict[str, float]:
    """vLLM's prefix-cache counters from /metrics (empty when not exported)."""
    text = await _metrics_text(endpoint)
    out: dict[str, float] = {}
    for name, value in _METRIC_RE.findall(text or ""):
        key = name.removeprefix("vllm:").removesuffix("_total") + "_tokens"
        out[key] = out.get(key, 0.0) + float(value)
    return out
