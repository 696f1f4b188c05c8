"""The tier-flow replay: spill-tier models, one replica's flow, and its invariants."""

from pathlib import Path

import numpy as np
import pytest
from bench_helpers import traces
from hypothesis import given, settings

from bench.hitrate import replay
from bench.hitrate.fleet import FleetConfig, replay_fleet
from bench.hitrate.keysets import FifoSet, LruSet, UnboundedSet, make_keyset
from bench.hitrate.offline import infinite_hits
from bench.hitrate.tiers import Replica, TierConfig, block_requests
from bench.traces import BlockTrace, from_chains, load_trace
from kvstore.index.policies import POLICIES

MOONCAKE_FIXTURE = Path(__file__).resolve().parents[2] / "bench" / "fixtures"
MOONCAKE_FIXTURE = MOONCAKE_FIXTURE / "conversation_mooncake.jsonl"


def fixture_head(requests: int = 300) -> BlockTrace:
    trace = load_trace(MOONCAKE_FIXTURE)
    return from_chains([trace.request(r) for r in range(requests)], block_tokens=512)


def roomy_device(trace: BlockTrace) -> int:
    """A device that can always take a whole prompt: a match that ends inside a node locks
    that node's whole run (at most a prompt long), so twice the longest prompt."""
    return max(1, 2 * int(np.diff(trace.offsets).max()))


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# --- spill-tier models ---------------------------------------------------------------------
def test_memory_is_lru_refreshed_by_reads_past_a_gap_but_not_by_writes():
    memory = make_keyset("memory", 3, 100)
    assert isinstance(memory, LruSet)
    memory.put([1, 2, 3])
    assert memory.run(ids(9, 1)) == 0  # a miss first; 1 is still refreshed
    memory.put([2])  # present: skipped, not refreshed
    memory.put([4])  # evicts the least recent: 2
    assert list(memory.order) == [3, 1, 4]
    assert memory.run(ids(3, 1, 4, 2)) == 3


def test_redis_is_lru_refreshed_by_reads_and_by_writes_of_present_keys():
    redis = make_keyset("redis", 3, 100)
    redis.put([1, 2, 3])
    redis.put([1])  # SET NX of a present key still touches it
    redis.put([4])
    assert list(redis.order) == [3, 1, 4]


def test_lmdb_is_fifo_and_evicts_down_to_its_low_water_mark_in_batches():
    lmdb = make_keyset("lmdb", 18, 100)  # low water 16 entries, batches of 2
    assert isinstance(lmdb, FifoSet)
    lmdb.put(list(range(18)))
    assert lmdb.run(ids(0, 1, 2)) == 3  # reads refresh nothing
    lmdb.put([50])  # 18 + 1 > 18: delete the oldest down to 16 - 1, then write
    assert list(lmdb.queue) == [*range(3, 18), 50]
    lmdb.put([60, 61, 62])  # two batches: [60, 61] fits (18), [62] evicts down to 15
    assert list(lmdb.queue) == [*range(6, 18), 50, 60, 61, 62]
    assert lmdb.run(ids(5, 6)) == 0


def test_a_tier_as_large_as_the_trace_never_evicts():
    tier = make_keyset("memory", 5, 5)
    assert isinstance(tier, UnboundedSet)
    tier.put([0, 1, 2, 3, 4])
    tier.put([0, 1])
    assert (len(tier), tier.run(ids(0, 1, 2, 3, 4))) == (5, 5)


@pytest.mark.parametrize(
    ("spill", "message"),
    [
        ((("disk", 5),), "unknown tier 'disk'"),
        ((("redis", 5), ("memory", 5)), "fastest first"),
        ((("memory", 0),), "memory capacity must be an int >= 1"),
    ],
)
def test_tier_config_says_what_to_fix(spill, message):
    with pytest.raises(ValueError, match=message):
        TierConfig(10, spill)


def test_tier_config_takes_the_cache_config_defaults_and_overrides():
    config = TierConfig(10, (("memory", 5), ("lmdb", 5), ("redis", 5)), (("lmdb", "selective"),))
    assert config.write_policies == {
        "memory": "write-back",
        "lmdb": "selective",
        "redis": "write-through",
    }
    with pytest.raises(ValueError, match="write policy for 'redis'"):
        TierConfig(10, (("memory", 5),), (("redis", "off"),))
    with pytest.raises(ValueError, match="choose from"):
        TierConfig(10, (("memory", 5),), (("memory", "sometimes"),))


# --- one replica's flow --------------------------------------------------------------------
def serve_all(trace: BlockTrace, replica: Replica) -> list[list[int]]:
    return [replica.serve(req) for req in block_requests(trace)]


def test_device_evictions_are_written_back_and_promoted_on_a_later_request():
    trace = from_chains([[0, 1], [2, 3], [0, 1], [2, 3]])
    replica = Replica(TierConfig(2, (("memory", 10),)), "lru", trace.num_unique)
    assert serve_all(trace, replica) == [[0, 0], [0, 0], [0, 2], [0, 2]]
    assert sorted(replica.index.all_block_ids()) == [2, 3]
    assert replica.stores[0].run(ids(0, 1, 2, 3)) == 4


