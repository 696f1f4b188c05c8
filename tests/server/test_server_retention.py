"""What a request asks to retain reaches the engine as `Request.retention`: each
`cache_control` breakpoint of /v1/messages at its token position with its TTL, and OpenAI's
`prompt_cache_retention: "24h"` as the whole prompt for 24 h (on an in-process app whose
engine's queue records the jobs it is given)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_helpers import micro_cache_config, micro_model
from starlette.testclient import TestClient

from engine.loop.engine import Engine
from engine.loop.group import SequenceGroup
from engine.loop.request import Request, Retain
from engine.server.app import create_app
from engine.server.config import ServerConfig

SYSTEM = "T" * 50  # the byte tokenizer: a token a character
HOUR = {"type": "ephemeral", "ttl": "1h"}


class Recorded(Engine):
    """An engine that keeps every request it queues, and every group."""

    def add_requests(self, requests: list[Request], max_waiting: int | None = None) -> list:
        self.seen.extend(requests)
        return super().add_requests(requests, max_waiting)

    def add_group(self, group: SequenceGroup, max_waiting: int | None = None) -> SequenceGroup:
        self.groups.append(group)
        return super().add_group(group, max_waiting)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[TestClient, Recorded]]:
    engine = Recorded(micro_model(seed=1), micro_cache_config())
    engine.seen, engine.groups = [], []
    with TestClient(create_app(engine, ServerConfig(served_model_name="micro"))) as client:
        yield client, engine


def test_each_breakpoint_is_retained_at_its_position_with_its_ttl(served):
    client, engine = served
    system = [{"type": "text", "text": SYSTEM, "cache_control": HOUR}]
    content = [{"type": "text", "text": "question", "cache_control": {"type": "ephemeral"}}]
    body = {"model": "micro", "max_tokens": 2, "system": system,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip
    answer = client.post("/v1/messages", json=body)
    assert answer.status_code == 200, answer.text
    job = engine.seen[-1]
    # <|bos|> "system: " SYSTEM <|end_of_turn|> "\n"; the last block: the whole prompt
    assert job.retention == (Retain(61, 3600.0), Retain(len(job.token_ids), 300.0))
    usage = answer.json()["usage"]
    whole = len(job.token_ids) // 4 * 4  # the furthest breakpoint, in blocks of 4
    assert usage["cache_creation_input_tokens"] == whole - usage["cache_read_input_tokens"]
    assert usage["input_tokens"] == len(job.token_ids) - whole


def test_a_message_without_breakpoints_retains_nothing(served):
    client, engine = served
    body = {"model": "micro", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    assert client.post("/v1/messages", json=body).status_code == 200
    assert engine.seen[-1].retention == ()


@pytest.mark.parametrize(
    ("retention", "ttl_s"), [("24h", 86400.0), ("in_memory", None), (None, None)]
)
def test_prompt_cache_retention_24h_retains_the_whole_prompt(served, retention, ttl_s):
    client, engine = served
    body = {"messages": [{"role": "user", "content": "keep"}], "max_tokens": 2,
            "prompt_cache_retention": retention}  # fmt: skip
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    job = engine.seen[-1]
    assert job.retention == (() if ttl_s is None else (Retain(len(job.token_ids), ttl_s),))


def test_of_several_choices_the_leader_retains_the_prompt_it_prefills(served):
    client, engine = served
    body = {"prompt": "several", "max_tokens": 2, "n": 2, "prompt_cache_retention": "24h"}
    assert client.post("/v1/completions", json=body).status_code == 200
    leader, other = engine.groups[-1].requests
    assert leader.retention == (Retain(len(leader.token_ids), 86400.0),)
    assert other.retention == ()
