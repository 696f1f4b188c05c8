"""`kvstore router`: one OpenAI- and Anthropic-compatible endpoint in front of `kvstore serve`
replicas.

Routes: POST /v1/completions, /v1/chat/completions and /v1/messages (forwarded; streams pass
through as they arrive), GET /v1/models, GET /health, GET /metrics. A request is authenticated and
validated here (a bad one never reaches a replica), rendered to token ids as the replicas
render it, and sent to the replica `Fleet.choose` picks. Until the client has its first
byte, a replica that fails is dropped and the request goes to the next one, so a dying
replica loses no request; a stream it breaks later ends with an error event. Requests that
share an `X-Session-ID` header, or a `prompt_cache_key` (within a load bound: affinity.py),
go to one replica.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.api.auth import Authenticator, authenticate, engine_salt
from engine.api.errors import ApiError, bad_request, stream_error
from engine.api.prompts import prompt_ids
from engine.api.roles import HANDOVER_HEADER, PREFILL_REPLICA_HEADER
from engine.api.routes import API_PATHS, add_api_routes, add_count_tokens_route, read_request
from engine.api.sse import ClosingStream
from engine.router.affinity import CacheKeys
from engine.router.config import SESSION_HEADER, RouterConfig
from engine.router.fleet import Fleet, NoReplicaError, Replica
from engine.router.metrics import RouterMetrics
from engine.router.pairing import Pairing
from hashing import BlockHash

MAX_SESSIONS = 100_000  # session ids whose replica is remembered
FORWARDED = ("authorization", "x-api-key", "content-type", "accept", "anthropic-version",
             "anthropic-beta")  # fmt: skip
REPLICA_HEADER = "x-kvstore-replica"  # on every forwarded answer: the replica that served it


class Retry(Exception):
    """The replica failed before the client got a byte: try another."""


class Busy(Exception):
    """The replica's queue is full (429): try another; `response` if none can take it."""

    def __init__(self, response: Response):
        super().__init__("queue full")
        self.response = response


