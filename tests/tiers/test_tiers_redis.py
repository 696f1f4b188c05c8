"""RedisStore against real redis-server processes: single, ACL/password, TLS, cluster;
failures (killed, paused) read as misses, the breaker opens and recovers."""

from __future__ import annotations

import itertools
import time
import uuid
from pathlib import Path

import pytest
import torch
from redis.cluster import key_slot
from tier_helpers import assert_same_entry, make_chain, namespace, run_in_threads, wait_for

from kvstore.config import CacheConfig
from kvstore.stores import CircuitBreaker, LmdbStore, MemoryStore, RedisStore, make_stores


def ns_id() -> str:
    return uuid.uuid4().hex[:16]


def round_trip(store: RedisStore, dtype: torch.dtype = torch.float32, n: int = 4):
    """Write n entries, write them again (skipped), count and read them back; the chain."""
    chain = make_chain(namespace(dtype), num_blocks=n, seed=n)
    assert store.put_many(chain.items) == n
    assert store.put_many(chain.items) == 0  # SET NX: present keys are skipped
    assert store.count_prefix(chain.keys) == n
    for i, data in enumerate(store.get_many(chain.keys)):
        assert data is not None
        assert_same_entry(chain.decode(i, data), chain.entries[i])
    return chain


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_redis_store_round_trips_entries_bit_exact(redis_server, dtype: torch.dtype) -> None:
    with RedisStore(redis_server.url, ns_id()) as store:
        round_trip(store, dtype)
        s = store.stats()
        assert (s.hits, s.misses, s.writes, s.errors, s.breaker_state) == (4, 0, 4, 0, "closed")


def test_redis_keys_are_namespaced_hex_with_optional_ttl(redis_server) -> None:
    chain = make_chain(namespace(), num_blocks=2)
    ns = ns_id()
    with RedisStore(redis_server.url, ns, ttl_s=100) as store:
        store.put_many(chain.items)
    admin = redis_server.client()
    expected = sorted(f"kvs:{ns}:{k.hex()}".encode() for k in chain.keys)
    assert sorted(admin.keys("*")) == expected
    assert 0 < admin.ttl(expected[0]) <= 100
    with RedisStore(redis_server.url, ns) as store:
        store.put_many([(b"\x01" * 16, b"v")])
    assert admin.ttl(f"kvs:{ns}:{'01' * 16}") == -1  # no TTL configured: no expiry


def test_redis_count_prefix_and_get_prefix_stop_at_the_first_gap(redis_server) -> None:
    chain = make_chain(namespace(), num_blocks=5)
    with RedisStore(redis_server.url, ns_id()) as store:
        store.put_many(chain.items)
        assert store.delete([chain.keys[3], b"\x00" * 16]) == 1
        assert store.count_prefix(chain.keys) == 3
        assert store.get_prefix(chain.keys) == chain.encoded[:3]
        assert store.reject(chain.keys[:1]) == 1
        assert store.count_prefix(chain.keys) == 0
        s = store.stats()
        assert (s.hits, s.misses, s.verify_failures) == (3, 2, 1)


def test_redis_clear_removes_only_its_namespace(redis_server) -> None:
    chain = make_chain(namespace(), num_blocks=3)
    a, b = RedisStore(redis_server.url, ns_id()), RedisStore(redis_server.url, ns_id())
    a.put_many(chain.items)
    b.put_many(chain.items[:2])
    assert a.clear() == 3
    assert (a.count_prefix(chain.keys), b.count_prefix(chain.keys)) == (0, 2)
    a.close()
    b.close()


def test_redis_password_in_url(redis_server_factory) -> None:
    password = "p@ss:w/rd"
    server = redis_server_factory("--requirepass", password, password=password)
    assert "%40" in server.url  # quoted in the URL
    with RedisStore(server.url, ns_id()) as store:
        round_trip(store)
    wrong = server.url.replace("p%40ss", "nope")
    with RedisStore(wrong, ns_id()) as store:
        chain = make_chain(namespace(), num_blocks=2)
        assert store.put_many(chain.items) == 0  # rejected login: dropped, not raised
        assert store.get_many(chain.keys) == [None, None]
        s = store.stats()
        assert (s.dropped_writes, s.misses, s.errors) == (2, 2, 2)


