"""Promise 1: only output tokens are limited; prompt tokens are free (checks prompt-free and
charge-parity: every charge samples a token)."""

from __future__ import annotations

from ratebench.analysis.checks.base import CheckMeaning, RowContext, meanings, per_row
from ratebench.analysis.verdict import Check, UserPhaseSummary

MEANINGS = meanings({
    "prompt-free": CheckMeaning("1", "long prompts waited for their first token as if their prompt tokens were "
                                "charged against the user's budget", "report.md, times to first token of the "
                                "long-prompt phase; {events}: the first emit of each request against its send"),
    "charge-parity": CheckMeaning("1", "a request was charged for steps that sampled no token (a prefill chunk, "
                                  "or a charge without an emit)", "{events}: dispatch against emit events of the "
                                  "request the explanation names"),
})


@per_row(50)
def prompt_free(c: RowContext) -> list[Check]:
    """Long prompts' first token far sooner than charging the prompt would allow."""
    check = _prompt_free(c.run.phases[c.p_index], c.row, c.ids)
    return [] if check is None else [check]


@per_row(80)
def charge_parity(c: RowContext) -> list[Check]:
    """Every charge samples a token: dispatch events = emitted tokens, request by request."""
    return [_charge_parity(c.row, c.ids)] if c.row.charge_requests else []


def _prompt_free(phase, row: UserPhaseSummary, ids) -> Check | None:
    """Only output tokens are limited: in a long-prompt phase, the p50 time to first token (engine side:
    first emit - sent; client side without events) stays under a quarter of what charging the prompt at
    the user's limit would take (prompt tokens / N / 4)."""
    prompt_tokens = phase.facts.prompt_tokens
    ttft = row.ttft_engine or row.ttft_client
    if phase.kind != "long-prompt" or not row.limit_tps or not prompt_tokens or ttft is None:
        return None
    limit_s = prompt_tokens / row.limit_tps / 4
    p50_s = ttft.p50_ns / 1e9
    return Check("prompt-free", *ids, round(p50_s, 4), round(limit_s, 4), "<=", "s", p50_s <= limit_s,
                 f"p50 time to first token of {ttft.count} requests with {prompt_tokens}-token prompts "
                 f"{p50_s * 1e3:.0f} ms ({'engine' if row.ttft_engine else 'client'} side); charging the prompt "
                 f"at {row.limit_tps} tok/s would take {prompt_tokens / row.limit_tps:.1f} s (allowed a quarter)")


def _charge_parity(row: UserPhaseSummary, ids) -> Check:
    ok = row.charge_over_allowance == 0
    text = (f"{row.charge_requests} finished requests: dispatch events - emitted tokens = {row.charge_excess_tokens:+d} "
            f"in all, {row.charge_over_allowance} beyond the allowance (0 for length, and stop when synchronous; "
            f"the look-ahead step after a stop, the steps dispatched before an abort)")
    if not ok:
        text += f"; worst {row.charge_worst}"
    return Check("charge-parity", *ids, row.charge_over_allowance, 0, "<=", "tokens", ok, text)