class Router:
    """Auth, tokenization, replica choice and forwarding."""

    def __init__(self, config: RouterConfig, tokenizer: Any):
        self.config, self.tokenizer = config, tokenizer
        self.fleet = Fleet(config)
        self.auth = Authenticator(config.api_keys, config.secret_bytes)
        self.cache_keys = CacheKeys(self.fleet)
        self.metrics = RouterMetrics(self.fleet, self.cache_keys)
        self.sessions: OrderedDict[str, Replica] = OrderedDict()
        timeout = httpx.Timeout(config.connect_timeout_s, read=None, write=30.0, pool=None)
        # idle connections close before the replicas' own 5 s keep-alive could close them
        # under a request (which would read as a failed replica)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64,
                              keepalive_expiry=2.0)  # fmt: skip
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        handover = (config.handover_min_tokens, config.handover_max_queued_tokens)
        self.pairing = Pairing(self.fleet, self.client, *handover, self.metrics.registry)

    def authenticate(self, request: Request) -> str | None:
        return authenticate(self.auth, request)

    async def handle(self, request: Request, kind: str) -> Response:
        tenant = self.authenticate(request)
        data, req = await read_request(request, kind, self.config.max_body_bytes)
        self.fleet.check_model(req.model)  # before any replica is chosen
        salt = engine_salt(self.auth, tenant, req.cache_salt)
        ids, keys = await run_in_threadpool(self._tokens, req, salt)
        path = API_PATHS[kind]
        body = json.dumps(data).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        session = request.headers.get(SESSION_HEADER)
        cache_key = _cache_key(req, salt)
        tried: list[Replica] = []
        busy: Response | None = None  # the last 429: answered if every replica is full
        handed: tuple[int, Replica] | None = None  # (cached tokens, prefill replica)
        while True:
            try:
                exclude = tried + self.pairing.not_serving()
                replica, cached = self._pick(ids, keys, session, exclude, cache_key)
            except ApiError:
                if busy is None:
                    raise
                return busy
            if handed is not None and not self.pairing.shares(handed[1], replica):
                handed = None  # (a retry on a replica that cannot read that tier)
            if handed is None and self.pairing.worth(replica, len(ids) - cached):
                handed = await self.pairing.prefill(ids, keys, req, headers, replica)
            sent, where = _handover_headers(headers, handed, cached)
            entry = self.fleet.sent(replica, 0 if handed else len(ids) - cached, keys)
            try:
                response = await self._send(replica, path, body, sent, bool(req.stream), where)
            except Retry as e:
                self.fleet.dead(replica, str(e))
                self.metrics.retries.inc()
                tried.append(replica)
            except Busy as e:
                busy = e.response
                tried.append(replica)
            else:
                self.fleet.prefilled(replica, entry)
                return response
            self.fleet.prefilled(replica, entry, queued=False)

    def _tokens(self, req: Any, salt: str) -> tuple[list[int], list[BlockHash]]:
        """The prompt as the replicas render it, and its block keys (400 for bad ids)."""
        ids = prompt_ids(self.tokenizer, req)
        try:
            return ids, self.fleet.keys(ids, salt)
        except ValueError as e:  # token ids out of range: the replica would say the same
            raise bad_request(str(e), "prompt") from None

    def _pick(
        self,
        ids: list[int],
        keys: list[BlockHash],
        session: str | None,
        exclude: list,
        cache_key: tuple[str, str] | None = None,
    ) -> tuple[Replica, int]:
        """The replica for the request (none of `exclude`), and the prompt tokens it holds
        by its events."""
        pinned = self.sessions.get(session) if session else None
        if pinned is not None and pinned.alive and pinned not in exclude:
            self.sessions.move_to_end(session)
            self.fleet.counts["session"] += 1
            return pinned, self.fleet.cached_tokens(pinned, len(ids), keys)
        keyed = self.cache_keys.pinned(cache_key, exclude)
        if keyed is not None:  # its prompts share a prefix: what it holds is not queued work
            cached = self.fleet.cached_tokens(keyed, len(ids), keys)
            self.metrics.predicted_cached.inc(cached)
            return keyed, cached
        try:
            replica, choice = self.fleet.choose(len(ids), keys, exclude)
        except NoReplicaError as e:
            raise ApiError(503, f"{e}: retry later", type="server_error") from None
        cached = choice.num_cached_tokens if choice is not None else 0
        self.metrics.predicted_cached.inc(cached)
        self.cache_keys.pin(cache_key, replica)
        if session:
            self.sessions[session] = replica
            if len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        return replica, cached

    async def _send(
        self,
        replica: Replica,
        path: str,
        body: bytes,
        headers: dict,
        stream: bool,
        where: dict[str, str] | None = None,
    ) -> Response:
        """The replica's answer, with `where` among its headers."""
        request = self.client.build_request("POST", replica.url + path, content=body,
                                            headers=headers)  # fmt: skip
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise Retry(f"{type(e).__name__} on connect") from None
        if upstream.status_code == 503:  # closing or its engine died: another may serve it
            await upstream.aclose()
            raise Retry("answered 503")
        whole = not stream or upstream.status_code != 200  # read it all before answering
        chunks = upstream.aiter_raw()
        try:
            first = await anext(chunks, b"")
            if whole:
                first += b"".join([c async for c in chunks])
        except BaseException as e:  # cancelled too: the connection is closed either way
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            if isinstance(e, httpx.HTTPError):
                raise Retry(f"{type(e).__name__} before the first byte") from None
            raise
        if whole:
            await upstream.aclose()
        where = {REPLICA_HEADER: replica.url} | (where or {})
        media = upstream.headers.get("content-type", "application/json")
        if upstream.status_code == 429:  # its queue is full: another replica may take it
            retry_after = upstream.headers.get("retry-after", "1")
            headers = where | {"Retry-After": retry_after}
            raise Busy(Response(first, 429, headers=headers, media_type=media))
        if whole:
            return Response(first, upstream.status_code, headers=where, media_type=media)
        relay = self._relay(replica, upstream, first, chunks, path)
        return ClosingStream(relay, media_type=media, headers=where)

    async def _relay(
        self, replica: Replica, upstream: httpx.Response, first: bytes, chunks: AsyncIterator,
        path: str,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """The stream as it arrives; a replica that breaks it mid-way ends it with an error
        event in the shape of `path`'s API (the client has part of an answer: it cannot be
        retried transparently)."""
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as e:
            self.fleet.dead(replica, f"{type(e).__name__} mid-stream")
            self.metrics.broken_streams.inc()
            message = f"replica {replica.url} failed mid-answer ({type(e).__name__}); retry"
            yield stream_error(ApiError(502, message, type="server_error"), path).encode()
        finally:
            await upstream.aclose()

    async def models(self, request: Request) -> Response:
        self.authenticate(request)
        for replica in self.fleet.replicas:
            if replica.alive:
                headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
                try:
                    answer = await self.client.get(replica.url + "/v1/models", headers=headers)
                except httpx.HTTPError:
                    continue
                return Response(answer.content, answer.status_code, media_type="application/json")
        raise ApiError(503, "no replica is up: retry later", type="server_error")

    def health(self) -> JSONResponse:
        replicas = [self.metrics.describe(r) for r in self.fleet.replicas]
        ok = any(r.alive for r in self.fleet.replicas)
        whole = all(r.alive and r.status == "ok" for r in self.fleet.replicas)
        status = "ok" if whole else "degraded" if ok else "unavailable"
        body = {"status": status, "policy": self.config.policy}
        return JSONResponse(body | {"replicas": replicas}, status_code=200 if ok else 503)

    async def close(self) -> None:
        await self.fleet.close()
        await self.client.aclose()


def _handover_headers(
    headers: dict[str, str], handed: tuple[int, Replica] | None, held: int
) -> tuple[dict[str, str], dict[str, str]]:
    """The request's headers to its replica, and the answer's own: a handed-over request
    tells its replica the prompt tokens cached before the prefill (the more of what the
    prefill replica had and what the serving one held, `held`: what one of them would have
    reported), and its client where the prompt was prefilled."""
    if handed is None:
        return headers, {}
    cached, prefill = handed
    sent = headers | {HANDOVER_HEADER: str(max(cached, held))}
    return sent, {PREFILL_REPLICA_HEADER: prefill.url}


def _cache_key(req: Any, salt: str) -> tuple[str, str] | None:
    """The request's prompt_cache_key within its cache salt (None: it has none)."""
    key = getattr(req, "prompt_cache_key", None)
    return (salt, key) if isinstance(key, str) and key else None


def create_router_app(config: RouterConfig, tokenizer: Any) -> FastAPI:
    router = Router(config, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.fleet.start()
        yield
        await router.close()

    app = FastAPI(title="kvstore router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router

    add_api_routes(app, router.handle)
    add_count_tokens_route(app, router.authenticate, router.fleet.check_model,
                           router.tokenizer, config.max_body_bytes)  # fmt: skip

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        return router.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    return app
