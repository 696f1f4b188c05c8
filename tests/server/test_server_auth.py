"""Keys, tenants, cache salts and limits on a live server; each test then checks that the
server is still healthy."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_helpers import BLOCK_SIZE, SERVED_NAME, wait_for

pytestmark = pytest.mark.integration


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(server, key: str | None, **body: object) -> httpx.Response:
    body = {"model": SERVED_NAME, "max_tokens": 2, "temperature": 0, **body}
    headers = bearer(key) if key else {}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)


def cached(server, key: str, prompt: list[int], **body: object) -> int:
    response = complete(server, key, prompt=prompt, **body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def ids(seed: int, n: int = 10 * BLOCK_SIZE + 3) -> list[int]:
    """A prompt of token ids no other test sends (43 tokens: 40 cacheable)."""
    return [(seed * 31 + i * 7) % 250 for i in range(n)]


def test_requests_without_a_valid_key_are_401(keyed_server):
    url = keyed_server.url
    no_key = complete(keyed_server, None, prompt="hello")
    assert no_key.status_code == 401
    assert no_key.json()["error"]["code"] == "invalid_api_key"
    assert complete(keyed_server, "sk-wrong", prompt="hello").status_code == 401
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/metrics").status_code == 401  # --metrics-require-key
    assert httpx.get(f"{url}/metrics", headers=bearer("sk-y")).status_code == 200
    assert keyed_server.healthy()


def test_a_tenant_never_hits_another_tenants_prompt(keyed_server):
    prompt = ids(1)
    assert cached(keyed_server, "sk-y", prompt) == 0
    assert cached(keyed_server, "sk-x-one", prompt) == 0  # y's blocks are not x's
    assert cached(keyed_server, "sk-x-two", prompt) == 40  # x's other key: the same tenant
    assert cached(keyed_server, "sk-y", prompt) == 40
    assert keyed_server.healthy()


def test_a_request_cache_salt_only_narrows_sharing(keyed_server):
    prompt = ids(2)
    assert cached(keyed_server, "sk-x-one", prompt, cache_salt="team-a") == 0
    assert cached(keyed_server, "sk-x-two", prompt, cache_salt="team-a") == 40
    assert cached(keyed_server, "sk-x-one", prompt) == 0  # unsalted: another namespace
    assert cached(keyed_server, "sk-x-one", prompt, cache_salt="team-b") == 0
    assert cached(keyed_server, "sk-y", prompt, cache_salt="team-a") == 0  # salt != tenant
    assert keyed_server.healthy()


@pytest.mark.parametrize("salt", ["s" * 257, "line\nbreak", 42])
def test_an_invalid_cache_salt_is_400(keyed_server, salt):
    response = complete(keyed_server, "sk-x-one", prompt="hello", cache_salt=salt)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"
    assert keyed_server.healthy()


def test_oversize_requests_are_refused_with_a_message(keyed_server):
    huge = complete(keyed_server, "sk-x-one", prompt="x" * 70_000)  # over --max-body-bytes
    assert huge.status_code == 413
    assert "65536-byte limit" in huge.json()["error"]["message"]
    long_prompt = complete(keyed_server, "sk-x-one", prompt=[1] * 2001)
    assert long_prompt.status_code == 400
    assert long_prompt.json()["error"]["code"] == "context_length_exceeded"
    too_many = complete(keyed_server, "sk-x-one", prompt="hi", max_tokens=6001)
    assert too_many.status_code == 400
    assert "at most 6000" in too_many.json()["error"]["message"]
    assert keyed_server.healthy()


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
        ("/v1/chat/completions", {"messages": HI, "top_logprobs": 1}, "top_logprobs"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ],
)
def test_what_is_unsupported_or_malformed_is_400(keyed_server, path, body, param):
    response = httpx.post(f"{keyed_server.url}{path}", json=body, headers=bearer("sk-y"))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert keyed_server.healthy()


def queue_counts(server) -> tuple[int, int]:
    health = httpx.get(f"{server.url}/health", timeout=5).json()
    return health["running"], health["waiting"]


def test_a_full_queue_answers_429_at_once_and_leaving_clients_free_their_place(keyed_server):
    url, slow = f"{keyed_server.url}/v1/completions", {
        "model": SERVED_NAME, "prompt": "slow", "max_tokens": 6000, "ignore_eos": True,
        "stream": True, "temperature": 0}  # fmt: skip
    queued: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: queued.append(complete(keyed_server, "sk-x-one", prompt="queued"))
    )
    with httpx.Client(timeout=60) as client_a, httpx.Client(timeout=60) as client_b:
        with client_a.stream("POST", url, json=slow, headers=bearer("sk-y")) as running:
            lines = running.iter_lines()  # kept open: closing it would close the stream
            next(line for line in lines if line.startswith("data: "))  # A is running
            with client_b.stream("POST", url, json=slow, headers=bearer("sk-x-one")) as waiting:
                wait_for(lambda: queue_counts(keyed_server) == (1, 1))  # the bound of 1
                refused = complete(keyed_server, "sk-x-two", prompt="refused")
                assert refused.status_code == 429
                assert refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "queue_full"
                assert waiting.status_code == 200
            wait_for(lambda: queue_counts(keyed_server) == (1, 0))  # B left the queue
            waiter.start()
            wait_for(lambda: queue_counts(keyed_server) == (1, 1))
        waiter.join(60)  # leaving A's stream cancels it; the queued request runs
    assert queued[0].status_code == 200
    metrics = keyed_server.metrics("sk-y")
    assert metrics['kvstore_requests_rejected_total{reason="queue_full"}'] == 1
    assert metrics['kvstore_requests_total{outcome="cancelled"}'] == 2
    assert keyed_server.healthy()