def test_redis_acl_user_in_url(redis_server_factory) -> None:
    acl = ("--user", "default", "off", "--user", "kv", "on", ">secret", "~kvs:*", "+@all")
    server = redis_server_factory(*acl, username="kv", password="secret")
    with RedisStore(server.url, ns_id()) as store:
        round_trip(store)
        assert store.clear() == 4


def deploy_acl_rules(password: str) -> list[str]:
    """The rules of docs/DEPLOY.md's `ACL SETUSER kvstore ...` (its indented lines), as written."""
    lines = (Path(__file__).resolve().parents[2] / "docs" / "DEPLOY.md").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if "ACL SETUSER kvstore " in line)
    block = itertools.takewhile(str.strip, lines[first:])  # up to the blank line
    words = " ".join(block).split()
    return [">" + password if w == ">PASSWORD" else w for w in words[3:]]


def test_the_acl_user_deploy_md_gives_runs_every_call_a_store_makes(redis_server_factory):
    rules = deploy_acl_rules("secret")
    assert "-@all" in rules  # what follows are the only commands allowed
    users = ("--user", "default", "off", "--user", "kvstore", *rules)
    server = redis_server_factory(*users, username="kvstore", password="secret")
    with RedisStore(server.url, ns_id()) as store:
        chain = round_trip(store)  # SET NX, EXISTS, MGET
        assert store.retain(chain.keys, 60.0) == 4  # PEXPIRE GT, PTTL
        assert store.count_entries() == 4  # SCAN
        assert store.delete(chain.keys[:1]) == 1  # DEL
        assert store.probe() is None  # PING
        assert store.clear() == 3  # SCAN, UNLINK
        assert store.stats().errors == 0


@pytest.mark.parametrize("refused", [("+pexpire",), ("+pexpire", "+pttl")])
def test_a_retention_the_acl_refuses_is_counted_as_an_error_not_silent(
    redis_server_factory, refused
):
    rules = [r for r in deploy_acl_rules("secret") if r not in refused]
    users = ("--user", "default", "off", "--user", "kvstore", *rules)
    server = redis_server_factory(*users, username="kvstore", password="secret")
    with RedisStore(server.url, ns_id()) as store:
        chain = round_trip(store)
        assert store.stats().errors == 0
        assert store.retain(chain.keys, 60.0) == 0
        assert store.stats().errors == 1


def test_redis_over_tls(redis_tls) -> None:
    assert redis_tls.url.startswith("rediss://")
    with RedisStore(redis_tls.url, ns_id()) as store:
        round_trip(store)
    # the same, with the CA given as a keyword instead of a query parameter
    base = redis_tls.url.split("?")[0]
    with RedisStore(base, ns_id(), ssl_ca_certs=redis_tls.tls["ca"]) as store:
        round_trip(store, torch.bfloat16)


def test_redis_tls_rejects_an_unknown_certificate_authority(redis_tls) -> None:
    base = redis_tls.url.split("?")[0]
    with RedisStore(base, ns_id()) as store:  # system CAs do not know the test CA
        chain = make_chain(namespace(), num_blocks=1)
        assert store.put_many(chain.items) == 0
        s = store.stats()
        assert (s.dropped_writes, s.errors) == (1, 1)


def test_redis_cluster_gets_keys_spanning_slots_in_one_call(redis_cluster) -> None:
    chain = make_chain(namespace(), num_blocks=24)
    with RedisStore(redis_cluster.url, "cluster-spread") as store:
        store.clear()  # the cluster is shared by the session
        assert store.cluster
        assert store.put_many(chain.items) == 24
        values = store.get_many(chain.keys)
        assert values == chain.encoded
        assert store.count_prefix(chain.keys) == 24
        for i, data in enumerate(values):
            assert_same_entry(chain.decode(i, data), chain.entries[i])
        # the keys really are spread: each master holds exactly the keys of its slots
        owned = _keys_by_node(redis_cluster, [store._rkey(k) for k in chain.keys])
        # fixed keys and the even slot split of --cluster create: a deterministic spread
        assert sorted(len(keys) for keys in owned.values()) == [5, 9, 10]
        for node in redis_cluster.nodes:
            with node.client() as c:
                assert sum(c.exists(k) for k in owned[node.port]) == len(owned[node.port])
        assert store.delete(chain.keys[:5]) == 5
        assert store.count_prefix(chain.keys) == 0
        assert store.clear() == 19
        assert store.stats().errors == 0


