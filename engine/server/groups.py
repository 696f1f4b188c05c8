"""A request of several choices (`n` or `best_of` > 1, engine/api/choices.py) on the server:
one engine request per sampled sequence, queued as one group (engine/loop/group.py), and
answered whole, or streamed with each choice's index as its tokens come. Each choice is
shaped as a request's only choice is (engine/api/logprobs.py; streamed: `ChoiceStream`):
its own logprobs, and with echo the prompt's text and logprobs first (the leader's, copied
to the others when their group is released).

The group answers whole or not at all: when a sequence fails, the others are cancelled and
the request gets the error (a stream: an error event). Only the leader's `on_done` counts a
request and its prompt in the server's metrics; the others count their generated tokens.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

from starlette.responses import JSONResponse, Response

from engine.api import logprobs as lp
from engine.api.choices import ChoiceCounts, best, choices_body, stream_chunks, usage_event
from engine.api.errors import ApiError, bad_request
from engine.api.sse import ClosingStream, sse
from engine.loop.engine import Engine
from engine.loop.group import SequenceGroup, branch_params
from engine.loop.request import (
    EngineClosedError,
    GenerateResult,
    InvalidRequestError,
    QueueFullError,
    Request,
    RequestCancelled,
    SamplingParams,
)
from engine.server.config import ServerConfig
from engine.server.metrics import ServerMetrics
from engine.server.streaming import DONE, ChoiceStream, TextStreamer, stream_outcome


class ChoiceBridge:
    """(index, token id) from the engine thread for each sequence, then (index, DONE) once
    its future is done: the worker pushes every token before it resolves the future."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    def pusher(self, index: int) -> Callable[[int], None]:
        """Sequence `index`'s `on_token` (thread-safe)."""
        return functools.partial(self._put, index)

    def _put(self, index: int, item: object) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, item))

    def watch(self, index: int, future: Future) -> None:
        future.add_done_callback(lambda _: self._put(index, DONE))

    async def get(self) -> tuple[int, object]:
        return await self._queue.get()


class Choices(NamedTuple):
    """The sequences of one request of several choices; sequence i is branch i."""

    jobs: list[Request]
    counts: ChoiceCounts
    bridge: ChoiceBridge | None  # when it streams


