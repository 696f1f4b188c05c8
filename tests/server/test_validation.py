"""One validation layer for both APIs (engine/api/validation.py): a known field of a wrong
type or range is a 400 whose `param` names it as the client sent it, with a message a person
reads; an unknown field is ignored with one warning naming it."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import micro_cache_config, micro_model

from engine.loop.engine import Engine
from engine.server.app import create_app
from engine.server.config import ServerConfig

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"prompt": "hi", "max_tokens": 1}
MESSAGES = {"model": "micro", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions",
         "messages": "/v1/messages"}  # fmt: skip
BODIES = {"chat": CHAT, "completion": COMPLETION, "messages": MESSAGES}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    engine = Engine(micro_model(seed=41), micro_cache_config())
    with TestClient(create_app(engine, ServerConfig(served_model_name="micro"))) as client:
        yield client


def post(client: TestClient, kind: str, **fields: object):
    return client.post(PATHS[kind], json=BODIES[kind] | fields)


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("completion", {"top_logprobs": "2"}, "top_logprobs"),
        ("completion", {"top_logprobs": 21}, "top_logprobs"),
        ("completion", {"top_logprobs": -1}, "top_logprobs"),
        ("chat", {"best_of": "x"}, "best_of"),
        ("chat", {"echo": "yes"}, "echo"),
        ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("completion", {"stream": True, "stream_options": {"include_usage": True, "x": 1}},
         "stream_options.x"),
        ("messages", {"messages": [{"role": "user", "content": ""}]}, "messages.0.content"),
        ("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
         "messages.0.content.0.text"),
        ("chat", {"stop": 5}, "stop"),
        ("chat", {"stop": ""}, "stop"),
        ("chat", {"stop": ["a", 7]}, "stop.1"),
        ("completion", {"max_tokens": "3"}, "max_tokens"),
        ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ("chat", {"messages": None}, "messages"),
    ],
)  # fmt: skip
def test_a_bad_value_is_a_400_naming_its_field(client, kind, fields, param) -> None:
    answer = post(client, kind, **fields)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    if kind == "messages":  # Anthropic's shape: the field starts the message
        assert error["message"].startswith(f"{param}: "), error
    else:
        assert error["param"] == param, error


def test_the_messages_say_what_to_fix(client) -> None:
    def message(kind: str, **fields: object) -> str:
        return post(client, kind, **fields).json()["error"]["message"]

    assert message("chat", stop=5) == "stop: expected a string or a list of strings, got 5"
    assert message("chat", stop="") == "a stop sequence must be a non-empty string"
    assert message("chat", stream_options={"include_usage": True}) == (
        "stream_options needs stream=true"
    )
    assert message("completion", top_logprobs=2).startswith("top_logprobs is chat's")
    assert message("chat", best_of=3).startswith("best_of is not served on chat")
    assert "str" not in post(client, "chat", stop=5).json()["error"]["param"]


def test_an_unknown_field_is_ignored_and_named_once(client, caplog) -> None:
    with caplog.at_level(logging.WARNING, "kvstore.api"):
        first = post(client, "chat", frobnicate=1, wizardry="yes")
        second = post(client, "completion", frobnicate=2)
    assert (first.status_code, second.status_code) == (200, 200)
    warned = [r.getMessage() for r in caplog.records if r.name == "kvstore.api"]
    assert warned == ["request fields frobnicate, wizardry are not part of the API: ignored"]


def test_defaults_of_the_other_endpoints_fields_are_accepted(client) -> None:
    """A client that sends the other endpoint's fields at their defaults is not refused."""
    assert post(client, "chat", echo=False, best_of=1).status_code == 200
    assert post(client, "completion", stream=True, stream_options={"include_usage": True},
                top_logprobs=None).status_code == 200  # fmt: skip
