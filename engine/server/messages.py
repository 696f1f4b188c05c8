"""POST /v1/messages on the replica server: Anthropic's Messages API over the engine.

The request is read and validated (`engine/api/anthropic.py`), rendered through the chat
template, its `cache_control` breakpoints turned into the job's retention
(`engine/api/breakpoints.py`), and answered as a message or as Anthropic's stream of events;
errors, mid-stream ones included, are in Anthropic's shape.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from engine.api import anthropic_responses as ar
from engine.api.anthropic import MessagesRequest
from engine.api.auth import engine_salt
from engine.api.breakpoints import retention
from engine.api.errors import ANTHROPIC_PATH, ApiError, bad_request, stream_error
from engine.api.routes import read_request
from engine.api.sse import ClosingStream
from engine.loop.request import (
    GenerateResult,
    InvalidRequestError,
    Request,
    Retain,
    SamplingParams,
)
from engine.server.streaming import DONE, TextStreamer, TokenBridge, stream_outcome


class Service(Protocol):
    """What the route uses of the replica server's `Service` (engine/server/service.py)."""

    engine: Any
    config: Any
    tokenizer: Any
    auth: Any
    metrics: Any
    role: Any  # ReplicaRole (engine/server/handover.py)

    def authenticate(self, request: HTTPRequest) -> str | None: ...
    def check_model(self, name: str | None) -> None: ...
    def prompt_ids(self, req: Any) -> list[int]: ...
    def new_tokens(self, asked: int | None, num_prompt: int, field: str, prompt: str) -> int: ...
    def admit(self, job: Request, prompt_field: str = "prompt") -> None: ...
    async def result(self, job: Request) -> GenerateResult: ...
    def failure(self, error: BaseException) -> ApiError: ...


def anthropic_ending(error: ApiError) -> list[str]:
    return [stream_error(error, ANTHROPIC_PATH)]


class Messages:
    """Anthropic's route of one server (its engine, auth and metrics are the service's)."""

    def __init__(self, service: Service):
        self.service = service
        self.block_size = service.engine.cache.block_size

    async def respond(self, request: HTTPRequest, on_end: Callable[[], None]) -> Response:
        """The answer; a stream calls `on_end` when it ends (the caller counts it out)."""
        job, req, bridge = await self.admit(request)
        if bridge is not None:
            return ClosingStream(self.events(job, req, bridge), on_end=on_end)
        result = await self.service.result(job)
        return JSONResponse(self.body(job, req, result))

    async def admit(self, request: HTTPRequest) -> tuple[Request, MessagesRequest, Any]:
        """Read, validate and render the request, and queue its job in the engine."""
        service = self.service
        tenant = service.authenticate(request)
        _, req = await read_request(request, "messages", service.config.max_body_bytes)
        service.check_model(req.model)
        salt = engine_salt(service.auth, tenant, req.cache_salt)
        ids, kept = await run_in_threadpool(self.prompt, req)
        job = Request(ids, self.sampling_params(req, len(ids)), salt, tenant,
                      on_done=service.metrics.observe)  # fmt: skip
        job.retention = tuple(Retain(n, ttl_s) for n, ttl_s in kept)
        service.role.receive(request, job)
        bridge = TokenBridge(asyncio.get_running_loop()) if req.stream else None
        if bridge is not None:
            job.on_token = bridge.push
            bridge.watch(job.future)
        await run_in_threadpool(service.admit, job, "messages")
        return job, req, bridge

    def prompt(self, req: MessagesRequest) -> tuple[list[int], list]:
        """The prompt's token ids and its breakpoints' retention."""
        ids = self.service.prompt_ids(req)
        return ids, retention(self.service.tokenizer, req, ids)

    def sampling_params(self, req: MessagesRequest, num_prompt: int) -> SamplingParams:
        asked = self.service.new_tokens(req.max_tokens, num_prompt, "max_tokens", "messages")
        try:
            return SamplingParams(max_new_tokens=asked, temperature=req.temperature,
                                  top_p=req.top_p or 1.0, stop=req.stop_strings,
                                  ignore_eos=req.ignore_eos)  # fmt: skip
        except InvalidRequestError as e:
            raise bad_request(str(e), "stop_sequences" if e.field == "stop" else e.field) from None

    def usage(self, job: Request, cached: int, output_tokens: int) -> ar.Usage:
        breakpoints = [(r.num_tokens, r.ttl_s) for r in job.retention]
        return ar.usage(len(job.token_ids), cached, output_tokens, breakpoints, self.block_size)

    def stop(self, req: MessagesRequest, result: GenerateResult) -> ar.Stop:
        decode = self.service.tokenizer.decode
        output = decode(result.output_token_ids, skip_special_tokens=True)
        return ar.stop_of(result.finish_reason, result.text, output, req.stop_strings)

    def body(self, job: Request, req: MessagesRequest, result: GenerateResult) -> dict:
        use = self.usage(job, result.cached_tokens, len(result.output_token_ids))
        name = self.service.config.served_model_name
        return ar.message_body(ar.new_message_id(), name, result.text, self.stop(req, result), use)

    async def events(
        self, job: Request, req: MessagesRequest, bridge: TokenBridge
    ) -> AsyncIterator[str]:
        """The stream: message_start at the first token (the cache's hit is known by then),
        text deltas, the stop and final usage; a client that goes away cancels its job, a
        job that fails ends it with an `error` event."""
        events = ar.MessageEvents(self.service.config.served_model_name)
        streamer = TextStreamer(self.service.tokenizer, req.stop_strings)
        try:
            while (token := await bridge.get()) is not DONE:
                if not events.started:
                    cached = job.reported_cached(job.num_cached_tokens)
                    for event in events.start(self.usage(job, cached, 1)):
                        yield event
                for event in events.delta(streamer.push(token)):  # type: ignore[arg-type]
                    yield event
            service = self.service
            result, ending = stream_outcome(job, service.failure, service.metrics,
                                            anthropic_ending)  # fmt: skip
            for event in ending if result is None else self.ending(job, req, result, events,
                                                                   streamer):  # fmt: skip
                yield event
        finally:
            if not job.future.done():
                self.service.engine.cancel(job)

    def ending(
        self, job: Request, req: MessagesRequest, result: GenerateResult,
        events: ar.MessageEvents, streamer: TextStreamer,
    ) -> list[str]:  # fmt: skip
        """The rest of the text, the block's end, the stop and the final usage."""
        use = self.usage(job, result.cached_tokens, len(result.output_token_ids))
        out = [] if events.started else events.start(use)
        out += events.delta(streamer.finish(result.text))
        return out + events.stop(self.stop(req, result), use)