def _keys_by_node(cluster, rkeys: list[bytes]) -> dict[int, list[bytes]]:
    with cluster.nodes[0].client() as c:
        slots = c.execute_command("CLUSTER SLOTS")  # [[start, end, [host, port, id]], ...]
    owned: dict[int, list[bytes]] = {port: [] for port in cluster.ports}
    for key in rkeys:
        slot = key_slot(key)
        port = next(int(r[2][1]) for r in slots if r[0] <= slot <= r[1])
        owned[port].append(key)
    return owned


def test_killed_redis_reads_as_misses_and_the_breaker_opens_then_recovers(redis_server) -> None:
    chain = make_chain(namespace(), num_blocks=3)
    breaker = CircuitBreaker(failures=3, cooldown_s=0.3)
    store = RedisStore(redis_server.url, ns_id(), deadline_ms=200, breaker=breaker)
    assert store.put_many(chain.items) == 3
    redis_server.kill()
    for _ in range(3):
        assert store.get_many(chain.keys) == [None] * 3
    assert breaker.state == "open"
    # open: no call reaches the network, nothing raises
    assert store.count_prefix(chain.keys) == 0
    assert store.put_many(chain.items) == 0
    assert store.get_many(chain.keys) == [None] * 3
    s = store.stats()
    assert (s.errors, s.misses, s.dropped_writes, s.breaker_state) == (3, 12, 3, "open")
    redis_server.restart()  # empty after the restart
    time.sleep(0.3)
    assert store.stats().breaker_state == "half_open"
    assert store.put_many(chain.items) == 3  # the probe succeeds: closed again
    assert breaker.state == "closed"
    assert store.get_many(chain.keys) == chain.encoded
    s = store.stats()
    assert (s.errors, s.hits, s.writes) == (3, 3, 6)
    store.close()


def test_an_outage_is_told_once_per_breaker_state_change(redis_server, caplog) -> None:
    chain = make_chain(namespace(), num_blocks=2)
    breaker = CircuitBreaker(failures=2, cooldown_s=0.2, name="redis")
    store = RedisStore(redis_server.url, ns_id(), deadline_ms=200, breaker=breaker)
    refused = f"ConnectionError: Error 111 connecting to 127.0.0.1:{redis_server.port}."
    with caplog.at_level("WARNING", logger="kvstore.tiers"):
        redis_server.kill()
        for _ in range(4):  # two failures open it, two calls miss without a network call
            assert store.get_many(chain.keys) == [None, None]
        redis_server.restart()
        wait_for(lambda: breaker.state == "half_open")
        assert store.put_many(chain.items) == 2  # the probe succeeds
    assert [r.getMessage() for r in caplog.records] == [
        f"redis tier: circuit breaker open after 2 failures in a row (last: {refused} "
        "Connection refused.): lookups miss the tier and writes to it are dropped for 0.2 s, "
        "then one call probes it",
        "redis tier: circuit breaker half-open: one call probes the tier",
        "redis tier: circuit breaker closed: the tier answers again",
    ]
    store.close()


def test_probe_says_why_a_server_cannot_be_reached_without_its_password(
    redis_server_factory,
) -> None:
    server = redis_server_factory("--requirepass", "pw-secret", password="pw-secret")
    with RedisStore(server.url, ns_id()) as store:
        assert store.probe() is None
        server.kill()
        assert store.probe() == (
            f"redis://:***@127.0.0.1:{server.port}/0: ConnectionError: Error 111 connecting to "
            f"127.0.0.1:{server.port}. Connection refused."
        )
        assert (store.stats().errors, store.breaker.state) == (0, "closed")  # only a check


