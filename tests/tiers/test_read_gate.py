"""The read gate (kvstore/tiers/gate.py): a tier is read only when fetching its blocks beats
computing their tokens. The rules on synthetic figures, then a real redis-server behind a
throttled loopback proxy, read by the micro model's engine: skipped once it is measured
slower than the prefill, with the same output as the read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import redis
import torch

from bench.throttle import ThrottledProxy
from engine.loop.engine import Engine
from engine.loop.graph import GraphConfig
from kvstore.metrics import CacheMetrics
from kvstore.tiers.gate import MIN_LOSS_S, MIN_PREFILL_TOKENS, ReadGate

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from engine_helpers import (
    close_to_reference,
    micro_cache_config,
    micro_model,
    reference_logits,
)

MB = 1_000_000
PROMPT = list(range(3, 44))  # 41 tokens: 10 whole blocks of 4 looked up
UNRELATED = list(range(100, 200))  # 100 tokens computed: the engine's prefill figure
RATE = 200_000  # bytes/s through the proxy: 10 blocks of 1 KiB take ~50 ms


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def gate(clock: Clock | None = None, enabled: bool = True) -> ReadGate:
    """1 MB blocks of 16 tokens; 1600 tokens/s computes a block in 10 ms."""
    g = ReadGate(MB, 16, CacheMetrics(), enabled, reprobe_s=30.0, clock=clock or Clock())
    g.observe_prefill(1600, 1.0)
    return g


def test_a_tier_nothing_measured_is_read():
    g = ReadGate(MB, 16, CacheMetrics())
    assert g.allows("redis", 100)
    g.observe_read("redis", 1, 10.0)  # 0.1 MB/s, but the prefill is not measured yet
    assert g.allows("redis", 100)
    assert gate().allows("redis", 100)  # the prefill is, the tier is not


def test_a_tier_slower_than_the_prefill_is_skipped_and_its_blocks_counted():
    g = gate()
    g.observe_read("redis", 10, 1.0)  # 10 MB/s: 100 ms a block against 10 ms computing it
    g.observe_read("lmdb", 10, 0.01)  # 1 GB/s: 1 ms a block
    assert not g.allows("redis", 1)
    assert g.allows("lmdb", 1000)
    g.skipped("redis", 7)
    assert g.metrics.get("tier_read_skipped_total", tier="redis") == 1
    assert g.metrics.get("tier_read_skipped_blocks_total", tier="redis") == 7
    snapshot = g.snapshot()
    assert snapshot["bandwidth_bytes_per_s"] == {"redis": 10 * MB, "lmdb": 1000 * MB}
    assert snapshot["prefill_tokens_per_s"] == 1600
    assert snapshot["block_compute_s"] == pytest.approx(0.01)


def test_a_read_that_loses_less_than_the_minimum_is_still_made():
    g = gate()
    g.observe_read("redis", 100, 1.05)  # 10.5 ms a block: 0.5 ms more than computing it
    under = int(MIN_LOSS_S / 0.0005)  # blocks whose loss stays under MIN_LOSS_S
    assert g.allows("redis", under - 1)
    assert not g.allows("redis", under + 1)


def test_one_slow_read_among_fast_ones_changes_nothing():
    g = gate()
    for _ in range(4):
        g.observe_read("redis", 10, 0.01)
    g.observe_read("redis", 10, 10.0)  # a stall: 1000 times slower
    assert g.allows("redis", 1000)
    for _ in range(2):  # three slow reads of five: the tier is slow now
        g.observe_read("redis", 10, 10.0)
    assert not g.allows("redis", 1)


def test_a_skipped_tier_is_read_again_after_the_reprobe_time():
    clock = Clock()
    g = gate(clock)
    assert g.allows("redis", 1)  # unmeasured: read at t=0
    g.observe_read("redis", 10, 1.0)
    clock.now = 29.0
    assert not g.allows("redis", 1)
    clock.now = 30.0
    assert g.allows("redis", 1)  # measured again
    assert not g.allows("redis", 1)  # and not once more before it is


def test_a_disabled_gate_reads_every_tier_and_still_measures():
    g = gate(enabled=False)
    g.observe_read("redis", 10, 100.0)
    assert g.allows("redis", 10_000)
    assert g.snapshot()["bandwidth_bytes_per_s"] == {"redis": 0.1 * MB}


def test_a_prefill_too_small_to_time_is_not_measured():
    g = ReadGate(MB, 16, CacheMetrics())
    g.observe_prefill(MIN_PREFILL_TOKENS - 1, 1.0)
    assert g.snapshot()["prefill_tokens_per_s"] is None
    g.observe_prefill(MIN_PREFILL_TOKENS, 1.0)
    assert g.snapshot()["prefill_tokens_per_s"] == MIN_PREFILL_TOKENS


def test_the_throttled_proxy_passes_every_byte_both_ways(redis_server):
    value = bytes(range(256)) * 1000
    with ThrottledProxy("127.0.0.1", redis_server.port, 10 * MB) as proxy:
        client = redis.Redis.from_url(proxy.url())
        client.set("gate-test", value)
        assert client.get("gate-test") == value
        client.close()


# --- through the engine: a real Redis, 200 kB/s away ------------------------------------------


@pytest.fixture(scope="module")
def model():
    return micro_model()


def only_in_redis(model, url: str) -> None:
    """The prompt's 10 blocks in Redis (a writer with a direct connection)."""
    with Engine(model, micro_cache_config(redis_url=url)) as writer:
        writer.prefill_logits(PROMPT)
        writer.cache.flush()


