"""SIGTERM drains a live `kvstore serve`, and /health tells the truth about its tiers."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx
from server_helpers import ServerProcess, clean_env, free_port, kvstore_script, wait_for

LONG = {"model": "micro", "prompt": [5] * 9, "max_tokens": 150, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip


def serve(model_dir: Path, tmp: Path, *extra: str) -> ServerProcess:
    port = free_port()
    args = [kvstore_script(), "serve", "--model", str(model_dir), "--served-model-name",
            "micro", "--port", str(port), "--block-size", "4", "--device-blocks", "512",
            "--device", "cpu", "--log-level", "info", *extra]  # fmt: skip
    return ServerProcess(args, port, tmp / "server.log", clean_env()).start().wait_ready()


def stream(url: str, body: dict, out: dict) -> None:
    """One streamed completion: its text chunks, final token ids and finish reason."""
    chunks: list[dict] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        out["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                out.setdefault("first_at", len(chunks))
    out["finish"] = chunks[-1]["choices"][0]["finish_reason"] if chunks else None
    out["token_ids"] = chunks[-1]["choices"][0].get("token_ids") if chunks else None


def test_sigterm_finishes_in_flight_streams_and_refuses_new_requests(
    model_dir: Path, tmp_path: Path
) -> None:
    server = serve(model_dir, tmp_path, "--drain-timeout-s", "60")
    try:
        results = [{} for _ in range(3)]
        clients = [threading.Thread(target=stream, args=(server.url, LONG, r)) for r in results]
        for client in clients:
            client.start()
        wait_for(lambda: all("first_at" in r for r in results), 60)
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 503, 10)
        health = httpx.get(f"{server.url}/health", timeout=5).json()
        refused = httpx.post(f"{server.url}/v1/completions", json={**LONG, "stream": False})
        for client in clients:
            client.join(120)
        server.proc.wait(60)
    finally:
        server.stop()
    assert health["status"] == "draining"
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "draining"
    assert refused.headers["retry-after"] == "1"
    assert [r["finish"] for r in results] == ["length"] * 3
    assert [len(r["token_ids"]) for r in results] == [150] * 3
    log = server.log_tail(20000)
    assert "waiting up to 60 s for 3 in flight" in log
    assert "drained in" in log
    assert "cache integrity ok; 0 of 512 device blocks held" in log


def test_health_shows_a_killed_redis_tier_down_then_ok_again(
    model_dir: Path, tmp_path: Path, redis_server
) -> None:
    server = serve(model_dir, tmp_path, "--redis-url", redis_server.url,
                   "--breaker-cooldown-s", "1", "--lookup-deadline-ms", "200")  # fmt: skip
    sent = iter(range(10_000))

    def health() -> dict:
        prompt = [next(sent) % 250 + 1] * 21  # a new prompt: its lookup reaches Redis
        body = {"model": "micro", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        return httpx.get(f"{server.url}/health", timeout=5).json()

    try:
        before = health()
        redis_server.kill()
        wait_for(lambda: health()["tiers"]["redis"]["state"] == "down", 30)
        down = httpx.get(f"{server.url}/health", timeout=5)
        redis_server.restart()
        wait_for(lambda: health()["status"] == "ok", 30)
        after = httpx.get(f"{server.url}/health", timeout=5).json()
    finally:
        server.stop()
    assert before["status"] == "ok"
    assert before["tiers"] == {
        "device": {"state": "ok"},
        "redis": {"state": "ok", "errors": 0, "breaker": "closed"},
    }
    assert down.status_code == 200  # it still serves: a tier down is a miss, not an outage
    assert down.json()["status"] == "degraded"
    assert down.json()["tiers"]["redis"]["breaker"] == "open"
    assert after["tiers"]["redis"]["breaker"] == "closed"
    assert "redis tier: " in server.log_tail(20000)