def test_paused_redis_times_out_to_misses_and_recovers(redis_server) -> None:
    chain = make_chain(namespace(), num_blocks=2)
    store = RedisStore(redis_server.url, ns_id(), deadline_ms=100, breaker=CircuitBreaker(3, 5))
    store.put_many(chain.items)
    redis_server.pause()
    try:
        assert store.get_many(chain.keys) == [None, None]
        assert store.count_prefix(chain.keys) == 0
    finally:
        redis_server.resume()
    assert store.get_many(chain.keys) == chain.encoded
    s = store.stats()
    assert (s.errors, s.hits, s.misses, s.breaker_state) == (2, 2, 2, "closed")
    store.close()


def test_maxmemory_eviction_makes_count_prefix_stop_at_the_first_gap(redis_server_factory) -> None:
    server = redis_server_factory("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    ns = namespace(layers=2, kv_heads=2, head_dim=64, block_size=16)  # 32 KiB per entry
    chain = make_chain(ns, num_blocks=128)  # 4 MiB
    with RedisStore(server.url, ns_id()) as store:
        for i in range(0, 128, 8):
            assert store.put_many(chain.items[i : i + 8]) == 8
        admin = server.client()
        admin.config_set("maxmemory", 0)  # freeze: no evictions while the test looks
        info = admin.info()
        assert info["evicted_keys"] == 128 - info["db0"]["keys"]
        exists = [admin.exists(store._rkey(k)) == 1 for k in chain.keys]
        first_gap = exists.index(False)
        assert store.count_prefix(chain.keys) == first_gap
        values = store.get_prefix(chain.keys)
        assert len(values) == first_gap
        for i, data in enumerate(values):
            assert_same_entry(chain.decode(i, data), chain.entries[i])


def test_make_stores_builds_the_configured_tiers_fastest_first(redis_server, tmp_path) -> None:
    ns = namespace()
    assert make_stores(CacheConfig(), ns) == []
    config = CacheConfig(
        memory_cache_gb=0.001,
        lmdb_dir=str(tmp_path / "lmdb"),
        lmdb_map_size_gb=0.01,
        redis_url=redis_server.url,
        redis_ttl_s=60,
        lookup_deadline_ms=150,
        breaker_failures=2,
        breaker_cooldown_s=1.5,
    )
    stores = make_stores(config, ns)
    assert [type(s) for s in stores] == [MemoryStore, LmdbStore, RedisStore]
    memory, lmdb_store, redis_store = stores
    assert memory.capacity_bytes == int(0.001 * 2**30)
    assert lmdb_store.stats().capacity_bytes == int(0.01 * 2**30) // 4096 * 4096
    assert redis_store.prefix == f"kvs:{ns.id}:".encode()
    assert (redis_store.ttl_s, redis_store.deadline_ms) == (60, 150)
    assert (redis_store.breaker.failures, redis_store.breaker.cooldown_s) == (2, 1.5)
    round_trip(redis_store)
    for store in stores:
        store.close()


def test_redis_store_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="url"):
        RedisStore("http://localhost", "ns")
    with pytest.raises(ValueError, match="namespace_id"):
        RedisStore("redis://localhost", "a b")
    with pytest.raises(ValueError, match="ttl_s"):
        RedisStore("redis://localhost", "ns", ttl_s=0)


def test_redis_store_serves_concurrent_threads(redis_server) -> None:
    chains = [make_chain(namespace(), num_blocks=20, seed=s) for s in range(4)]
    store = RedisStore(redis_server.url, ns_id())
    written = [0] * 4

    def work(t: int) -> None:
        for i in range(0, 20, 4):
            written[t] += store.put_many(chains[t].items[i : i + 4])
            assert store.get_prefix(chains[t].keys) == chains[t].encoded[: i + 4]

    assert run_in_threads(work) == []
    assert written == [20] * 4
    s = store.stats()
    assert (s.writes, s.errors, s.hits, s.misses) == (
        80,
        0,
        4 * (4 + 8 + 12 + 16 + 20),
        4 * (16 + 12 + 8 + 4),
    )
    store.close()
