"""/metrics read with prometheus_client's own parser: exact values after known requests, on
an in-process app with an LMDB tier (a second app on the same directory hits it)."""

from __future__ import annotations

import math
from pathlib import Path

from engine_helpers import BLOCK_SIZE, micro_cache_config, micro_model
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from engine.loop.engine import Engine
from engine.server.app import create_app, describe_engine
from engine.server.config import ServerConfig
from engine.server.metrics import LATENCY_BUCKETS_S

PROMPTS = ["the prefix cache " * 4, "the prefix cache " * 4 + "and more", "other words " * 3]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def serve(lmdb_dir: Path) -> TestClient:
    engine = Engine(micro_model(seed=1), micro_cache_config(lmdb_dir=str(lmdb_dir)))
    return TestClient(create_app(engine, ServerConfig(served_model_name="micro")))


def complete(client: TestClient, prompt: str) -> dict:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 200
    return response.json()["usage"]


def scrape(client: TestClient) -> Samples:
    response = client.get("/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = text_string_to_metric_families(response.text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_count_exactly_the_requests_sent(tmp_path):
    with serve(tmp_path) as client:
        usages = [complete(client, prompt) for prompt in [*PROMPTS, PROMPTS[0]]]
        unknown = client.post("/v1/completions", json={"prompt": "x", "model": "nope"})
        assert unknown.status_code == 404
        samples = scrape(client)
        for method, path, status in (("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405)):
            error = client.request(method, path).json()["error"]  # OpenAI's shape, not FastAPI's
            assert error["message"] == f"{method} {path}: " + (
                "Not Found" if status == 404 else "Method Not Allowed"
            )
            assert error["type"] == (
                "not_found_error" if status == 404 else "invalid_request_error"
            )
    n, cached = len(usages), sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0
    assert value(samples, "kvstore_requests_total", outcome="ok") == n
    assert value(samples, "kvstore_requests_rejected_total", reason="not_found") == 1
    assert value(samples, "kvstore_lookups_total") == n
    assert value(samples, "kvstore_prefix_cache_hits_tokens_total", tier="device") == cached
    assert value(samples, "kvstore_prefix_cache_hits_tokens_total", tier="lmdb") == 0
    assert value(samples, "kvstore_tenant_cached_tokens_total", tenant="") == cached
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    assert value(samples, "kvstore_prefix_cache_queries_tokens_total") == prompt_tokens
    completion = sum(u["completion_tokens"] for u in usages)
    assert value(samples, "kvstore_tenant_completion_tokens_total", tenant="") == completion
    assert not [name for name, _ in samples if name.endswith("_created")]


def test_latency_histograms_count_every_request_in_the_same_buckets(tmp_path):
    with serve(tmp_path) as client:
        for prompt in PROMPTS:
            complete(client, prompt)
        samples = scrape(client)
    for name in ("kvstore_time_to_first_token_seconds", "kvstore_queue_wait_seconds"):
        bounds = [float(dict(labels)["le"]) for n, labels in samples if n == name + "_bucket"]
        assert bounds == [*LATENCY_BUCKETS_S, math.inf]
        assert value(samples, name + "_count") == len(PROMPTS)
        assert value(samples, name + "_bucket", le="+Inf") == len(PROMPTS)


def test_hits_from_a_tier_are_counted_by_that_tier(tmp_path):
    with serve(tmp_path) as first:
        complete(first, PROMPTS[0])  # written through to LMDB; closing flushes it
    with serve(tmp_path) as second:
        cached = complete(second, PROMPTS[0])["prompt_tokens_details"]["cached_tokens"]
        samples = scrape(second)
    assert cached > 0
    assert value(samples, "kvstore_prefix_cache_hits_tokens_total", tier="lmdb") == cached
    assert value(samples, "kvstore_prefix_cache_hits_tokens_total", tier="device") == 0
    assert value(samples, "kvstore_promoted_blocks_total") == cached // BLOCK_SIZE
    assert value(samples, "kvstore_tenant_cached_tokens_total", tenant="") == cached
    # the read gate: LMDB's read measured (and not skipped); no prefill big enough to time
    assert value(samples, "kvstore_tier_read_skipped_total", tier="lmdb") == 0
    assert value(samples, "kvstore_tier_read_skipped_blocks_total", tier="lmdb") == 0
    assert value(samples, "kvstore_tier_read_bytes_per_second", tier="lmdb") > 0
    assert not [name for name, _ in samples if name == "kvstore_prefill_tokens_per_second"]


def test_device_blocks_count_the_runners_scratch_as_reserved_and_the_states_sum_to_total(
    tmp_path,
):
    with serve(tmp_path) as client:
        idle = scrape(client)
        prompt_tokens = complete(client, PROMPTS[0])["prompt_tokens"]
        after = scrape(client)
        line = describe_engine(client.app.state.service.engine)
    states = ("free", "cached", "tails", "reserved")
    got = [{s: value(m, "kvstore_device_blocks", state=s) for s in states} for m in (idle, after)]
    # 69 prompt tokens + 2 generated, K/V for all but the last: 70 = 17 whole blocks of 4
    # cached, and the partial one kept as a tail for the next turn
    assert prompt_tokens == 69
    assert got == [
        {"free": 255, "cached": 0, "tails": 0, "reserved": 1},
        {"free": 237, "cached": 17, "tails": 1, "reserved": 1},
    ]
    for samples, blocks in zip((idle, after), got, strict=True):
        assert value(samples, "kvstore_device_blocks", state="total") == sum(blocks.values()) == 256
    assert "pool 256 blocks of 4 tokens (1 reserved for the runner's scratch) = " in line


def test_health_publishes_the_read_costs_the_replicas_gate_measured(tmp_path):
    """A router prices this replica's tier blocks with them (kvstore/fleet/routing.py)."""
    with serve(tmp_path) as first:
        complete(first, PROMPTS[0])
    with serve(tmp_path) as second:
        assert second.get("/health").json()["read_costs"] == {}  # nothing measured yet
        complete(second, "a prompt of its own, long enough to time its prefill: " * 2)
        complete(second, PROMPTS[0])  # read from LMDB
        costs = second.get("/health").json()["read_costs"]
        samples = scrape(second)
    assert list(costs) == ["DISK"] and 0 <= costs["DISK"] <= 1
    assert value(samples, "kvstore_prefill_tokens_per_second") > 0


def test_health_and_metrics_report_each_tiers_bytes_per_block_under_its_codec(tmp_path):
    # micro: 2 layers x (K, V) x 2 KV heads x 4 tokens x 16 dims; an entry's header is 112
    # fixed + 20 shape + 16 token bytes, aligned to 160, and an 8-byte checksum follows
    device = 2 * 2 * 2 * 4 * 16 * 4  # float32
    want = {"none": 160 + device + 8, "int8": 160 + 2 * 2 * 2 * 4 * 2 + device // 4 + 8}
    for codec, lmdb in want.items():
        engine = Engine(micro_model(seed=1), micro_cache_config(lmdb_dir=str(tmp_path / codec),
                                                                codec=codec))  # fmt: skip
        with TestClient(create_app(engine, ServerConfig(served_model_name="micro"))) as client:
            capacity = client.get("/health").json()["capacity"]
            samples = scrape(client)
        assert capacity == {
            "device": {"bytes_per_block": device, "blocks_per_gb": 1e9 / device},
            "lmdb": {"bytes_per_block": lmdb, "blocks_per_gb": 1e9 / lmdb},
        }
        for tier, size in (("device", device), ("lmdb", lmdb)):
            assert value(samples, "kvstore_tier_block_bytes", tier=tier) == size
            assert value(samples, "kvstore_tier_blocks_per_gb", tier=tier) == 1e9 / size
    assert want["none"] / want["int8"] > 2.6  # a quarter of the payload; the header stays
