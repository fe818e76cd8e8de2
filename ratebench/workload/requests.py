"""What a scenario asks the driver to send: one :class:`StreamRequest` per streamed request, the
phase it belongs to (:class:`PhaseContext`) and the JSON body it becomes (:func:`request_body`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class WorkloadError(RuntimeError):
    """The server refused what the driver needs (tokenizer, model): says what and where."""


@dataclass
class StreamRequest:
    """One streamed request a scenario wants sent."""

    user: str | None  # vllm_xargs.output_rate_user; None: the field is left out
    prompt: list[int] | str  # token ids (completions) or text (chat, or completions)
    max_tokens: int
    api: str = "completions"  # "completions" | "chat"
    ignore_eos: bool = True
    delay_s: float = 0.0  # after the phase starts
    cancel_after_tokens: int | None = None
    cancel_after_s: float | None = None
    background: bool = False  # closed by the driver once every foreground stream is done
    openai_user: str | None = None  # the OpenAI "user" field
    extra_body: dict[str, Any] = field(default_factory=dict)  # min_tokens, logit_bias, ...
    extra_xargs: dict[str, Any] = field(default_factory=dict)  # more vllm_xargs keys (spoofing attempts)
    headers: dict[str, str] = field(default_factory=dict)  # more HTTP headers (spoofing attempts)
    spoof: str | None = None  # the channels through which the request names another user, in words
    stream_index: int = 0
    prompt_tokens: int | None = None  # known length of the prompt, when exact
    # a closed loop: at most loop_streams requests of loop_group open at once, each sent delay_s after
    # one of them ends (the first ones, after the phase starts), in list order
    loop_group: str | None = None
    loop_streams: int = 1


@dataclass
class PhaseContext:
    """Where a phase's records belong."""

    scenario: str
    phase: str
    engine: str
    endpoint: str
    model: str
    # a fleet's phase: the fleet's engine name (each record's ``fleet``), and the response header in which
    # the balancer names the engine that served the request (each record's ``engine``)
    fleet: str | None = None
    served_by_header: str | None = None
    # a stream that gets no byte for this long is closed as stalled (profile.stall_timeout_s)
    stall_timeout_s: float = 60.0


def request_body(model: str, req: StreamRequest) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": req.ignore_eos,
        "temperature": 1.0,
        # the answer's token ids in each chunk: what the client got, to hold against the same request
        # on the limiter-off engine (answers-intact)
        "return_token_ids": True,
    }
    if req.api == "chat":
        text = req.prompt if isinstance(req.prompt, str) else None
        if text is None:
            raise WorkloadError("chat requests need a text prompt")
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    xargs = dict(req.extra_xargs)
    if req.user is not None:
        xargs["output_rate_user"] = req.user
    if xargs:
        body["vllm_xargs"] = xargs
    if req.openai_user is not None:
        body["user"] = req.openai_user
    body.update(req.extra_body)
    return body
