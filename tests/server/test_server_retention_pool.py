"""Retention asked over HTTP holds in a small device pool with no spill tier: a retained
prompt survives a flood that evicts its unretained twin, retention at its cap never blocks
admission, and /metrics counts what is retained (an in-process app on a micro model)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from engine_helpers import BLOCK_SIZE, micro_cache_config, micro_config
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from engine.loop.engine import Engine
from engine.model.loading import byte_tokenizer, random_model, wrap_model
from engine.server.app import create_app
from engine.server.config import ServerConfig

POOL = 256  # device blocks


@pytest.fixture
def client() -> Iterator[TestClient]:
    config = micro_config()
    config.max_position_embeddings = 2048
    model = wrap_model(random_model(config, seed=1), byte_tokenizer(), "micro-long")
    engine = Engine(model, micro_cache_config(device_blocks=POOL, tail_blocks=0))
    server = ServerConfig(served_model_name="micro", max_tokens_limit=8)
    with TestClient(create_app(engine, server)) as test_client:
        yield test_client


def text(num_blocks: int, seed: int) -> str:
    """A prompt of `num_blocks` full blocks and one token more (the byte tokenizer and a
    BOS: a token a character, plus one)."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(num_blocks * 4))


def complete(client: TestClient, prompt: str, **fields: object) -> dict:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def retained_blocks(client: TestClient) -> float:
    families = text_string_to_metric_families(client.get("/metrics").text)
    samples = [s for f in families for s in f.samples if s.name == "kvstore_retained_blocks"]
    return sum(s.value for s in samples)


def test_a_retained_prompt_is_hit_in_full_after_a_flood_its_unretained_twin_is_not(client):
    assert BLOCK_SIZE == 4
    kept, control = text(40, 1), text(40, 2)
    usage = complete(client, kept, prompt_cache_retention="24h")
    assert usage["prompt_tokens"] == 40 * 4 + 1
    complete(client, control)
    assert retained_blocks(client) == 40
    for seed in range(20):  # each a quarter of the pool
        complete(client, text(POOL // 4, 100 + seed))
    assert complete(client, kept)["prompt_tokens_details"]["cached_tokens"] == 40 * 4
    assert complete(client, control)["prompt_tokens_details"]["cached_tokens"] == 0


def test_with_retention_at_its_cap_a_prompt_of_forty_percent_of_the_pool_is_served(client):
    prompts = [text(40, seed) for seed in range(4)]
    for prompt in prompts:
        complete(client, prompt, prompt_cache_retention="24h")
    assert retained_blocks(client) == POOL // 2  # the cap: the fourth got 8 of its 40 blocks
    big = text(int(0.4 * POOL), 9)
    assert complete(client, big)["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(client, big)["prompt_tokens_details"]["cached_tokens"] == 102 * 4
    hits = [complete(client, p)["prompt_tokens_details"]["cached_tokens"] for p in prompts[:3]]
    assert hits == [160, 160, 160]


def test_a_cache_control_breakpoint_retains_the_system_blocks(client):
    system = [{"type": "text", "text": text(30, 5), "cache_control": {"type": "ephemeral"}}]
    body = {"model": "micro", "max_tokens": 1, "system": system,
            "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
    first = client.post("/v1/messages", json=body).json()["usage"]
    blocks = first["cache_creation_input_tokens"] // 4
    assert blocks >= 30 and retained_blocks(client) == blocks
    for seed in range(20):
        complete(client, text(POOL // 4, 100 + seed))
    body["messages"] = [{"role": "user", "content": "another question"}]
    second = client.post("/v1/messages", json=body).json()["usage"]
    assert second["cache_read_input_tokens"] == blocks * 4
    assert second["cache_creation_input_tokens"] == 0
