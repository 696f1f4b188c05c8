"""The index's block events and the routing cost built on them (kvstore/fleet/events.py,
kvstore/fleet/routing.py): one implementation for `kvstore router` and the replay's kv route."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.fleet.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockSet,
    BlockStored,
    EventSink,
    MediaBlocks,
)
from kvstore.fleet.routing import (
    ReplicaLoad,
    RoutingConfig,
    choose_replica,
    load_cost,
    within_key_bound,
)
from kvstore.index import RadixIndex

BS = 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Recorder(EventSink):
    def __init__(self) -> None:
        self.events: list = []

    def emit(self, event) -> None:
        self.events.append(event)


def index_keys(index: RadixIndex) -> set[bytes]:
    return {e for s in index.snapshot() for e in s.block_hashes}


def held(*ids: int) -> BlockSet:
    blocks = BlockSet()
    blocks.apply(BlockStored([key(i) for i in ids], None, [0] * BS * len(ids), BS))
    return blocks


def media(device=(), host=(), disk=(), redis: BlockSet | None = None) -> MediaBlocks:
    """A replica's blocks per medium; `redis` a set shared with other replicas."""
    tiers = {"HOST": held(*host), "DISK": held(*disk)}
    return MediaBlocks(held(*device), tiers | ({"REDIS": redis} if redis is not None else {}))