def test_promotion_is_capped_by_the_device_room_and_only_what_fits_is_stored():
    # device of 3 blocks, lmdb write-through: request 2 gets [0, 1, 2] from lmdb, which fills
    # the device; its 2 further blocks are computed but cannot be stored, nor written
    trace = from_chains([[0, 1, 2], [3, 4, 5], [0, 1, 2, 6, 7], [0, 1, 2, 6]])
    replica = Replica(TierConfig(3, (("lmdb", 50),)), "lru", trace.num_unique)
    assert serve_all(trace, replica) == [[0, 0], [0, 0], [0, 3], [3, 0]]
    assert replica.stores[0].run(ids(0, 1, 2, 6)) == 3  # block 6 was never written


def test_a_slower_tier_hit_fills_the_faster_write_through_tiers():
    shared = {"redis": make_keyset("redis", 50, 10)}
    config = TierConfig(4, (("lmdb", 50), ("redis", 50)))
    first, second = (Replica(config, "lru", 10, shared) for _ in range(2))
    requests = list(block_requests(from_chains([[0, 1, 2], [0, 1, 2, 3]])))
    assert first.serve(requests[0]) == [0, 0, 0]  # computed: written to lmdb and redis
    assert second.serve(requests[1]) == [0, 0, 3]  # redis gives 3 ...
    assert second.stores[0].run(ids(0, 1, 2, 3)) == 4  # ... and fills this lmdb, with block 3


def test_selective_tiers_get_blocks_once_they_reach_the_device_hit_threshold():
    trace = from_chains([[0, 1], [0, 1, 2], [0, 1, 2]])
    config = TierConfig(10, (("memory", 50),), (("memory", "selective"),))
    replica = Replica(config, "lru", trace.num_unique)
    memory = replica.stores[0]
    replica.serve(next(block_requests(from_chains([[0, 1]]))))
    assert len(memory) == 0
    assert serve_all(trace, replica) == [[2, 0], [2, 0], [3, 0]]
    # 0 and 1 reached 2 device hits at request 1 and were written; 2 has one hit
    assert (len(memory), memory.run(ids(0, 1, 2))) == (2, 2)


# --- invariants ----------------------------------------------------------------------------
def fleet_hits(trace: BlockTrace, config: FleetConfig) -> list[int]:
    hits: list[int] = []
    replay_fleet(trace, config, on_request=lambda r, i, h: hits.append(sum(h)))
    return hits


def plain_hits(trace: BlockTrace, policy: str, capacity: int) -> list[int]:
    hits: list[int] = []
    replay(trace, policy, capacity, on_request=lambda r, hit, index: hits.append(hit))
    return hits


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("capacity", [1, 3, 6, 20])
@settings(max_examples=25, derandomize=True, deadline=None)
@given(trace=traces())
def test_one_replica_with_only_a_device_tier_equals_the_plain_replay(policy, capacity, trace):
    config = FleetConfig(TierConfig(capacity), policy)
    assert fleet_hits(trace, config) == plain_hits(trace, policy, capacity)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_one_replica_device_only_equals_the_plain_replay_on_the_fixture(policy):
    trace = fixture_head()
    config = FleetConfig(TierConfig(120), policy)
    assert fleet_hits(trace, config) == plain_hits(trace, policy, 120)


SPILL_WRITES = [
    ("memory", "write-back"),
    ("memory", "write-through"),
    ("lmdb", "write-through"),
    ("lmdb", "write-back"),
    ("redis", "write-through"),
    ("redis", "write-back"),
]


@pytest.mark.parametrize(("tier", "write"), SPILL_WRITES)
@settings(max_examples=30, derandomize=True, deadline=None)
@given(trace=traces())
def test_a_spill_tier_holding_every_block_brings_the_total_to_the_infinite_rate(tier, write, trace):
    # the cache stores (and writes) only what its device took
    spill = ((tier, max(1, trace.num_unique)),)
    config = FleetConfig(TierConfig(roomy_device(trace), spill, ((tier, write),)), "lru")
    assert sum(fleet_hits(trace, config)) == infinite_hits(trace)


@pytest.mark.parametrize(("tier", "write"), SPILL_WRITES)
def test_a_spill_tier_holding_every_block_reaches_the_infinite_rate_on_the_fixture(tier, write):
    trace = fixture_head()
    spill = ((tier, trace.num_unique),)
    config = FleetConfig(TierConfig(roomy_device(trace), spill, ((tier, write),)), "lru")
    assert sum(fleet_hits(trace, config)) == infinite_hits(trace)


def test_with_a_device_shorter_than_a_prompt_its_tail_is_never_stored():
    trace = from_chains([[0, 1, 2, 3], [0, 1, 2, 3]])
    config = FleetConfig(TierConfig(2, (("redis", 10),)), "lru")
    assert fleet_hits(trace, config) == [0, 2]
    assert infinite_hits(trace) == 4


def test_a_match_ending_inside_a_run_locks_only_the_matched_blocks():
    # request 1 hits block 0 of the run [0, 1]; the hit splits the run and locks block 0
    # alone, so block 1 (the unused tail) makes room for block 2: request 2 hits 2 blocks
    trace = from_chains([[0, 1], [0, 2], [0, 2]])
    config = FleetConfig(TierConfig(2, (("memory", 10),)), "lru")
    assert fleet_hits(trace, config) == [0, 1, 2]
