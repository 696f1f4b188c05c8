"""OpenAI's `n` and `best_of`: how many sequences a request samples and which it answers
with, and the answers of several choices (the body, the stream chunks, the usage).

`n` choices are returned; `best_of` (completions) sequences are sampled, and the `n` whose
output tokens have the highest cumulative log-probability are returned, best first. Both
are bounded by the server (`--max-n`). A stream sends every sampled sequence, so streaming
with `best_of` > `n` is refused, as OpenAI and vLLM refuse it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.api.errors import bad_request
from engine.api.openai_responses import (
    StreamChunks,
    chat_choice,
    completion_choice,
    envelope,
    new_id,
    now,
)
from engine.api.sse import sse

if TYPE_CHECKING:
    from engine.api.logprobs import LogprobFormat
    from engine.loop.request import GenerateResult


class ChoiceCounts(NamedTuple):
    n: int  # choices answered
    best_of: int  # sequences sampled (>= n)

    @property
    def field(self) -> str:
        """The field that sets how many sequences run: what a refusal names."""
        return "best_of" if self.best_of > self.n else "n"


def choice_counts(req: Any, max_n: int) -> ChoiceCounts:
    """A request's `n` and `best_of` (None: n), within 1..`max_n`; a 400 naming the field."""
    n, best_of = req.n, getattr(req, "best_of", None)
    best_of = n if best_of is None else best_of
    for field, value in (("n", n), ("best_of", best_of)):
        if value > max_n:
            raise bad_request(f"{field} is {value}; this server allows at most {max_n}", field)
    if best_of < n:
        raise bad_request(f"best_of ({best_of}) must be >= n ({n})", "best_of")
    if req.stream and best_of > n:
        why = "a stream sends every sequence as it is sampled; best_of > n cannot stream"
        raise bad_request(f"{why} (best_of {best_of}, n {n}): send stream=false", "best_of")
    return ChoiceCounts(n, best_of)


def best(logprobs: Sequence[float], n: int) -> list[int]:
    """The indices of the `n` highest cumulative log-probabilities, best first (ties: the
    lower index)."""
    return sorted(range(len(logprobs)), key=lambda i: (-logprobs[i], i))[:n]


def group_usage(results: Sequence[GenerateResult], leader: GenerateResult) -> dict:
    """The prompt once (its cached tokens as the leader saw them), every answered choice's
    output tokens."""
    completion = sum(len(r.output_token_ids) for r in results)
    return {
        "prompt_tokens": leader.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": leader.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": leader.cached_tokens},
    }


def choices_body(
    kind: str,
    model: str,
    results: Sequence[GenerateResult],
    leader: GenerateResult,
    return_token_ids: bool,
) -> dict:
    """The whole answer of a request of several choices, `results` in index order."""
    choices = []
    for index, result in enumerate(results):
        ids = result.output_token_ids if return_token_ids else None
        build = completion_choice if kind == "completion" else chat_choice
        choices.append({**build(result.text, result.finish_reason, ids), "index": index})
    name = "text_completion" if kind == "completion" else "chat.completion"
    body = envelope(name, new_id("cmpl" if kind == "completion" else "chatcmpl"), now(), model,
                    choices)  # fmt: skip
    return {**body, "usage": group_usage(results, leader)}


class IndexedChunks(StreamChunks):
    """The stream chunks of one choice of several: its `index`, the stream's id and time,
    its own logprobs format (None: none)."""

    def __init__(self, first: StreamChunks, index: int, logprobs: LogprobFormat | None = None):
        super().__init__(first.kind, first.model, bool(first.extra), logprobs)
        self.id, self.created, self.index = first.id, first.created, index

    def _event(self, choices: list[dict]) -> str:
        return super()._event([{**choice, "index": self.index} for choice in choices])


def stream_chunks(
    kind: str,
    model: str,
    include_usage: bool,
    n: int,
    logprobs: Callable[[], LogprobFormat | None] = lambda: None,
) -> list[IndexedChunks]:
    """Each choice's chunks, of one stream (one id); `logprobs` makes each choice's format."""
    first = StreamChunks(kind, model, include_usage)
    return [IndexedChunks(first, index, logprobs()) for index in range(n)]


def usage_event(chunks: StreamChunks, results: Sequence[GenerateResult]) -> str:
    """The stream's last chunk with `include_usage`: empty choices, the group's usage."""
    body = envelope(chunks.object, chunks.id, chunks.created, chunks.model, [])
    return sse({**body, "usage": group_usage(results, results[0])})