def test_events_rebuild_the_index_exactly_through_splits_and_evictions():
    sink = Recorder()
    index = RadixIndex(2, "lru", sink)
    index.insert([key(i) for i in range(4)], np.arange(8), [0, 1, 2, 3])
    index.insert([key(0), key(1), key(9)], np.array([0, 1, 2, 3, 7, 7]), [0, 1, 5])  # split
    index.evict(3)
    consumer = BlockSet()
    consumer.apply_all(sink.events)
    assert consumer.blocks == index_keys(index)
    assert len(consumer) == index.num_cached_blocks == 2
    stored = [e for e in sink.events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [4, 1]
    assert stored[1].parent_block_hash == key(1)  # the split point, not the root
    assert stored[0].parent_block_hash is None
    assert stored[1].token_ids == [7, 7]


def test_a_lost_removal_breaks_the_rebuilt_set():
    """The control: the comparison above can fail."""
    sink = Recorder()
    index = RadixIndex(2, "lru", sink)
    index.insert([key(i) for i in range(4)], np.arange(8), [0, 1, 2, 3])
    index.evict(2)
    consumer = BlockSet()
    consumer.apply_all(e for e in sink.events if not isinstance(e, BlockRemoved))
    assert consumer.blocks != index_keys(index)
    assert len(consumer) - index.num_cached_blocks == 2


def test_snapshot_then_replayed_events_converge():
    sink = Recorder()
    index = RadixIndex(1, "lru", sink)
    index.insert([key(1), key(2)], np.array([1, 2]), [0, 1])
    snap = index.snapshot()
    index.evict(1)
    index.insert([key(1), key(3)], np.array([1, 3]), [0, 2])
    consumer = BlockSet()
    consumer.apply_all([AllBlocksCleared(), *snap, *sink.events])  # events before it too
    assert consumer.blocks == index_keys(index) == {key(1), key(3)}


def test_the_replica_holding_the_prefix_wins_at_equal_load():
    keys = [key(i) for i in range(4)]
    choice = choose_replica(
        keys, 4 * BS + 1, BS, [held(0), held(0, 1, 2)], [ReplicaLoad()] * 2, RoutingConfig()
    )
    assert (choice.replica, choice.num_cached_tokens) == (1, 3 * BS)
    # each device block saves its prefill, and is worth device_affinity (1) of one more
    assert choice.costs == [4 * BS + 1 - 2 * BS, 4 * BS + 1 - 6 * BS]
    assert not choice.fallback


def test_a_shared_first_block_does_not_pile_requests_onto_one_replica():
    """Replica 0 holds every prompt's first block; its queue outweighs that overlap (the
    block's prefill and its affinity)."""
    keys = [key(0), key(5)]
    loads = [ReplicaLoad(queued_tokens=2 * BS + 1), ReplicaLoad()]
    choice = choose_replica(keys, 3 * BS, BS, [held(0), BlockSet()], loads, RoutingConfig())
    assert choice.replica == 1
    assert choice.costs == [2 * BS + 2 * BS + 1 - BS, 3 * BS]


def test_running_tokens_weigh_by_the_decode_weight():
    loads = [ReplicaLoad(running_tokens=1000), ReplicaLoad(running_tokens=0)]
    config = RoutingConfig(prefill_weight=1.0, decode_weight=0.1, device_affinity=0.0)
    choice = choose_replica([key(0)], 2 * BS, BS, [held(0), BlockSet()], loads, config)
    assert choice.costs == [BS + 100.0, 2 * BS]
    assert choice.replica == 1


def test_stale_events_fall_back_to_least_loaded():
    loads = [ReplicaLoad(queued_tokens=50), ReplicaLoad(queued_tokens=10)]
    choice = choose_replica([key(0)], 2 * BS, BS, [held(0), None], loads, RoutingConfig())
    assert choice.fallback and choice.replica == 1 and choice.num_cached_tokens == 0


def test_ties_go_to_fewer_routed_then_lower_index():
    loads = [ReplicaLoad(routed=3), ReplicaLoad(routed=1), ReplicaLoad(routed=1)]
    sets = [BlockSet(), BlockSet(), BlockSet()]
    assert choose_replica([], 10, BS, sets, loads, RoutingConfig()).replica == 1


def test_only_candidates_are_chosen_and_never_the_last_token():
    keys = [key(0)]
    sets = [held(0), held(0)]
    choice = choose_replica(keys, BS, BS, sets, [ReplicaLoad()] * 2, RoutingConfig(), [1])
    assert choice.replica == 1
    assert choice.num_cached_tokens == BS - 1  # all held: the last token is computed again
    with pytest.raises(ValueError, match="no replica"):
        choose_replica(keys, BS, BS, sets, [ReplicaLoad()] * 2, RoutingConfig(), [])


@pytest.mark.parametrize("weights", [(-1.0, 0.1), (1.0, float("nan")), (True, 0.1)])
def test_bad_weights_are_refused(weights):
    with pytest.raises(ValueError, match="weight"):
        RoutingConfig(*weights)


def test_a_keys_replica_takes_it_while_its_load_is_within_the_slack_of_the_least():
    """Load cost: prefill_weight x queued + decode_weight x running, whatever it holds."""
    config = RoutingConfig(key_load_slack=100.0)
    loads = [ReplicaLoad(queued_tokens=61, running_tokens=400), ReplicaLoad(queued_tokens=1)]
    assert [load_cost(load, config) for load in loads] == [101.0, 1.0]
    assert within_key_bound(0, loads, [0, 1], config)  # 101 <= 1 + 100
    assert not within_key_bound(0, [loads[0], ReplicaLoad()], [0, 1], config)  # 101 > 0 + 100
    assert within_key_bound(0, [loads[0], ReplicaLoad()], [0], config)  # the only candidate


# --- tier-aware cost -----------------------------------------------------------------------
FOUR = [key(i) for i in range(4)]  # a prompt of 4 whole blocks and one more token
N = 4 * BS + 1
DEFAULTS = RoutingConfig()
HOST, DISK, REDIS = DEFAULTS.host_block_cost, DEFAULTS.disk_block_cost, DEFAULTS.redis_block_cost
AFFINITY = DEFAULTS.device_affinity


def test_a_replica_whose_host_tier_holds_the_prefix_beats_a_cold_one():
    loads = [ReplicaLoad(routed=0), ReplicaLoad(routed=5)]  # the tie-break favours the cold one
    choice = choose_replica(FOUR, N, BS, [media(), media(host=(0, 1, 2))], loads, RoutingConfig())
    assert (choice.replica, choice.num_cached_tokens) == (1, 3 * BS)
    assert choice.costs == [N, N - 3 * BS + 3 * HOST * BS]


def test_a_device_hit_beats_the_same_prefix_in_host_memory():
    loads = [ReplicaLoad(routed=0), ReplicaLoad(routed=5)]
    blocks = [media(host=(0, 1, 2)), media(device=(0, 1, 2))]
    choice = choose_replica(FOUR, N, BS, blocks, loads, RoutingConfig())
    assert choice.replica == 1
    assert choice.costs == [N - 3 * BS + 3 * HOST * BS, N - 3 * BS - 3 * AFFINITY * BS]


def test_each_block_counts_at_its_cheapest_medium_and_the_walk_stops_at_the_first_gap():
    # block 0 on the device (and in Redis), 1 in host memory and LMDB, 2 in LMDB; 3 nowhere,
    # so nothing after it counts even where a tier holds it
    shared = held(0, 4)
    blocks = [media(device=(0,), host=(1,), disk=(1, 2), redis=shared)]
    keys = [*FOUR, key(4)]
    choice = choose_replica(keys, 5 * BS + 1, BS, blocks, [ReplicaLoad()], RoutingConfig())
    assert choice.num_cached_tokens == 3 * BS
    assert choice.costs == [5 * BS + 1 - 3 * BS + (HOST + DISK - AFFINITY) * BS]


def test_a_shared_redis_counts_for_every_replica_that_reads_it():
    # replicas 0 and 1 read one Redis holding the prefix; replica 2 reads none. Replica 0 is
    # busier, so the prefix goes to replica 1, read from the shared tier
    shared = held(0, 1, 2)
    blocks = [media(redis=shared), media(redis=shared), media()]
    loads = [ReplicaLoad(queued_tokens=10), ReplicaLoad(routed=3), ReplicaLoad()]
    choice = choose_replica(FOUR, N, BS, blocks, loads, RoutingConfig())
    tier = N - 3 * BS + 3 * REDIS * BS
    assert choice.costs == [tier + 10, tier, N]
    assert (choice.replica, choice.num_cached_tokens) == (1, 3 * BS)


def test_stale_events_still_fall_back_to_least_loaded_with_tiers_known():
    loads = [ReplicaLoad(queued_tokens=50), ReplicaLoad(queued_tokens=10)]
    choice = choose_replica(FOUR, N, BS, [media(host=(0, 1, 2, 3)), None], loads, RoutingConfig())
    assert choice.fallback and choice.replica == 1 and choice.num_cached_tokens == 0
    assert choice.costs == [N + 50, N + 10]


def test_with_device_blocks_only_the_cost_is_the_device_only_cost():
    # the live router knows device blocks only: a BlockSet, or a MediaBlocks without tiers,
    # prices them exactly as the cost without tiers did (prefill of the rest plus load)
    loads = [ReplicaLoad(queued_tokens=7), ReplicaLoad(running_tokens=30)]
    plain = choose_replica(FOUR, N, BS, [held(0), held(0, 1)], loads, RoutingConfig())
    tiered = [MediaBlocks(held(0)), MediaBlocks(held(0, 1))]
    assert choose_replica(FOUR, N, BS, tiered, loads, RoutingConfig()) == plain
    assert plain.costs == [N - BS + 7 - AFFINITY * BS, N - 2 * BS + 3.0 - 2 * AFFINITY * BS]


def test_device_affinity_keeps_a_conversation_on_its_device_against_a_shared_tier_copy():
    """Both replicas read the prefix (one on its device, one from a shared Redis); the device
    holder is busier by more than Redis saves over the device, less than the affinity adds."""
    shared = held(0, 1, 2)
    blocks = [media(device=(0, 1, 2), redis=shared), media(redis=shared)]
    busy = (1 - REDIS) * 3 * BS + 1  # more than the Redis copy costs over the device one
    loads = [ReplicaLoad(queued_tokens=int(busy)), ReplicaLoad()]
    assert choose_replica(FOUR, N, BS, blocks, loads, RoutingConfig()).replica == 0
    no_affinity = RoutingConfig(device_affinity=0.0)
    assert choose_replica(FOUR, N, BS, blocks, loads, no_affinity).replica == 1


def test_a_tier_priced_as_recomputing_its_blocks_is_as_good_as_cold():
    blocks, loads = [media(), media(host=(0, 1, 2))], [ReplicaLoad()] * 2
    choice = choose_replica(FOUR, N, BS, blocks, loads, RoutingConfig(host_block_cost=1.0))
    assert choice.costs == [N, N] and choice.replica == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"host_block_cost": 1.5}, "host_block_cost must be <= 1"),
        ({"disk_block_cost": -0.1}, "disk_block_cost must be a finite number >= 0"),
        ({"redis_block_cost": float("inf")}, "redis_block_cost must be a finite number"),
        ({"host_block_cost": "0.1"}, "host_block_cost must be a number"),
    ],
)
def test_bad_block_costs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**kwargs)


