"""Anthropic's Messages API on `kvstore serve`: the message and its stream of events, the
usage of cache_control breakpoints, errors in Anthropic's shape, API keys in x-api-key, the
official `anthropic` client, and OpenAI's prompt-caching fields on the same server."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest
from server_helpers import SERVED_NAME, ServerProcess, clean_env, free_port, kvstore_script

pytestmark = pytest.mark.integration
KEY = "sk-messages"
BLOCK = 4
SYSTEM = "You answer in one short line. " + "S" * 20  # 50 bytes: one token each
EPHEMERAL = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("messages-server") / "server.log"
    port = free_port()
    args = [kvstore_script(), "serve", "--model", str(model_dir), "--served-model-name",
            SERVED_NAME, "--port", str(port), "--block-size", str(BLOCK), "--device-blocks",
            "1024", "--device", "cpu", "--max-body-bytes", "65536",
            "--log-level", "warning"]  # fmt: skip
    process = ServerProcess(args, port, log, clean_env(KVSTORE_API_KEY=KEY)).start()
    try:
        yield process.wait_ready()
    finally:
        process.stop()


NO_WRITES = {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}


def fresh() -> str:
    """A cache salt of its own: the request's prefix is in no one else's cache."""
    return uuid.uuid4().hex


def message(server: ServerProcess, headers: dict | None = None, **fields) -> httpx.Response:
    body = {"model": SERVED_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Hello there"}]} | fields  # fmt: skip
    headers = {"x-api-key": KEY} if headers is None else headers
    return httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=120)


def events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(name, data) of each event of a stream; each data's `type` is its event's name."""
    out = []
    for chunk in response.text.split("\n\n"):
        if chunk:
            name, data = chunk.split("\n")
            assert name.startswith("event: ") and data.startswith("data: ")
            out.append((name[7:], json.loads(data[6:])))
            assert out[-1][1]["type"] == out[-1][0]
    return out


def cached_system(salt: str, user: str) -> dict:
    system = [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]
    return {"system": system, "messages": [{"role": "user", "content": user}], "cache_salt": salt}


def test_a_message_answers_in_anthropic_shape_with_the_chat_routes_text(server):
    salt = fresh()
    answer = message(server, system=SYSTEM, cache_salt=salt)
    assert answer.status_code == 200
    body = answer.json()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]
    same = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-api-key": KEY},
                      json=same | {"cache_salt": fresh()}, timeout=120)  # fmt: skip
    assert body["id"].startswith("msg_") and len(body["id"]) == 36
    assert {k: body[k] for k in ("type", "role", "model", "stop_reason", "stop_sequence")} == {
        "type": "message", "role": "assistant", "model": SERVED_NAME,
        "stop_reason": "max_tokens", "stop_sequence": None}  # fmt: skip
    text = chat.json()["choices"][0]["message"]["content"]
    assert body["content"] == [{"type": "text", "text": text}]
    prompt = chat.json()["usage"]["prompt_tokens"]
    assert body["usage"] == {"input_tokens": prompt, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 0, "output_tokens": 6,
                             "cache_creation": NO_WRITES}  # fmt: skip


def test_a_system_breakpoint_is_written_once_then_read(server):
    salt, prompt = fresh(), 1 + 8 + 50 + 2 + 6 + 11 + 2 + 11  # "user: " 11 bytes "assistant: "
    first = message(server, **cached_system(salt, "first query")).json()["usage"]
    second = message(server, **cached_system(salt, "other query")).json()["usage"]
    # the breakpoint: <|bos|> "system: " SYSTEM <|end_of_turn|> "\n" = 61 tokens, 60 in blocks
    assert first == {"input_tokens": prompt - 60, "cache_creation_input_tokens": 60,
                     "cache_read_input_tokens": 0, "output_tokens": 6,
                     "cache_creation": {"ephemeral_5m_input_tokens": 60,
                                        "ephemeral_1h_input_tokens": 0}}  # fmt: skip
    # the two prompts share 61 + len("user: ") = 67 tokens: 64 in whole blocks
    assert second == {"input_tokens": prompt - 64, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 64, "output_tokens": 6,
                      "cache_creation": NO_WRITES}  # fmt: skip


