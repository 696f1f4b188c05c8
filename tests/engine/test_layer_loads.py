"""Layer-by-layer loads from the spill tiers (kvstore/tiers/layered.py): a tier hit reaches the
pool one layer at a time while the forward runs, and the forward's output is used only once
every promised block verified. Against real stores (host memory, LMDB, a private Redis) and
the micro model, each output is held to the no-cache reference and to the whole-load path's.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest
import torch
from engine_helpers import close_to_reference, micro_cache_config, micro_model, reference_logits

from engine.loop.engine import Engine
from engine.loop.graph import GraphConfig
from engine.loop.request import SamplingParams
from kvstore.config import ConfigError
from kvstore.entry import ExpectedEntry
from kvstore.tiers import layered

PROMPT = list(range(3, 44))  # 41 tokens: 10 whole blocks of 4 looked up
CACHED = 40


@pytest.fixture(scope="module")
def model():
    return micro_model()


@pytest.fixture(scope="module")
def reference(model) -> torch.Tensor:
    return reference_logits(model, PROMPT)[-1]


def tier_config(tier: str, tmp_path, redis_url: str | None, **extra: object):
    if tier == "memory":
        values = {"memory_cache_gb": 0.05, "memory_write_policy": "write-through"}
    elif tier == "lmdb":
        values = {"lmdb_dir": str(tmp_path / "lmdb")}
    else:
        values = {"redis_url": redis_url}
    return micro_cache_config(**values, **{"layer_loads": True, **extra})


@pytest.fixture(params=["memory", "lmdb", "redis"])
def tier(request) -> str:
    return request.param


@pytest.fixture
def redis_url(request, tier) -> Iterator[str | None]:
    if tier != "redis":
        yield None
        return
    yield request.getfixturevalue("redis_server").url


def only_in_tier(engine: Engine) -> None:
    """Store the prompt, then keep it only in the spill tier."""
    engine.prefill_logits(PROMPT)
    engine.on_loop(lambda: (engine.cache.flush(), engine.cache.evict_device()))


def tier_logits(model, config) -> tuple[torch.Tensor, dict, dict]:
    """(Decode graphs off: a whole load's one-token forward would replay a graph, a layered
    one's runs eager, and the two agree within the contract, not bit for bit.)"""
    with Engine(model, config, graph_config=GraphConfig("off")) as engine:
        only_in_tier(engine)
        pre = engine.prefill(PROMPT)
        engine.cache.check_integrity()
        metrics = engine.cache.metrics
        counts = {
            name: metrics.get(name)
            for name in ("layer_load_retries_total", "promoted_blocks_total")
        }
        return pre.logits, pre.cached_by_tier, counts


@pytest.mark.parametrize("chunk_blocks", [1, 2])
def test_a_layered_load_gives_the_whole_loads_output_exactly(
    model, reference, tier, redis_url, tmp_path, chunk_blocks
):
    config = tier_config(tier, tmp_path, redis_url, chunk_blocks=chunk_blocks)
    logits, by_tier, counts = tier_logits(model, config)
    assert by_tier == {tier: CACHED}
    assert counts == {"layer_load_retries_total": 0, "promoted_blocks_total": CACHED // 4}
    assert close_to_reference(logits, reference)
    whole = tier_config(tier, tmp_path / "whole", redis_url, chunk_blocks=chunk_blocks)
    whole_logits, whole_by_tier, _ = tier_logits(
        model, dataclasses.replace(whole, layer_loads=False)
    )
    assert whole_by_tier == {tier: CACHED}
    assert torch.equal(logits, whole_logits)  # the same bytes in the pool, the same forward


def damage_layer(engine: Engine, tier: str, entry: int, layer: int) -> None:
    """Flip bytes of one layer of the `entry`-th block's entry in the tier (its header and
    checksum stay: only the checksum over the payload can see it)."""
    store = engine.cache.tiers.stores[0]
    key = engine.cache.block_keys(PROMPT)[entry]
    expected = engine.cache.scopes.default.expected
    value = bytearray(store.get_many([key])[0])
    layer_bytes = engine.cache.pool.layout.bytes_per_block // engine.cache.pool.layout.num_layers
    at = expected.header_bytes + layer * layer_bytes
    value[at : at + layer_bytes] = bytes(b ^ 0x5A for b in value[at : at + layer_bytes])
    store.delete([key])
    store.put_many([(key, bytes(value))])


def test_a_damaged_layer_is_a_miss_from_its_block_and_the_request_recomputes(
    model, reference, tier, redis_url, tmp_path
):
    with Engine(model, tier_config(tier, tmp_path, redis_url)) as engine:
        only_in_tier(engine)
        damage_layer(engine, tier, entry=3, layer=1)
        pre = engine.prefill(PROMPT)
        metrics = engine.cache.metrics
        # the layered try promised 10 blocks and 3 verified: those went to the index, the
        # damaged entry was deleted, and the retry (whole loads) found the 3 on the device
        assert metrics.get("layer_load_retries_total") == 1
        assert metrics.get("verify_failures_total", reason="checksum", tier=tier) == 1
        assert pre.cached_by_tier == {"device": 12}
        assert close_to_reference(pre.logits, reference)
        engine.cache.check_integrity()


def test_control_the_damaged_layer_changes_the_output_when_its_checksum_is_not_checked(
    model, reference, tier, redis_url, tmp_path, monkeypatch
):
    monkeypatch.setattr(ExpectedEntry, "checksum_ok", lambda self, data: True)
    with Engine(model, tier_config(tier, tmp_path, redis_url)) as engine:
        only_in_tier(engine)
        damage_layer(engine, tier, entry=3, layer=1)
        pre = engine.prefill(PROMPT)
        assert pre.cached_by_tier == {tier: CACHED}
        assert not close_to_reference(pre.logits, reference)


def test_a_redis_that_dies_during_the_load_is_a_miss_and_the_request_recomputes(
    model, reference, redis_server, monkeypatch
):
    config = micro_cache_config(redis_url=redis_server.url, breaker_failures=1, layer_loads=True)
    with Engine(model, config) as engine:
        only_in_tier(engine)
        store = engine.cache.tiers.stores[0]
        read = store.read_prefix

        def read_after_kill(keys):  # the count answered: the server dies before the read
            if threading.current_thread().name.startswith("kvstore-layers"):
                redis_server.kill()
            return read(keys)

        monkeypatch.setattr(store, "read_prefix", read_after_kill)
        pre = engine.prefill(PROMPT)
        assert engine.cache.metrics.get("layer_load_retries_total") == 1
        assert pre.cached_tokens == 0
        assert close_to_reference(pre.logits, reference)
        engine.cache.check_integrity()


def prefill_in_thread(engine: Engine) -> tuple[threading.Thread, list]:
    """The prompt stored and held in the tier only, then its prefill started in a thread
    (its result lands in the list)."""
    only_in_tier(engine)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(engine.prefill(PROMPT)))
    thread.start()
    return thread, result


def on_loader() -> bool:
    return threading.current_thread().name.startswith("kvstore-layers")


def test_the_forward_computes_early_layers_while_later_ones_load(model, tmp_path, monkeypatch):
    """The loader copies every layer (the forward claims none) and is held at layer 1: the
    forward must reach layer 1's wait, having computed layer 0, while layer 1 is loading."""
    release, reached = threading.Event(), threading.Event()
    claim, copy, wait = layered.LayerLoad.claim, layered.LayerLoad.copy, layered.LayerLoad.wait

    def loader_claims(self, up_to=None):
        return claim(self, up_to) if on_loader() else None

    def held_copy(self, layer, *stream):
        if layer == 1:
            release.wait(timeout=30)
        copy(self, layer, *stream)

    def noted_wait(self, layer):
        if layer == 1:
            reached.set()
        wait(self, layer)

    monkeypatch.setattr(layered.LayerLoad, "claim", loader_claims)
    monkeypatch.setattr(layered.LayerLoad, "copy", held_copy)
    monkeypatch.setattr(layered.LayerLoad, "wait", noted_wait)
    with Engine(model, tier_config("memory", tmp_path, None)) as engine:
        thread, result = prefill_in_thread(engine)
        assert reached.wait(timeout=30)  # layer 0 computed, layer 1 still loading
        assert not result
        release.set()
        thread.join(timeout=30)
        assert result[0].cached_by_tier == {"memory": CACHED}
        assert engine.cache.metrics.get("layer_load_retries_total") == 0


def test_the_forward_copies_the_layers_the_loader_has_not_claimed(
    model, reference, tmp_path, monkeypatch
):
    """A loader held before it claims a layer (no core to spare): the forward copies each
    layer itself and finishes; the load's checksums still decide before it is used."""
    release, copiers = threading.Event(), []
    prepare, copy = layered.LayerLoad.prepare, layered.LayerLoad.copy

    def held_prepare(self, layout, header_bytes):
        prepare(self, layout, header_bytes)
        release.wait(timeout=30)  # the layers are claimable, the loader claims none yet

    def noted_copy(self, layer, *stream):
        copiers.append(on_loader())
        copy(self, layer, *stream)

    monkeypatch.setattr(layered.LayerLoad, "prepare", held_prepare)
    monkeypatch.setattr(layered.LayerLoad, "copy", noted_copy)
    with Engine(model, tier_config("memory", tmp_path, None)) as engine:
        thread, result = prefill_in_thread(engine)
        thread.join(timeout=5)
        assert thread.is_alive()  # the forward ran; settling waits for the checksums
        assert copiers == [False, False]  # both layers, copied by the forward's thread
        release.set()
        thread.join(timeout=30)
        assert result[0].cached_by_tier == {"memory": CACHED}
        assert close_to_reference(result[0].logits, reference)
        assert engine.cache.metrics.get("layer_load_retries_total") == 0


def test_batched_requests_over_a_tier_hit_match_the_reference_and_a_damaged_one_recomputes(
    model, tmp_path
):
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    prompts = [PROMPT, [*PROMPT[:36], 90, 91, 92, 93, 94]]
    with Engine(model, micro_cache_config(memory_cache_gb=0.05, layer_loads=True)) as engine:
        expected = [r.output_token_ids for r in engine.generate(prompts, params)]
        engine.on_loop(lambda: (engine.cache.flush(), engine.cache.evict_device()))
        engine.on_loop(lambda: engine.cache.flush())
        damage_layer(engine, "memory", entry=5, layer=0)
        results = engine.generate(prompts, params)  # queued at once: admitted in one step
        assert [r.output_token_ids for r in results] == expected
        metrics = engine.cache.metrics
        assert metrics.get("layer_load_retries_total") == 1
        assert metrics.get("verify_failures_total", reason="checksum", tier="memory") == 1
        engine.cache.check_integrity()


def hold_loads_until_the_forward_waits(monkeypatch) -> None:
    """The loader copies nothing until a forward asks for layer 0."""
    asked = threading.Event()
    copy, wait = layered.LayerLoad.copy, layered.LayerLoad.wait

    def held_copy(self, layer, *stream):
        if on_loader():
            asked.wait(timeout=30)
        copy(self, layer, *stream)

    def noted_wait(self, layer):
        asked.set()
        wait(self, layer)

    monkeypatch.setattr(layered.LayerLoad, "copy", held_copy)
    monkeypatch.setattr(layered.LayerLoad, "wait", noted_wait)


def test_a_one_token_step_over_a_tier_hit_reads_the_loaded_layers(model, monkeypatch):
    """All but the last token in a tier: the first step feeds that token alone, which looks
    like a decode step; the decode mirror must not be built from the pool before the
    layers arrive."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    with Engine(model, micro_cache_config(memory_cache_gb=0.05, layer_loads=True)) as engine:
        (first,) = engine.generate([PROMPT], params)
        engine.on_loop(lambda: (engine.cache.flush(), engine.cache.evict_device()))
        engine.on_loop(lambda: engine.cache.flush())
        engine.on_loop(lambda: engine.cache.pool.kv.fill_(7.0))  # no stale K/V to read
        hold_loads_until_the_forward_waits(monkeypatch)
        (again,) = engine.generate([PROMPT], params)
        assert engine.cache.metrics.get("layer_load_retries_total") == 0
    assert again.cached_by_tier == {"memory": CACHED}
    assert again.output_token_ids == first.output_token_ids


def test_a_whole_prompt_tier_hit_with_a_damaged_layer_is_settled_before_its_step(model):
    """Every block of the prompt in a tier: its step re-runs the last token, whose K/V goes
    to the scratch block other rows read as padding, so the load settles before the
    forward; a damaged layer is then a retry before anything ran on it."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    prompt = PROMPT[:40]
    with Engine(model, micro_cache_config(memory_cache_gb=0.05, layer_loads=True)) as engine:
        (first,) = engine.generate([prompt], params)
        engine.on_loop(lambda: (engine.cache.flush(), engine.cache.evict_device()))
        engine.on_loop(lambda: engine.cache.flush())
        damage_layer(engine, "memory", entry=6, layer=1)
        (again,) = engine.generate([prompt], params)
        assert engine.cache.metrics.get("layer_load_retries_total") == 1
    assert again.cached_by_tier == {"device": 24}
    assert again.output_token_ids == first.output_token_ids


def test_by_default_tier_hits_are_read_whole_on_any_device(model, reference, tmp_path):
    config = micro_cache_config(memory_cache_gb=0.05, memory_write_policy="write-through")
    logits, by_tier, counts = tier_logits(model, config)
    assert by_tier == {"memory": CACHED}
    assert counts["promoted_blocks_total"] == CACHED // 4
    assert close_to_reference(logits, reference)
    with Engine(model, config) as engine:
        assert engine.cache.promoter.loader is None


def test_layer_loads_refuses_what_is_not_a_bool():
    with pytest.raises(ConfigError, match="layer_loads"):
        micro_cache_config(layer_loads="yes")


@pytest.mark.parametrize("shared", ["lmdb", "redis"])  # host memory is one process's
def test_a_layered_reader_with_another_secret_deletes_nothing_and_counts_it_once(
    model, reference, shared, request, tmp_path
):
    """Entries written under one secret are foreign to a reader with another: a miss, kept,
    and recorded once, whether the load compared headers at lookup time (LMDB) or on the
    loader (Redis: promised by its key count, then the retry's whole read records it)."""
    url = request.getfixturevalue("redis_server").url if shared == "redis" else None
    config = tier_config(shared, tmp_path, url)
    with Engine(model, config) as writer:
        only_in_tier(writer)
        keys = writer.cache.block_keys(PROMPT)
    with Engine(model, dataclasses.replace(config, secret="another")) as reader:
        pre = reader.prefill(PROMPT)
        metrics = reader.cache.metrics
        assert metrics.get("verify_failures_total", reason="secret", tier=shared) == 1
        assert metrics.get("layer_load_retries_total") == (1 if shared == "redis" else 0)
        assert reader.cache.tiers.stores[0].count_prefix(keys) == 10  # nothing deleted
    assert pre.cached_tokens == 0
    assert close_to_reference(pre.logits, reference)


def test_a_truncated_entry_is_deleted_by_a_layered_reader(
    model, reference, tier, redis_url, tmp_path
):
    with Engine(model, tier_config(tier, tmp_path, redis_url)) as engine:
        only_in_tier(engine)
        store, keys = engine.cache.tiers.stores[0], engine.cache.block_keys(PROMPT)
        value = store.get_many([keys[4]])[0]
        store.delete([keys[4]])
        store.put_many([(keys[4], value[:-100])])
        pre = engine.prefill(PROMPT)
        metrics = engine.cache.metrics
        assert metrics.get("verify_failures_total", reason="truncated", tier=tier) == 1
        assert store.count_prefix(keys) == 4  # the damaged entry deleted
    # Redis promised all 10 by key count: the 4 that verified are on the device for the retry
    assert pre.cached_by_tier == ({"device": 16} if tier == "redis" else {tier: 16})
    assert close_to_reference(pre.logits, reference)


@pytest.mark.parametrize("deployment", ["redis_cluster", "redis_tls"])
def test_a_layered_load_from_redis_cluster_or_tls_gives_the_whole_loads_output(
    model, reference, deployment, request, tmp_path
):
    url = request.getfixturevalue(deployment).url
    layered_logits, by_tier, counts = tier_logits(model, tier_config("redis", tmp_path, url))
    assert by_tier == {"redis": CACHED}
    assert counts == {"layer_load_retries_total": 0, "promoted_blocks_total": CACHED // 4}
    whole = tier_config("redis", tmp_path, url, layer_loads=False)
    whole_logits, _, _ = tier_logits(model, whole)
    assert torch.equal(layered_logits, whole_logits)
    assert close_to_reference(layered_logits, reference)


def test_an_embedders_layered_lookup_loads_the_same_kv_once_settled(model, tmp_path):
    """`PrefixCache.lookup(layered=True)`: `load` settles first, then gathers exactly what a
    whole lookup gathers; `release` leaves the accounting whole."""
    with Engine(model, tier_config("lmdb", tmp_path, None)) as engine:
        only_in_tier(engine)
        cache = engine.cache

        def lookup_and_load(layered: bool):
            hit = cache.lookup(PROMPT, layered=layered)
            pending = hit.pending is not None
            kv = cache.load(hit)
            cache.release(hit)
            cache.check_integrity()
            cache.evict_device()
            return pending, kv

        layered_pending, layered_kv = engine.on_loop(lambda: lookup_and_load(True))
        whole_pending, whole_kv = engine.on_loop(lambda: lookup_and_load(False))
    assert (layered_pending, whole_pending) == (True, False)
    assert layered_kv.num_tokens == whole_kv.num_tokens == CACHED
    for (k1, v1), (k2, v2) in zip(layered_kv.layers, whole_kv.layers, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
