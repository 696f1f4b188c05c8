"""The layer under every adapter, with no stack installed: stack entries (the entry format
without token ids), stack namespaces and keys, `contains_many` on every store, and
`BlockStore` over memory, LMDB, Redis and Redis Cluster."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from adapter_helpers import corrupt, count, verify_failures

from hashing import BlockHasher, InvalidNamespace, Namespace, StackHasher, StackNamespace
from kvstore.adapters.blocks import BlockStore, PutBlock, config_from_settings
from kvstore.config import CacheConfig, ConfigError
from kvstore.entry import BlockEntry, EntryError, decode_entry, encode_entry
from kvstore.entry.stack import decode_stack_entry, encode_stack_entry
from kvstore.stores import LmdbStore, MemoryStore, RedisStore, make_stores

NS = StackNamespace("vllm", "org/model", '{"chunk_bytes": 4096}', "bfloat16")
PAYLOAD = bytes(range(256)) * 16


def entry_parts(namespace: StackNamespace = NS, stack_key: bytes = b"block-0") -> dict:
    hasher = StackHasher(namespace)
    return {"namespace": hasher.root, "key": hasher.key(stack_key),
            "digest": hasher.digest(stack_key)}  # fmt: skip


# --- stack entries -----------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["none", "lz4", "zstd"])
def test_a_stack_entry_round_trips_bit_exact(codec):
    parts = entry_parts()
    data = encode_stack_entry(**parts, payload=PAYLOAD, num_tokens=16, meta=b"lmc", codec=codec)
    entry = decode_stack_entry(data, **parts, payload_bytes=len(PAYLOAD))
    assert bytes(entry.payload) == PAYLOAD
    assert (entry.meta, entry.num_tokens, entry.key) == (b"lmc", 16, parts["key"])
    assert len(data) < len(PAYLOAD) or codec == "none"  # the payload compresses


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: d[:50], "truncated"),
        (lambda d: b"XXXX" + d[4:], "magic"),
        (lambda d: d[:-20] + bytes([d[-20] ^ 1]) + d[-19:], "checksum"),
    ],
)
def test_a_damaged_stack_entry_is_rejected_with_its_reason(damage, reason):
    parts = entry_parts()
    data = encode_stack_entry(**parts, payload=PAYLOAD)
    decode_stack_entry(data, **parts)  # control: the intact entry verifies
    with pytest.raises(EntryError) as e:
        decode_stack_entry(damage(data), **parts)
    assert e.value.reason == reason


def test_a_stack_entry_proves_namespace_key_digest_and_size():
    parts = entry_parts()
    data = encode_stack_entry(**parts, payload=PAYLOAD)
    other_ns = entry_parts(StackNamespace("vllm", "org/other", "{}", "bfloat16"))
    other_key = entry_parts(stack_key=b"block-1")
    cases = [({**parts, "namespace": other_ns["namespace"]}, {}, "namespace"),
             ({**parts, "key": other_key["key"]}, {}, "key"),
             ({**parts, "digest": other_key["digest"]}, {}, "digest"),
             (parts, {"payload_bytes": 10}, "shape")]  # fmt: skip
    for expected, extra, reason in cases:
        with pytest.raises(EntryError) as e:
            decode_stack_entry(data, **expected, **extra)
        assert e.value.reason == reason


def test_model_entries_and_stack_entries_never_read_as_each_other():
    ns = Namespace("m", "float32", 1, 1, 4, 16)
    hasher = BlockHasher(ns)
    tokens = np.arange(16, dtype=np.uint32)
    key, digest = hasher.hash_blocks(tokens)[0], hasher.digest_blocks(tokens)[0]
    kv = torch.zeros(1, 2, 1, 16, 4)
    model = encode_entry(BlockEntry(ns.root(), key, digest, hasher.root, tokens, kv))
    with pytest.raises(EntryError, match="not a stack block entry") as e:
        decode_stack_entry(model, namespace=ns.root(), key=key, digest=digest)
    assert e.value.reason == "kind"
    stack = encode_stack_entry(ns.root(), key, digest, PAYLOAD)
    with pytest.raises(EntryError, match="a stack block entry") as e:
        decode_entry(stack, namespace=ns.root(), key=key, digest=digest, dtype=torch.float32)
    assert e.value.reason == "kind"


def test_bad_input_is_a_typed_error_saying_what_to_fix():
    with pytest.raises(EntryError, match="codec must be one of"):
        encode_stack_entry(**entry_parts(), payload=PAYLOAD, codec="fp16")
    with pytest.raises(InvalidNamespace, match="model must be a non-empty printable str"):
        StackNamespace("vllm", "", "{}", "bfloat16")
    with pytest.raises(ValueError, match=r"a stack key must be 1\.\.4096 bytes"):
        StackHasher(NS).key(b"")


def test_keys_differ_by_namespace_tenant_and_secret_digests_by_secret():
    tenant = StackNamespace(NS.stack, NS.model, NS.layout, NS.dtype, tenant="org-1")
    assert StackHasher(NS).key(b"k") != StackHasher(tenant).key(b"k")
    assert StackHasher(NS).digest(b"k") != StackHasher(NS, b"another-secret").digest(b"k")
    assert StackHasher(NS).key(b"k") == StackHasher(NS, b"another-secret").key(b"k")


# --- stores ------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "lmdb", "redis"])
def store(request, tmp_path):
    if request.param == "memory":
        made = MemoryStore(1 << 20)
    elif request.param == "lmdb":
        made = LmdbStore(str(tmp_path / "lmdb"), 1 << 20)
    else:
        made = RedisStore(request.getfixturevalue("redis_server").url, "contains")
    yield made
    made.close()


def test_contains_many_answers_per_key_in_one_call(store):
    keys = [bytes([i]) * 16 for i in range(4)]
    store.put_many([(keys[0], b"a"), (keys[2], b"c")])
    assert store.contains_many(keys) == [True, False, True, False]
    assert store.count_prefix(keys) == 1
    assert store.contains_many([]) == []


# --- BlockStore --------------------------------------------------------------------------


def block_store(settings: dict, namespace: StackNamespace = NS) -> BlockStore:
    return BlockStore(config_from_settings(settings, env={}), namespace)


def test_a_block_store_round_trips_and_counts_on_every_tier(tier):
    blocks = block_store(tier.settings)
    keys = [b"k0", b"k1", b"k2"]
    assert blocks.put([PutBlock(k, PAYLOAD[i:] + PAYLOAD[:i], 16) for i, k in enumerate(keys)])
    got = blocks.get([*keys, b"absent"], payload_bytes=len(PAYLOAD))
    assert [bytes(b.payload) for b in got[:3]] == [PAYLOAD[i:] + PAYLOAD[:i] for i in range(3)]
    assert got[3] is None and {b.tier for b in got[:3]} == {tier.name}
    assert blocks.contains([b"k1", b"absent"]) == [True, False]
    assert blocks.count_prefix([b"k0", b"k1", b"absent", b"k2"]) == 2
    assert count(blocks, "adapter_writes_blocks_total", tier=tier.name) == 3
    assert count(blocks, "adapter_hits_blocks_total", tier=tier.name) == 3
    assert count(blocks, "adapter_lookups_blocks_total") == 6
    assert count(blocks, "adapter_reads_blocks_total") == 4
    assert blocks.stats()["metrics"]["hit_rate"] == 3 / 4
    corrupt(blocks, b"k2")
    assert blocks.get([b"k2"]) == [None]
    assert verify_failures(blocks, tier.name, "checksum") == 1
    blocks.close()


def test_another_tenant_never_reads_a_block(tmp_path):
    settings = {"lmdb_dir": str(tmp_path / "shared"), "lmdb_map_size_gb": 0.01}
    writer = block_store(settings)
    writer.put([PutBlock(b"k", PAYLOAD)])
    org2 = StackNamespace(NS.stack, NS.model, NS.layout, NS.dtype, "org-2")
    tenant = block_store({**settings, "tenant_salt": "org-2"}, org2)
    assert tenant.get([b"k"]) == [None] and tenant.contains([b"k"]) == [False]
    for blocks in (writer, tenant):
        blocks.close()


def test_two_secrets_on_one_tier_keep_each_others_blocks(tier, caplog):
    """A process with another secret reads the blocks as foreign misses and never deletes
    them; both announce it; a damaged block is still deleted (the control)."""
    (store,) = make_stores(config_from_settings(tier.settings, env={}), NS.id)
    a = BlockStore(config_from_settings({**tier.settings, "secret": "a"}, env={}), NS, [store])
    b = BlockStore(config_from_settings({**tier.settings, "secret": "b"}, env={}), NS, [store])
    a.put([PutBlock(b"a%d" % i, PAYLOAD) for i in range(3)])
    b.put([PutBlock(b"b%d" % i, PAYLOAD) for i in range(3)])
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers"):
        for reader, other in ((a, b"b"), (b, b"a")):
            keys = [other + b"%d" % i for i in range(3)]
            assert reader.contains(keys) == [True] * 3  # the entries are there ...
            assert reader.get(keys) == [None] * 3  # ... but not this secret's
            assert reader.get(keys[:1]) == [None]  # twice: still there, still a miss
            assert verify_failures(reader, store.name, "secret") == 4
            assert reader.metrics.get("foreign_entries_total", tier=store.name,
                                      reason="secret") == 4  # fmt: skip
    assert [bytes(x.payload) for x in a.get([b"a0", b"a1", b"a2"])] == [PAYLOAD] * 3
    assert [bytes(x.payload) for x in b.get([b"b0", b"b1", b"b2"])] == [PAYLOAD] * 3
    stats = store.stats()
    assert (stats.verify_failures, stats.foreign) == (8, 8)
    announced = [r for r in caplog.records if "secret (KVSTORE_SECRET) differs" in r.message]
    assert len(announced) == 2  # once per reader
    corrupt(a, b"a0")
    assert a.get([b"a0"]) == [None] and verify_failures(a, store.name, "checksum") == 1
    assert a.contains([b"a0", b"a1"]) == [False, True]  # only the damaged one is gone
    a.close()


def test_a_slower_tier_fills_the_faster_one(tmp_path):
    lmdb = {"lmdb_dir": str(tmp_path / "l"), "lmdb_map_size_gb": 0.01}
    block_store(lmdb).put([PutBlock(b"k", PAYLOAD)])
    both = block_store({**lmdb, "memory_cache_gb": 0.01})
    assert [b.tier for b in both.get([b"k"])] == ["lmdb"]
    assert [b.tier for b in both.get([b"k"])] == ["memory"]
    assert count(both, "adapter_writes_blocks_total", tier="memory") == 1
    both.close()


def test_a_write_policy_off_tier_is_read_but_never_written(tmp_path):
    blocks = block_store({"memory_cache_gb": 0.01, "memory_write_policy": "off",
                          "lmdb_dir": str(tmp_path / "l"), "lmdb_map_size_gb": 0.01})  # fmt: skip
    blocks.put([PutBlock(b"k", PAYLOAD)])
    assert [s.stats().entries for s in blocks.stores] == [0, 1]
    blocks.close()


def test_a_block_store_on_redis_cluster(redis_cluster):
    blocks = block_store({"redis_url": redis_cluster.url})
    keys = [b"c%d" % i for i in range(12)]  # spread over the cluster's slots
    assert blocks.put([PutBlock(k, PAYLOAD[: 64 + i]) for i, k in enumerate(keys)])
    assert [len(b.payload) for b in blocks.get(keys)] == [64 + i for i in range(12)]
    assert blocks.count_prefix(keys) == 12
    blocks.close()


def test_settings_are_converted_and_bad_ones_are_typed_errors(tmp_path):
    config = config_from_settings({"memory_cache_gb": "0.01", "breaker_failures": "2"}, env={})
    assert (config.memory_cache_gb, config.breaker_failures) == (0.01, 2)
    env = {"KVSTORE_REDIS_URL": "redis://127.0.0.1:6390/0", "KVSTORE_SECRET": "s3"}
    assert config_from_settings({}, env=env).secret == "s3"
    with pytest.raises(ConfigError, match=r"lmdb_path: .* unknown; did you mean 'lmdb_dir'\?") as e:
        config_from_settings({"lmdb_path": str(tmp_path)}, env={})
    assert "device_blocks" not in str(e.value)  # only what an adapter takes is listed
    with pytest.raises(ConfigError, match=r"block_size: .* does nothing in an adapter"):
        config_from_settings({"memory_cache_gb": 1, "block_size": 4}, env={})
    with pytest.raises(ConfigError, match=r"unix://.*rediss\+cluster://"):
        config_from_settings({"redis_url": "http://127.0.0.1:6379"}, env={})
    with pytest.raises(ConfigError, match="codec: adapters store raw bytes"):
        config_from_settings({"memory_cache_gb": 1, "codec": "fp16"}, env={})
    with pytest.raises(ConfigError, match="set at least one of memory_cache_gb"):
        config_from_settings({}, env={})
    assert isinstance(config, CacheConfig)
