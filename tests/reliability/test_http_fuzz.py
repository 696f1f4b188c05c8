"""Fault 8 at CI scale: hypothesis-generated bad requests to a live `kvstore serve` each get a
4xx, the server stays healthy and the cache index does not move; plus the bugs it found."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from bench.faults.common import Context, FaultOutcome, Scale, cache_config, micro_model
from bench.faults.http import INDEX, PER_REQUEST, http_fuzz, strategies, sweep
from engine.loop.engine import Engine
from engine.server.app import create_app
from engine.server.config import ServerConfig

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

CI = Scale(requests=8, collision_trials=160, leak_requests=160, outage_s=0.5, kill_rounds=3)
CATEGORIES = {"malformed_json", "wrong_types", "token_ids", "huge", "salts", "keys"}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Context:
    torch.set_num_threads(1)
    workdir: Path = tmp_path_factory.mktemp("http-fuzz")
    return Context(micro_model(), None, workdir, CI)  # type: ignore[arg-type]  # no Redis here


@pytest.fixture(scope="module")
def outcome(ctx: Context) -> FaultOutcome:
    return http_fuzz(ctx)


def test_every_generated_bad_request_gets_a_4xx_from_a_server_that_stays_up(ctx, outcome):
    n = PER_REQUEST * CI.requests
    assert set(strategies(ctx)) == CATEGORIES
    assert outcome.requests == 6 * n + len(sweep()) == 6 * 80 + 76
    assert outcome.succeeded == outcome.requests, outcome.note
    assert outcome.wrong_outputs == outcome.lost_entries == 0
    assert outcome.corrupt_detected == outcome.corrupt_injected == 0
    for category in CATEGORIES - {"wrong_types"}:
        assert outcome.figures[f"category_{category}"] == n
    assert outcome.figures["category_wrong_types"] == n + 76  # + one per documented field
    statuses = {k: v for k, v in outcome.figures.items() if k.startswith("status_")}
    assert set(statuses) == {"status_400", "status_401", "status_404", "status_413"}
    assert sum(statuses.values()) == outcome.requests


def test_the_cache_index_is_the_same_after_the_fuzzing(outcome):
    f = outcome.figures
    assert f["device_cached_before"] == f["device_evictable_before"] == 10  # the warm prompt
    assert all(f[f"{k}_before"] == f[f"{k}_after"] for k in INDEX)
    assert f["index_changed"] == 0
    assert f["warm_cached_cold"] == 0
    # 40 from the index's 10 blocks, the 41st from the tail the warm prompt's request kept
    assert f["warm_cached_before"] == f["warm_cached_after"] == 41
    assert f["refused_after"] - f["refused_before"] == outcome.requests  # none was queued


def test_every_openapi_path_with_an_input_is_fuzzed(outcome):
    assert outcome.figures["openapi_paths"] == 7
    assert outcome.figures["openapi_paths_fuzzed"] == 6  # all but /health, which takes none


# --- regressions: bad input the fuzzing found answered with a 2xx or a 500 -------------------


@pytest.fixture(scope="module")
def client(ctx: Context) -> Iterator[TestClient]:
    engine = Engine(ctx.model, cache_config(ctx))
    app = create_app(engine, ServerConfig(served_model_name="micro", max_body_bytes=16384))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


VALID = b'{"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0'
FOUND = {
    "deep nesting: RecursionError, 500": b"[" * 5000 + b"]" * 5000,
    "deep nesting in a field": VALID + b', "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "NaN literal: accepted, 200": VALID + b', "metadata": NaN}',
    "Infinity literal": VALID + b', "metadata": -Infinity}',
    "lone surrogate in the prompt: tokenizer error, 500": b'{"prompt": "\\ud800"}',
    "lone surrogate in an ignored field: 200": VALID + b', "user": "\\udfff"}',
    "lone surrogate in a chat message": b'{"messages": [{"role": "user", "content": "\\udb33"}]}',
    "bool token id: taken as 1, 200": b'{"prompt": [true, 5], "max_tokens": 2}',
    "float token ids: taken as ints": b'{"prompt": [[1.0, 2.0]], "max_tokens": 2}',
    "bool max_tokens": b'{"prompt": [1, 2], "max_tokens": true}',
    "string max_tokens": b'{"prompt": [1, 2], "max_tokens": "2"}',
    "string temperature": b'{"prompt": [1, 2], "max_tokens": 2, "temperature": "0.5"}',
    "int stream": VALID + b', "stream": 0}',
    "bool seed": VALID + b', "seed": false}',
    "seed over 64 bits: torch overflow, 500": VALID + b', "seed": 18446744073709551616}',
    "seed under -2**63": VALID + b', "seed": -9223372036854775809}',
}


@pytest.mark.parametrize("content", FOUND.values(), ids=FOUND.keys())
def test_bad_input_the_fuzzing_found_is_a_400(client, content):
    path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
    response = client.post(path, content=content)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert client.get("/health").status_code == 200


def test_the_same_fields_well_typed_are_still_served(client):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.0, "seed": 2**64 - 1,
            "stream": False, "stream_options": None}  # fmt: skip
    assert client.post("/v1/completions", json=body).status_code == 200
    pair = VALID + b', "user": "\\ud83d\\ude00", "seed": -9223372036854775808}'  # an emoji
    assert client.post("/v1/completions", content=pair).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi \U0001f600"}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


def test_null_for_an_optional_openai_field_means_its_default(client):
    nulls = {"temperature": None, "top_p": None, "n": None, "presence_penalty": None,
             "frequency_penalty": None, "stream": None, "seed": None, "stop": None}  # fmt: skip
    # temperature null is 1.0: sampled, so EOS is ignored to make the count exact
    body = {"prompt": [1, 2, 3], "max_tokens": None, "echo": None, "ignore_eos": True, **nulls}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16  # max_tokens null: 16
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": None}
    assert client.post("/v1/chat/completions", json={**chat, **nulls}).status_code == 200
