"""The request path shared by the routes: authenticate, read and validate the body, tokenize,
admit into the engine, then answer with JSON or stream server-sent events. OpenAI's routes
are answered here, Anthropic's /v1/messages by `engine/server/messages.py`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from engine.api import logprobs as lp
from engine.api import openai as p
from engine.api.anthropic import MessagesRequest
from engine.api.auth import Authenticator, authenticate, engine_salt
from engine.api.choices import choice_counts
from engine.api.errors import ApiError, bad_request
from engine.api.openai_responses import StreamChunks, response_body
from engine.api.prompts import prompt_ids
from engine.api.routes import read_request
from engine.api.sse import ClosingStream, sse
from engine.loop.engine import Engine
from engine.loop.request import (
    EngineClosedError,
    GenerateResult,
    InvalidRequestError,
    QueueFullError,
    Request,
    Retain,
    SamplingParams,
)
from engine.server.config import ServerConfig
from engine.server.groups import Choices, GroupAnswers
from engine.server.handover import ReplicaRole
from engine.server.health import Health, health
from engine.server.messages import Messages
from engine.server.metrics import ServerMetrics
from engine.server.streaming import DONE, ChoiceStream, TextStreamer, TokenBridge, stream_outcome
from kvstore.fleet.events import TIER_MEDIUM

log = logging.getLogger("kvstore.server")
DRAIN_LINGER_S = 1.0  # after the last response of a drain: still answering 503 this long


def cache_info(engine: Engine, config: ServerConfig) -> dict:
    """What a router needs to hash prompts as this replica does and to read its events
    (no secret: tenant salts stay on the server)."""
    events = None
    if config.kv_events_port is not None:
        events = {"port": config.kv_events_port, "replay_port": config.kv_events_replay_port}
    namespace = dataclasses.asdict(engine.cache.namespace)
    if namespace["kv_cache_dtype"] == "auto":  # as its root leaves it out: older routers too
        del namespace["kv_cache_dtype"]
    tiers = engine.cache.tiers.stores if engine.cache.tiers else []
    return {
        "block_size": engine.cache.block_size,
        "namespace": namespace,
        "kv_events": events,
        # the spill tiers whose events it publishes (medium), and which it shares with other
        # replicas (`shared`: the backend's identity, no secret; None: its own)
        "tiers": [
            {"name": s.name, "medium": TIER_MEDIUM[s.name], "shared": s.identity()}
            for s in tiers
            if s.name in TIER_MEDIUM
        ],
    }


def read_costs(engine: Engine) -> dict[str, float]:
    """Per spill medium, loading a block as a fraction of computing it, as this replica's
    read gate measured them (capped at 1: a dearer tier is not read); what it has not
    measured yet is left out. A router prices this replica's tier blocks with them."""
    tiers = engine.cache.tiers
    gate = tiers.gate.snapshot() if tiers else None
    compute = gate["block_compute_s"] if gate else None
    if not compute:
        return {}
    fetch = gate["block_fetch_s"]
    return {
        TIER_MEDIUM[tier]: min(1.0, seconds / compute)
        for tier, seconds in fetch.items()
        if seconds is not None and tier in TIER_MEDIUM
    }


