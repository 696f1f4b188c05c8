"""Fault 10 of `python -m bench faults` at CI scale: a cross-tenant TTFT probe cannot tell the
victim's prompts from fresh ones when salts differ, and the same probe can when they match."""

from collections.abc import Iterator

import pytest
import torch

from bench.faults.common import Context, FaultOutcome, Scale, micro_model
from bench.faults.timing import LENGTH, auc, timing_side_channel
from bench.launch import RedisServer

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

CI = Scale(requests=8, collision_trials=160, leak_requests=160, outage_s=0.5, kill_rounds=3)
PAIRS = 64  # 8 x CI.requests, per run
RUNS = 4  # salted; shared salt with hits from the device pool, from LMDB, from Redis
ROUNDS = 2  # 32 pairs a round, each after 4 untimed warm-ups
# Under no channel the AUC of 64 vs 64 independent TTFTs has mean 0.5 and standard deviation
# sqrt((64 + 64 + 1) / (12 * 64 * 64)) = 0.051, so |AUC - 0.5| <= 0.2 allows 3.9 SD: a false
# failure about once in 10,000 runs (load bursts widen the spread a little: 0.41-0.62 seen in
# 9 runs, still > 3 SD of room). Secrets and controls are interleaved in random order, so
# machine-load drift slows both classes alike. With a shared salt a hit skips ~4 ms of
# prefill, which a busy 2-core machine's scheduling jitter rarely hides: measured 0.97-1.0
# at load 3 on 2 cores. A hit from LMDB or Redis still reads and verifies 127 entries (~1-2
# ms), and Redis needs its own process scheduled, so that gap is narrower: 0.88-1.0 measured.
MAX_DEVIATION = 0.2
MIN_UNSALTED_AUC = 0.9  # device-pool hits; the spill tiers' AUCs are reported by the bench


@pytest.fixture(scope="module")
def timing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultOutcome]:
    torch.set_num_threads(1)  # as the bench does: a micro model runs faster on one thread
    workdir = tmp_path_factory.mktemp("timing")
    server = RedisServer(workdir).start()
    try:
        yield timing_side_channel(Context(micro_model(), server, workdir, CI))
    finally:
        server.kill()


def test_auc_is_the_chance_a_control_is_slower_than_a_secret_with_ties_half():
    assert auc([2.0, 3.0], [1.0, 2.0]) == 3.5 / 4
    assert auc([5.0, 6.0], [1.0, 2.0]) == 1.0
    assert auc([1.0, 1.0], [1.0]) == 0.5


def test_every_probe_request_is_served_and_matches_the_no_cache_reference(timing):
    assert timing.requests == timing.succeeded == RUNS * (3 * PAIRS + 4 * ROUNDS)
    assert timing.wrong_outputs == 0
    assert timing.lost_entries == 0
    assert timing.corrupt_detected == timing.corrupt_injected == 0
    assert timing.figures["pairs"] == PAIRS


def test_a_salted_probe_gets_no_cached_token_and_a_shared_salt_gets_every_block(timing):
    assert timing.figures["cross_tenant_tokens"] == 0
    assert timing.figures["control_cached_tokens"] == 0
    # every shared-salt secret: at least LENGTH - 1 = 508 tokens from the run's tier (the
    # device's kept tail may add the 509th), in all 3 runs
    assert timing.figures["full_hits"] == 3 * PAIRS
    assert timing.figures["prompt_tokens"] == LENGTH == 509


def test_with_salts_the_probe_cannot_tell_the_victims_prompts_from_fresh_ones(timing):
    assert abs(timing.figures["auc_salted"] - 0.5) <= MAX_DEVIATION, timing.note


def test_with_one_shared_salt_the_same_probe_tells_hits_from_misses(timing):
    assert timing.figures["auc_unsalted"] >= MIN_UNSALTED_AUC, timing.note
