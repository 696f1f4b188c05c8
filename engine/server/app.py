"""The FastAPI application and `kvstore serve`.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/messages (Anthropic's),
GET /v1/models (all need a valid key when keys are configured), GET /health (never),
GET /metrics (with --metrics-require-key only). SIGTERM drains first: new requests get 503
while the admitted ones finish, up to --drain-timeout-s.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.api.errors import ApiError
from engine.api.openai_responses import now
from engine.api.routes import add_api_routes, add_count_tokens_route
from engine.loop.engine import Engine
from engine.server.config import (
    ServerConfig,
    check_port_free,
    check_ports_free,
    check_role,
    server_config_from_args,
)
from engine.server.heap import QuietTrimmer, cap_malloc_arenas
from engine.server.service import Service, read_costs
from kvstore.fleet.events import EventSink
from kvstore.stores.redis import redact_url

GRACEFUL_CLOSE_S = 5.0  # after the drain: how long uvicorn waits for open responses
REJECT_REASONS = {401: "unauthorized", 404: "not_found", 413: "too_large", 429: "queue_full",
                  503: "draining"}  # fmt: skip
log = logging.getLogger("kvstore.server")


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """An app serving `engine`; it closes the engine when the app shuts down."""
    service = Service(engine, config)

    trimmer = QuietTrimmer(service.requests_seen, service.in_flight)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        trimming = asyncio.create_task(trimmer.run())
        yield
        trimming.cancel()
        await run_in_threadpool(service.close)

    app = FastAPI(title="kvstore", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    app.state.trimmer = trimmer

    def rejected(error: ApiError) -> None:
        if error.status != 500:
            service.metrics.reject(REJECT_REASONS.get(error.status, "invalid"))

    add_api_routes(app, service.handle, on_error=rejected)
    add_count_tokens_route(app, service.authenticate, service.check_model, service.tokenizer,
                           config.max_body_bytes)  # fmt: skip

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        service.authenticate(request)
        card = {"id": config.served_model_name, "object": "model", "created": now()}
        return {"object": "list", "data": [{**card, "owned_by": "kvstore"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        queue, state = engine.queue_stats(), await run_in_threadpool(service.health)
        body = {"status": state.status, "model": config.served_model_name, "role": config.role}
        body |= {"waiting": queue.waiting, "running": queue.running}
        body |= {"queued_tokens": queue.queued_tokens, "running_tokens": queue.running_tokens}
        body["tiers"] = state.tiers
        body["cache"] = service.cache_info  # what a router needs to hash like this replica
        body["read_costs"] = await run_in_threadpool(read_costs, engine)  # and to price tiers
        body["capacity"] = engine.cache.capacity()  # bytes per block, blocks per GB, per tier
        return JSONResponse(body, status_code=state.http_status)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if config.metrics_require_key:
            service.authenticate(request)
        page = await run_in_threadpool(service.metrics.render)  # reads the cache's stats
        # the format generate_latest writes (CONTENT_TYPE_LATEST names 1.0.0 in newer clients)
        return Response(page, media_type=CONTENT_TYPE_PLAIN_0_0_4)

    return app


def _tier_names(engine: Engine) -> list[str]:
    """`device` and each spill tier with where it is (a Redis URL without its password)."""
    config, names = engine.cache_config, ["device"]
    if config.memory_cache_gb > 0:
        names.append(f"memory ({config.memory_cache_gb:g} GiB)")
    if config.lmdb_dir is not None:
        names.append(f"lmdb ({config.lmdb_dir})")
    if config.redis_url is not None:
        names.append(f"redis ({redact_url(config.redis_url)})")
    return names


def describe_engine(engine: Engine) -> str:
    """The start-up line: model, device, dtype, pool size, tiers and batching mode."""
    model, pool = engine.model, engine.cache.pool
    pool_bytes = pool.nbytes
    batching = "continuous batching" if engine.mode == "paged" else "one request at a time"
    notes = "" if pool.window is None else f" (+ {pool.window.num_slots} window-layer slots)"
    reserved = engine.cache.held.num_reserved  # the paged runner's scratch block: never cached
    if reserved:
        notes += f" ({reserved} reserved for the runner's scratch)"
    return (
        f"model {model.name} ({model.layout.num_layers} layers, {model.kv_dtype}) on "
        f"{model.device}; pool {pool.num_blocks} blocks of {pool.block_size} tokens{notes} = "
        f"{pool_bytes:,} bytes ({pool_bytes / 2**20:.1f} MiB); tiers: "
        f"{', '.join(_tier_names(engine))}; {batching}"
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain first: the first SIGTERM (or SIGINT) makes new requests
    503 and /health "draining" while the admitted ones finish (up to the drain timeout),
    then uvicorn shuts down as usual; a second signal skips the rest of the drain."""

    def __init__(self, config: uvicorn.Config, service: Service, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.service, self.drain_timeout_s = service, drain_timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.service.draining.is_set() or self.drain_timeout_s == 0:
            super().handle_exit(sig, frame)
            return
        self.service.draining.set()  # at once: a second signal finds it set
        threading.Thread(target=self._drain, args=(sig, frame), daemon=True).start()

    def _drain(self, sig: int, frame: FrameType | None) -> None:
        start = time.monotonic()
        done = self.service.drain(self.drain_timeout_s)
        took = time.monotonic() - start
        if done:
            log.info("drained in %.1f s: shutting down", took)
        else:
            log.error("drain timed out after %.1f s: the requests still running fail", took)
        super().handle_exit(sig, frame)


def run_server(args: argparse.Namespace) -> int:
    """`kvstore serve`: load the model and cache, then serve until SIGINT/SIGTERM."""
    cap_malloc_arenas()
    from engine.commands import check_cache_config, load_engine
    from kvstore.config.settings import config_from_args

    config = server_config_from_args(args)  # invalid flags fail before the model loads
    check_port_free(config.host, config.port)
    if not config.auth_enabled and not _is_loopback(config.host):
        print(
            f"kvstore serve: warning: no API key and bound to {config.host}: anyone who can "
            "reach it can use it (set --api-key or --api-keys-file)",
            file=sys.stderr,
        )
    engines: list[Engine] = []  # the snapshot callback reads the engine made below
    cache_config = config_from_args(args)
    check_role(config, bool(cache_config.redis_url or cache_config.lmdb_dir))
    device = check_cache_config(cache_config)
    publisher = start_publisher(config, device, lambda: engines[0].cache.snapshot_events())
    try:
        _, engine = load_engine(args, events=publisher)
        engines.append(engine)
        log.info("%s", describe_engine(engine))
        app = create_app(engine, config)
        try:
            uv_config = uvicorn.Config(
                app, host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
            )  # fmt: skip
            DrainingServer(uv_config, app.state.service, config.drain_timeout_s).run()
        finally:
            app.state.service.close()
    finally:
        if publisher is not None:
            publisher.close()
    return 0


def start_publisher(
    config: ServerConfig, device: object, snapshot: Callable[[], list]
) -> EventSink | None:
    """The ZMQ publisher of the cache's block events, when --kv-events-port is set."""
    if config.kv_events_port is None:
        return None
    from engine.events.publisher import EventsConfig, ZmqEventPublisher
    from engine.events.wire import medium_for, zmq_host

    check_ports_free(config)
    events = EventsConfig(
        endpoint=f"tcp://{zmq_host(config.host)}:{config.kv_events_port}",
        replay_endpoint=f"tcp://{zmq_host(config.host)}:{config.kv_events_replay_port}",
        medium=medium_for(device),
    )
    publisher = ZmqEventPublisher(events, snapshot=snapshot)
    log.info("KV events on %s (--kv-events-port), replays on %s (--kv-events-replay-port)",
             events.endpoint, events.replay_endpoint)  # fmt: skip
    return publisher