class Service:
    """Engine, auth and metrics of one server."""

    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.tokenizer = engine.model.tokenizer
        self.texts = lp.TokenTexts(self.tokenizer)  # each token's text, for logprobs
        self.auth = Authenticator(config.api_keys, engine.cache_config.secret_bytes)
        self.metrics = ServerMetrics(engine.stats, engine.queue_stats)
        self.cache_info = cache_info(engine, config)
        self.draining = threading.Event()  # set on SIGTERM: new requests get 503
        self._in_flight = _Gauge()  # requests from arrival to their response's last byte
        # requests of several choices (n, best_of)
        self.groups = GroupAnswers(engine, config, self.metrics, self.failure, self.texts)
        self.messages = Messages(self)  # Anthropic's /v1/messages
        # prefill and decode roles (engine/server/handover.py)
        self.role = ReplicaRole(config.role, engine.cache, self.metrics.registry)
        self.closed = False

    def health(self) -> Health:
        return health(self.engine.alive, self.draining.is_set(), self.engine.cache.tier_health())

    def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait until every request in flight has sent its last byte;
        False if `timeout_s` ran out first (the rest fail when the engine closes)."""
        self.draining.set()
        (log.warning if self._in_flight.value else log.info)(
            "draining: new requests get 503; waiting up to %g s for %d in flight",
            timeout_s, self._in_flight.value,
        )  # fmt: skip
        end = time.monotonic() + timeout_s
        while self._in_flight.value and time.monotonic() < end:
            time.sleep(0.05)
        done = not self._in_flight.value
        if done:  # connections the kernel already took get a 503, not a reset at close
            time.sleep(DRAIN_LINGER_S)
        return done

    def in_flight(self) -> int:
        """Requests admitted and not answered to their last byte."""
        return self._in_flight.value

    def requests_seen(self) -> int:
        return self._in_flight.entered

    def authenticate(self, request: HTTPRequest) -> str | None:
        return authenticate(self.auth, request)

    def check_draining(self) -> None:
        if self.draining.is_set():
            message = "the server is shutting down (draining); send the request to another replica"
            error = ApiError(503, message, type="server_error", code="draining")
            error.headers = {"Retry-After": str(self.config.retry_after_s)}
            raise error

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            served = self.config.served_model_name
            message = f"model {name!r} is not served here; this server serves {served!r}"
            raise ApiError(404, message, param="model", code="model_not_found")

    # --- request -> job --------------------------------------------------------------------

    async def handle(self, request: HTTPRequest, kind: str) -> Response:
        """POST /v1/completions (kind "completion"), /v1/chat/completions (kind "chat") and
        /v1/messages (kind "messages"). Counted in flight from before the drain check (so a
        drain either refuses it or waits for it) to its last byte (a stream: when the response
        ends, however it ends)."""
        self._in_flight.enter()
        streaming = False
        try:
            self.check_draining()
            if kind == "messages":
                response = await self.messages.respond(request, self._in_flight.exit)
                streaming = isinstance(response, ClosingStream)  # the response counts it out
                return response
            job, req, bridge = await self.admit_request(request, kind)
            if isinstance(job, Choices):  # n or best_of > 1 (engine/server/groups.py)
                response = await self.groups.respond(job, req, kind, self._in_flight.exit)
                streaming = job.bridge is not None  # the response counts it out
                return response
            if bridge is not None:
                events = self.events(job, req, kind, bridge)
                response = ClosingStream(events, on_end=self._in_flight.exit)
                streaming = True  # the response counts it out
                return response
            result = await self.result(job)
            return JSONResponse(self.response(kind, req, result, job.token_ids))
        finally:
            if not streaming:
                self._in_flight.exit()

    async def admit_request(
        self, request: HTTPRequest, kind: str
    ) -> tuple[Request | Choices, Any, Any]:
        """Read, validate and tokenize the request, and queue its job (its jobs, for
        several choices) in the engine."""
        tenant = self.authenticate(request)
        _, req = await read_request(request, kind, self.config.max_body_bytes)
        self.check_model(req.model)
        counts = choice_counts(req, self.config.max_n)
        salt = engine_salt(self.auth, tenant, req.cache_salt)
        ids = await run_in_threadpool(self.prompt_ids, req)
        params = self.sampling_params(req, len(ids))
        prompt_field = "messages" if isinstance(req, p.ChatRequest) else "prompt"
        retention = self.retention(req, len(ids))
        if counts.best_of > 1:
            choices = self.groups.jobs(req, ids, params, salt, tenant, counts)
            choices.jobs[0].retention = retention  # the leader prefills the prompt
            self.role.receive(request, choices.jobs[0])
            await run_in_threadpool(self.groups.admit, choices, prompt_field)
            return choices, req, choices.bridge
        job = Request(ids, params, salt, tenant, on_done=self.metrics.observe)
        job.retention = retention
        self.role.receive(request, job)
        bridge = TokenBridge(asyncio.get_running_loop()) if req.stream else None
        if bridge is not None:
            job.on_token = bridge.push
            bridge.watch(job.future)
        await run_in_threadpool(self.admit, job, prompt_field)  # hashes: off the event loop
        return job, req, bridge

    def prompt_ids(self, req: Any) -> list[int]:
        """The request's prompt as token ids, within --max-prompt-tokens."""
        ids = prompt_ids(self.tokenizer, req)
        limit = self.config.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            message = f"the prompt has {len(ids)} tokens; this server takes at most {limit}"
            field = "messages" if isinstance(req, MessagesRequest) else "prompt"
            raise bad_request(message, field, "context_length_exceeded")
        return ids

    @staticmethod
    def retention(req: p.CompletionRequest | p.ChatRequest, num_prompt: int) -> tuple:
        """`prompt_cache_retention` "24h": the whole prompt, retained 24 h."""
        ttl_s = req.retention_ttl_s
        return () if ttl_s is None else (Retain(num_prompt, ttl_s),)

    def sampling_params(self, req: p.CompletionRequest | p.ChatRequest, num_prompt: int) -> Any:
        """The engine's sampling parameters; a 400 naming the field the client sent."""
        chat = isinstance(req, p.ChatRequest)
        asked = req.requested_max_tokens if chat else req.max_tokens
        field = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
        asked = self.new_tokens(asked, num_prompt, field, "messages" if chat else "prompt")
        want = lp.asked(req)
        try:
            return SamplingParams(
                max_new_tokens=max(asked, 1),  # 0 (echo only): one, dropped (api/logprobs.py)
                temperature=req.temperature,
                top_p=req.top_p,
                seed=req.seed,
                stop=req.stop_strings,
                ignore_eos=req.ignore_eos,
                logprobs=want.logprobs,
                prompt_logprobs=want.prompt_logprobs,
            )
        except InvalidRequestError as e:
            client_field = field if e.field == "max_new_tokens" else e.field
            raise bad_request(str(e).replace("max_new_tokens", field), client_field) from None

    def new_tokens(self, asked: int | None, num_prompt: int, field: str, prompt_field: str) -> int:
        """`max_new_tokens` within this server's limit and its model's positions."""
        room, limit = self.engine.model.max_positions, self.config.max_tokens_limit
        return max_new_tokens(asked, num_prompt, limit, room, field, prompt_field)

    def admit(self, job: Request, prompt_field: str = "prompt") -> None:
        """Queue a job in the engine (`prompt_field`: what the client called its prompt)."""
        try:
            job.token_ids = self.engine.encode(job.token_ids, job.params)  # range and positions
            self.engine.add_request(job, self.config.max_queue)
        except InvalidRequestError as e:
            field = e.field if e.field in ("logprobs", "prompt_logprobs") else prompt_field
            raise bad_request(str(e), field) from None
        except QueueFullError as e:
            raise self.failure(e) from None
        except EngineClosedError as e:
            raise ApiError(503, "the server is shutting down", type="server_error") from e

    # --- job -> response -------------------------------------------------------------------

    async def result(self, job: Request) -> GenerateResult:
        """The job's result; on a prefill replica, once its prompt is in the shared tier."""
        try:
            result = await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            self.engine.cancel(job)
            raise
        except Exception as e:
            raise self.failure(e) from None
        if self.role.hands_over:
            await run_in_threadpool(self.role.hand_over, job)
        return result

    def failure(self, error: BaseException) -> ApiError:
        if isinstance(error, InvalidRequestError):
            return bad_request(str(error))
        if isinstance(error, QueueFullError):  # full, or displaced by a fairer tenant's turn
            retry = str(self.config.retry_after_s)
            message = f"the server is busy ({error}); retry after {retry} s"
            busy = ApiError(429, message, type="rate_limit_error", code="queue_full")
            busy.headers = {"Retry-After": retry}
            return busy
        if isinstance(error, EngineClosedError):
            return ApiError(503, str(error), type="server_error")
        log.error("request failed", exc_info=error)
        return ApiError(500, f"internal error: {type(error).__name__}", type="server_error")

    def response(
        self, kind: str, req: Any, result: GenerateResult, prompt_ids: Sequence[int] = ()
    ) -> dict:
        """The answer's body; `prompt_ids`: the prompt's tokens (an echo's logprobs)."""
        want = lp.asked(req)
        result = lp.answered(want, result)
        body = response_body(kind, self.config.served_model_name, result, req.return_token_ids)
        echo = lp.echo_text(want, req, self.tokenizer.decode)
        return lp.shape_choices(body, kind, want, [result], prompt_ids, echo, self.texts)

    async def events(
        self, job: Request, req: Any, kind: str, bridge: TokenBridge
    ) -> AsyncIterator[str]:
        """The SSE stream; a client that goes away cancels its job (queued or running). A job
        that fails, even before its first token (displaced from a full queue: code
        `queue_full`), ends it with an error event in OpenAI's error shape."""
        want = lp.asked(req)
        form = lp.logprob_format(kind, want, self.texts)
        chunks = StreamChunks(kind, self.config.served_model_name, req.include_usage, form)
        echo = lp.echo_text(want, req, self.tokenizer.decode)
        stream = ChoiceStream(
            chunks, job, want, echo, TextStreamer(self.tokenizer, req.stop_strings)
        )
        try:
            while (token := await bridge.get()) is not DONE:
                for event in stream.token(token):  # type: ignore[arg-type]
                    yield event
            result, ending = stream_outcome(job, self.failure, self.metrics)
            if result is None:
                for event in ending:
                    yield event
                return
            result = lp.answered(want, result)
            yield stream.final(result, req.return_token_ids)
            if req.include_usage:
                yield chunks.usage(result)
            yield sse("[DONE]")
        finally:
            if not job.future.done():
                self.engine.cancel(job)

    def close(self) -> None:
        """Close the engine, then check the cache: a block still held after every request
        ended is a leak, and the index and pool must agree. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.engine.close(cancel_waiting=True)
        try:
            self.engine.cache.check_integrity()
        except Exception as e:  # reported, not raised: the process is exiting anyway
            log.error("shutdown: cache integrity check failed: %s", e)
            return
        cache = self.engine.cache  # closed: its tiers are not asked
        total = cache.pool.num_blocks
        held = total - cache.pool.num_free_blocks - cache.index.num_evictable_blocks
        report = log.info if held == 0 else log.error
        report("shutdown: cache integrity ok; %d of %d device blocks held after the last "
               "request", held, total)  # fmt: skip


class _Gauge:
    """A thread-safe count."""

    def __init__(self) -> None:
        self._lock, self.value, self.entered = threading.Lock(), 0, 0

    def enter(self) -> None:
        with self._lock:
            self.value += 1
            self.entered += 1

    def exit(self) -> None:
        with self._lock:
            self.value -= 1


def max_new_tokens(
    asked: int | None, num_prompt: int, limit: int, room: int | None, field: str, prompt_field: str
) -> int:
    """The tokens to generate: what the client asked (its `field`), within the server's
    `limit` and the model's `room` (positions, None: no bound), or what fits when it asked
    none; a 400 naming the client's field (`prompt_field`: its prompt's) otherwise."""
    if asked is not None and asked > limit:
        raise bad_request(f"{field} is {asked}; this server allows at most {limit}", field)
    if asked is not None:
        if room is not None and num_prompt + asked > room:
            message = (
                f"the prompt ({num_prompt} tokens) + {field} ({asked}) exceeds the model's "
                f"{room} positions; shorten the {prompt_field} or lower {field}"
            )
            raise bad_request(message, field, "context_length_exceeded")
        return asked
    asked = limit if room is None else min(limit, room - num_prompt)
    if asked < 1:
        message = f"the prompt ({num_prompt} tokens) fills the model's {room} positions"
        raise bad_request(message, prompt_field, "context_length_exceeded")
    return asked