def test_a_stream_sends_anthropics_events_and_the_same_message(server):
    fields = cached_system(fresh(), "stream this")
    whole = message(server, **fields | {"cache_salt": fresh()}).json()
    streamed = message(server, stream=True, **fields)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    got = events(streamed)
    names = [name for name, _ in got]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", "ping",
                     *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    start = got[0][1]["message"]
    assert (start["content"], start["stop_reason"], start["role"]) == ([], None, "assistant")
    assert start["usage"] == whole["usage"] | {"output_tokens": 1}
    text = "".join(data["delta"]["text"] for name, data in got if name == "content_block_delta")
    assert text == whole["content"][0]["text"]
    end = got[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"] == whole["usage"]


def test_a_stop_sequence_ends_the_answer_and_is_named(server):
    salt = fresh()
    text = message(server, max_tokens=12, cache_salt=salt).json()["content"][0]["text"]
    assert len(text) >= 3, repr(text)
    stop = next(c for c in text[2:] if c != "\ufffd")  # a whole character past the start
    body = message(server, max_tokens=12, cache_salt=salt, stop_sequences=["\x00", stop]).json()
    assert body["content"][0]["text"] == text[: text.find(stop)]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", stop)


def test_errors_are_in_anthropics_shape(server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    refused = message(server, messages=[{"role": "user", "content": [image]}])
    assert refused.status_code == 400
    assert refused.json() == {"type": "error", "error": {"type": "invalid_request_error",
        "message": "messages.0.content.0.type: content blocks of type 'image' are not supported; "
                   "send text blocks"}}  # fmt: skip
    unknown = message(server, model="claude-x")
    assert (unknown.status_code, unknown.json()["error"]["type"]) == (404, "not_found_error")
    assert message(server, headers={}).json()["error"]["type"] == "authentication_error"
    huge = message(server, system="x" * 70_000)
    assert (huge.status_code, huge.json()["error"]["type"]) == (413, "request_too_large")
    wrong = httpx.get(f"{server.url}/v1/messages", timeout=10)
    assert (wrong.status_code, wrong.json()["type"]) == (405, "error")
    missing = httpx.post(f"{server.url}/v1/messages/batches", json={}, timeout=10)
    assert missing.json()["error"]["type"] == "not_found_error"  # (in Anthropic's shape)
    openai_shaped = httpx.post(f"{server.url}/v1/nothing", json={}, timeout=10)
    assert openai_shaped.json()["error"]["type"] == "not_found_error"
    assert "type" not in openai_shaped.json()


def test_the_api_key_is_taken_from_x_api_key_or_bearer(server):
    assert message(server, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert message(server, headers={"x-api-key": "sk-wrong"}).status_code == 401
    chat = httpx.post(f"{server.url}/v1/completions", headers={"x-api-key": KEY},
                      json={"prompt": "x", "max_tokens": 1}, timeout=60)  # fmt: skip
    assert chat.status_code == 200


def test_the_anthropic_client_creates_and_streams_messages(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    extra = {"cache_salt": fresh(), "ignore_eos": True, "temperature": 0}  # no such arguments
    system = [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]
    kwargs = {"model": SERVED_NAME, "max_tokens": 5, "system": system,
              "messages": [{"role": "user", "content": "client query"}]}  # fmt: skip
    created = client.messages.create(**kwargs, extra_body=extra)
    assert (created.usage.cache_creation_input_tokens, created.usage.output_tokens) == (60, 5)
    other = [{"role": "user", "content": "second query"}]  # as long, differs from its first byte
    with client.messages.stream(**kwargs | {"messages": other}, extra_body=extra) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text and len(final.content) == 1
    assert final.usage.cache_read_input_tokens == 64  # the prompts' first 67 tokens, in blocks
    assert final.usage.cache_creation_input_tokens == 0
    assert final.usage.input_tokens == created.usage.input_tokens + 60 - 64
    assert final.stop_reason == "max_tokens"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**kwargs, extra_body={"temperature": 2.0})
    assert info.value.body["error"]["message"].startswith("temperature: ")


def test_openai_prompt_cache_fields_are_accepted_and_bad_ones_refused(server):
    def chat(**fields) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": "retain me"}], "max_tokens": 2,
                "cache_salt": fresh()} | fields  # fmt: skip
        return httpx.post(f"{server.url}/v1/chat/completions", json=body,
                          headers={"x-api-key": KEY}, timeout=60)  # fmt: skip

    ok = chat(prompt_cache_retention="24h", prompt_cache_key="agent-7")
    assert ok.status_code == 200
    assert ok.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    bad = chat(prompt_cache_retention="forever")
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "prompt_cache_retention")
    long = chat(prompt_cache_key="k" * 65)
    assert (long.status_code, long.json()["error"]["param"]) == (400, "prompt_cache_key")


def test_count_tokens_matches_the_usage_of_a_message_with_the_same_body(server):
    """The official client's count_tokens: the input, cache-creation and cache-read tokens
    of a messages.create of the same body, added up; the cache writes split by TTL."""
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    hour = {"type": "ephemeral", "ttl": "1h"}
    system = [{"type": "text", "text": SYSTEM, "cache_control": hour}]
    user = [{"type": "text", "text": "count me, " * 20, "cache_control": EPHEMERAL}]
    kwargs = {"model": SERVED_NAME, "system": system,
              "messages": [{"role": "user", "content": user}]}  # fmt: skip
    counted = client.messages.count_tokens(**kwargs, extra_body={"cache_salt": fresh()})
    created = client.messages.create(
        **kwargs, max_tokens=2, extra_body={"cache_salt": fresh(), "ignore_eos": True}
    )
    usage = created.usage
    total = usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
    assert counted.input_tokens == total
    split = usage.cache_creation
    assert split.ephemeral_1h_input_tokens == 60  # the system block, in whole blocks
    assert split.ephemeral_1h_input_tokens + split.ephemeral_5m_input_tokens == (
        usage.cache_creation_input_tokens
    )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(**kwargs | {"model": "nope"})
