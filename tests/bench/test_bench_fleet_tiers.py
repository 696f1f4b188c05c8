"""The replay's `kv` route sees every tier: each replica's host memory and LMDB publish their
block events per medium, a shared Redis publishes one set every replica reads, and the
route prices each prefix block by where it would come from (kvstore/fleet/routing.py)."""

from bench.hitrate.fleet import FleetConfig, ServiceModel, replay_fleet
from bench.hitrate.keysets import LruSet
from bench.hitrate.tiers import TierConfig
from bench.traces import from_chains
from kvstore.fleet.events import BlockRemoved, BlockSet, BlockStored
from kvstore.fleet.routing import RoutingConfig

IDLE = ServiceModel(0.0, 0.0)  # no request waits: routing is by the cache alone

# A1, B1 and C1 share nothing; A2 is A1's next turn. Two replicas of 3 device blocks: A1 goes
# to replica 0, B1 to 1, C1 to 0 (fewer routed, then the lower index), where it evicts A1's
# blocks from the device into the host-memory tier (write-back)
CHAINS = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2, 9]]


def replay(spill, routing: RoutingConfig | None = None):
    config = FleetConfig(TierConfig(3, spill), "lru", 2, "kv", routing or RoutingConfig(), IDLE)
    placed: list[tuple[int, list[int]]] = []
    result = replay_fleet(
        from_chains(CHAINS, block_tokens=4),
        config,
        on_request=lambda r, i, hits: placed.append((i, hits)),
    )
    return placed, result


def test_the_next_turn_goes_to_the_replica_whose_host_memory_holds_its_history():
    placed, result = replay((("memory", 6),))
    assert placed == [(0, [0, 0]), (1, [0, 0]), (0, [0, 0]), (0, [0, 3])]
    assert result.tier_block_hits == {"device": 0, "memory": 3}
    assert result.routed == [3, 1]


def test_a_router_blind_to_host_memory_sends_it_to_the_cold_replica():
    # a host block priced as computing it again is what a device-only router assumes: both
    # replicas look cold, and A2 goes to the one with fewer requests, losing its history
    placed, result = replay((("memory", 6),), RoutingConfig(host_block_cost=1.0))
    assert placed == [(0, [0, 0]), (1, [0, 0]), (0, [0, 0]), (1, [0, 0])]
    assert result.tier_block_hits == {"device": 0, "memory": 0}
    assert result.routed == [2, 2]


def test_a_private_lmdb_holding_the_history_draws_the_next_turn_too():
    # LMDB is written through: replica 0's holds what it computed, A1's blocks included
    placed, result = replay((("lmdb", 9),))
    assert placed == [(0, [0, 0]), (1, [0, 0]), (0, [0, 0]), (0, [0, 3])]
    assert result.tier_block_hits == {"device": 0, "lmdb": 3}


def test_host_memory_serves_before_lmdb_when_both_hold_the_history():
    placed, _ = replay((("memory", 6), ("lmdb", 9)))
    assert placed[-1] == (0, [0, 3, 0])


def test_a_shared_redis_makes_every_replica_warm_and_load_decides():
    # Redis holds A1's blocks for both replicas: neither device does, so the costs tie and A2
    # goes to the replica with fewer requests, reading its history from the shared tier
    placed, result = replay((("redis", 20),))
    assert placed[-1] == (1, [0, 3])
    assert result.tier_block_hits == {"device": 0, "redis": 3}
    assert result.routed == [2, 2]


def test_a_tier_reports_each_writes_evictions_then_its_stores():
    sink = BlockSet()
    events: list = []
    sink.emit = events.append  # type: ignore[method-assign]
    tier = LruSet("memory", 2, 10, refresh_on_write=False, events=sink)
    tier.put([1, 2, 3])  # 1 is stored, then evicted by 3: in neither event
    tier.put([1])  # evicts 2
    tier.put([1, 3])  # both present: no event
    key = [b.to_bytes(16, "little") for b in range(4)]
    assert events == [
        BlockStored([key[2], key[3]], None, [2, 3], 1),
        BlockRemoved([key[2]]),
        BlockStored([key[1]], None, [1], 1),
    ]
    rebuilt = BlockSet()
    rebuilt.apply_all(events)
    assert rebuilt.blocks == {key[3], key[1]}
