"""Prompts of a controlled token length, from the server's own tokenizer (its ``/tokenize``)."""

from __future__ import annotations

import httpx

from ratebench.workload.requests import WorkloadError
from ratebench.workload.sse import ssl_context

# Natural text the prompts are made of (tokenized once by the server's /tokenize).
_BASE_TEXT = (
    "The scheduler hands out output tokens one step at a time, and every user shares "
    "a single budget across all of their streams. A request that runs out of budget "
    "waits in place and resumes later; it is never cut short. Meanwhile other users "
    "carry on at their own pace, as if nothing had happened. "
)


class PromptMaker:
    """Prompts of a controlled token length, from the server's own tokenizer."""

    def __init__(self, endpoint: str, model: str) -> None:
        self.endpoint = endpoint
        self.model = model
        self.base_ids: list[int] = []
        self.chars_per_token = 4.0
        self._salt_cache: dict[str, list[int]] = {}

    async def tokenize(self, text: str) -> list[int]:
        async with httpx.AsyncClient(timeout=30.0, verify=ssl_context()) as client:
            r = await client.post(f"{self.endpoint}/tokenize",
                                  json={"model": self.model, "prompt": text, "add_special_tokens": False})
        if r.status_code != 200:
            raise WorkloadError(f"{self.endpoint}/tokenize answered HTTP {r.status_code}: {r.text[:300]}")
        return list(r.json()["tokens"])

    async def calibrate(self) -> None:
        text = _BASE_TEXT * 8
        self.base_ids = await self.tokenize(text)
        if not self.base_ids:
            raise WorkloadError(f"{self.endpoint}/tokenize returned no tokens for plain English text")
        self.chars_per_token = len(text) / len(self.base_ids)

    async def header_ids(self, salt: str) -> list[int]:
        if salt not in self._salt_cache:
            self._salt_cache[salt] = await self.tokenize(f"[{salt}] ")
        return self._salt_cache[salt]

    def fill(self, n: int, offset: int = 0) -> list[int]:
        """``n`` token ids of natural text, starting ``offset`` tokens into it."""
        base = self.base_ids
        return [base[(offset + i) % len(base)] for i in range(n)]

    async def token_prompt(self, n: int, salt: str, prefix: list[int] | None = None) -> list[int]:
        """Exactly ``n`` token ids (plus ``prefix``): a unique header, then text.

        The unique header keeps prompts from sharing cached blocks by accident.
        """
        head = (await self.header_ids(salt))[:n]
        return (prefix or []) + head + self.fill(n - len(head), offset=len(salt))

    def text_prompt(self, approx_tokens: int, salt: str) -> str:
        """Text of about ``approx_tokens`` tokens, starting with a unique header."""
        body = (_BASE_TEXT * (1 + int(approx_tokens * self.chars_per_token) // len(_BASE_TEXT)))
        return f"[{salt}] " + body[: int(approx_tokens * self.chars_per_token)]
