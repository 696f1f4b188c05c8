"""Tokens from the engine's worker thread to an SSE stream (`engine.api.sse`): a thread-safe
bridge into asyncio, an incremental detokenizer that never sends text a stop string will
cut away, and one choice's events (its text, its logprobs, an echo first)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from engine.api import logprobs as lp
from engine.api.sse import sse
from engine.loop.logprobs import prompt_logprobs_of
from engine.loop.request import QueueFullError

if TYPE_CHECKING:
    from engine.api.errors import ApiError
    from engine.api.openai_responses import StreamChunks
    from engine.loop.request import GenerateResult, Request
    from engine.server.metrics import ServerMetrics

DONE = object()  # the bridge's end marker
_INCOMPLETE = "\ufffd"  # what a partial UTF-8 sequence decodes to
_MAX_UTF8_TAIL = 3  # bytes of a UTF-8 sequence that may still be missing


class TokenBridge:
    """Token ids from the worker thread, in order, then DONE once the job's future is done."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue[object] = asyncio.Queue()

    def push(self, token_id: int) -> None:
        """Thread-safe; used as the job's on_token."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, token_id)

    def watch(self, future: Future) -> None:
        """DONE follows every pushed token: the worker pushes before it resolves the future."""
        future.add_done_callback(
            lambda _: self._loop.call_soon_threadsafe(self._queue.put_nowait, DONE)
        )

    async def get(self) -> object:
        return await self._queue.get()


class TextStreamer:
    """Text deltas of a growing token list. Holds back the last (longest stop - 1) characters
    and a trailing partial UTF-8 character, so everything sent is a prefix of the final text."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that can be sent now (maybe empty)."""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        end = len(text) - self.holdback
        cut = min((i for s in self.stop if (i := text.find(s)) >= 0), default=None)
        if cut is not None:
            end = min(end, cut)
        tail = len(text) - _MAX_UTF8_TAIL
        while end > max(len(self.sent), tail) and text[end - 1] == _INCOMPLETE:
            end -= 1
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) : end]
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text (the engine's, already cut at a stop string)."""
        if not final_text.startswith(self.sent):
            return ""  # cannot happen for prefix-stable tokenizers; never resend text
        rest = final_text[len(self.sent) :]
        self.sent = final_text
        return rest


class ChoiceStream:
    """The events of one streamed choice: its `chunks` (with the logprobs format its request
    asks), the text of its `job`'s tokens so far, the echoed prompt first. A choice of
    several streams as one alone does: its job has its own logprobs, and its prompt's."""

    def __init__(
        self, chunks: StreamChunks, job: Request, want: lp.Asked, echo: str, streamer: TextStreamer
    ):
        """`echo`: the prompt's text (`lp.echo_text`)."""
        self.chunks, self.job, self.want, self.echo = chunks, job, want, echo
        self.streamer = streamer

    def token(self, token: int) -> list[str]:
        """A generated token's events: its text and logprobs, after the prompt's first when
        echoed (an echo-only request's one token is dropped)."""
        chunks, job, want = self.chunks, self.job, self.want
        if want.echo and not chunks.started:  # the prompt's logprobs are all known by now
            chunks.prefix = self.echo
            if want.logprobs is not None:
                chunks.pending = lp.prompt_positions(job.token_ids, prompt_logprobs_of(job))
        if want.echo_only:
            return []
        if chunks.logprobs is not None:  # recorded before the token was emitted
            entry = job.logprobs.output[len(self.streamer.token_ids)]
            chunks.pending += lp.output_positions([entry])
        return chunks.delta(self.streamer.push(token))

    def final(self, result: GenerateResult, return_token_ids: bool) -> str:
        """The choice's last chunk (`result`: as answered, `lp.answered`)."""
        ids = result.output_token_ids if return_token_ids else None
        return self.chunks.final(self.streamer.finish(result.text), result.finish_reason, ids)


def openai_ending(error: ApiError) -> list[str]:
    return [sse(error.body()), sse("[DONE]")]


def stream_outcome(
    job: Request,
    failure: Callable[[BaseException], ApiError],
    metrics: ServerMetrics,
    ending: Callable[[ApiError], list[str]] = openai_ending,
) -> tuple[GenerateResult | None, list[str]]:
    """A streamed job that is done: its result, or None and the events that end the stream
    with its error (`ending`: in OpenAI's shape by default; a job displaced from a full
    queue after its headers went out counts as a `queue_full` rejection)."""
    try:
        return job.future.result(), []
    except (Exception, concurrent.futures.CancelledError) as e:
        if isinstance(e, QueueFullError):
            metrics.reject("queue_full")
        return None, ending(failure(e))
