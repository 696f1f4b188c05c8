"""Helpers for router tests: `kvstore serve` replicas that publish their KV events, a
`kvstore router` in front of them, and what the router's /health says of each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
from server_helpers import ServerProcess, clean_env, free_port, kvstore_script, wait_for

BLOCK = 4
KEY = "sk-router-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
REPLICA = "x-kvstore-replica"


def start_replica(model_dir: Path, log_dir: Path, name: str, *extra: str) -> ServerProcess:
    """`extra`: more `kvstore serve` flags (a later flag wins over the defaults here)."""
    port = free_port()
    args = [kvstore_script(), "serve", "--model", str(model_dir), "--port", str(port),
            "--block-size", str(BLOCK), "--device-blocks", "512", "--device", "cpu",
            "--log-level", "warning", "--kv-events-port", str(free_port()),
            "--kv-events-replay-port", str(free_port()), *extra]  # fmt: skip
    env = clean_env(KVSTORE_API_KEY=KEY, OMP_NUM_THREADS="1")
    return ServerProcess(args, port, log_dir / f"{name}.log", env)


def start_router(model_dir: Path, log_dir: Path, urls: list[str], *extra: str) -> ServerProcess:
    port = free_port()
    replicas = [arg for url in urls for arg in ("--replica", url)]
    args = [kvstore_script(), "router", "--model", str(model_dir), "--port", str(port),
            "--log-level", "warning", *replicas, *extra]  # fmt: skip
    env = clean_env(KVSTORE_API_KEY=KEY)
    return ServerProcess(args, port, log_dir / "router.log", env, "kvstore router")


@contextlib.contextmanager
def running_fleet(
    model_dir: Path,
    log_dir: Path,
    replicas: int = 2,
    router_args: tuple[str, ...] = (),
    replica_args: tuple[str, ...] = (),
) -> Iterator[tuple[ServerProcess, list[ServerProcess]]]:
    """Replicas with events (and `replica_args`) behind a kv router (with `router_args`),
    the router's view of their events fresh: (router, [replica 0, ...]); all stopped on
    leaving."""
    procs = [start_replica(model_dir, log_dir, f"r{i}", *replica_args) for i in range(replicas)]
    router = None
    try:
        for r in procs:
            r.start()
        for r in procs:
            r.wait_ready()
        urls = [r.url for r in procs]
        router = start_router(model_dir, log_dir, urls, *router_args).start().wait_ready()
        wait_for(lambda: all(r["events"] == "fresh" for r in health(router)["replicas"]))
        yield router, procs
    finally:
        for proc in [router, *procs]:
            if proc is not None:
                proc.stop()


@contextlib.contextmanager
def busy(replica: ServerProcess, router: ServerProcess) -> Iterator[None]:
    """A long generation on `replica` (sent to it directly), until the router sees it."""
    body = {"prompt": "x" * 200, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{replica.url}/v1/completions", json=body, headers=AUTH,
                      timeout=120) as response:  # fmt: skip
        assert response.status_code == 200
        wait_for(lambda: replica_rows(router)[replica.url]["running_tokens"] > 1000)
        yield  # leaving closes the stream: the replica cancels the request


def health(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def replica_rows(router: ServerProcess) -> dict[str, dict]:
    """The router's /health row of each replica, by URL."""
    return {r["url"]: r for r in health(router)["replicas"]}


def indexed(router: ServerProcess, replica: ServerProcess) -> int:
    return replica_rows(router)[replica.url]["indexed_blocks"]


def cached_blocks(replica: ServerProcess) -> float:
    return replica.metrics()['kvstore_device_blocks{state="cached"}']


def chat(router: ServerProcess, messages: list[dict], **extra) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True} | extra
    return httpx.post(f"{router.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
