"""Anthropic's /v1/messages through `kvstore router`: forwarded as OpenAI's routes are
(streams pass through), keys from x-api-key, bodies checked at the router, errors in
Anthropic's shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_helpers import KEY, REPLICA, running_fleet
from server_helpers import ServerProcess

pytestmark = pytest.mark.integration
SYSTEM = "R" * 50  # 50 tokens of the byte tokenizer
EPHEMERAL = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory) -> Iterator[tuple[ServerProcess, list]]:
    """One replica (serving the model under its directory's name) behind a router."""
    with running_fleet(model_dir, tmp_path_factory.mktemp("router-messages"), 1) as running:
        running[0].model = model_dir.name
        yield running


def post(router: ServerProcess, headers: dict | None = None, **fields) -> httpx.Response:
    system = [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]
    body = {"model": router.model, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "system": system, "messages": [{"role": "user", "content": "first query"}]}  # fmt: skip
    headers = {"x-api-key": KEY} if headers is None else headers
    return httpx.post(f"{router.url}/v1/messages", json=body | fields, headers=headers,
                      timeout=120)  # fmt: skip


def test_a_message_is_forwarded_and_its_breakpoint_read_by_the_next(fleet):
    router, (replica,) = fleet
    salt = uuid.uuid4().hex
    first = post(router, cache_salt=salt)
    assert first.status_code == 200, first.text
    assert first.headers[REPLICA] == replica.url
    assert first.json()["type"] == "message"
    second = post(router, cache_salt=salt, messages=[{"role": "user", "content": "other"}])
    # <|bos|> "system: " SYSTEM <|end_of_turn|> "\n": 61 tokens, 60 in blocks of 4; then
    # "user: " is shared too: 64 in blocks
    assert first.json()["usage"]["cache_creation_input_tokens"] == 60
    assert second.json()["usage"]["cache_read_input_tokens"] == 64


def test_a_stream_passes_through_as_anthropics_events(fleet):
    router, _ = fleet
    streamed = post(router, stream=True, cache_salt=uuid.uuid4().hex)
    assert streamed.status_code == 200
    names = [chunk.split("\n")[0] for chunk in streamed.text.split("\n\n") if chunk]
    assert names[:3] == ["event: message_start", "event: content_block_start", "event: ping"]
    assert names[-3:] == ["event: content_block_stop", "event: message_delta",
                          "event: message_stop"]  # fmt: skip
    delta = json.loads(streamed.text.split("\n\n")[-3].split("\n")[1][6:])
    assert delta["usage"]["output_tokens"] == 4


def test_keys_and_bodies_are_checked_at_the_router_in_anthropics_shape(fleet):
    router, _ = fleet
    assert post(router, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    unauthorized = post(router, headers={})
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"]["type"] == "authentication_error"
    tool = {"type": "tool_use", "id": "t", "name": "x", "input": {}}
    refused = post(router, messages=[{"role": "user", "content": [tool]}])
    assert refused.status_code == 400 and REPLICA not in refused.headers  # never forwarded
    assert refused.json()["error"]["message"].startswith("messages.0.content.0.type: ")
    wrong = httpx.get(f"{router.url}/v1/messages", timeout=10)
    assert (wrong.status_code, wrong.json()["type"]) == (405, "error")