class GroupAnswers:
    """The requests of several choices of one server: its engine, settings, metrics and
    tokenizer, `failure`, the ApiError of an engine error (`Service.failure`), and `texts`,
    each token's text (logprobs)."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        metrics: ServerMetrics,
        failure: Callable[[BaseException], ApiError],
        texts: lp.TokenTexts,
    ):
        self.engine, self.config, self.metrics, self.failure = engine, config, metrics, failure
        self.tokenizer, self.texts = engine.model.tokenizer, texts

    def jobs(self, req: Any, ids: list[int], params: SamplingParams, salt: str,
             tenant: str | None, counts: ChoiceCounts) -> Choices:  # fmt: skip
        """One job per sampled sequence (branch i seeded seed + i), bridged when it streams."""
        metrics = self.metrics
        jobs = [
            Request(ids, p, salt, tenant, on_done=metrics.observe if i == 0 else metrics.branch)
            for i, p in enumerate(branch_params(params, counts.best_of))
        ]
        bridge = ChoiceBridge(asyncio.get_running_loop()) if req.stream else None
        for index, job in enumerate(jobs):
            if counts.best_of > counts.n:
                job.cumulative_logprob = 0.0  # ranked by it
            if bridge is not None:
                job.on_token = bridge.pusher(index)
                bridge.watch(index, job.future)
        return Choices(jobs, counts, bridge)

    def admit(self, choices: Choices, prompt_field: str) -> None:
        """Queue the group in the engine; a 400 naming `n` or `best_of` for a group that can
        never run at once."""
        engine, leader = self.engine, choices.jobs[0]
        try:
            ids = engine.encode(leader.token_ids, leader.params)  # range and positions
            for job in choices.jobs:
                job.token_ids = ids
            engine.add_group(SequenceGroup(choices.jobs), self.config.max_queue)
        except InvalidRequestError as e:
            if e.field in ("logprobs", "prompt_logprobs"):  # the per-request fallback's
                raise bad_request(str(e), e.field) from None
            if e.field != "n":
                raise bad_request(str(e), prompt_field) from None
            field = choices.counts.field
            count = getattr(choices.counts, field)
            raise bad_request(f"{field} is {count}: {e}", field) from None
        except QueueFullError as e:
            raise self.failure(e) from None
        except EngineClosedError as e:
            raise ApiError(503, "the server is shutting down", type="server_error") from e

    async def respond(
        self, choices: Choices, req: Any, kind: str, on_end: Callable[[], None]
    ) -> Response:
        """The answer: a stream (`on_end` once it ends), or the whole body once every
        sequence is done."""
        if choices.bridge is not None:
            return ClosingStream(self.events(choices, req, kind), on_end=on_end)
        jobs, want = choices.jobs, lp.asked(req)
        results = await self.results(jobs)
        counts, name = choices.counts, self.config.served_model_name
        order = range(counts.n)
        if counts.best_of > counts.n:
            order = best([job.cumulative_logprob for job in jobs], counts.n)
        answered = [lp.answered(want, results[i]) for i in order]
        body = choices_body(kind, name, answered, results[0], req.return_token_ids)
        echo = lp.echo_text(want, req, self.tokenizer.decode)
        prompt_ids = jobs[0].token_ids  # every sequence's
        lp.shape_choices(body, kind, want, answered, prompt_ids, echo, self.texts)
        return JSONResponse(body)

    async def results(self, jobs: list[Request]) -> list[GenerateResult]:
        """Every sequence's result; the first failure (the others then cancelled) as an
        ApiError, and a client gone away cancels them all."""
        futures = [asyncio.wrap_future(job.future) for job in jobs]
        try:
            await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
            if all(_succeeded(f) for f in futures):
                return [f.result() for f in futures]
            self.cancel(jobs)
            await asyncio.wait(futures)  # the others end at their next step
        except asyncio.CancelledError:
            self.cancel(jobs)
            raise
        raise self.failure(_first_error(futures))

    def cancel(self, jobs: list[Request]) -> None:
        for job in jobs:
            if not job.future.done():
                self.engine.cancel(job)

    def streams(self, jobs: list[Request], req: Any, kind: str) -> list[ChoiceStream]:
        """Each choice's events, of one stream."""
        want, name = lp.asked(req), self.config.served_model_name
        form = functools.partial(lp.logprob_format, kind, want, self.texts)
        chunks = stream_chunks(kind, name, req.include_usage, len(jobs), form)
        echo = lp.echo_text(want, req, self.tokenizer.decode)
        return [
            ChoiceStream(chunk, job, want, echo, TextStreamer(self.tokenizer, req.stop_strings))
            for chunk, job in zip(chunks, jobs, strict=True)
        ]

    async def events(self, choices: Choices, req: Any, kind: str) -> AsyncIterator[str]:
        """The SSE stream: each choice's chunks carry its index, interleaved as tokens come,
        its last chunk its finish_reason. A failed sequence ends the stream with an error
        event; a client that goes away cancels every sequence."""
        jobs, bridge, want = choices.jobs, choices.bridge, lp.asked(req)
        streams = self.streams(jobs, req, kind)
        results: list[GenerateResult | None] = [None] * len(jobs)
        try:
            while any(result is None for result in results):
                index, token = await bridge.get()  # type: ignore[union-attr]
                if token is not DONE:
                    for event in streams[index].token(token):  # type: ignore[arg-type]
                        yield event
                    continue
                result, ending = stream_outcome(jobs[index], self.failure, self.metrics)
                if result is None:
                    for event in ending:
                        yield event
                    return
                result = results[index] = lp.answered(want, result)
                yield streams[index].final(result, req.return_token_ids)
            if req.include_usage:
                yield usage_event(streams[0].chunks, results)  # type: ignore[arg-type]
            yield sse("[DONE]")
        finally:
            self.cancel(jobs)


def _succeeded(future: asyncio.Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _first_error(futures: list[asyncio.Future]) -> BaseException:
    """The error that ended the group: the first that is not a cancellation it caused."""
    errors = [f.exception() for f in futures if f.done() and not f.cancelled()]
    errors = [e for e in errors if e is not None]
    causes = [e for e in errors if not isinstance(e, RequestCancelled)]
    return (causes or errors or [RequestCancelled("the request was cancelled")])[0]
