"""A streaming chat client for `bench load` (`bench.serve.send` streams /v1/completions of
token ids; this one streams /v1/chat/completions and keeps the answer's text).

TTFT is the time from sending a request to the first SSE chunk that carries non-empty text:
`transformers serve` sends a role-only chunk before it has even prefilled the prompt, and
kvstore a role chunk with empty content at its first token, so only text is comparable.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field

import httpx

from bench.serve import Outcome


@dataclass
class ChatOutcome(Outcome):
    """`bench.serve.Outcome` with the session, turn and answer text; `cached_reported` is
    False when the server's usage has no prompt_tokens_details.cached_tokens."""

    session: int = 0
    turn: int = 0
    text: str = ""
    cached_reported: bool = False
    token_times: list[float] = field(default_factory=list)  # perf_counter of each text chunk
    error_event: bool = False  # the stream ended with an error event (not cut silently)

    def gaps_s(self) -> list[float]:
        """Inter-token latencies: the time between consecutive text chunks."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_text(error: object) -> str:
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def _take_usage(out: ChatOutcome, usage: dict) -> None:
    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    out.completion_tokens = int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    out.cached_reported = cached is not None
    out.cached_tokens = int(cached or 0)


def _read_events(response: httpx.Response, out: ChatOutcome, start: float) -> None:
    """Text, TTFT and usage from the SSE stream; stops at [DONE], an error or the stream's end
    (`transformers serve` sends no [DONE])."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            out.error, out.error_event = _error_text(chunk["error"]), True
            return
        for choice in chunk.get("choices") or []:
            if text := (choice.get("delta") or {}).get("content"):
                now = time.perf_counter()
                if out.ttft_s is None:
                    out.ttft_s = now - start
                out.token_times.append(now)
                out.text += text
        if chunk.get("usage"):
            _take_usage(out, chunk["usage"])


def send_chat(client: httpx.Client, url: str, body: dict, api_key: str | None) -> ChatOutcome:
    """One streamed chat completion; ok once the stream ended with a usage and no error."""
    start = time.perf_counter()
    out = ChatOutcome(url, False, 0)
    try:
        with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=_headers(api_key)
        ) as response:
            out.status = response.status_code
            if response.status_code != 200:
                out.error = response.read().decode(errors="replace")[:300]
            else:
                _read_events(response, out, start)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.ok = not out.error and out.prompt_tokens > 0
    if not out.ok and not out.error:
        out.error = "the stream ended without a usage"
    out.latency_s = time.perf_counter() - start
    return out