def test_a_medium_the_cost_does_not_know_is_refused():
    with pytest.raises(ValueError, match="unknown spill medium 'CPU'"):
        MediaBlocks(BlockSet(), {"CPU": BlockSet()})
    with pytest.raises(ValueError, match="no load cost for medium 'GPU'"):
        RoutingConfig().block_cost("GPU")


def test_a_replicas_measured_tier_cost_replaces_the_configured_one():
    """Two replicas read one shared Redis holding the prompt; one measured its link at the
    cost of computing (1.0), the other at 0.01: the same blocks, priced by each replica's
    own figure (the configured 0.5 is a guess for a replica that published none)."""
    shared = held(0, 1, 2, 3)
    blocks = [media(redis=shared), media(redis=shared)]
    keys, loads, config = [key(i) for i in range(4)], [ReplicaLoad()] * 2, RoutingConfig()
    alike = choose_replica(keys, 5 * BS, BS, blocks, loads, config)
    assert alike.replica == 0 and alike.costs[0] == alike.costs[1]  # the tie-break: index
    measured = [{"REDIS": 1.0}, {"REDIS": 0.01}]
    choice = choose_replica(keys, 5 * BS, BS, blocks, loads, config, None, measured)
    assert choice.replica == 1
    assert choice.costs == [BS + 4 * BS * 1.0, BS + 4 * BS * 0.01]  # the last block + loads
    partly = choose_replica(keys, 5 * BS, BS, blocks, loads, config, None, [{}, {"HOST": 0.0}])
    assert partly.costs[0] == partly.costs[1] == BS + 4 * BS * 0.5  # Redis: still configured
