"""The fault scenarios of `python -m bench faults`, at CI scale, with their must-haves:
no wrong output, no lost entry, every request served, every injected corruption detected."""

from pathlib import Path

import pytest
import torch

from bench.faults.common import Context, FaultOutcome, Scale, micro_model
from bench.faults.outage import redis_outage
from bench.faults.processes import concurrent_writers, killed_writers, leaks
from bench.faults.storage import collisions, corruption, lmdb_full, redis_eviction
from bench.faults.tenants import tenant_isolation
from engine.model.loading import LoadedModel

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

CI = Scale(requests=8, collision_trials=160, leak_requests=160, outage_s=0.5, kill_rounds=3)


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    torch.set_num_threads(1)  # as the bench does: a micro model runs faster on one thread
    return micro_model()


@pytest.fixture
def ctx(model, redis_server, tmp_path: Path) -> Context:
    return Context(model, redis_server, tmp_path, CI)


def assert_must_haves(o: FaultOutcome) -> None:
    assert o.succeeded == o.requests
    assert o.wrong_outputs == 0
    assert o.lost_entries == 0
    assert o.corrupt_detected == o.corrupt_injected


@pytest.mark.parametrize("tier", ["lmdb", "redis"])
def test_damaged_entries_are_deleted_and_foreign_ones_kept(ctx, tier):
    o = corruption(ctx, tier)
    assert_must_haves(o)  # lost entries 0: every foreign entry is still stored
    assert o.corrupt_injected == 10  # bit flip, truncation, version, namespace, secret: 2 each
    assert o.requests == 20  # 10 prompts read over the change, then 10 again
    assert o.figures["hits_cut_at_damage"] == 10
    assert o.figures["repaired"] == 4  # the damaged ones: deleted, recomputed, rewritten
    assert o.figures["foreign_kept"] == 6  # the foreign ones: kept, so still a miss there


@pytest.mark.parametrize("tier", ["lmdb", "redis"])
def test_damaged_int8_entries_are_deleted_and_foreign_ones_kept(ctx, tier):
    """The same faults over quantized entries, each output held to int8's tolerance."""
    o = corruption(ctx._replace(codec="int8"), tier)
    assert_must_haves(o)
    assert (o.corrupt_injected, o.figures["hits_cut_at_damage"]) == (10, 10)
    assert (o.figures["repaired"], o.figures["foreign_kept"]) == (4, 6)


@pytest.mark.parametrize("tier", ["lmdb", "redis"])
def test_damaged_entries_of_an_int8_pool_are_deleted_and_foreign_ones_kept(ctx, tier):
    """The same faults over a quantized pool's blocks, as its tiers hold them."""
    o = corruption(ctx._replace(kv_cache_dtype="int8"), tier)
    assert_must_haves(o)
    assert (o.corrupt_injected, o.figures["hits_cut_at_damage"]) == (10, 10)
    assert (o.figures["repaired"], o.figures["foreign_kept"]) == (4, 6)


def test_a_codec_run_refuses_the_scenarios_it_cannot_reach(capsys):
    from bench.faults import main

    with pytest.raises(SystemExit):
        main(["--codec", "int8", "--only", "http-fuzz"])
    assert "--codec / --kv-cache-dtype: scenarios corrupt-lmdb" in capsys.readouterr().err


def test_forced_lookup_key_collisions_never_serve_another_prefix(ctx):
    o = collisions(ctx)
    assert_must_haves(o)
    assert o.requests == 160
    assert o.figures["collisions_rejected"] > 0  # 1-byte keys collide: the digest said no
    assert o.figures["verified_hits"] > 0


def test_redis_eviction_cuts_every_hit_at_the_first_missing_block(ctx):
    o = redis_eviction(ctx)
    assert_must_haves(o)
    assert o.figures["past_gap"] == 0
    # a hit ends at the first gap, or earlier when Redis evicted a block after the snapshot
    assert o.figures["hits_at_gap"] + o.figures["short_of_gap"] == o.requests == 40


def test_redis_paused_killed_and_restarted_under_load_fails_no_request(ctx):
    o = redis_outage(ctx)
    assert_must_haves(o)
    assert o.requests > 0
    assert o.recovery_s is not None  # Redis hits came back after the restart


@pytest.mark.parametrize("disk", [False, True], ids=["tiny-map", "full-tmpfs"])
def test_a_full_lmdb_keeps_serving_every_request(ctx, disk, skip_or_fail):
    o = lmdb_full(ctx, disk)
    if o is None:  # CI (root) must run it: the skip would hide a scenario there
        skip_or_fail("cannot mount a size-limited tmpfs here (needs root)")
    assert_must_haves(o)
    assert o.requests == 63


def test_a_tenant_never_gets_another_tenants_cached_tokens_in_any_tier(ctx):
    o = tenant_isolation(ctx)
    assert_must_haves(o)
    assert o.figures["cross_tenant_tokens"] == 0
    assert o.figures["owner_full_hits"] == 8  # 4 prompts, from lmdb and from redis


def test_many_requests_with_eviction_keep_the_pool_bounded(ctx):
    o = leaks(ctx)
    assert_must_haves(o)
    assert o.requests == o.succeeded == 160
    assert o.figures["pool_used_end"] <= 48
    assert o.figures["evicted"] > 0


def test_four_processes_writing_overlapping_prefixes_write_each_entry_once(ctx):
    o = concurrent_writers(ctx)
    assert_must_haves(o)
    f = o.figures
    assert f["distinct_blocks"] == 4 * 6 + 16 * 4  # 4 shared prefixes, 16 distinct tails
    assert f["lmdb_writes"] == f["redis_writes"] == f["distinct_blocks"]
    assert f["lmdb_entries"] == f["redis_entries"] == f["distinct_blocks"]
    assert f["full_hits"] == 16


def test_a_writer_killed_mid_write_leaves_only_entries_that_verify(ctx):
    o = killed_writers(ctx, rounds=3)
    assert_must_haves(o)
    assert o.corrupt_detected == 0  # no torn entry
    assert o.figures["committed_checked"] > 0