def prefill_twice(model, url: str, **config: object):
    """The prompt read once from Redis (the tier not measured yet), the device copy dropped,
    then prefilled again; and the skip counters."""
    cache_config = micro_cache_config(redis_url=url, lookup_deadline_ms=5000.0, **config)
    with Engine(model, cache_config, graph_config=GraphConfig("off")) as engine:
        engine.prefill(UNRELATED)
        first = engine.prefill(PROMPT)
        engine.on_loop(engine.cache.evict_device)
        second = engine.prefill(PROMPT)
        engine.cache.check_integrity()
        get = engine.cache.metrics.get
        skipped = [get(f"tier_read_skipped{s}_total", tier="redis") for s in ("", "_blocks")]
        return first, second, skipped, engine.cache.stats()["read_gate"]


@pytest.mark.parametrize("layer_loads", [False, True])
def test_a_redis_slower_than_the_prefill_is_skipped_with_the_same_output(
    model, redis_server, layer_loads
):
    only_in_redis(model, redis_server.url)
    reference = reference_logits(model, PROMPT)[-1]
    with ThrottledProxy("127.0.0.1", redis_server.port, RATE) as proxy:
        first, second, skipped, figures = prefill_twice(model, proxy.url(), layer_loads=layer_loads)
    assert first.cached_by_tier == {"redis": 40}
    assert second.cached_tokens == 0
    assert skipped == [1, 10]
    assert figures["prefill_tokens_per_s"] is not None
    assert figures["bandwidth_bytes_per_s"]["redis"] < RATE * 1.5  # what the proxy let by
    for pre in (first, second):
        assert close_to_reference(pre.logits, reference)
    assert torch.argmax(first.logits) == torch.argmax(second.logits)


def test_control_with_the_gate_off_the_slow_redis_is_read_again(model, redis_server):
    only_in_redis(model, redis_server.url)
    with ThrottledProxy("127.0.0.1", redis_server.port, RATE) as proxy:
        first, second, skipped, _ = prefill_twice(model, proxy.url(), tier_read_gate=False)
    assert first.cached_by_tier == second.cached_by_tier == {"redis": 40}
    assert skipped == [0, 0]
